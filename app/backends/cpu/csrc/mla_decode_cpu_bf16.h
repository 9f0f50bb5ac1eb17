/* The bf16 dot path of mla_decode_cpu.c (bf16 cache and q, a CPU with AVX512-BF16 and
 * AVX512BW): q.k and p.v through vdpbf16ps, which multiplies pairs of bf16 values and
 * accumulates in float32, twice the multiply-adds of an fp32 FMA. Included by
 * mla_decode_cpu.c after its shared pieces (G, PR, QK_PF_STEPS, D_MLA, pf_cursor and pf_step,
 * hsum16, four_keys, store_scores4, add_tile), which it uses; compiled with the file's flags,
 * these functions carry the AVX512-BF16 target themselves and run only where the caller
 * checked the CPU.
 *
 * q.k reads q and the cache rows as they are; p.v rounds p to bf16 (the output's own
 * precision; the output is normalised by the sum of the rounded p, see run_item) and pairs
 * keys j, j+1 column by column with 16-bit unpacks (ORDER_PAIRS).
 */
#ifndef MLA_DECODE_CPU_BF16_H
#define MLA_DECODE_CPU_BF16_H

#define BF16_ISA APP_AVX512BF16_ISA
#define BF16_TARGET __attribute__((BF16_ISA, noinline))

/* As scores(), from q rows of bf16 bits; the scores are multiplied by mult afterwards. Four
 * keys x 4 rows per pass (4 key loads + 4 q loads per 16 dot products, not 2 + 8): pass p's
 * reduced vector holds key k's rows 4p..4p+3 in its 128-bit block k, and a 4 x 4 transpose
 * of blocks turns the four passes into S[j..j+3]. */
static inline __attribute__((always_inline, BF16_ISA)) void scores_bf16_d(
    const uint16_t* qg, const int64_t d, const char* const* rows, int64_t n, int64_t valid,
    float mult, float* S, pf_cursor* pc) {
  const __m512 vm = _mm512_set1_ps(mult);
  pf_cursor cur = *pc;
  for (int64_t j = 0; j < n; j += 4) {
    const char *k0, *k1, *k2, *k3;
    four_keys(rows, j, n, &k0, &k1, &k2, &k3);
    __m512 v[4];
    for (int pass = 0; pass < 4; ++pass) {
      v[pass] = _mm512_setzero_ps();
      if (pass * 4 >= valid) continue;
      const uint16_t* qr = qg + pass * 4 * d;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      _Pragma("GCC unroll 18") for (int64_t c = 0; c < d; c += 32) {
        if ((c / 32) % QK_PF_STEPS == 0) pf_step(&cur);
        const __m512bh a0 = (__m512bh)_mm512_loadu_si512((const void*)(k0 + 2 * c));
        const __m512bh a1 = (__m512bh)_mm512_loadu_si512((const void*)(k1 + 2 * c));
        const __m512bh a2 = (__m512bh)_mm512_loadu_si512((const void*)(k2 + 2 * c));
        const __m512bh a3 = (__m512bh)_mm512_loadu_si512((const void*)(k3 + 2 * c));
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; ++r) {
          const __m512bh qv = (__m512bh)_mm512_load_si512((const void*)(qr + r * d + c));
          acc[r] = _mm512_dpbf16_ps(acc[r], qv, a0);
          acc[4 + r] = _mm512_dpbf16_ps(acc[4 + r], qv, a1);
          acc[8 + r] = _mm512_dpbf16_ps(acc[8 + r], qv, a2);
          acc[12 + r] = _mm512_dpbf16_ps(acc[12 + r], qv, a3);
        }
      }
      v[pass] = _mm512_mul_ps(hsum16(acc), vm);
    }
    store_scores4(S, j, n, v);
  }
  *pc = cur;
}

static BF16_TARGET void scores_bf16(const uint16_t* qg, int64_t d, const char* const* rows,
                                    int64_t n, int64_t valid, float mult, float* S,
                                    pf_cursor* pc) {
  if (d == D_MLA) scores_bf16_d(qg, D_MLA, rows, n, valid, mult, S, pc); /* see D_MLA */
  else scores_bf16_d(qg, d, rows, n, valid, mult, S, pc);
}

/* The dot path's softmax (see softmax_ref in mla_decode_cpu.c): the probabilities rounded to
 * bf16, as p.v multiplies them, P1[j][lane] = the bits of key j's (low half; P1 overwrites
 * S in place) and P2[j / 2][lane] = keys 2 (j / 2) and 2 (j / 2) + 1 as a pair; lr sums the
 * rounded ones (see lr in run_item), l the float32 ones. Rounding here with the CPU's
 * conversion, rather than in software and then packing in a pass of its own, measured
 * 1.01-1.02x cache resident and 1.02-1.03x streamed (16 heads, paired); bit-identical. */
