/* The MLA decode kernel's argument struct (mla_decode_cpu.c), mirrored by MlaDecodeArgs in
 * app/backends/decode/cpu_mla.py; the loader checks the two layouts agree at load. */
#ifndef MLA_DECODE_CPU_H
#define MLA_DECODE_CPU_H

#include "app_native.h"

/* Bump on any change to this struct or to an exported function of mla_decode_cpu.c. */
#define MLA_DECODE_CPU_ABI 5

/* cache_dt beyond the element types of app_native.h (APP_DT_*): the FP8 latent caches
 * (mla_decode_cpu_fp8.h; issue 36). Python asks mla_decode_cpu_cache_code(name). */
enum { MLA_CACHE_FP8_E4M3 = 16, MLA_CACHE_FP8_DS_MLA = 17 };

/* One decode step over a paged latent cache (one KV head), D = rank + rope:
 *   cache [num_blocks, block_size, D] of cache_dt, strides (block_stride, row_stride, 1);
 *   an FP8 cache (MLA_CACHE_*) has byte strides: rows of D e4m3 bytes (fp8_e4m3; its scale is
 *   the caller's k_scale, in q_mult and v_mult) or DeepSeek's fp8_ds_mla rows (rank e4m3
 *   bytes, rank / 128 float32 scales, rope bf16; rank % 128 == 0);
 *   q [B, qlen, heads, D] of q_dt, strides (q_sb, q_si, q_sh, 1);
 *   out [B, qlen, heads, rank] of out_dt, contiguous; lse [B, qlen, heads] float32 or NULL;
 *   block_table int32 [B, bt_stride-strided rows], ids in [0, num_blocks) (entries past a
 *   request's last block are never read: any value); seq_lens int32 [B] (>= qlen, counting
 *   this step's tokens). Row i of request b sees keys [0, seq_lens[b] - qlen + i].
 *   out and lse must not overlap an input (cache, q, block_table, seq_lens, items, merge);
 *   the inputs may overlap each other (they are only read: blocks shared by requests).
 * Logits are q_mult * (q . k) in base 2 (q_mult = softmax scale * k_scale * log2(e)); the
 * output is v_mult * sum(p v) (v_mult = k_scale).
 * items: n_items quadruples (request, first key, end key, part): a key range of a request.
 * part < 0 writes out/lse directly (the range must be the whole request); part >= 0 writes
 * a partial (normalised fp32 rows, base-2 LSE) into part_out [parts, qlen*heads, rank] and
 * part_lse [parts, qlen*heads], merged by mla_decode_cpu_merge.
 * scratch: mla_decode_cpu_scratch_floats() floats, 64-byte aligned, one per thread.
 * bf16_dot: 1 to use AVX512-BF16 dot products (a bf16 q with a bf16 or FP8 cache; the caller
 * checks the CPU has AVX512-BF16 and AVX512BW): bf16 products, float32 sums, p rounded to
 * bf16 for p.v.
 * merge: n_merge triples (request, first part, number of parts <= 64). */
#define MLA_DECODE_ARGS(X)                                                                \
  X(const void*, cache) X(const void*, q) X(void*, out) X(float*, lse)                     \
  X(const int32_t*, block_table) X(const int32_t*, seq_lens) X(const int64_t*, items)       \
  X(const int64_t*, merge) X(float*, part_out) X(float*, part_lse) X(float*, scratch)       \
  X(int64_t, batch) X(int64_t, qlen) X(int64_t, heads) X(int64_t, rank) X(int64_t, rope)    \
  X(int64_t, num_blocks) X(int64_t, block_size) X(int64_t, block_stride)                   \
  X(int64_t, row_stride) X(int64_t, bt_stride) X(int64_t, q_sb) X(int64_t, q_si)           \
  X(int64_t, q_sh) X(int64_t, n_items) X(int64_t, n_merge) X(int32_t, cache_dt)            \
  X(int32_t, q_dt) X(int32_t, out_dt) X(int32_t, bf16_dot) X(float, q_mult) X(float, v_mult)

APP_NATIVE_STRUCT(mla_decode_args, MLA_DECODE_ARGS)

/* 0 when done; 1 (nothing written) for an unsupported dtype or shape (rank % 64, D % 32), or
 * an item out of range: a request outside [0, batch), seq_lens[b] < qlen, keys outside
 * [0, seq_lens[b]], or a block id of its keys outside [0, num_blocks) (items_ok in
 * mla_decode_cpu_shares.h). */
APP_NATIVE_EXPORT int32_t mla_decode_cpu_run(const mla_decode_args* a);
/* 0 when done: merges the partials of every request in a->merge into out/lse. */
APP_NATIVE_EXPORT int32_t mla_decode_cpu_merge(const mla_decode_args* a);
/* 0 when done: the shares of one call on the calling thread's OpenMP team (see the source);
 * 1 (nothing written) where mla_decode_cpu_run would refuse any of its items. */
APP_NATIVE_EXPORT int32_t mla_decode_cpu_run_shares(const mla_decode_args* a,
                                                    const int64_t* share_end, int64_t n_shares,
                                                    int64_t scratch_stride, int32_t threads);
/* 1 when the library was built with OpenMP. */
APP_NATIVE_EXPORT int32_t mla_decode_cpu_openmp(void);
/* omp_get_max_threads of the OpenMP runtime the library is bound to (NULL without OpenMP). */
APP_NATIVE_EXPORT const void* mla_decode_cpu_openmp_runtime(void);
/* The cache_dt code of an FP8 cache layout ("fp8_e4m3", "fp8_ds_mla"), -1 for another name. */
APP_NATIVE_EXPORT int32_t mla_decode_cpu_cache_code(const char* name);
/* Test hook: count (a multiple of 32) e4m3fn bytes, each times `scale`, -> the bf16 bits the
 * bf16-dot path's tile holds for them. method 0: through fp16 and float32 (any CPU with
 * AVX512-BF16); 1: by table look-ups (AVX512-VBMI; a positive power-of-two scale 2^-117 ..
 * 2^119). 0 when done; 1, nothing written, where the method cannot (CPU, scale, count). */
APP_NATIVE_EXPORT int32_t mla_decode_cpu_e4m3_to_bf16(const uint8_t* src, int64_t count,
                                                      float scale, int32_t method,
                                                      uint16_t* dst);
/* Scratch floats one thread needs for qlen * heads query rows of head dim rank + rope (an
 * FP8 cache's dequantised tile included). */
APP_NATIVE_EXPORT int64_t mla_decode_cpu_scratch_floats(int64_t qlen, int64_t heads,
                                                        int64_t rank, int64_t rope);

#endif /* MLA_DECODE_CPU_H */
