/* DeepSeek Sparse Attention on an AVX-512 CPU: attention over selected latent rows, the
 * lightning indexer's scores, and their top-k. The structs and the contract of each exported
 * function are in mla_sparse_cpu.h; the Python side is app/backends/cpu/sparse_kernel.py.
 *
 * Attention: an item is one query row (all its heads: the latent cache has one KV head, so
 * every latent row loaded serves every head) and a range of its index entries. Entries are
 * gathered TK at a time as row pointers (no copy; -1 skipped, a repeat counted as a repeat),
 * scored for every head (q.k over the whole row: AVX512-BF16 dot products for a bf16 cache and
 * q, else float32 FMAs), folded into an online softmax in base 2 (vectorised over the tile's
 * keys), and p.v accumulates in float32: on the dot path as bf16 dot products over pairs of
 * keys (p rounded to bf16, as CPU_MLA does: the output is normalised by the sum of the rounded
 * p, lr, while the LSE is the float32 one, from the sum of the unrounded p, l), else as
 * float32 FMAs with 16 heads of one 16-column slice held in registers, each value row loaded
 * once for them. NaN and inf: a non-finite score makes its row's p (and so its output)
 * non-finite; rows a query does not name are never read.
 *
 * The indexer's scores and their top-k are in mla_sparse_index_cpu.c (the same library).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "app_native_simd.h"
#include "mla_sparse_cpu.h"

APP_NATIVE_LIBRARY(MLA_SPARSE_CPU_ABI)
APP_NATIVE_STRUCT_LAYOUT(mla_sparse_attn_args, MLA_SPARSE_ATTN_ARGS)
APP_NATIVE_STRUCT_LAYOUT(mla_sparse_index_args, MLA_SPARSE_INDEX_ARGS)

#define TK 32 /* attention: index entries per tile */
#define HB 16 /* attention: heads whose p.v accumulators stay in registers */
#define LN2 0.69314718055994530942f

/* Elements i .. i + 15 of p (of type dt) as float32. */
static inline __m512 load16(const void* p, int64_t i, int dt) {
  if (dt == APP_DT_F32) return _mm512_loadu_ps((const float*)p + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
  if (dt == APP_DT_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* ---------------------------------------------------------------------------------------
 * Attention over selected rows */

static inline int attn_dims_ok(const mla_sparse_attn_args* a) {
  const int dts = (a->kv_dt == APP_DT_F32 || a->kv_dt == APP_DT_BF16 || a->kv_dt == APP_DT_F16);
  return dts && a->q_dt == a->kv_dt &&
         (a->out_dt == APP_DT_F32 || a->out_dt == APP_DT_BF16 || a->out_dt == APP_DT_F16) &&
         a->rank > 0 && a->rank % 16 == 0 && (a->rank + a->rope) % 32 == 0 && a->rope >= 0 &&
         a->heads > 0 && a->block_size > 0 && !(a->bf16_dot && a->kv_dt != APP_DT_BF16);
}

/* S[h * TK + j] = mult * (q_h . row_j) in float32 FMAs, q packed as float32 [heads, d]. */
static void qk_f32(const float* qf, int64_t heads, int64_t d, const void* const* rows, int n,
                   int dt, float mult, float* S, const void* const* next, int nn) {
  const int64_t bytes = d * app_native_elem_size(dt);
  for (int j = 0; j < n; ++j) {
    const void* r = rows[j];
    if (j < nn) app_prefetch_lines(next[j], bytes);
    int64_t h = 0;
    for (; h + 4 <= heads; h += 4) {
      __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
      const float* q0 = qf + h * d;
      for (int64_t e = 0; e < d; e += 16) {
        const __m512 k = load16(r, e, dt);
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + e), k, c0);
        c1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d + e), k, c1);
        c2 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * d + e), k, c2);
        c3 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 3 * d + e), k, c3);
      }
      S[h * TK + j] = mult * _mm512_reduce_add_ps(c0);
      S[(h + 1) * TK + j] = mult * _mm512_reduce_add_ps(c1);
      S[(h + 2) * TK + j] = mult * _mm512_reduce_add_ps(c2);
      S[(h + 3) * TK + j] = mult * _mm512_reduce_add_ps(c3);
    }
    for (; h < heads; ++h) {
      __m512 c = _mm512_setzero_ps();
      for (int64_t e = 0; e < d; e += 16)
        c = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * d + e), load16(r, e, dt), c);
      S[h * TK + j] = mult * _mm512_reduce_add_ps(c);
    }
  }
}

