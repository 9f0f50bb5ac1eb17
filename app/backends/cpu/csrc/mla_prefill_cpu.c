/* MLA prefill attention for one (request, head) on an AVX-512 CPU, float32.
 *
 * Built at first use by app/backends/cpu/loader.py (cc -O3 -mavx512f -mfma -mf16c) and
 * called through ctypes, which releases the GIL, so one Python thread per core runs its own
 * (request, head) items. A flash-attention loop: query blocks of BQ rows, key blocks of BK
 * keys, register tiles of MR x 32 scores (q.k) and PR x 64 outputs (p.v), an online softmax
 * in the log2 domain (k is pre-scaled by scale * log2(e) while it is packed), and keys past
 * a tile's last visible key are never touched (bottom-right causal mask). q is packed into
 * the tile layout one query block at a time, k into panels and v copied contiguous as the
 * blocks first see them (read in place, rows a whole token apart, H * D elements, evict each
 * other from L1 and halve the p.v rate).
 *
 * Layouts (elements, last dim contiguous): q [q_len rows, ld_q], k [kv_len rows, ld_k],
 * v [kv_len rows, ld_v], out [q_len rows, ld_o]; lse [q_len] float32 (natural log; -inf and
 * a zero output row for a query that sees no key). q/k/v share one element type and out has
 * one (APP_DT_F32, APP_DT_BF16 or APP_DT_F16); they are converted to float32 while packing and
 * back when the output is written (bf16 rounds to nearest even), so the math is float32 always.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "app_native_simd.h"
#include "mla_prefill_cpu.h"

APP_NATIVE_LIBRARY(MLA_PREFILL_CPU_ABI)
APP_NATIVE_STRUCT_LAYOUT(mla_prefill_args, MLA_PREFILL_ARGS)

#define MR 14          /* query rows per q.k register tile */
#define NR 32          /* keys per q.k register tile (two vectors) */
/* query rows per p.v register tile (x 64 output columns): 6 x 4 accumulators, 4 v vectors
 * and the broadcast fit the 32 registers; with 7 rows the compiler spilled one accumulator
 * to the stack on every key (p.v ran ~4% slower end to end) */
#define PR 6
#define BQ 126         /* query rows per block (a multiple of MR and PR) */
#define BK 512         /* keys per block (a multiple of NR) */
#define LDS (BK + 16)  /* score row stride: padded so score rows do not share cache sets */
#define PREFETCH_ROWS 4  /* v rows are a whole token apart: fetch ahead of the copy */

