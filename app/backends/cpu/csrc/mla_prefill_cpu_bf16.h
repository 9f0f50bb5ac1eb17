/* bf16 products for mla_prefill_cpu.c: q.k and p.v through vdpbf16ps (AVX512-BF16), float32
 * accumulation. Included by mla_prefill_cpu.c when it is compiled with -DMLA_PREFILL_BF16
 * -mavx512bf16 (the second library app/backends/cpu/prefill_kernel.py builds, loaded only on CPUs
 * with AVX512-BF16); it reuses that file's helpers (transpose16, softmax_row), the shared ones of
 * app_native_simd.h (app_store16) and its block structure, with only the packing and the
 * register tiles in bf16.
 *
 * vdpbf16ps multiplies pairs of bf16 and adds both products to a float32 lane, so the
 * reduction dimension is packed in pairs (one 32-bit word per pair):
 * - q tiles [dp][MR] words and k panels [dp][NR] words, dp = ceil(d / 2): word c of a row is
 *   its elements (2c, 2c + 1) (a 32-bit transpose of the rows; an odd d pads with 0);
 * - v as key pairs: [ceil(kv / 2)][dv][2] bf16, (v[2p][c], v[2p + 1][c]) in one word (an odd
 *   kv_len pads with 0);
 * - probabilities rounded to bf16 (round to nearest even, as GPU kernels round P before p.v),
 *   written over the float32 score row they come from (row i of S holds LDS floats = room for
 *   2 LDS bf16), zero past the keys the row's p.v tile reads, so pairs never pick up garbage.
 * Scores are scaled (scale * log2(e)) in float32 as a tile is stored, not folded into k before
 * rounding. The row sums use the float32 probabilities (as FlashAttention does).
 */
#ifndef MLA_PREFILL_CPU_BF16_H
#define MLA_PREFILL_CPU_BF16_H

/* Up to 16 rows of bf16 src (row stride ld elements; rows past `rows` read as zero), as
 * 32-bit words (element pairs) transposed: dst[c * ld_d + r] = word c of row r for c < dp
 * and the lanes set in `lanes`. Masked loads: no read past an odd d's last element. */
static inline __attribute__((always_inline)) void transpose_words(
    const uint16_t* src, long ld, long rows, long d, uint32_t* dst, long ld_d,
    __mmask16 lanes) {
  const long dp = (d + 1) / 2;
  for (long c0 = 0; c0 < dp; c0 += 16) {
    const long valid = d - 2 * c0;  /* bf16 elements left in a row */
    const __mmask32 mask = valid >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << valid) - 1);
    __m512 r[16], c[16];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, src + i * ld + 2 * c0))
                      : _mm512_setzero_ps();
    transpose16(r, c);
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
      if (c0 + i < dp) _mm512_mask_storeu_ps((float*)(dst + (c0 + i) * ld_d), lanes, c[i]);
  }
}

/* Keys [0, n) of v (bf16, row stride ld) -> key pairs [n/2][dv][2] (an odd n pads with 0). */
static void pack_v_pairs(const uint16_t* v, long ld, long n, long dv, uint16_t* dst) {
  /* Word c of the output pair row: element c of the even key, then of the odd key. */
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                      40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                      32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (long r = 0; r < n; r += 2) {
    if (r + 2 + PREFETCH_ROWS < n) {
      prefetch_row(v, r + 1 + PREFETCH_ROWS, ld, dv, APP_DT_BF16);
      prefetch_row(v, r + 2 + PREFETCH_ROWS, ld, dv, APP_DT_BF16);
    }
    uint16_t* out = dst + r * dv;  /* pair r / 2 starts at element (r / 2) * 2 dv */
    for (long c = 0; c < dv; c += 32) {
      __m512i a = _mm512_loadu_si512(v + r * ld + c);
      __m512i b = r + 1 < n ? _mm512_loadu_si512(v + (r + 1) * ld + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

/* s[mr x NR] = (q tile . k panel) * mult, in float32 (mr <= MR); dp word columns. */
static inline __attribute__((always_inline)) void qk_tile_bf16(
    const uint32_t* qt, const uint32_t* kp, long dp, const int mr, float mult, float* s) {
  __m512 c0[MR], c1[MR];
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
    c0[i] = _mm512_setzero_ps();
    c1[i] = _mm512_setzero_ps();
  }
  for (long c = 0; c < dp; ++c) {
    __m512bh b0 = (__m512bh)_mm512_load_si512(kp + c * NR);
    __m512bh b1 = (__m512bh)_mm512_load_si512(kp + c * NR + 16);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)qt[c * MR + i]);
      c0[i] = _mm512_dpbf16_ps(c0[i], a, b0);
      c1[i] = _mm512_dpbf16_ps(c1[i], a, b1);
    }
  }
  const __m512 vm = _mm512_set1_ps(mult);
  _Pragma("GCC unroll 16") for (int i = 0; i < mr; ++i) {
    _mm512_storeu_ps(s + i * LDS, _mm512_mul_ps(c0[i], vm));
    _mm512_storeu_ps(s + i * LDS + 16, _mm512_mul_ps(c1[i], vm));
  }
}