static BF16_TARGET void softmax_group_bf16(float* S, uint32_t* P2, int64_t n, int64_t pos0,
                                           int64_t tail, const int32_t* limit, float* m,
                                           float* l, float* lr, float* acc, int64_t rank) {
  const __m512i lim = _mm512_loadu_si512((const void*)limit);
  __m512 vmax, ref, alpha;
  softmax_ref(S, n, pos0, tail, lim, m, &vmax, &ref, &alpha);
  uint32_t* P1 = (uint32_t*)S;
  __m512 sum = _mm512_setzero_ps(), sum_r = _mm512_setzero_ps();
  __m512i even = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = softmax_p(S, j, pos0, tail, lim, ref);
    sum = _mm512_add_ps(sum, p);
    const __m512i w = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
    const __m512i hi = _mm512_slli_epi32(w, 16);
    sum_r = _mm512_add_ps(sum_r, _mm512_castsi512_ps(hi));
    _mm512_store_si512((void*)(P1 + j * G), w);
    if (j & 1) _mm512_store_si512((void*)(P2 + j / 2 * G), _mm512_or_si512(even, hi));
    else even = w;
  }
  softmax_commit(m, l, lr, vmax, alpha, sum, sum_r, acc, rank);
}

static inline __attribute__((always_inline, BF16_ISA)) void dot4(__m512* c, __m512bh p, __m512bh a0,
                                                       __m512bh b0, __m512bh a1, __m512bh b1) {
  c[0] = _mm512_dpbf16_ps(c[0], a0, p);
  c[1] = _mm512_dpbf16_ps(c[1], b0, p);
  c[2] = _mm512_dpbf16_ps(c[2], a1, p);
  c[3] = _mm512_dpbf16_ps(c[3], b1, p);
}

/* As pv_tile() in ORDER_PAIRS: pairs of keys over [0, n_main), then single keys (paired
 * with a zero) for an odd one left and the step's own keys, skipping the rows they hide.
 * Inlined with a constant pr, like pv_tile(), so that the tile stays in registers. */
static inline __attribute__((always_inline, BF16_ISA)) void pv_tile_bf16(
    const uint32_t* P1, const uint32_t* P2, const char* const* rows, int64_t n, int64_t n_main,
    int64_t pos0, const int32_t* limit, int r0, const int pr, float* acc, int64_t rank,
    int64_t c0, pf_cursor* pc) {
  __m512 c[PR][4];
  _Pragma("GCC unroll 6") for (int i = 0; i < PR; ++i)
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) c[i][u] = _mm512_setzero_ps();
  const int64_t pairs = n_main / 2;
  for (int64_t jp = 0; jp < pairs; ++jp) {
    pf_step(pc);
    const char* v0 = rows[2 * jp] + 2 * c0;
    const char* v1 = rows[2 * jp + 1] + 2 * c0;
    const __m512i x0 = _mm512_loadu_si512((const void*)v0);
    const __m512i x1 = _mm512_loadu_si512((const void*)v1);
    const __m512i y0 = _mm512_loadu_si512((const void*)(v0 + 64));
    const __m512i y1 = _mm512_loadu_si512((const void*)(v1 + 64));
    const __m512bh a0 = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
    const __m512bh b0 = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
    const __m512bh a1 = (__m512bh)_mm512_unpacklo_epi16(y0, y1);
    const __m512bh b1 = (__m512bh)_mm512_unpackhi_epi16(y0, y1);
    const uint32_t* p = P2 + jp * G + r0;
    _Pragma("GCC unroll 6") for (int i = 0; i < PR; ++i)
      if (i < pr) dot4(c[i], (__m512bh)_mm512_set1_epi32((int)p[i]), a0, b0, a1, b1);
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 2 * pairs; j < n; ++j) {
    const char* v = rows[j] + 2 * c0;
    const __m512i x = _mm512_loadu_si512((const void*)v);
    const __m512i y = _mm512_loadu_si512((const void*)(v + 64));
    const __m512bh a0 = (__m512bh)_mm512_unpacklo_epi16(x, zero);
    const __m512bh b0 = (__m512bh)_mm512_unpackhi_epi16(x, zero);
    const __m512bh a1 = (__m512bh)_mm512_unpacklo_epi16(y, zero);
    const __m512bh b1 = (__m512bh)_mm512_unpackhi_epi16(y, zero);
    _Pragma("GCC unroll 6") for (int i = 0; i < PR; ++i) {
      if (i >= pr || (j >= n_main && pos0 + j > limit[r0 + i])) continue; /* 0 * NaN: skip */
      dot4(c[i], (__m512bh)_mm512_set1_epi32((int)P1[j * G + r0 + i]), a0, b0, a1, b1);
    }
  }
  add_tile(c, pr, acc + r0 * rank + c0, rank);
}

static BF16_TARGET void pv_group_bf16(float* S, uint32_t* P2, const char* const* rows,
                                      int64_t n, int64_t n_main, int64_t pos0,
                                      const int32_t* limit, int64_t valid, float* acc,
                                      int64_t rank, pf_cursor* pc) {
  const uint32_t* P1 = (const uint32_t*)S; /* see softmax_group_bf16 */
  pf_cursor cur = *pc;
  for (int64_t c0 = 0; c0 < rank; c0 += 64)
    for (int r0 = 0; r0 < valid; r0 += PR) {
      if (valid - r0 >= PR)
        pv_tile_bf16(P1, P2, rows, n, n_main, pos0, limit, r0, PR, acc, rank, c0, &cur);
      else
        pv_tile_bf16(P1, P2, rows, n, n_main, pos0, limit, r0, (int)(valid - r0), acc, rank,
                     c0, &cur);
    }
  *pc = cur;
}

#endif /* MLA_DECODE_CPU_BF16_H */