/* As qk_f32 from bf16 q rows (head stride q_sh) and bf16 rows, on AVX512-BF16 dot products. */
static __attribute__((APP_AVX512BF16_ISA)) void qk_bf16(const uint16_t* q, int64_t q_sh,
                                                        int64_t heads, int64_t d,
                                                        const void* const* rows, int n,
                                                        float mult, float* S,
                                                        const void* const* next, int nn) {
  for (int j = 0; j < n; ++j) {
    const uint16_t* r = (const uint16_t*)rows[j];
    if (j < nn) app_prefetch_lines(next[j], 2 * d);
    int64_t h = 0;
    for (; h + 4 <= heads; h += 4) {
      __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
      const uint16_t* q0 = q + h * q_sh;
      for (int64_t e = 0; e < d; e += 32) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512((const void*)(r + e));
        c0 = _mm512_dpbf16_ps(c0, (__m512bh)_mm512_loadu_si512((const void*)(q0 + e)), k);
        c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512((const void*)(q0 + q_sh + e)), k);
        c2 = _mm512_dpbf16_ps(c2,
                              (__m512bh)_mm512_loadu_si512((const void*)(q0 + 2 * q_sh + e)), k);
        c3 = _mm512_dpbf16_ps(c3,
                              (__m512bh)_mm512_loadu_si512((const void*)(q0 + 3 * q_sh + e)), k);
      }
      S[h * TK + j] = mult * _mm512_reduce_add_ps(c0);
      S[(h + 1) * TK + j] = mult * _mm512_reduce_add_ps(c1);
      S[(h + 2) * TK + j] = mult * _mm512_reduce_add_ps(c2);
      S[(h + 3) * TK + j] = mult * _mm512_reduce_add_ps(c3);
    }
    for (; h < heads; ++h) {
      __m512 c = _mm512_setzero_ps();
      for (int64_t e = 0; e < d; e += 32)
        c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_loadu_si512((const void*)(q + h * q_sh + e)),
                             (__m512bh)_mm512_loadu_si512((const void*)(r + e)));
      S[h * TK + j] = mult * _mm512_reduce_add_ps(c);
    }
  }
}

/* Fold the scores S[h * TK + j] (base 2) of n rows into head h's running max m, sum l and
 * accumulator acc (rescaled when the max rises); S becomes the probabilities p. With bf16_pv
 * the p stored are rounded to bf16 (p.v multiplies them so) and lr sums those rounded ones
 * (the output's normaliser), while l always sums the unrounded float32 p: the LSE is the
 * float32 one, as CPU_MLA's (a chunked prefill merges its chunks by it). Vectorised
 * over the tile's keys (TK = 32: two vectors); a NaN score is never a max (vmaxps returns its
 * second operand, the running max, for a NaN first one) and makes its p NaN. */