/* acc[mr x 64] += p[mr x 2 pairs] . v[pairs x 64] (mr <= PR): p rows are bf16 with a row
 * stride of 2 LDS elements (LDS words), v pair rows dv words apart. Row i takes only its
 * first vis[i] keys, as pv_tile: its p is 0 past them, but 0 * NaN is NaN, so a non-finite v
 * in a key the row must not see would leak in; a pair half seen takes v with the second key's
 * elements zeroed. */
static inline __attribute__((always_inline)) void pv_tile_bf16(
    const uint32_t* p, const uint32_t* v, long ld_v, long pairs, const long* vis,
    const int mr, float* acc, long ld_a) {
  __m512 c[PR][4];
  _Pragma("GCC unroll 8") for (int i = 0; i < PR; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      c[i][u] = i < mr ? _mm512_loadu_ps(acc + i * ld_a + 16 * u) : _mm512_setzero_ps();
  long common = 2 * pairs;  /* keys every row of the tile sees */
  for (int i = 0; i < mr; ++i)
    if (vis[i] < common) common = vis[i];
  for (long j = 0; j < common / 2; ++j) {
    const uint32_t* vr = v + j * ld_v;
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(vr);
    __m512bh b1 = (__m512bh)_mm512_loadu_si512(vr + 16);
    __m512bh b2 = (__m512bh)_mm512_loadu_si512(vr + 32);
    __m512bh b3 = (__m512bh)_mm512_loadu_si512(vr + 48);
    _Pragma("GCC unroll 8") for (int i = 0; i < PR; ++i) {
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)p[i * LDS + j]);
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
      c[i][2] = _mm512_dpbf16_ps(c[i][2], a, b2);
      c[i][3] = _mm512_dpbf16_ps(c[i][3], a, b3);
    }
  }
  const __mmask32 even = 0x55555555u;  /* the first key of each pair */
  for (long j = common / 2; j < pairs; ++j) {  /* the diagonal: at most (MR + PR) / 2 pairs */
    const uint32_t* vr = v + j * ld_v;
    const __m512i w0 = _mm512_loadu_si512(vr), w1 = _mm512_loadu_si512(vr + 16);
    const __m512i w2 = _mm512_loadu_si512(vr + 32), w3 = _mm512_loadu_si512(vr + 48);
    _Pragma("GCC unroll 8") for (int i = 0; i < PR; ++i) {
      if (i >= mr || 2 * j >= vis[i]) continue;
      const __mmask32 keep = 2 * j + 1 < vis[i] ? 0xFFFFFFFFu : even;
      __m512bh a = (__m512bh)_mm512_set1_epi32((int)p[i * LDS + j]);
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, (__m512bh)_mm512_maskz_mov_epi16(keep, w0));
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, (__m512bh)_mm512_maskz_mov_epi16(keep, w1));
      c[i][2] = _mm512_dpbf16_ps(c[i][2], a, (__m512bh)_mm512_maskz_mov_epi16(keep, w2));
      c[i][3] = _mm512_dpbf16_ps(c[i][3], a, (__m512bh)_mm512_maskz_mov_epi16(keep, w3));
    }
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < mr; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      _mm512_storeu_ps(acc + i * ld_a + 16 * u, c[i][u]);
}

/* The first `width` float32 probabilities of a score row -> bf16 in place (the row's first
 * bytes), rounded to nearest even, zero from `width` up to the next even count. Ascending
 * chunks: a chunk's 32 output bytes end before the next chunk's input starts. */
static inline void probabilities_to_bf16(float* row, long width) {
  uint16_t* out = (uint16_t*)row;
  const long pairs_end = app_round_up(width, 2);
  for (long j = 0; j < pairs_end; j += 16) {
    const long left = width - j;
    const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, row + j));
    const long n = pairs_end - j < 16 ? pairs_end - j : 16;
    _mm256_mask_storeu_epi16(out + j, (__mmask16)((1u << n) - 1), h);
  }
}

/* attend_head (mla_prefill_cpu.c) for bf16 q/k/v with bf16 products; same arguments and
 * scratch (its bf16 layouts need no more than the float32 ones). */
