/* AVX-512 on a CPU without it, for testing only: force-included (-include) ahead of a kernel
 * source compiled with -mavx2 -mfma -mf16c instead of its -mavx512* flags. SIMDe (libsimde-dev,
 * https://github.com/simd-everywhere/simde) supplies most intrinsics as portable code; this
 * header supplies the ones SIMDe 0.7.4 lacks. The kernels then run, slowly, the same
 * instructions' semantics on every x86-64 machine, so their sanitizer drivers and hostile cases
 * (tests/backends/cpu/) run where there is no AVX-512. Never built for serving.
 *
 * Masked loads and stores touch only the lanes their mask names, element by element, as the
 * hardware does: a full-width load blended afterwards would read past a buffer's end and make
 * AddressSanitizer report the emulation instead of the kernel.
 */
#ifndef APP_AVX512_EMULATION_H
#define APP_AVX512_EMULATION_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#define APP_AVX512_EMULATED 1

/* A function the kernels mark as AVX512-BF16 or -VBMI code runs the emulated intrinsics. */
#define APP_AVX512BF16_ISA target("avx2,fma,f16c")
#define VBMI_ISA target("avx2,fma,f16c")

/* Every AVX-512 extension is there (emulated), so every run-time branch of the kernels and
 * their drivers runs; anything else (AMX) is asked of the CPU itself. */
#define __builtin_cpu_supports(feature) \
  (strncmp((feature), "avx512", 6) == 0 || __builtin_cpu_supports(feature))

static inline __m256i app_emu_mm512_cvtps_ph(__m512 x) {
  float f[16];
  _mm512_storeu_ps(f, x);
  const __m128i lo = _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT);
  const __m128i hi = _mm256_cvtps_ph(_mm256_loadu_ps(f + 8), _MM_FROUND_TO_NEAREST_INT);
  return _mm256_set_m128i(hi, lo);
}
#undef _mm512_cvtps_ph
/* every caller rounds to nearest even */
#define _mm512_cvtps_ph(x, rounding) app_emu_mm512_cvtps_ph(x)

static inline __m512 app_emu_mm512_cvtph_ps(__m256i h) {
  float f[16];
  _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
  _mm256_storeu_ps(f + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  return _mm512_loadu_ps(f);
}
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(h) app_emu_mm512_cvtph_ps(h)

static inline __m256i app_emu_mm512_cvtepi32_epi16(__m512i x) {
  int32_t a[16];
  int16_t b[16];
  _mm512_storeu_si512(a, x);
  for (int i = 0; i < 16; ++i) b[i] = (int16_t)a[i];
  return _mm256_loadu_si256((const __m256i*)b);
}
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(x) app_emu_mm512_cvtepi32_epi16(x)

static inline __m512i app_emu_mm512_cvtepu16_epi32(__m256i h) {
  uint16_t a[16];
  int32_t b[16];
  _mm256_storeu_si256((__m256i*)a, h);
  for (int i = 0; i < 16; ++i) b[i] = (int32_t)a[i];
  return _mm512_loadu_si512(b);
}
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(h) app_emu_mm512_cvtepu16_epi32(h)

/* Lanes are summed pairwise in halves (8 + 8, then 4 + 4, ...): GCC's own order. */
static inline float app_emu_mm512_reduce_add_ps(__m512 x) {
  float f[16];
  _mm512_storeu_ps(f, x);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) f[i] += f[i + w];
  return f[0];
}
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(x) app_emu_mm512_reduce_add_ps(x)

/* vmaxps semantics per step: the second operand where either is a NaN. */
static inline float app_emu_mm512_reduce_max_ps(__m512 x) {
  float f[16];
  _mm512_storeu_ps(f, x);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) f[i] = f[i] > f[i + w] ? f[i] : f[i + w];
  return f[0];
}
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(x) app_emu_mm512_reduce_max_ps(x)

static inline int64_t app_emu_mm512_reduce_add_epi64(__m512i x) {
  int64_t a[8];
  _mm512_storeu_si512(a, x);
  uint64_t s = 0;
  for (int i = 0; i < 8; ++i) s += (uint64_t)a[i];
  return (int64_t)s;
}
#undef _mm512_reduce_add_epi64
#define _mm512_reduce_add_epi64(x) app_emu_mm512_reduce_add_epi64(x)

/* Result lanes 0-1 take 128-bit blocks of a, lanes 2-3 of b, each picked by two bits of imm. */
static inline __m512 app_emu_mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {
  float fa[16], fb[16], r[16];
  _mm512_storeu_ps(fa, a);
  _mm512_storeu_ps(fb, b);
  for (int blk = 0; blk < 4; ++blk) {
    const float* src = blk < 2 ? fa : fb;
    memcpy(r + 4 * blk, src + 4 * ((imm >> (2 * blk)) & 3), 4 * sizeof(float));
  }
  return _mm512_loadu_ps(r);
}
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) app_emu_mm512_shuffle_f32x4((a), (b), (imm))

static inline __m512 app_emu_mm512_mask_loadu_ps(__m512 src, __mmask16 k, const void* p) {
  float r[16];
  _mm512_storeu_ps(r, src);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) memcpy(r + i, (const float*)p + i, sizeof(float));
  return _mm512_loadu_ps(r);
}
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps(src, k, p) app_emu_mm512_mask_loadu_ps((src), (k), (p))
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) app_emu_mm512_mask_loadu_ps(_mm512_setzero_ps(), (k), (p))