static void softmax_tile(float* S, int n, int64_t heads, int64_t rank, float* m, float* l,
                         float* lr, float* acc, int bf16_pv) {
  const __mmask16 k0 = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1u);
  const __mmask16 k1 = (__mmask16)(n >= 32 ? 0xFFFF : n <= 16 ? 0 : (1u << (n - 16)) - 1u);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = S + h * TK;
    const __m512 s0 = _mm512_mask_loadu_ps(ninf, k0, s);
    const __m512 s1 = _mm512_mask_loadu_ps(ninf, k1, s + 16);
    const float mx = fmaxf(m[h], _mm512_reduce_max_ps(_mm512_max_ps(s0, _mm512_max_ps(s1, ninf))));
    __m512 p0, p1;
    if (mx == -INFINITY) { /* nothing finite yet: p is 0, or NaN for a NaN score */
      p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, s0, _CMP_UNORD_Q), s0);
      p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, s1, _CMP_UNORD_Q), s1);
    } else {
      const __m512 vm = _mm512_set1_ps(mx);
      p0 = _mm512_maskz_mov_ps(k0, app_exp2_nonpositive(_mm512_sub_ps(s0, vm)));
      p1 = _mm512_maskz_mov_ps(k1, app_exp2_nonpositive(_mm512_sub_ps(s1, vm)));
    }
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1)); /* unrounded: the LSE's */
    float sum_r = sum;
    if (bf16_pv) { /* p.v multiplies p in bf16: the output's normaliser sums the same p */
      p0 = app_round_to_bf16(p0);
      p1 = app_round_to_bf16(p1);
      sum_r = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    }
    _mm512_storeu_ps(s, p0);
    _mm512_storeu_ps(s + 16, p1);
    if (mx != m[h]) {
      const float alpha = m[h] == -INFINITY ? 0.f : exp2f(m[h] - mx);
      if (l[h] != 0.f || isnan(l[h]) || lr[h] != 0.f || isnan(lr[h])) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < rank; c += 16)
          _mm512_storeu_ps(acc + h * rank + c,
                           _mm512_mul_ps(va, _mm512_loadu_ps(acc + h * rank + c)));
      }
      l[h] *= alpha;
      lr[h] *= alpha;
      m[h] = mx;
    }
    l[h] += sum;
    lr[h] += sum_r;
  }
}

/* acc[h] += sum_j P[h * TK + j] * v_j over the first rank values of the n rows. */
static void pv_tile(const float* P, const void* const* rows, int n, int dt, int64_t heads,
                    int64_t rank, float* acc) {
  for (int64_t c = 0; c < rank; c += 16) {
    int64_t h0 = 0;
    for (; h0 + HB <= heads; h0 += HB) {
      __m512 t[HB];
      for (int h = 0; h < HB; ++h) t[h] = _mm512_loadu_ps(acc + (h0 + h) * rank + c);
      for (int j = 0; j < n; ++j) {
        const __m512 v = load16(rows[j], c, dt);
        for (int h = 0; h < HB; ++h)
          t[h] = _mm512_fmadd_ps(_mm512_set1_ps(P[(h0 + h) * TK + j]), v, t[h]);
      }
      for (int h = 0; h < HB; ++h) _mm512_storeu_ps(acc + (h0 + h) * rank + c, t[h]);
    }
    for (; h0 < heads; ++h0) {
      __m512 t = _mm512_loadu_ps(acc + h0 * rank + c);
      for (int j = 0; j < n; ++j)
        t = _mm512_fmadd_ps(_mm512_set1_ps(P[h0 * TK + j]), load16(rows[j], c, dt), t);
      _mm512_storeu_ps(acc + h0 * rank + c, t);
    }
  }
}

/* Whether p.v runs on AVX512-BF16 dot products: the bf16 dot path with rank % 32 == 0. */
static inline int bf16_pv(const mla_sparse_attn_args* a) {
  return a->bf16_dot && a->rank % 32 == 0;
}

/* rank zero bf16 values at the end of the scratch (the partner of an odd tile's last row: a
 * zero probability times a NaN would be NaN). */
static inline const void* zero_row(const mla_sparse_attn_args* a) {
  const int64_t d = a->rank + a->rope;
  return a->scratch + a->heads * (d + TK + a->rank + 3);
}

