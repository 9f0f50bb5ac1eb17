/* MLA decode over a paged latent cache on an AVX-512 CPU, float32 math. bf16 / fp16 / fp32
 * caches are read in place; FP8 caches (fp8_e4m3, DeepSeek's fp8_ds_mla: mla_decode_cpu_fp8.h)
 * are dequantised a chunk at a time into a per-thread tile that the same code reads.
 *
 * Built at first use by app/backends/decode/cpu_mla.py through the shared native loader and
 * called through ctypes (which releases the GIL): one call per worker thread, each with its
 * own items and scratch. The cache is read in place through the block table (a chunk of BK
 * keys is a list of row pointers, never a copy), and
 * the latent cache has one KV head, so every row loaded serves all query rows of the request
 * (qlen x heads, in groups of 16: one per vector lane) for both q.k (the whole row) and p.v
 * (its first `rank` values). At 16 heads that is 30 FLOPs per byte of a bf16 cache, so the
 * kernel must stream the cache near the core's limit while it computes: the next chunk's rows
 * are prefetched a line or two at a time from the inner loops (pf_cursor, in
 * mla_decode_cpu_prefetch.h).
 *
 * Layout trick: a 32-element chunk of a bf16 row is loaded as one 512-bit vector and split
 * into its even and odd elements with a shift and a mask (no shuffles). The dot product does
 * not care about order, so q is packed in the same order; the p.v accumulators are kept in
 * it too and put back in natural order (one permute per 16 values) when the output is
 * written. fp16 and fp32 rows load in natural order.
 *
 * q.k: 4 query rows x 4 keys per register tile (16 accumulators along the head dim),
 * reduced to one vector of 16 scores per key (lane = query row); the softmax is then
 * lane-wise over the keys (base 2: q is pre-scaled by scale * log2(e)); p.v: 6 rows x 64
 * columns tiles.
 * Causal (multi-token prediction): row i sees keys <= seq_len - qlen + i, so only the last
 * qlen - 1 keys are hidden from some rows; those keys are masked in the scores and skipped
 * (not multiplied by 0: 0 * NaN is NaN) in p.v, and rows past seq_len are never read.
 * A non-finite value in a visible key makes exactly the rows that see it non-finite.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "app_native_simd.h"
#include "mla_decode_cpu.h"

APP_NATIVE_LIBRARY(MLA_DECODE_CPU_ABI)
APP_NATIVE_STRUCT_LAYOUT(mla_decode_args, MLA_DECODE_ARGS)

#define G 16   /* query rows per group: one per vector lane */
#ifndef BK
#define BK 64 /* keys per chunk: their rows (72 KiB at D = 576, bf16) stay in L2; 64 rather
                 * than 32 halves the per-chunk costs (accumulator reloads, softmax set-up).
                 * One group of 16 rows once ran 32 (faster while the prefetches went out in
                 * bursts); with them dealt evenly 64 measured 1.04-1.06x over 32, and 96 or
                 * 128 no faster (128 slower on fp32). */
#endif
#if BK % 4
#error "BK must be a multiple of 4"
#endif
#define PR 6   /* query rows per p.v register tile (x 64 columns: 24 accumulators) */
/* The bf16 q.k steps pf_step() every QK_PF_STEPS steps of 32 dims (32 dot products), about
 * as often in time as p.v does (one per key pair of a tile: 16-24): the next chunk's lines
 * then go out evenly over the whole chunk, not mostly during p.v (measured, 16 heads, cache
 * streaming from memory: 1.04-1.13x; once per 4 x 4 tile, i.e. every 288 products, left
 * the memory idle through q.k). The float q.k (fp32, fp16, bf16 without dot products) keeps
 * one step per tile: stepping it from its inner loop measured 0.96x on fp32, whose 16 rows of
 * q (36 KiB) share the 48 KiB L1 with what the prefetches bring in. */