static inline __m512i app_emu_mm512_maskz_loadu_epi16(__mmask32 k, const void* p) {
  uint16_t r[32] = {0};
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) memcpy(r + i, (const uint16_t*)p + i, sizeof(uint16_t));
  return _mm512_loadu_si512(r);
}
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) app_emu_mm512_maskz_loadu_epi16((k), (p))

static inline __m512i app_emu_mm512_maskz_loadu_epi8(__mmask64 k, const void* p) {
  uint8_t r[64] = {0};
  for (int i = 0; i < 64; ++i)
    if (k >> i & 1) r[i] = ((const uint8_t*)p)[i];
  return _mm512_loadu_si512(r);
}
#undef _mm512_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi8(k, p) app_emu_mm512_maskz_loadu_epi8((k), (p))

static inline void app_emu_mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 x) {
  float f[16];
  _mm512_storeu_ps(f, x);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) memcpy((float*)p + i, f + i, sizeof(float));
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, x) app_emu_mm512_mask_storeu_ps((p), (k), (x))

static inline void app_emu_mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i x) {
  uint16_t a[16];
  _mm256_storeu_si256((__m256i*)a, x);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) memcpy((uint16_t*)p + i, a + i, sizeof(uint16_t));
}
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, x) app_emu_mm256_mask_storeu_epi16((p), (k), (x))

/* vcvtneps2bf16: round to nearest even, a denormal input becomes a zero of its sign, a NaN
 * stays a NaN (quieted). */
static inline __m256bh app_emu_mm512_cvtneps_pbh(__m512 x) {
  uint32_t a[16];
  uint16_t b[16];
  _mm512_storeu_si512(a, _mm512_castps_si512(x));
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = a[i];
    if ((u & 0x7F800000u) == 0) b[i] = (uint16_t)((u >> 16) & 0x8000u);
    else if ((u & 0x7FFFFFFFu) > 0x7F800000u) b[i] = (uint16_t)((u >> 16) | 0x0040u);
    else b[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  __m256bh r;
  memcpy(&r, b, sizeof r);
  return r;
}
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(x) app_emu_mm512_cvtneps_pbh(x)

static inline __mmask32 app_emu_mm256_cmpeq_epi8_mask(__m256i a, __m256i b) {
  return (__mmask32)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(a, b));
}
#undef _mm256_cmpeq_epi8_mask
#define _mm256_cmpeq_epi8_mask(a, b) app_emu_mm256_cmpeq_epi8_mask((a), (b))

/* vcvtne2ps2bf16: b's lanes become elements 0-15, a's 16-31. */
static inline __m512bh app_emu_mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
  const __m256bh lo = app_emu_mm512_cvtneps_pbh(b), hi = app_emu_mm512_cvtneps_pbh(a);
  __m512bh r;
  memcpy(&r, &lo, sizeof lo);
  memcpy((char*)&r + sizeof lo, &hi, sizeof hi);
  return r;
}
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) app_emu_mm512_cvtne2ps_pbh((a), (b))

/* Integer adds wrap, as the hardware's do: SIMDe adds signed lanes in C, which UBSan reports
 * as overflow. Each half goes through AVX2's own add. */
#define APP_EMU_WRAPPING_ADD(name, add256)                                   \
  static inline __m512i app_emu_##name(__m512i a, __m512i b) {               \
    __m256i x[2], y[2];                                                      \
    memcpy(x, &a, sizeof x);                                                 \
    memcpy(y, &b, sizeof y);                                                 \
    x[0] = add256(x[0], y[0]);                                               \
    x[1] = add256(x[1], y[1]);                                               \
    memcpy(&a, x, sizeof x);                                                 \
    return a;                                                                \
  }
APP_EMU_WRAPPING_ADD(mm512_add_epi8, _mm256_add_epi8)
APP_EMU_WRAPPING_ADD(mm512_add_epi16, _mm256_add_epi16)
APP_EMU_WRAPPING_ADD(mm512_add_epi32, _mm256_add_epi32)
APP_EMU_WRAPPING_ADD(mm512_add_epi64, _mm256_add_epi64)
#undef _mm512_add_epi8
#define _mm512_add_epi8(a, b) app_emu_mm512_add_epi8((a), (b))
#undef _mm512_add_epi16
#define _mm512_add_epi16(a, b) app_emu_mm512_add_epi16((a), (b))
#undef _mm512_add_epi32
#define _mm512_add_epi32(a, b) app_emu_mm512_add_epi32((a), (b))
#undef _mm512_add_epi64
#define _mm512_add_epi64(a, b) app_emu_mm512_add_epi64((a), (b))
#undef _mm512_mask_add_epi8
#define _mm512_mask_add_epi8(src, k, a, b) \
  _mm512_mask_mov_epi8((src), (k), app_emu_mm512_add_epi8((a), (b)))
#undef _mm512_mask_add_epi16
#define _mm512_mask_add_epi16(src, k, a, b) \
  _mm512_mask_mov_epi16((src), (k), app_emu_mm512_add_epi16((a), (b)))

#endif /* APP_AVX512_EMULATION_H */
