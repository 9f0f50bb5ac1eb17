/* mla_decode_cpu_merge of mla_decode_cpu.c: the partial results of a request split across
 * threads, merged by their LSE. Included at the end of mla_decode_cpu.c (it uses shape_ok,
 * to_natural and accumulator_order). */
#ifndef MLA_DECODE_CPU_MERGE_H
#define MLA_DECODE_CPU_MERGE_H

int32_t mla_decode_cpu_merge(const mla_decode_args* a) {
  if (!shape_ok(a)) return 1;
  const int64_t rows_m = a->qlen * a->heads, rank = a->rank;
  for (int64_t t = 0; t < a->n_merge; ++t) /* checked first: nothing half-written */
    if (a->merge[3 * t + 2] < 1 || a->merge[3 * t + 2] > MAX_PARTS) return 1;
  for (int64_t t = 0; t < a->n_merge; ++t) {
    const int64_t b = a->merge[3 * t], p0 = a->merge[3 * t + 1], np = a->merge[3 * t + 2];
    for (int64_t r = 0; r < rows_m; ++r) {
      float mx = -INFINITY, tot = 0.f, w[MAX_PARTS];
      for (int64_t p = 0; p < np; ++p) {
        const float x = a->part_lse[(p0 + p) * rows_m + r];
        if (x > mx) mx = x;
      }
      const float ref = mx == -INFINITY ? 0.f : mx;
      for (int64_t p = 0; p < np; ++p) { /* a NaN partial LSE gives a NaN weight: kept */
        w[p] = exp2f(a->part_lse[(p0 + p) * rows_m + r] - ref);
        tot += w[p];
      }
      const float inv = tot == 0.f ? 0.f : a->v_mult / tot;
      const int64_t o = (b * rows_m + r) * rank;
      for (int64_t c = 0; c < rank; c += 32) {
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int64_t p = 0; p < np; ++p) {
          const float* po = a->part_out + ((p0 + p) * rows_m + r) * rank + c;
          const __m512 wp = _mm512_set1_ps(w[p]);
          s0 = _mm512_fmadd_ps(wp, _mm512_loadu_ps(po), s0);
          s1 = _mm512_fmadd_ps(wp, _mm512_loadu_ps(po + 16), s1);
        }
        __m512 lo, hi;
        to_natural(_mm512_mul_ps(s0, _mm512_set1_ps(inv)), _mm512_mul_ps(s1, _mm512_set1_ps(inv)),
                   accumulator_order(a), &lo, &hi);
        app_store16(a->out, o + c, lo, a->out_dt);
        app_store16(a->out, o + c + 16, hi, a->out_dt);
      }
      if (a->lse) a->lse[b * rows_m + r] = tot == 0.f ? -INFINITY : (ref + log2f(tot)) * LN2;
    }
  }
  return 0;
}

#endif /* MLA_DECODE_CPU_MERGE_H */