#define QK_PF_STEPS 2
/* The head dim of every MLA model there is (DeepSeek-V2/V3, Kimi K2: kv_lora_rank 512 +
 * rope 64). q.k is compiled a second time for it, with its 18 steps of 32 dims a constant:
 * fully unrolled, with the prefetch cursor's steps at fixed places, it measured 1.03x
 * (bf16) and 1.06x (fp32) on 16x8k at 16 heads, cache resident and streamed alike. */
#define D_MLA 576
#define LN2 0.6931471805599453f
#define MAX_PARTS 64 /* partials per request that mla_decode_cpu_merge accepts */

/* 32 elements at p -> two float32 vectors in the cache order of dt (see the top). */
static inline __attribute__((always_inline)) void load32(const char* p, const int dt, __m512* a,
                                                         __m512* b) {
  if (dt == APP_DT_BF16) {
    const __m512i x = _mm512_loadu_si512((const void*)p);
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
  } else if (dt == APP_DT_F16) {
    *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    *b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p + 1));
  } else {
    *a = _mm512_loadu_ps((const float*)p);
    *b = _mm512_loadu_ps((const float*)p + 16);
  }
}

/* Where natural element e (0..31) of a chunk sits in the cache order of dt. */
static inline int64_t cache_slot(int64_t e, int dt) {
  return dt == APP_DT_BF16 ? (e & 1) * 16 + (e >> 1) : e;
}

/* Accumulator orders of a 32-column chunk: ORDER_NATURAL (fp16/fp32 rows), ORDER_EVEN_ODD
 * (bf16 rows split by shift and mask), ORDER_PAIRS (the bf16 dot path: 16-bit unpacks put
 * columns 8k..8k+3 of each 128-bit lane k in the first vector and 8k+4..8k+7 in the second). */
enum { ORDER_NATURAL = 0, ORDER_EVEN_ODD = 1, ORDER_PAIRS = 2 };

/* A chunk's two accumulator vectors -> its natural first and second halves. */
static inline void to_natural(__m512 a, __m512 b, int order, __m512* lo, __m512* hi) {
  if (order == ORDER_NATURAL) {
    *lo = a;
    *hi = b;
    return;
  }
  __m512i il, ih;
  if (order == ORDER_EVEN_ODD) {
    il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    ih = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  } else {
    il = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    ih = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  }
  *lo = _mm512_permutex2var_ps(a, il, b);
  *hi = _mm512_permutex2var_ps(a, ih, b);
}

/* lane r of the result = the sum of the lanes of v[r]: a 16 x 16 transpose-and-add. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 v[16]) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                                  _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88),
                                  _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

/* The rows of keys j .. j + 3 for a 4 x 4 scores tile; past n, key j again (its scores are
 * computed and not stored). */
static inline __attribute__((always_inline)) void four_keys(const char* const* rows, int64_t j,
                                                            int64_t n, const char** k0,
                                                            const char** k1, const char** k2,
                                                            const char** k3) {
  *k0 = rows[j];
  *k1 = rows[j + 1 < n ? j + 1 : j];
  *k2 = rows[j + 2 < n ? j + 2 : j];
  *k3 = rows[j + 3 < n ? j + 3 : j];
}

/* S[j + k] = the scores of key j + k (k < 4, j + k < n) from a 4 x 4 tile's four reduced
 * passes: pass p holds key k's rows 4p..4p+3 in its 128-bit block k; a 4 x 4 transpose of
 * blocks. */
static inline __attribute__((always_inline)) void store_scores4(float* S, int64_t j, int64_t n,
                                                                const __m512 v[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);
  const __m512 t1 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t2 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  _mm512_store_ps(S + j * G, _mm512_shuffle_f32x4(t0, t1, 0x88));
  if (j + 1 < n) _mm512_store_ps(S + (j + 1) * G, _mm512_shuffle_f32x4(t0, t1, 0xDD));
  if (j + 2 < n) _mm512_store_ps(S + (j + 2) * G, _mm512_shuffle_f32x4(t2, t3, 0x88));
  if (j + 3 < n) _mm512_store_ps(S + (j + 3) * G, _mm512_shuffle_f32x4(t2, t3, 0xDD));
}