static inline __m512 load16(const void* p, long i, int dt) {
  if (dt == APP_DT_F32) return _mm512_loadu_ps((const float*)p + i);
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
  if (dt == APP_DT_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline long elem_size(int dt) { return (long)app_native_elem_size(dt); }

/* Scratch floats for one (request, head) of these sizes: a packed query block, packed k,
 * v copy, scores, accumulator, row max and row sum, plus 16 floats to align the packed k. */
int64_t mla_prefill_cpu_scratch_floats(int64_t q_len, int64_t kv_len, int64_t d, int64_t dv) {
  (void)q_len;
  /* ... + m, l and lr per query row of a block (see softmax_row) + 16 to align */
  return BQ * d + app_round_up(kv_len, NR) * d + kv_len * dv + BQ * LDS + BQ * dv + 3 * BQ + 16;
}

/* A hint to fetch one input row (never faults). */
static inline void prefetch_row(const void* src, long row, long ld, long width, int dt) {
  const char* p = (const char*)src + row * ld * elem_size(dt);
  for (long b = 0; b < width * elem_size(dt); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* cols[c] = column c of the 16 x 16 block rows (element r of cols[c] is element c of
 * rows[r]): three rounds of in-lane unpacks and lane shuffles. */
static inline __attribute__((always_inline)) void transpose16(const __m512 rows[16],
                                                              __m512 cols[16]) {
  __m512 t[16], u[16];
  _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  /* 128-bit lane k of u[4 g + m]: element 4 k + m of rows 4 g .. 4 g + 3. */
  _Pragma("GCC unroll 4") for (int g = 0; g < 4; ++g) {
    __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    __m512d c = _mm512_castps_pd(t[4 * g + 2]), e = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  _Pragma("GCC unroll 4") for (int m = 0; m < 4; ++m) {
    __m512 lo0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44);
    __m512 hi0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    __m512 lo1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    __m512 hi1 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    cols[m] = _mm512_shuffle_f32x4(lo0, lo1, 0x88);
    cols[4 + m] = _mm512_shuffle_f32x4(lo0, lo1, 0xDD);
    cols[8 + m] = _mm512_shuffle_f32x4(hi0, hi1, 0x88);
    cols[12 + m] = _mm512_shuffle_f32x4(hi0, hi1, 0xDD);
  }
}

/* Up to 16 rows of src (row stride ld; rows past `rows` read as zero), transposed and
 * multiplied by mult: dst[c * ld_d + r] = src[r][c] * mult for c < d and the lanes r set in
 * `lanes`. A whole 16 x 16 block moves through registers, so each source cache line is read
 * once and whole (a scalar transpose ran at ~6 cycles an element). */
static inline __attribute__((always_inline)) void transpose_rows(
    const void* src, long ld, long rows, long d, const int dt, float mult, float* dst,
    long ld_d, __mmask16 lanes) {
  const __m512 vm = _mm512_set1_ps(mult);
  long c0 = 0;
  for (; c0 + 16 <= d; c0 += 16) {
    __m512 r[16], c[16];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? load16(src, i * ld + c0, dt) : _mm512_setzero_ps();
    transpose16(r, c);
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
      _mm512_mask_storeu_ps(dst + (c0 + i) * ld_d, lanes, _mm512_mul_ps(c[i], vm));
  }
  for (; c0 < d; ++c0)  /* d % 16 trailing columns */
    for (long i = 0; i < 16; ++i)
      if ((lanes >> i) & 1)
        dst[c0 * ld_d + i] = i < rows ? app_load_elem(src, i * ld + c0, dt) * mult : 0.f;
}

/* Query rows -> tiles of MR rows, each stored [d][MR] (rows past n are zero). */
static inline __attribute__((always_inline)) void pack_q(
    const void* q, long ld, long n, long d, const int dt, float* dst) {
  for (long t = 0; t * MR < n; ++t)
    transpose_rows((const char*)q + t * MR * ld * elem_size(dt), ld,
                   n - t * MR < MR ? n - t * MR : MR, d, dt, 1.f, dst + t * d * MR, MR,
                   (__mmask16)((1u << MR) - 1));
}

/* Keys -> panels of NR keys, each stored [d][NR] and multiplied by mult (keys past n: 0). */
static inline __attribute__((always_inline)) void pack_k(
    const void* k, long ld, long n, long d, const int dt, float mult, float* dst) {
  for (long p = 0; p * NR < n; ++p)
    for (long j0 = 0; j0 < NR; j0 += 16)
      transpose_rows((const char*)k + (p * NR + j0) * ld * elem_size(dt), ld,
                     n - p * NR - j0, d, dt, mult, dst + p * d * NR + j0, NR,
                     (__mmask16)0xFFFF);
}

/* Pack q and k and copy v to float32; one specialised copy per element type. */
static inline __attribute__((always_inline)) void pack_inputs_as(
    const void* q, long ld_q, const void* k, long ld_k, const void* v, long ld_v, const int dt,
    long q_len, long kv_len, long d, long dv, float k_mult, float* qpack, float* kpack,
    float* vbuf) {
  pack_q(q, ld_q, q_len, d, dt, qpack);
  pack_k(k, ld_k, kv_len, d, dt, k_mult, kpack);
  for (long r = 0; r < kv_len; ++r) {
    if (r + PREFETCH_ROWS < kv_len) prefetch_row(v, r + PREFETCH_ROWS, ld_v, dv, dt);
    for (long c = 0; c < dv; c += 16)
      _mm512_storeu_ps(vbuf + r * dv + c, load16(v, r * ld_v + c, dt));
  }
}

static void pack_inputs(const void* q, long ld_q, const void* k, long ld_k, const void* v,
                        long ld_v, int dt, long q_len, long kv_len, long d, long dv,
                        float k_mult, float* qpack, float* kpack, float* vbuf) {
  if (dt == APP_DT_BF16)
    pack_inputs_as(q, ld_q, k, ld_k, v, ld_v, APP_DT_BF16, q_len, kv_len, d, dv, k_mult, qpack,
                   kpack, vbuf);
  else if (dt == APP_DT_F16)
    pack_inputs_as(q, ld_q, k, ld_k, v, ld_v, APP_DT_F16, q_len, kv_len, d, dv, k_mult, qpack,
                   kpack, vbuf);
  else
    pack_inputs_as(q, ld_q, k, ld_k, v, ld_v, APP_DT_F32, q_len, kv_len, d, dv, k_mult, qpack,
                   kpack, vbuf);
}

/* s[mr x NR] = q tile . k panel (mr <= MR). */
static inline __attribute__((always_inline)) void qk_tile(
    const float* qt, const float* kp, long d, const int mr, float* s) {
  __m512 c0[MR], c1[MR];
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
    c0[i] = _mm512_setzero_ps();
    c1[i] = _mm512_setzero_ps();
  }
  for (long c = 0; c < d; ++c) {
    __m512 b0 = _mm512_load_ps(kp + c * NR), b1 = _mm512_load_ps(kp + c * NR + 16);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      __m512 a = _mm512_set1_ps(qt[c * MR + i]);
      c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < mr; ++i) {
    _mm512_storeu_ps(s + i * LDS, c0[i]);
    _mm512_storeu_ps(s + i * LDS + 16, c1[i]);
  }
}

/* acc[mr x 64] += p[mr x keys] . v[keys x 64] (mr <= PR), row i over its first vis[i] keys
 * only: past them its p is 0, but 0 * inf and 0 * NaN are NaN, so a non-finite v in a key
 * the row must not see (the causal diagonal) would leak into it. */
static inline __attribute__((always_inline)) void pv_tile(
    const float* p, const float* v, long ld_v, long keys, const long* vis, const int mr,
    float* acc, long ld_a) {
  __m512 c[PR][4];
  _Pragma("GCC unroll 8") for (int i = 0; i < PR; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      c[i][u] = i < mr ? _mm512_loadu_ps(acc + i * ld_a + 16 * u) : _mm512_setzero_ps();
  long common = keys;  /* keys every row of the tile sees */
  for (int i = 0; i < mr; ++i)
    if (vis[i] < common) common = vis[i];
  for (long j = 0; j < common; ++j) {
    const float* vr = v + j * ld_v;
    __m512 b0 = _mm512_loadu_ps(vr), b1 = _mm512_loadu_ps(vr + 16);
    __m512 b2 = _mm512_loadu_ps(vr + 32), b3 = _mm512_loadu_ps(vr + 48);
    _Pragma("GCC unroll 8") for (int i = 0; i < PR; ++i) {
      __m512 a = _mm512_set1_ps(p[i * LDS + j]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
      c[i][3] = _mm512_fmadd_ps(a, b3, c[i][3]);
    }
  }
  for (long j = common; j < keys; ++j) {  /* the diagonal: at most MR + PR keys */
    const float* vr = v + j * ld_v;
    __m512 b0 = _mm512_loadu_ps(vr), b1 = _mm512_loadu_ps(vr + 16);
    __m512 b2 = _mm512_loadu_ps(vr + 32), b3 = _mm512_loadu_ps(vr + 48);
    _Pragma("GCC unroll 8") for (int i = 0; i < PR; ++i) {
      if (i >= mr || j >= vis[i]) continue;
      __m512 a = _mm512_set1_ps(p[i * LDS + j]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
      c[i][3] = _mm512_fmadd_ps(a, b3, c[i][3]);
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < mr; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      _mm512_storeu_ps(acc + i * ld_a + 16 * u, c[i][u]);
}

/* One score row: keep the first `vis` of `width` scores (exponentiated against the new
 * running max), zero the rest; update the row's running max m, sum l and accumulator.
 * A non-finite score among the first `vis` (a NaN or inf in q or in a key the row sees)
 * makes l NaN, and so the row's output and LSE: the max and the exp clamp below would
 * otherwise drop a NaN, hiding the corruption. The rest of the row is never read. round_p:
 * the bf16-products path, which multiplies p in bf16: p is rounded (app_round_to_bf16) and lr
 * sums the rounded values. lr normalises that path's output, so the output is the exact
 * weighted mean of the values under the rounded weights (a key holding almost all the weight
 * comes out to float32, not bf16's 2^-9); l, the float32 sum, gives the LSE. */
static void softmax_row(float* row, long vis, long width, float* m, float* l, float* lr,
                        float* acc, long dv, int round_p) {
  for (long j = vis; j < width; ++j) row[j] = 0.f;
  if (vis <= 0) return;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __m512 nonfinite = _mm512_setzero_ps();  /* x - x: 0 for a finite x, NaN otherwise */
  long j = 0;
  for (; j + 16 <= vis; j += 16) {
    __m512 x = _mm512_loadu_ps(row + j);
    vmax = _mm512_max_ps(vmax, x);
    nonfinite = _mm512_add_ps(nonfinite, _mm512_sub_ps(x, x));
  }
  __mmask16 tail = (__mmask16)((1u << (vis - j)) - 1);
  if (j < vis) {
    __m512 x = _mm512_maskz_loadu_ps(tail, row + j);
    vmax = _mm512_max_ps(vmax, _mm512_mask_blend_ps(tail, _mm512_set1_ps(-INFINITY), x));
    nonfinite = _mm512_add_ps(nonfinite, _mm512_sub_ps(x, x));
  }
  float row_max = _mm512_reduce_max_ps(vmax);
  float m_new = *m > row_max ? *m : row_max;
  float alpha = exp2f(*m - m_new);  /* 0 on the first block (m = -inf) */
  __m512 vm = _mm512_set1_ps(m_new), sum = nonfinite, sum_r = nonfinite;
  for (j = 0; j + 16 <= vis; j += 16) {
    __m512 e = app_exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
    sum = _mm512_add_ps(sum, e);
    if (round_p) {
      e = app_round_to_bf16(e);
      sum_r = _mm512_add_ps(sum_r, e);
    }
    _mm512_storeu_ps(row + j, e);
  }
  if (j < vis) {
    __m512 e = app_exp2_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), vm));
    e = _mm512_maskz_mov_ps(tail, e);
    sum = _mm512_add_ps(sum, e);
    if (round_p) {
      e = app_round_to_bf16(e);
      sum_r = _mm512_add_ps(sum_r, e);
    }
    _mm512_mask_storeu_ps(row + j, tail, e);
  }
  *l = *l * alpha + _mm512_reduce_add_ps(sum);
  if (round_p) *lr = *lr * alpha + _mm512_reduce_add_ps(sum_r);
  *m = m_new;
  if (alpha != 1.f) {
    __m512 va = _mm512_set1_ps(alpha);
    for (long c = 0; c < dv; c += 16)
      _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), va));
  }
}

/* Attention of one (request, head). d: q/k head dim (any); dv: v head dim, a multiple of
 * 64. causal: query r sees keys <= r + kv_len - q_len. in_dt: the element type of q/k/v,
 * out_dt: of out. scratch: mla_prefill_cpu_scratch_floats. */
static void attend_head(const void* q, long ld_q, const void* k, long ld_k, const void* v,
                         long ld_v, int in_dt, long q_len, long kv_len, long d, long dv,
                         int causal, float scale, void* out, long ld_o, int out_dt, float* lse,
                         float* scratch) {
  float* qpack = scratch;  /* the query block's tiles */
  float* kpack = qpack + BQ * d;
  kpack += (16 - ((unsigned long)kpack / sizeof(float)) % 16) % 16;  /* 64-byte aligned */
  float* vbuf = kpack + app_round_up(kv_len, NR) * d;
  float* S = vbuf + kv_len * dv;
  float* acc = S + BQ * LDS;
  float* m = acc + BQ * dv;
  float* l = m + BQ;
  const long off = kv_len - q_len;
  const char* qc = q;
  const char* kc = k;
  const char* vc = v;
  long packed = 0;  /* keys packed so far: whole k panels, or all of them */

  for (long qs = 0; qs < q_len; qs += BQ) {
    const long qn = q_len - qs < BQ ? q_len - qs : BQ;
    long kv_end = causal ? qs + qn + off : kv_len;
    if (kv_end > kv_len) kv_end = kv_len;
    /* Pack as the blocks go: this query block's rows, and the keys it is the first to see
     * (the scratch holds one packed query block, not all of q: 3 MiB less per 4k tokens). */
    long need = app_round_up(kv_end > 0 ? kv_end : 0, NR);
    if (need > kv_len) need = kv_len;
    const long fresh = need > packed ? need - packed : 0;
    pack_inputs(qc + qs * ld_q * elem_size(in_dt), ld_q,
                kc + packed * ld_k * elem_size(in_dt), ld_k,
                vc + packed * ld_v * elem_size(in_dt), ld_v, in_dt, qn, fresh, d, dv,
                scale * 1.4426950408889634f, qpack, kpack + packed * d, vbuf + packed * dv);
    packed += fresh;
    for (long i = 0; i < qn; ++i) { m[i] = -INFINITY; l[i] = 0.f; }
    memset(acc, 0, sizeof(float) * qn * dv);
    for (long ks = 0; ks < kv_end; ks += BK) {
      const long kn = kv_end - ks < BK ? kv_end - ks : BK;
      long tile_keys[BQ / MR];  /* keys of this block the tile's last row sees */
      long row_vis[BQ];         /* keys of this block each row sees */
      for (long i0 = 0; i0 < qn; i0 += MR) {
        const long mr = qn - i0 < MR ? qn - i0 : MR;
        long end = causal ? qs + i0 + mr + off : kv_end;
        if (end > ks + kn) end = ks + kn;
        tile_keys[i0 / MR] = end > ks ? end - ks : 0;
      }
      /* A p.v tile may span two q.k tiles (PR does not divide MR): it reads the keys of
       * the tile holding its last row, and the scores past a row's own tile are zeroed. */
      long pv_keys[BQ / PR];
      for (long i0 = 0; i0 < qn; i0 += PR)
        pv_keys[i0 / PR] = tile_keys[((i0 + PR < qn ? i0 + PR : qn) - 1) / MR];
      for (long p0 = 0; p0 < kn; p0 += NR) {  /* a k panel stays in L1 across the tiles */
        const float* kp = kpack + (ks + p0) * d;
        for (long i0 = 0; i0 < qn; i0 += MR) {
          if (p0 >= tile_keys[i0 / MR]) continue;
          const int mr = qn - i0 < MR ? (int)(qn - i0) : MR;
          const float* qt = qpack + i0 * d;
          /* A constant row count lets the compiler keep the whole tile in registers;
           * only a query block's last, partial tile takes the variable-count copy. */
          if (mr == MR) qk_tile(qt, kp, d, MR, S + i0 * LDS + p0);
          else qk_tile(qt, kp, d, mr, S + i0 * LDS + p0);
        }
      }
      for (long i = 0; i < qn; ++i) {
        long vis = causal ? qs + i + off + 1 - ks : kn;
        if (vis > tile_keys[i / MR]) vis = tile_keys[i / MR];
        if (vis < 0) vis = 0;
        row_vis[i] = vis;
        softmax_row(S + i * LDS, vis, pv_keys[i / PR], m + i, l + i, NULL, acc + i * dv, dv, 0);
      }
      for (long i0 = 0; i0 < qn; i0 += PR) {
        const long tk = pv_keys[i0 / PR];
        if (tk == 0) continue;
        const int pr = qn - i0 < PR ? (int)(qn - i0) : PR;
        for (long c0 = 0; c0 < dv; c0 += 64) {
          const float* vb = vbuf + ks * dv + c0;
          if (pr == PR)
            pv_tile(S + i0 * LDS, vb, dv, tk, row_vis + i0, PR, acc + i0 * dv + c0, dv);
          else
            pv_tile(S + i0 * LDS, vb, dv, tk, row_vis + i0, pr, acc + i0 * dv + c0, dv);
        }
      }
    }
    for (long i = 0; i < qn; ++i) {
      const long o = (qs + i) * ld_o;
      if (l[i] == 0.f) {
        memset((char*)out + o * elem_size(out_dt), 0, (size_t)(elem_size(out_dt) * dv));
        lse[qs + i] = -INFINITY;
        continue;
      }
      __m512 inv = _mm512_set1_ps(1.f / l[i]);
      for (long c = 0; c < dv; c += 16)
        app_store16(out, o + c, _mm512_mul_ps(_mm512_loadu_ps(acc + i * dv + c), inv), out_dt);
      lse[qs + i] = (m[i] + log2f(l[i])) * 0.6931471805599453f;
    }
  }
}

#ifdef MLA_PREFILL_BF16  /* the bf16-products build (AVX512-BF16): bf16 inputs go there */
#include "mla_prefill_cpu_bf16.h"
#endif

/* A worker's share of a ragged batch: see mla_prefill_args in mla_prefill_cpu.h. */
int32_t mla_prefill_cpu_attend(const mla_prefill_args* a) {
  const int in_ok = a->in_dt == APP_DT_F32 || a->in_dt == APP_DT_BF16 || a->in_dt == APP_DT_F16;
  const int out_ok =
      a->out_dt == APP_DT_F32 || a->out_dt == APP_DT_BF16 || a->out_dt == APP_DT_F16;
  if (!in_ok || !out_ok || a->dv % 64 != 0 || a->dv <= 0 || a->d <= 0) return 1;
  const long in_size = elem_size(a->in_dt), out_size = elem_size(a->out_dt);
  for (long it = 0; it < a->n_items; ++it) {
    const long b = a->items[2 * it], h = a->items[2 * it + 1];
    const long qs = a->q_start[b], ks = a->kv_start[b];
#ifdef MLA_PREFILL_BF16
    if (a->in_dt == APP_DT_BF16) {
      attend_head_bf16((const uint16_t*)a->q + qs * a->q_row + h * a->q_head, a->q_row,
                       (const uint16_t*)a->k + ks * a->k_row + h * a->k_head, a->k_row,
                       (const uint16_t*)a->v + ks * a->v_row + h * a->v_head, a->v_row,
                       a->q_len[b], a->kv_len[b], a->d, a->dv, a->causal, a->scale,
                       (char*)a->out + (qs * a->o_row + h * a->o_head) * out_size, a->o_row,
                       a->out_dt, a->lse + h * a->lse_head + qs, a->scratch);
      continue;
    }
#endif
    attend_head((const char*)a->q + (qs * a->q_row + h * a->q_head) * in_size, a->q_row,
                (const char*)a->k + (ks * a->k_row + h * a->k_head) * in_size, a->k_row,
                (const char*)a->v + (ks * a->v_row + h * a->v_head) * in_size, a->v_row,
                a->in_dt, a->q_len[b], a->kv_len[b], a->d, a->dv, a->causal, a->scale,
                (char*)a->out + (qs * a->o_row + h * a->o_head) * out_size, a->o_row,
                a->out_dt, a->lse + h * a->lse_head + qs, a->scratch);
  }
  return 0;
}
