/* AVX-512 helpers shared by the kernels under app/backends/cpu/csrc/ (mla_prefill_cpu.c, the
 * sparse kernels, mla_decode_cpu.c, cpu_peaks.c): one copy of each instead of one per kernel.
 * All static inline, so each library compiles its own and exports nothing; a source that
 * includes this header is built with at least -mavx512f (app/backends/cpu/loader.py builds
 * every library with its spec's flags). The element-type codes (APP_DT_*) come from
 * app_native.h.
 */
#ifndef APP_NATIVE_SIMD_H
#define APP_NATIVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "app_native.h"

/* The target of a function that uses AVX512-BF16 (vdpbf16ps, vcvtneps2bf16) in a library
 * compiled without -mavx512bf16: it is called only where the CPU has AVX512-BF16 and
 * AVX512BW (the caller checks; the Python side reads /proc/cpuinfo). */
#ifndef APP_AVX512BF16_ISA
#define APP_AVX512BF16_ISA target("avx512f,avx512bw,avx512vl,avx512bf16")
#endif

/* x rounded up to a multiple of m (x >= 0, m > 0). */
static inline int64_t app_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Ask for the lines of the bytes at p: rows a kernel picks out of a cache are scattered, so
 * each row of the next tile is asked for while one of this tile's is used. */
static inline void app_prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char*)p + off, _MM_HINT_T0);
}

/* Element i of p (of type dt) as a float32. */
static inline float app_load_elem(const void* p, int64_t i, int dt) {
  if (dt == APP_DT_BF16) {
    uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  if (dt == APP_DT_F16) return _cvtsh_ss(((const uint16_t*)p)[i]);
  return ((const float*)p)[i];
}

/* x rounded to the nearest bf16 value (ties to even), kept as float32; a NaN stays a NaN.
 * The bf16-product kernels sum the probabilities they multiply in bf16 *after* this rounding:
 * the output is then an exact weighted mean of the values with the rounded weights, so a key
 * that takes almost all the weight is reproduced to float32, not to bf16's 2^-9. */
static inline __m512 app_round_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  const __m512 rounded = _mm512_castsi512_ps(
      _mm512_and_si512(up, _mm512_set1_epi32((int)0xFFFF0000u)));
  return _mm512_mask_mov_ps(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* Store 16 float32 lanes as elements i .. i + 15 of p (of type dt). fp16 and bf16 round to
 * nearest even; a NaN is stored as the quiet NaN 0x7FC0 in bf16 (rounding a NaN's payload
 * could carry into the sign bit and leave -0). */
static inline void app_store16(void* p, int64_t i, __m512 x, int dt) {
  if (dt == APP_DT_F32) {
    _mm512_storeu_ps((float*)p + i, x);
  } else if (dt == APP_DT_F16) {
    _mm256_storeu_si256((__m256i*)((uint16_t*)p + i),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512i bits = _mm512_castps_si512(app_round_to_bf16(x));
    bits = _mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7FC00000));
    _mm256_storeu_si256((__m256i*)((uint16_t*)p + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
}

/* 2^x for x <= 0 (relative error ~1e-7): below -126 gives 0, never a denormal (a key that
 * far below the row's max has no weight in float32; 2^-126 would still carry a value of 1e38
 * into the output); a NaN stays a NaN (the clamp's NaN operand comes second: vmaxps returns
 * its second operand when either is a NaN; the zeroing keeps unordered lanes), so a
 * non-finite score reaches the probabilities it makes. */
static inline __m512 app_exp2_nonpositive(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-126.f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

#endif /* APP_NATIVE_SIMD_H */