static void attend_head_bf16(const uint16_t* q, long ld_q, const uint16_t* k, long ld_k,
                             const uint16_t* v, long ld_v, long q_len, long kv_len, long d,
                             long dv, int causal, float scale, void* out, long ld_o,
                             int out_dt, float* lse, float* scratch) {
  const long dp = (d + 1) / 2;
  uint32_t* qpack = (uint32_t*)scratch;  /* the query block's tiles, [dp][MR] words each */
  uint32_t* kpack = qpack + BQ * dp;
  kpack += (16 - ((unsigned long)kpack / sizeof(uint32_t)) % 16) % 16;  /* 64-byte aligned */
  uint16_t* vbuf = (uint16_t*)(kpack + app_round_up(kv_len, NR) * dp);
  float* S = (float*)(vbuf + app_round_up(kv_len, 2) * dv);
  float* acc = S + BQ * LDS;
  float* m = acc + BQ * dv;
  float* l = m + BQ;
  float* lr = l + BQ;  /* the rounded probabilities' sum: see softmax_row */
  const long off = kv_len - q_len;
  const float mult = scale * 1.4426950408889634f;
  long packed = 0;  /* keys packed so far: whole k panels, or all of them */

  for (long qs = 0; qs < q_len; qs += BQ) {
    const long qn = q_len - qs < BQ ? q_len - qs : BQ;
    long kv_end = causal ? qs + qn + off : kv_len;
    if (kv_end > kv_len) kv_end = kv_len;
    long need = app_round_up(kv_end > 0 ? kv_end : 0, NR);
    if (need > kv_len) need = kv_len;
    for (long t = 0; t * MR < qn; ++t)
      transpose_words(q + (qs + t * MR) * ld_q, ld_q, qn - t * MR < MR ? qn - t * MR : MR, d,
                      qpack + t * dp * MR, MR, (__mmask16)((1u << MR) - 1));
    if (need > packed) {  /* fresh keys (packed is a whole number of panels then) */
      for (long p = packed; p < app_round_up(need, NR); p += 16)  /* whole panels, zero-padded */
        transpose_words(k + p * ld_k, ld_k, need - p, d,
                        kpack + (p / NR) * dp * NR + p % NR, NR, (__mmask16)0xFFFF);
      pack_v_pairs(v + packed * ld_v, ld_v, need - packed, dv, vbuf + packed * dv);
      packed = need;
    }
    for (long i = 0; i < qn; ++i) { m[i] = -INFINITY; l[i] = 0.f; lr[i] = 0.f; }
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
      long pv_keys[BQ / PR];
      for (long i0 = 0; i0 < qn; i0 += PR)
        pv_keys[i0 / PR] = tile_keys[((i0 + PR < qn ? i0 + PR : qn) - 1) / MR];
      for (long p0 = 0; p0 < kn; p0 += NR) {
        const uint32_t* kp = kpack + (ks + p0) * dp;
        for (long i0 = 0; i0 < qn; i0 += MR) {
          if (p0 >= tile_keys[i0 / MR]) continue;
          const int mr = qn - i0 < MR ? (int)(qn - i0) : MR;
          const uint32_t* qt = qpack + i0 * dp;
          if (mr == MR) qk_tile_bf16(qt, kp, dp, MR, mult, S + i0 * LDS + p0);
          else qk_tile_bf16(qt, kp, dp, mr, mult, S + i0 * LDS + p0);
        }
      }
      for (long i = 0; i < qn; ++i) {
        long vis = causal ? qs + i + off + 1 - ks : kn;
        if (vis > tile_keys[i / MR]) vis = tile_keys[i / MR];
        if (vis < 0) vis = 0;
        row_vis[i] = vis;
        softmax_row(S + i * LDS, vis, pv_keys[i / PR], m + i, l + i, lr + i, acc + i * dv, dv, 1);
        probabilities_to_bf16(S + i * LDS, pv_keys[i / PR]);
      }
      for (long i0 = 0; i0 < qn; i0 += PR) {
        const long tk = pv_keys[i0 / PR];
        if (tk == 0) continue;
        const int pr = qn - i0 < PR ? (int)(qn - i0) : PR;
        const uint32_t* pt = (const uint32_t*)(S + i0 * LDS);
        for (long c0 = 0; c0 < dv; c0 += 64) {
          const uint32_t* vb = (const uint32_t*)(vbuf + ks * dv) + c0;
          if (pr == PR)
            pv_tile_bf16(pt, vb, dv, (tk + 1) / 2, row_vis + i0, PR, acc + i0 * dv + c0, dv);
          else
            pv_tile_bf16(pt, vb, dv, (tk + 1) / 2, row_vis + i0, pr, acc + i0 * dv + c0, dv);
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
      __m512 inv = _mm512_set1_ps(lr[i] == 0.f ? 0.f : 1.f / lr[i]);
      for (long c = 0; c < dv; c += 16)
        app_store16(out, o + c, _mm512_mul_ps(_mm512_loadu_ps(acc + i * dv + c), inv), out_dt);
      lse[qs + i] = (m[i] + log2f(l[i])) * 0.6931471805599453f;
    }
  }
}

#endif /* MLA_PREFILL_CPU_BF16_H */