#include "mla_decode_cpu_prefetch.h" /* pf_cursor, row_pointers, touch_pages_ahead */

/* S[j][lane] = q row (g0 + lane) . key j for the n keys at rows[] (q rows past `valid` are
 * zero and their lanes unused). 4 keys x 4 rows per pass, as scores_bf16() (16 loads per 32
 * multiply-adds; 2 keys x 8 rows took 20, and measured 1.11x slower streaming fp32): pass p's
 * reduced vector holds key k's rows 4p..4p+3 in its 128-bit block k. */
static inline __attribute__((always_inline)) void scores_d(const float* qg, const int64_t d,
                                                           const char* const* rows, int64_t n,
                                                           int64_t valid, const int dt,
                                                           float* S, pf_cursor* pc,
                                                           int near_ahead) {
  const int64_t es = app_native_elem_size(dt);
  pf_cursor cur = *pc;
  for (int64_t j = 0; j < n; j += 4) {
    const char *k0, *k1, *k2, *k3;
    four_keys(rows, j, n, &k0, &k1, &k2, &k3);
    __m512 v[4];
    for (int pass = 0; pass < 4; ++pass) {
      v[pass] = _mm512_setzero_ps();
      if (pass * 4 >= valid) continue;
      pf_step(&cur);
      const float* qr = qg + pass * 4 * d;
      /* near_ahead: the next tile's keys, L2 to L1, one pass each (the first group of rows
       * only: the others find them in L2 anyway): 1.02-1.03x on fp32 caches (16x8k and
       * 64x4k, paired, L3 flushed); the dot path showed no change and does not. */
      const char* near = near_ahead ? rows[j + 4 + pass < n ? j + 4 + pass : j] : NULL;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      _Pragma("GCC unroll 18") for (int64_t c = 0; c < d; c += 32) {
        if (near != NULL) {
          _mm_prefetch(near + c * es, _MM_HINT_T0);
          if (es == 4) _mm_prefetch(near + c * es + 64, _MM_HINT_T0);
        }
        __m512 a0, b0, a1, b1, a2, b2, a3, b3;
        load32(k0 + c * es, dt, &a0, &b0);
        load32(k1 + c * es, dt, &a1, &b1);
        load32(k2 + c * es, dt, &a2, &b2);
        load32(k3 + c * es, dt, &a3, &b3);
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; ++r) {
          const __m512 qa = _mm512_load_ps(qr + r * d + c);
          const __m512 qb = _mm512_load_ps(qr + r * d + c + 16);
          acc[r] = _mm512_fmadd_ps(qa, a0, acc[r]);
          acc[4 + r] = _mm512_fmadd_ps(qa, a1, acc[4 + r]);
          acc[8 + r] = _mm512_fmadd_ps(qa, a2, acc[8 + r]);
          acc[12 + r] = _mm512_fmadd_ps(qa, a3, acc[12 + r]);
          acc[r] = _mm512_fmadd_ps(qb, b0, acc[r]);
          acc[4 + r] = _mm512_fmadd_ps(qb, b1, acc[4 + r]);
          acc[8 + r] = _mm512_fmadd_ps(qb, b2, acc[8 + r]);
          acc[12 + r] = _mm512_fmadd_ps(qb, b3, acc[12 + r]);
        }
      }
      v[pass] = hsum16(acc);
    }
    store_scores4(S, j, n, v);
  }
  *pc = cur;
}

static inline __attribute__((always_inline)) void scores(const float* qg, int64_t d,
                                                         const char* const* rows, int64_t n,
                                                         int64_t valid, const int dt, float* S,
                                                         pf_cursor* pc, int near_ahead) {
  if (d == D_MLA) scores_d(qg, D_MLA, rows, n, valid, dt, S, pc, near_ahead); /* see D_MLA */
  else scores_d(qg, d, rows, n, valid, dt, S, pc, near_ahead);
}

