/* DeepSeek Sparse Attention on an AVX-512 CPU (mla_sparse_cpu.c, mla_sparse_index_cpu.c): the
 * argument structs, mirrored by SparseAttnArgs / SparseIndexArgs in
 * app/backends/cpu/sparse_kernel.py; the loader checks the layouts agree at load. */
#ifndef MLA_SPARSE_CPU_H
#define MLA_SPARSE_CPU_H

#include "app_native.h"

/* Bump on any change to these structs or to an exported function of mla_sparse_cpu.c. */
#define MLA_SPARSE_CPU_ABI 3

/* Sparse absorbed MLA over selected latent rows (one KV head), D = rank + rope:
 *   kv: rows of kv_dt; index i names the row at kv + (i / block_size) * block_stride
 *       + (i % block_size) * row_stride elements (a paged cache's flat slots, or rows with
 *       block_size 1 and block_stride their row stride), unit stride in the last dim; kv_rows
 *       rows (num_blocks * block_size, or N);
 *   q [rows, heads, D] of q_dt, strides (q_st, q_sh, 1);
 *   indices int32 [rows, topk] contiguous, -1 padding (each other entry one softmax term),
 *   every other entry a row in [0, kv_rows);
 *   out [rows, heads, rank] of out_dt, contiguous; lse [rows, heads] float32 (natural log)
 *   or NULL. A row naming nothing gets out 0 and lse -inf.
 * out, lse, part_out and part_lse must not overlap any input (kv, q, indices, items, merge)
 * nor each other: a row's out is written while other rows' inputs may still be read (the
 * Python side hands a private output where the caller's shares memory with an input). The
 * inputs may overlap each other (they are only read): q inside kv, one row named many times.
 * A call whose items or indices are out of range (an item's row outside [0, rows), its entries
 * outside [0, topk], an index below -1 or >= kv_rows) is refused before anything is written;
 * an index that changes to one out of range during the call (the caller's memory: it should
 * be a private copy) is skipped as -1, never read.
 * Logits are q_mult * (q . k) in base 2 (q_mult = softmax scale * k_scale * log2(e)); the
 * output is v_mult * sum(p v) (v_mult = k_scale).
 * items: n_items quadruples (row, first entry, end entry, part) of indices[row]: part < 0
 * writes out/lse directly (the range must be the whole row); part >= 0 writes a partial
 * (normalised fp32, base-2 LSE) into part_out [parts, heads, rank] / part_lse [parts, heads],
 * merged by mla_sparse_attn_merge with merge: n_merge triples (row, first part, parts <= 64).
 * scratch: mla_sparse_attn_scratch_floats() floats, 64-byte aligned, one per thread.
 * bf16_dot: 1 for AVX512-BF16 dot products (bf16 kv and q only; the caller checks the CPU):
 * q.k, and p.v with p rounded to bf16 when rank % 32 == 0 (float32 sums either way). */
#define MLA_SPARSE_ATTN_ARGS(X)                                                              \
  X(const void*, kv) X(const void*, q) X(const int32_t*, indices) X(void*, out) X(float*, lse)  \
  X(const int64_t*, items) X(const int64_t*, merge) X(float*, part_out) X(float*, part_lse)   \
  X(float*, scratch) X(int64_t, rows) X(int64_t, heads) X(int64_t, rank) X(int64_t, rope)     \
  X(int64_t, topk) X(int64_t, block_size) X(int64_t, block_stride) X(int64_t, row_stride)     \
  X(int64_t, q_st) X(int64_t, q_sh) X(int64_t, n_items) X(int64_t, n_merge)                   \
  X(int64_t, kv_rows) X(int32_t, kv_dt) X(int32_t, q_dt) X(int32_t, out_dt)                    \
  X(int32_t, bf16_dot) X(float, q_mult) X(float, v_mult)

APP_NATIVE_STRUCT(mla_sparse_attn_args, MLA_SPARSE_ATTN_ARGS)