/* The bf16 p.v of one tile: keys in pairs (j, j + 1), their 32-column slices interleaved
 * (unpacklo/hi_epi16) so that one dot product multiplies both keys' values by both keys' p
 * (rounded to bf16 by the softmax). Accumulator lane 4L + k of the "lo" vector of a 32-column
 * slice holds column 8L + k, of the "hi" vector column 8L + 4 + k (attn_finish puts them back
 * in order). 8 heads x 2 vectors in registers per slice. */
static __attribute__((APP_AVX512BF16_ISA)) void pv_tile_bf16(float* P,
                                                             const void* const* rows, int n,
                                                             int64_t heads, int64_t rank,
                                                             float* acc, const void* zero) {
  uint32_t* pp = (uint32_t*)(void*)P; /* pairs of p as bf16 bits, over P's own storage: */
  for (int64_t h = 0; h < heads; ++h) /* pair j / 2 of head h overwrites P[h * TK + j / 2] */
    for (int j = 0; j < n; j += 2) {
      uint32_t lo, hi = 0;
      memcpy(&lo, P + h * TK + j, 4);
      if (j + 1 < n) memcpy(&hi, P + h * TK + j + 1, 4);
      pp[h * TK + j / 2] = (lo >> 16) | (hi & 0xFFFF0000u);
    }
  for (int64_t c = 0; c < rank; c += 32) {
    for (int64_t h0 = 0; h0 < heads; h0 += 8) {
      const int nh = heads - h0 < 8 ? (int)(heads - h0) : 8;
      __m512 lo[8], hi[8];
      for (int h = 0; h < 8; ++h) {
        lo[h] = h < nh ? _mm512_loadu_ps(acc + (h0 + h) * rank + c) : _mm512_setzero_ps();
        hi[h] = h < nh ? _mm512_loadu_ps(acc + (h0 + h) * rank + c + 16) : _mm512_setzero_ps();
      }
      for (int j = 0; j < n; j += 2) {
        const __m512i a = _mm512_loadu_si512((const uint16_t*)rows[j] + c);
        const __m512i b = _mm512_loadu_si512((const uint16_t*)(j + 1 < n ? rows[j + 1] : zero) + c);
        const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh vh = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < 8; ++h) {
          if (h >= nh) break;
          const __m512bh pv = (__m512bh)_mm512_set1_epi32((int32_t)pp[(h0 + h) * TK + j / 2]);
          lo[h] = _mm512_dpbf16_ps(lo[h], vl, pv);
          hi[h] = _mm512_dpbf16_ps(hi[h], vh, pv);
        }
      }
      for (int h = 0; h < nh; ++h) {
        _mm512_storeu_ps(acc + (h0 + h) * rank + c, lo[h]);
        _mm512_storeu_ps(acc + (h0 + h) * rank + c + 16, hi[h]);
      }
    }
  }
}

static void attn_tile(const mla_sparse_attn_args* a, const void* qrow, const float* qf,
                      const void* const* rows, int n, const void* const* next, int nn,
                      float* S, float* m, float* l, float* lr, float* acc) {
  const int64_t d = a->rank + a->rope;
  if (a->bf16_dot)
    qk_bf16((const uint16_t*)qrow, a->q_sh, a->heads, d, rows, n, a->q_mult, S, next, nn);
  else
    qk_f32(qf, a->heads, d, rows, n, a->kv_dt, a->q_mult, S, next, nn);
  softmax_tile(S, n, a->heads, a->rank, m, l, lr, acc, bf16_pv(a));
  if (bf16_pv(a))
    pv_tile_bf16(S, rows, n, a->heads, a->rank, acc, zero_row(a));
  else
    pv_tile(S, rows, n, a->kv_dt, a->heads, a->rank, acc);
}

/* Write head h's normalised output (v_mult * acc / lr: acc's own weights, see softmax_tile) and
 * its LSE (from l, the float32 sum): natural log into out/lse, or base 2 into a partial. A head
 * whose row named nothing gets 0 and -inf. */
