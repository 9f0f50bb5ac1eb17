/* Peak-rate probes of one CPU core: loops of independent multiply-adds held in registers,
 * and a streaming read (the memory bound of the decode benchmark's roofline).
 *
 * Built at first use by app/bench/_peaks.py through the shared loader
 * (app/backends/cpu/loader.py) and called through ctypes (which releases the GIL), one
 * call per thread on every thread the kernels use, so the summed rate is the
 * machine's bound for a kernel with the same instruction mix. Nothing touches memory inside
 * the loops. NACC independent accumulators cover the instruction latency on every
 * x86 core we know (4-6 cycles x 2 pipes needs >= 12 chains); the result is returned so the
 * compiler cannot drop the loop, and the operands come from the arguments so it cannot
 * fold them.
 */
#include <immintrin.h>

#include "app_native.h"
#include "app_native_simd.h"

/* Bump on any change to an exported function's signature or meaning (_peaks.ABI_VERSION). */
APP_NATIVE_LIBRARY(2)

#define NACC 24

#define REPEAT24(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
  X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)

/* FLOPs of one iteration of each loop: NACC instructions x 16 float32 lanes x 2 (multiply
 * and add); vdpbf16ps does two bf16 products per lane, so 4 per lane. */
APP_NATIVE_EXPORT int64_t cpu_peak_fma_f32_flops_per_iter(void) { return NACC * 16 * 2; }
APP_NATIVE_EXPORT int64_t cpu_peak_dot_bf16_flops_per_iter(void) { return NACC * 16 * 4; }

/* iters x NACC vfmadd231ps zmm (acc = acc * mul + add). */
APP_NATIVE_EXPORT float cpu_peak_fma_f32(int64_t iters, float mul, float add) {
  const __m512 m = _mm512_set1_ps(mul), a = _mm512_set1_ps(add);
#define DECL(i) __m512 c##i = _mm512_set1_ps((float)(i));
  REPEAT24(DECL)
#undef DECL
  for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) c##i = _mm512_fmadd_ps(c##i, m, a);
    REPEAT24(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, c##i);
  REPEAT24(SUM)
#undef SUM
  return _mm512_reduce_add_ps(s);
}

#ifndef APP_NO_AVX512BF16
/* iters x NACC vdpbf16ps zmm (acc += a.b over bf16 pairs); `bits` is the bf16 pair
 * broadcast into every 32-bit lane of both operands. */
APP_NATIVE_EXPORT __attribute__((APP_AVX512BF16_ISA))
float cpu_peak_dot_bf16(int64_t iters, uint32_t bits) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32((int)bits);
#define DECL(i) __m512 c##i = _mm512_set1_ps((float)(i));
  REPEAT24(DECL)
#undef DECL
  for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) c##i = _mm512_dpbf16_ps(c##i, x, x);
    REPEAT24(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, c##i);
  REPEAT24(SUM)
#undef SUM
  return _mm512_reduce_add_ps(s);
}
#endif

/* One pass over `bytes` bytes at p (64-byte aligned, a multiple of 256) with 512-bit loads
 * into four independent sums, no software prefetch (the hardware prefetchers stream it):
 * one thread's share of a stream-bandwidth probe. The sum is returned so the loop stays.
 * The benchmark calls it on its own threads, not OpenMP's: an OpenMP region leaves its
 * threads spinning for milliseconds, which slows whatever is timed next on those cores. */
APP_NATIVE_EXPORT int64_t cpu_stream_read(const void* p, int64_t bytes) {
  const char* b = (const char*)p;
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i + 256 <= bytes; i += 256) {
    s0 = _mm512_add_epi64(s0, _mm512_load_si512((const void*)(b + i)));
    s1 = _mm512_add_epi64(s1, _mm512_load_si512((const void*)(b + i + 64)));
    s2 = _mm512_add_epi64(s2, _mm512_load_si512((const void*)(b + i + 128)));
    s3 = _mm512_add_epi64(s3, _mm512_load_si512((const void*)(b + i + 192)));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1),
                                                  _mm512_add_epi64(s2, s3)));
}

/* 1 where the bf16 probe was compiled in (the compiler knew avx512bf16). */
APP_NATIVE_EXPORT int32_t cpu_peak_has_bf16_probe(void) {
#ifndef APP_NO_AVX512BF16
  return 1;
#else
  return 0;
#endif
}