/* The lightning indexer's scores: score(t, s) = sum_h weights[t, h] * relu(q[t, h] . key[s])
 * over a paged key cache of one request.
 *   q [rows, heads, dim] of q_dt, strides (q_st, q_sh, 1); weights float32 [rows, heads]
 *   contiguous; key_cache of key_dt, strides (block_stride, row_stride, 1);
 *   block_table int32 [requests, bt_stride-strided rows]; visible int64 [rows];
 *   scores float32: row t's position s at scores[(t - score_row0) * score_stride + s].
 * items: n_items quintuples (request, first row, end row, first key, end key): rows of one
 * request (<= 8), keys a range of its positions; positions >= visible[row] get -inf (never
 * read).
 * scratch: mla_sparse_index_scratch_floats() floats, 64-byte aligned, one per thread.
 * bf16_dot: as for attention (bf16 keys and q). */
#define MLA_SPARSE_INDEX_ARGS(X)                                                             \
  X(const void*, q) X(const float*, weights) X(const void*, key_cache)                        \
  X(const int32_t*, block_table) X(const int64_t*, visible) X(float*, scores)                 \
  X(const int64_t*, items) X(float*, scratch) X(int64_t, heads) X(int64_t, dim)              \
  X(int64_t, block_size) X(int64_t, block_stride) X(int64_t, row_stride) X(int64_t, q_st)     \
  X(int64_t, q_sh) X(int64_t, bt_stride) X(int64_t, score_stride) X(int64_t, score_row0)    \
  X(int64_t, n_items) X(int32_t, key_dt) X(int32_t, q_dt) X(int32_t, bf16_dot) X(int32_t, pad0)

APP_NATIVE_STRUCT(mla_sparse_index_args, MLA_SPARSE_INDEX_ARGS)

/* 0 when done; 1 (nothing written) for an unsupported dtype or shape (rank % 16, D % 32), or
 * an item or index out of range (see above). */
APP_NATIVE_EXPORT int32_t mla_sparse_attn_run(const mla_sparse_attn_args* a);
/* 0 when done: merges the partials of every row in a->merge into out/lse; 1 (nothing
 * written) for a merge entry out of range (a row outside [0, rows), parts outside 1 .. 64). */
APP_NATIVE_EXPORT int32_t mla_sparse_attn_merge(const mla_sparse_attn_args* a);
/* Scratch floats one thread needs for heads query heads of head dim rank + rope. */
APP_NATIVE_EXPORT int64_t mla_sparse_attn_scratch_floats(int64_t heads, int64_t rank,
                                                         int64_t rope);
/* 0 when done; 1 (nothing written) for an unsupported dtype or an item of more than 8 rows. */
APP_NATIVE_EXPORT int32_t mla_sparse_index_run(const mla_sparse_index_args* a);
/* Scratch floats one thread needs for the indexer's items. */
APP_NATIVE_EXPORT int64_t mla_sparse_index_scratch_floats(int64_t heads, int64_t dim);
/* The top-k of rows first_row .. end_row - 1 of scores [*, score_stride] (row t's candidates:
 * positions [0, count[t]), every other one hidden): int32 positions in increasing order into
 * out [*, out_stride] (pre-filled with -1: fewer than topk candidates leave -1 at the end); of
 * positions tied at the topk-th score the earliest are kept. A row holding a non-finite score
 * is left alone and flagged (flags[t] = 1; else 0): the caller orders it.
 * scratch: count's largest value uint32s. */
APP_NATIVE_EXPORT int32_t mla_sparse_topk(const float* scores, int64_t score_stride,
                                          const int64_t* count, int64_t first_row,
                                          int64_t end_row, int64_t topk, int32_t* out,
                                          int64_t out_stride, int32_t* flags,
                                          uint32_t* scratch);

#endif /* MLA_SPARSE_CPU_H */