/* Online softmax of one group over one chunk, in three parts (softmax_group() here, and
 * softmax_group_bf16() of the dot path, which fuses the bf16 packing into its middle part):
 * softmax_ref() masks hidden keys (position >= tail only) and finds the new running max and
 * the reference the probabilities are taken against; the middle turns S into the
 * probabilities (exactly 0 for hidden keys) and sums them; softmax_commit() updates the
 * running max m and sums l (and lr, the dot path's, where given) of each lane and rescales
 * the accumulator rows. */
static inline __attribute__((always_inline)) void softmax_ref(float* S, int64_t n, int64_t pos0,
                                                              int64_t tail, __m512i lim,
                                                              const float* m, __m512* vmax,
                                                              __m512* ref, __m512* alpha) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 mx = m_old;
  for (int64_t j = 0; j < n; ++j) {
    __m512 s = _mm512_load_ps(S + j * G);
    if (pos0 + j >= tail) {
      const __mmask16 vis = _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(pos0 + j)), lim);
      s = _mm512_mask_mov_ps(ninf, vis, s);
      _mm512_store_ps(S + j * G, s);
    }
    mx = _mm512_max_ps(mx, s);
  }
  /* A lane that has seen no key yet keeps max -inf; 0 is its reference (its p are 0). */
  const __mmask16 none = _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ);
  *vmax = mx;
  *ref = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
  *alpha = app_exp2_nonpositive(_mm512_sub_ps(m_old, *ref));
}

/* The probability of key j (position pos0 + j) in each lane: 0 where the key is hidden. */
static inline __attribute__((always_inline)) __m512 softmax_p(const float* S, int64_t j,
                                                              int64_t pos0, int64_t tail,
                                                              __m512i lim, __m512 ref) {
  const __m512 p = app_exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(S + j * G), ref));
  if (pos0 + j < tail) return p;
  return _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(pos0 + j)), lim),
                             p);
}

static inline __attribute__((always_inline)) void softmax_commit(
    float* m, float* l, float* lr, __m512 vmax, __m512 alpha, __m512 sum, __m512 sum_r,
    float* acc, int64_t rank) {
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
  if (lr != NULL) _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), alpha, sum_r));
  _mm512_storeu_ps(m, vmax);
  __mmask16 rescale = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ);
  if (!rescale) return;
  float a[G];
  _mm512_storeu_ps(a, alpha);
  for (int r = 0; r < G; ++r) {
    if (!((rescale >> r) & 1)) continue;
    const __m512 va = _mm512_set1_ps(a[r]);
    for (int64_t c = 0; c < rank; c += 16)
      _mm512_storeu_ps(acc + r * rank + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * rank + c), va));
  }
}

/* The float path's softmax (see softmax_ref): S becomes the probabilities in float32. */
static void softmax_group(float* S, int64_t n, int64_t pos0, int64_t tail, const int32_t* limit,
                          float* m, float* l, float* acc, int64_t rank) {
  const __m512i lim = _mm512_loadu_si512((const void*)limit);
  __m512 vmax, ref, alpha;
  softmax_ref(S, n, pos0, tail, lim, m, &vmax, &ref, &alpha);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = softmax_p(S, j, pos0, tail, lim, ref);
    sum = _mm512_add_ps(sum, p);
    _mm512_store_ps(S + j * G, p);
  }
  softmax_commit(m, l, NULL, vmax, alpha, sum, sum, acc, rank); /* no rounded sum */
}

/* acc[i * rank + 0 .. 63] += c[i] for the pr rows of a p.v tile. A tile sums from zero and
 * is added to acc once at its end, rather than starting from acc: the loads then wait for
 * nothing and the first products do not wait for them (p.v alone, cache hot: 1.07x). */