static void attn_finish(const mla_sparse_attn_args* a, int64_t row, int64_t part,
                        const float* m, const float* l, const float* lr, const float* acc) {
  const int64_t heads = a->heads, rank = a->rank;
  const int permuted = bf16_pv(a); /* pv_tile_bf16's column order, per 32 columns */
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int64_t h = 0; h < heads; ++h) {
    const int empty = l[h] == 0.f;
    const __m512 scale = _mm512_set1_ps(empty ? 0.f : a->v_mult / lr[h]);
    const float lse2 = empty ? -INFINITY : m[h] + log2f(l[h]);
    for (int64_t c = 0; c < rank; c += 16) {
      __m512 v = _mm512_loadu_ps(acc + h * rank + c);
      if (permuted) {
        const int64_t base = h * rank + (c & ~(int64_t)31);
        v = _mm512_permutex2var_ps(_mm512_loadu_ps(acc + base), c & 16 ? second : first,
                                   _mm512_loadu_ps(acc + base + 16));
      }
      const __m512 o = _mm512_mul_ps(scale, v);
      if (part < 0)
        app_store16(a->out, (row * heads + h) * rank + c, o, a->out_dt);
      else
        _mm512_storeu_ps(a->part_out + (part * heads + h) * rank + c, o);
    }
    if (part >= 0)
      a->part_lse[part * heads + h] = lse2;
    else if (a->lse)
      a->lse[row * heads + h] = lse2 * LN2;
  }
}

/* The row index i (>= 0) names. */
static inline const char* row_at(const mla_sparse_attn_args* a, int64_t i, int64_t esize) {
  return (const char*)a->kv +
         ((i / a->block_size) * a->block_stride + (i % a->block_size) * a->row_stride) * esize;
}

/* The next up to TK rows named from entry *e on (-1 skipped; *e advanced past them). An index
 * outside [0, kv_rows) is skipped too: the call was refused unless it changed since
 * items_ok() read it (the caller's memory, written during the call), and it is never read
 * (one unsigned compare, as cheap as the test for -1 it replaces). */
static int gather(const mla_sparse_attn_args* a, const int32_t* idx, int64_t* e, int64_t e1,
                  int64_t esize, const void** rows) {
  int n = 0;
  while (*e < e1 && n < TK) {
    const int64_t i = idx[(*e)++];
    if ((uint64_t)i < (uint64_t)a->kv_rows) rows[n++] = row_at(a, i, esize);
  }
  return n;
}

/* Whether every item and every index entry it reads is in range (mla_sparse_cpu.h): checked
 * before anything is written, so that a refused call writes nothing. One pass over the entries
 * the call reads: O(rows * topk) against the attention's O(rows * topk * heads * D). */
static int items_ok(const mla_sparse_attn_args* a) {
  for (int64_t it = 0; it < a->n_items; ++it) {
    const int64_t* item = a->items + 4 * it;
    const int64_t row = item[0], e0 = item[1], e1 = item[2];
    if (row < 0 || row >= a->rows || e0 < 0 || e0 > e1 || e1 > a->topk) return 0;
    const int32_t* idx = a->indices + row * a->topk;
    for (int64_t e = e0; e < e1; ++e)
      if (idx[e] < -1 || idx[e] >= a->kv_rows) return 0;
  }
  return 1;
}