static inline __attribute__((always_inline)) void add_tile(const __m512 c[PR][4], const int pr,
                                                          float* acc, int64_t rank) {
  _Pragma("GCC unroll 6") for (int i = 0; i < PR; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      if (i < pr) {
        float* a = acc + i * rank + 16 * u;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), c[i][u]));
      }
}

/* acc rows r0 .. r0 + pr (64 columns from c0) += p . v over the chunk's keys. Keys before
 * n_main are seen by every row; a later key only by the rows whose limit reaches it. */
static inline __attribute__((always_inline)) void pv_tile(
    const float* S, const char* const* rows, int64_t n, int64_t n_main, int64_t pos0,
    const int32_t* limit, int r0, const int pr, float* acc, int64_t rank, int64_t c0,
    const int dt, pf_cursor* pc) {
  const int64_t es = app_native_elem_size(dt);
  __m512 c[PR][4];
  _Pragma("GCC unroll 6") for (int i = 0; i < PR; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) c[i][u] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n_main; ++j) {
    pf_step(pc);
    const char* v = rows[j] + c0 * es;
    __m512 a0, b0, a1, b1;
    load32(v, dt, &a0, &b0);
    load32(v + 32 * es, dt, &a1, &b1);
    const float* p = S + j * G + r0;
    _Pragma("GCC unroll 6") for (int i = 0; i < PR; ++i) {
      if (i >= pr) continue;
      const __m512 pi = _mm512_set1_ps(p[i]);
      c[i][0] = _mm512_fmadd_ps(pi, a0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(pi, b0, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(pi, a1, c[i][2]);
      c[i][3] = _mm512_fmadd_ps(pi, b1, c[i][3]);
    }
  }
  for (int64_t j = n_main; j < n; ++j) { /* the step's own keys: skip the rows they hide */
    const char* v = rows[j] + c0 * es;
    __m512 a0, b0, a1, b1;
    load32(v, dt, &a0, &b0);
    load32(v + 32 * es, dt, &a1, &b1);
    const float* p = S + j * G + r0;
    for (int i = 0; i < pr; ++i) {
      if (pos0 + j > limit[r0 + i]) continue;
      const __m512 pi = _mm512_set1_ps(p[i]);
      c[i][0] = _mm512_fmadd_ps(pi, a0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(pi, b0, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(pi, a1, c[i][2]);
      c[i][3] = _mm512_fmadd_ps(pi, b1, c[i][3]);
    }
  }
  add_tile(c, pr, acc + r0 * rank + c0, rank);
}

static inline __attribute__((always_inline)) void pv_group(
    const float* S, const char* const* rows, int64_t n, int64_t n_main, int64_t pos0,
    const int32_t* limit, int64_t valid, float* acc, int64_t rank, const int dt, pf_cursor* pc) {
  for (int64_t c0 = 0; c0 < rank; c0 += 64)
    for (int r0 = 0; r0 < valid; r0 += PR) {
      if (valid - r0 >= PR)
        pv_tile(S, rows, n, n_main, pos0, limit, r0, PR, acc, rank, c0, dt, pc);
      else
        pv_tile(S, rows, n, n_main, pos0, limit, r0, (int)(valid - r0), acc, rank, c0, dt, pc);
    }
}

#include "mla_decode_cpu_bf16.h" /* the bf16 dot path: scores_bf16, pv_group_bf16 */
#include "mla_decode_cpu_fp8.h"  /* FP8 caches: each chunk dequantised into a tile */

static int accumulator_order(const mla_decode_args* a) {
  if (a->bf16_dot) return ORDER_PAIRS;
  return a->cache_dt == APP_DT_BF16 ? ORDER_EVEN_ODD : ORDER_NATURAL; /* FP8: a float32 tile */
}

int64_t mla_decode_cpu_scratch_floats(int64_t qlen, int64_t heads, int64_t rank, int64_t rope) {
  const int64_t mp = app_round_up(qlen * heads, G);
  /* 16 to align, packed q, accumulators, m, l, lr, limits (int32), scores (+1 key of
   * slack), bf16 probability pairs; 16 to align and an FP8 cache's tile of BK rows (float32
   * on the float path, bf16 on the dot path) */
  return 16 + mp * (rank + rope) + mp * rank + 4 * mp + (BK + 1) * G + (BK / 2 + 1) * G
         + 16 + BK * (rank + rope);
}

/* The key range [k0, k1) of request b, for all its query rows; see mla_decode_args. `after`:
 * the next item of the call (request, first key, end key, part), or NULL. */
static inline __attribute__((always_inline)) void run_item(const mla_decode_args* a, int64_t b,
                                                           int64_t k0, int64_t k1, int64_t part,
                                                           const int64_t* after, const int dt,
                                                           const int dot, const int src) {
  /* dt: the element type the chunk's rows are read in: the cache's, or for an FP8 cache
   * (src, its layout) the dequantised tile's (bf16 on the dot path, else float32). */
  const int64_t heads = a->heads, qlen = a->qlen, rows_m = qlen * heads, rank = a->rank;
  const int64_t d = rank + a->rope, mp = app_round_up(rows_m, G), es = app_native_elem_size(dt);
  const int fp8 = is_fp8_cache(src);
  const int64_t src_es = fp8 ? 1 : es; /* the cache's strides count bytes for FP8 */
  const int64_t src_row = cache_row_bytes(src, rank, a->rope);
  const int64_t seq_len = a->seq_lens[b], tail = seq_len - qlen + 1;
  float* qp = a->scratch + (16 - ((uintptr_t)a->scratch / sizeof(float)) % 16) % 16;
  float* acc = qp + mp * d;
  float* m = acc + mp * rank;
  float* l = m + mp;
  /* The dot path's sum of the probabilities as rounded to bf16 (what p.v multiplies): it
   * normalises the output, so the output is the exact weighted mean of the values under the
   * rounded weights (a key holding almost all the weight comes out to float32, not bf16's
   * 2^-9); l, the float32 sum, gives the LSE. */
  float* lr = l + mp;
  int32_t* limit = (int32_t*)(lr + mp);
  float* S = (float*)(limit + mp);
  uint32_t* P2 = (uint32_t*)(S + (BK + 1) * G);
  float* tile = (float*)(P2 + (BK / 2 + 1) * G);
  tile += (16 - ((uintptr_t)tile / sizeof(float)) % 16) % 16;
  const char* tile_rows[BK]; /* an FP8 chunk's rows, dequantised: tile + j * d elements */
  if (fp8)
    for (int64_t j = 0; j < BK; ++j) tile_rows[j] = (const char*)tile + j * d * es;
  uint16_t* q16 = (uint16_t*)qp; /* the dot path keeps q as bf16 bits, unscaled */
  const int64_t qes = app_native_elem_size(a->q_dt);
  for (int64_t r = 0; r < mp; ++r) {
    const int64_t i = r / heads, h = r % heads;
    const char* src = (const char*)a->q + (b * a->q_sb + i * a->q_si + h * a->q_sh) * qes;
    if (dot && r >= rows_m) memset(q16 + r * d, 0, sizeof(uint16_t) * (size_t)d);
    else if (dot) memcpy(q16 + r * d, src, sizeof(uint16_t) * (size_t)d);
    else if (r >= rows_m) memset(qp + r * d, 0, sizeof(float) * (size_t)d);
    else
      for (int64_t e = 0; e < d; ++e)
        qp[r * d + e / 32 * 32 + cache_slot(e % 32, dt)] = app_load_elem(src, e, a->q_dt) * a->q_mult;
    limit[r] = (int32_t)(r >= rows_m ? seq_len - 1 : seq_len - qlen + i);
    m[r] = -INFINITY;
    l[r] = 0.f;
    lr[r] = 0.f;
  }
  memset(acc, 0, sizeof(float) * (size_t)(mp * rank));
  const int32_t* table = a->block_table + b * a->bt_stride;
  /* Chunk t's row pointers live in ring[t % 3], each made once: one chunk ahead (its lines
   * are prefetched over chunk t - 1's work), or two where pages are touched ahead. */
  const char* ring[3][BK];
  const int touch = 4 * a->block_size <= BK; /* see touch_pages_ahead */
  row_pointers(a, table, k0, k1 - k0 < BK ? k1 - k0 : BK, src_es, ring[0]);
  for (int64_t t = 0, cs = k0; cs < k1; ++t, cs += BK) {
    const int64_t n = k1 - cs < BK ? k1 - cs : BK;
    const char* const* rows = ring[t % 3];
    if (fp8) { /* the chunk's stored rows (prefetched during the last chunk) -> the tile */
      if (dot) fp8_tile_bf16(a, rows, n, (uint16_t*)tile);
      else fp8_tile_f32(a, rows, n, tile);
      rows = tile_rows;
    }
    const char** next = ring[(t + 1) % 3];
    int64_t n_next = k1 - cs - BK < BK ? k1 - cs - BK : BK;
    /* made by chunk t - 1 when it touched this item's next chunk's pages */
    int made = touch && t > 0;
    const int32_t* next_table = table;
    int64_t next_start = cs + BK;
    /* The last chunk fetches the next item's first chunk (`after`: its quadruple, or NULL),
     * which otherwise started cold: 1.02-1.03x on 64 requests of 4k keys and 128 of 1k,
     * 1.06x on 256 of 512 (paired, cache from memory). */
    if (n_next <= 0 && after != NULL) {
      const int64_t len = after[2] - after[1];
      n_next = len < BK ? len : BK;
      next_table = a->block_table + after[0] * a->bt_stride;
      next_start = after[1];
      made = 0;
    }
    pf_cursor pc = {next, n_next > 0 ? n_next : 0, (src_row + 63) / 64 * 64, -1, 0, NULL, NULL};
    if (n_next > 0) {
      if (!made) row_pointers(a, next_table, next_start, n_next, src_es, next);
      const int64_t calls = prefetch_calls(rows_m, n, rank, d, dot);
      pc.per_call = (n_next * (pc.row_bytes / 64) + calls - 1) / calls;
    }
    if (touch && k1 - cs > 2 * BK)
      touch_pages_ahead(a, table, cs + 2 * BK, k1 - cs - 2 * BK < BK ? k1 - cs - 2 * BK : BK,
                        src_es, ring[(t + 2) % 3]);
    int64_t n_main = tail - cs;
    n_main = n_main < 0 ? 0 : n_main > n ? n : n_main;
    for (int64_t g0 = 0; g0 < rows_m; g0 += G) {
      const int64_t valid = rows_m - g0 < G ? rows_m - g0 : G;
      if (dot) scores_bf16(q16 + g0 * d, d, rows, n, valid, a->q_mult, S, &pc);
      else scores(qp + g0 * d, d, rows, n, valid, dt, S, &pc, g0 == 0);
      if (dot)
        softmax_group_bf16(S, P2, n, cs, tail, limit + g0, m + g0, l + g0, lr + g0,
                           acc + g0 * rank, rank);
      else softmax_group(S, n, cs, tail, limit + g0, m + g0, l + g0, acc + g0 * rank, rank);
      if (dot)
        pv_group_bf16(S, P2, rows, n, n_main, cs, limit + g0, valid, acc + g0 * rank, rank, &pc);
      else pv_group(S, rows, n, n_main, cs, limit + g0, valid, acc + g0 * rank, rank, dt, &pc);
    }
    pf_finish(&pc);
  }
  for (int64_t r = 0; r < rows_m; ++r) {
    const float norm = dot ? lr[r] : l[r];
    const float inv = norm == 0.f ? 0.f : 1.f / norm;
    const float lse2 = l[r] == 0.f ? -INFINITY : m[r] + log2f(l[r]);
    const float* row = acc + r * rank;
    if (part >= 0) {
      float* po = a->part_out + (part * rows_m + r) * rank;
      const __m512 vi = _mm512_set1_ps(inv);
      for (int64_t c = 0; c < rank; c += 16)
        _mm512_storeu_ps(po + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), vi));
      a->part_lse[part * rows_m + r] = lse2;
      continue;
    }
    const __m512 vi = _mm512_set1_ps(inv * a->v_mult);
    const int64_t o = (b * rows_m + r) * rank;
    for (int64_t c = 0; c < rank; c += 32) {
      __m512 lo, hi;
      to_natural(_mm512_mul_ps(_mm512_loadu_ps(row + c), vi),
                 _mm512_mul_ps(_mm512_loadu_ps(row + c + 16), vi), accumulator_order(a), &lo,
                 &hi);
      app_store16(a->out, o + c, lo, a->out_dt);
      app_store16(a->out, o + c + 16, hi, a->out_dt);
    }
    if (a->lse) a->lse[b * rows_m + r] = lse2 * LN2;
  }
}

static int shape_ok(const mla_decode_args* a) {
  const int dts_ok = (a->cache_dt == APP_DT_F32 || a->cache_dt == APP_DT_BF16 ||
                      a->cache_dt == APP_DT_F16 || is_fp8_cache(a->cache_dt)) &&
                     (a->q_dt == APP_DT_F32 || a->q_dt == APP_DT_BF16 || a->q_dt == APP_DT_F16) &&
                     (a->out_dt == APP_DT_F32 || a->out_dt == APP_DT_BF16 ||
                      a->out_dt == APP_DT_F16);
  const int dot_ok = !a->bf16_dot || ((a->cache_dt == APP_DT_BF16 || is_fp8_cache(a->cache_dt)) &&
                                      a->q_dt == APP_DT_BF16);
  const int ds_ok = a->cache_dt != MLA_CACHE_FP8_DS_MLA || a->rank % 128 == 0;
  return dts_ok && dot_ok && ds_ok && a->rank > 0 && a->rank % 64 == 0 && a->rope >= 0 &&
         a->rope % 32 == 0 && a->qlen > 0 && a->heads > 0 && a->block_size > 0;
}

#include "mla_decode_cpu_shares.h" /* run_shares, items_ok, the OpenMP probes */

int32_t mla_decode_cpu_run(const mla_decode_args* a) {
  if (!shape_ok(a) || !items_ok(a, a->items, a->n_items)) return 1;
  for (int64_t t = 0; t < a->n_items; ++t) {
    const int64_t* it = a->items + 4 * t;
    const int64_t* after = t + 1 < a->n_items ? it + 4 : NULL;
    const int src = a->cache_dt;
    if (a->cache_dt == APP_DT_BF16 && a->bf16_dot)
      run_item(a, it[0], it[1], it[2], it[3], after, APP_DT_BF16, 1, APP_DT_BF16);
    else if (a->cache_dt == APP_DT_BF16)
      run_item(a, it[0], it[1], it[2], it[3], after, APP_DT_BF16, 0, APP_DT_BF16);
    else if (a->cache_dt == APP_DT_F16)
      run_item(a, it[0], it[1], it[2], it[3], after, APP_DT_F16, 0, APP_DT_F16);
    else if (is_fp8_cache(src) && a->bf16_dot) /* the chunk's tile in bf16 */
      run_item(a, it[0], it[1], it[2], it[3], after, APP_DT_BF16, 1, src);
    else if (is_fp8_cache(src)) /* ... in float32 */
      run_item(a, it[0], it[1], it[2], it[3], after, APP_DT_F32, 0, src);
    else run_item(a, it[0], it[1], it[2], it[3], after, APP_DT_F32, 0, APP_DT_F32);
  }
  return 0;
}

#include "mla_decode_cpu_merge.h" /* mla_decode_cpu_merge */