static void attn_item(const mla_sparse_attn_args* a, int64_t row, int64_t e0, int64_t e1,
                      int64_t part) {
  const int64_t heads = a->heads, rank = a->rank, d = rank + a->rope;
  const int64_t esize = app_native_elem_size(a->kv_dt);
  float* qf = a->scratch;                 /* [heads, d] (float32 path) */
  float* S = qf + heads * d;              /* [heads, TK] */
  float* acc = S + heads * TK;            /* [heads, rank] */
  float* m = acc + heads * rank;          /* [heads] */
  float* l = m + heads;                   /* [heads] float32 sums of p (the LSE's) */
  float* lr = l + heads;                  /* [heads] sums of p as p.v takes them (the output's) */
  const char* qrow = (const char*)a->q + row * a->q_st * esize;
  if (!a->bf16_dot)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t e = 0; e < d; e += 16)
        _mm512_storeu_ps(qf + h * d + e, load16(qrow + h * a->q_sh * esize, e, a->q_dt));
  memset(acc, 0, (size_t)(heads * rank) * sizeof(float));
  if (bf16_pv(a)) memset((void*)zero_row(a), 0, (size_t)rank * 2);
  for (int64_t h = 0; h < heads; ++h) m[h] = -INFINITY, l[h] = 0.f, lr[h] = 0.f;
  const int32_t* idx = a->indices + row * a->topk;
  const void* tiles[2][TK];
  int64_t e = e0;
  int cur = 0, n = gather(a, idx, &e, e1, esize, tiles[0]);
  for (int j = 0; j < n; ++j) app_prefetch_lines(tiles[0][j], d * esize);
  while (n) { /* the next tile's rows are asked for while this one is scored */
    const int nn = gather(a, idx, &e, e1, esize, tiles[cur ^ 1]);
    attn_tile(a, qrow, qf, tiles[cur], n, tiles[cur ^ 1], nn, S, m, l, lr, acc);
    cur ^= 1;
    n = nn;
  }
  attn_finish(a, row, part, m, l, lr, acc);
}

APP_NATIVE_EXPORT int64_t mla_sparse_attn_scratch_floats(int64_t heads, int64_t rank,
                                                         int64_t rope) {
  return heads * (rank + rope + TK + rank + 3) + rank / 2 + 16;
}

APP_NATIVE_EXPORT int32_t mla_sparse_attn_run(const mla_sparse_attn_args* a) {
  if (!attn_dims_ok(a) || !items_ok(a)) return 1;
  for (int64_t it = 0; it < a->n_items; ++it) {
    const int64_t* item = a->items + 4 * it;
    attn_item(a, item[0], item[1], item[2], item[3]);
  }
  return 0;
}

APP_NATIVE_EXPORT int32_t mla_sparse_attn_merge(const mla_sparse_attn_args* a) {
  if (!attn_dims_ok(a)) return 1;
  const int64_t heads = a->heads, rank = a->rank;
  for (int64_t r = 0; r < a->n_merge; ++r) /* checked first: nothing half-written */
    if (a->merge[3 * r] < 0 || a->merge[3 * r] >= a->rows || a->merge[3 * r + 1] < 0 ||
        a->merge[3 * r + 2] < 1 || a->merge[3 * r + 2] > 64)
      return 1;
  for (int64_t r = 0; r < a->n_merge; ++r) {
    const int64_t row = a->merge[3 * r], first = a->merge[3 * r + 1], parts = a->merge[3 * r + 2];
    for (int64_t h = 0; h < heads; ++h) {
      float mx = -INFINITY;
      int nan = 0;
      for (int64_t p = 0; p < parts; ++p) {
        const float v = a->part_lse[(first + p) * heads + h];
        nan |= isnan(v);
        if (v > mx) mx = v;
      }
      float w[64], total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float v = a->part_lse[(first + p) * heads + h];
        w[p] = nan ? NAN : (mx == -INFINITY ? 0.f : exp2f(v - mx));
        total += w[p];
      }
      const float inv = total == 0.f ? 0.f : 1.f / total;
      for (int64_t c = 0; c < rank; c += 16) {
        __m512 o = _mm512_setzero_ps();
        for (int64_t p = 0; p < parts; ++p)
          o = _mm512_fmadd_ps(_mm512_set1_ps(w[p] * inv),
                              _mm512_loadu_ps(a->part_out + ((first + p) * heads + h) * rank + c),
                              o);
        app_store16(a->out, (row * heads + h) * rank + c, o, a->out_dt);
      }
      if (a->lse)
        a->lse[row * heads + h] = (total == 0.f && !nan) ? -INFINITY
                                                         : (mx + log2f(total)) * LN2;
    }
  }
  return 0;
}
