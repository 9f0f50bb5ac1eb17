/* FP8 latent caches for mla_decode_cpu.c (issue 36): the rows are read as they are stored and
 * dequantised a chunk at a time (BK keys) into a per-thread tile, which the chunk's q.k and
 * p.v then read as they read a bf16 (dot path) or float32 (float path) cache. Included by
 * mla_decode_cpu.c after its constants (BK) and the argument struct.
 *
 * Layouts (app/kvcache/cache_dtypes.py has the writer):
 *   MLA_CACHE_FP8_E4M3: D e4m3fn bytes per row; the layer's scale is the call's k_scale (in
 *     q_mult and v_mult), so the tile holds e4m3 exactly.
 *   MLA_CACHE_FP8_DS_MLA: DeepSeek's FlashMLA row: rank e4m3fn bytes, rank / 128 float32
 *     scales (little-endian; value = e4m3 * scale), then rope bf16 values: 656 bytes at
 *     512 + 64. The tile holds e4m3 * scale: exact in float32 for any scale, and in bf16 for a
 *     power-of-two scale (the package's writer); another writer's scale (vLLM's amax / 448)
 *     costs one bf16 rounding of the product on the dot path (2^-9 relative, against e4m3's
 *     own 2^-4; app/testing/fp8_bounds.py bounds it).
 *
 * Why a tile, not a conversion inside the q.k and p.v loops: those loops read each key once
 * per 4 query rows (q.k) and once per 6 (p.v), so a conversion there would be repeated 4 and
 * 3 times at 16 heads; here each chunk's rows are converted once (and the tile, 72 KiB in
 * bf16, stays in L2 for the chunk's work, as the rows of a bf16 cache do).
 *
 * e4m3fn -> fp16 bits: sign to bit 15, the 7 other bits shifted left by 7 (exponent field
 * e + 0 in fp16's bias 15 instead of 7, so the value is 2^-8 of the e4m3 one; e4m3
 * subnormals become fp16 subnormals), then vcvtph2ps (exact) and one multiply by 2^8 x scale.
 * e4m3fn's NaN (S.1111.111) would become 1.875 x 2^0: it is set to fp16's NaN first, so a NaN
 * in the cache stays a NaN (the kernel's rule: the rows that see it come out non-finite).
 */
#ifndef MLA_DECODE_CPU_FP8_H
#define MLA_DECODE_CPU_FP8_H

int32_t mla_decode_cpu_cache_code(const char* name) {
  if (strcmp(name, "fp8_e4m3") == 0) return MLA_CACHE_FP8_E4M3;
  if (strcmp(name, "fp8_ds_mla") == 0) return MLA_CACHE_FP8_DS_MLA;
  return -1;
}

static inline int is_fp8_cache(int dt) {
  return dt == MLA_CACHE_FP8_E4M3 || dt == MLA_CACHE_FP8_DS_MLA;
}

/* Bytes of one stored row of D = rank + rope values. */
static inline int64_t cache_row_bytes(int dt, int64_t rank, int64_t rope) {
  if (dt == MLA_CACHE_FP8_DS_MLA) return rank + 4 * (rank / 128) + 2 * rope;
  if (dt == MLA_CACHE_FP8_E4M3) return rank + rope;
  return (rank + rope) * app_native_elem_size(dt);
}

/* 16 e4m3fn bytes -> 16 float32 (times `mult`, which includes the 2^8 of the fp16 layout).
 * AVX2 + AVX512F only (the float path runs on CPUs without AVX512BW too). */
static inline __attribute__((always_inline)) __m512 e4m3x16(const uint8_t* p, __m512 mult) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); /* sign-extended */
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBFFF));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)),
                                         _mm256_set1_epi16(0x3F80));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
  return _mm512_mul_ps(_mm512_cvtph_ps(h), mult);
}

/* The multiplier of a tile of values stored with `scale`: 2^8 x scale, or NULL-safe for
 * scales whose product with 2^8 would overflow (applied in two steps then). */
static inline int split_scale(float scale, __m512* mult, __m512* post) {
  if (scale > 0x1p119f || scale < -0x1p119f) { /* 2^8 x scale would not be finite */
    *mult = _mm512_set1_ps(256.f);
    *post = _mm512_set1_ps(scale);
    return 1;
  }
  *mult = _mm512_set1_ps(256.f * scale);
  return 0;
}

/* values [first, first + count) of a row (all in one scale tile, count % 16 == 0), each
 * times `scale` -> dst (float32). */
static inline void e4m3_run_f32(const uint8_t* src, int64_t count, float scale, float* dst) {
  __m512 mult, post = _mm512_setzero_ps();
  const int two = split_scale(scale, &mult, &post);
  for (int64_t c = 0; c < count; c += 16) {
    __m512 v = e4m3x16(src + c, mult);
    if (two) v = _mm512_mul_ps(v, post);
    _mm512_storeu_ps(dst + c, v);
  }
}

/* Scale t of an fp8_ds_mla row (copied out: a row's address is only byte-aligned in a
 * strided cache). */
static inline float tile_scale(const uint8_t* row, int64_t rank, int64_t t) {
  float s;
  memcpy(&s, row + rank + 4 * t, sizeof s);
  return s;
}

/* The float path's tile: rows[j] (j < n) of an FP8 cache -> dst + j * d float32 values. */
static void fp8_tile_f32(const mla_decode_args* a, const char* const* rows, int64_t n,
                         float* dst) {
  const int64_t rank = a->rank, rope = a->rope, d = rank + rope;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* r = (const uint8_t*)rows[j];
    float* out = dst + j * d;
    if (a->cache_dt == MLA_CACHE_FP8_E4M3) {
      e4m3_run_f32(r, d, 1.f, out);
      continue;
    }
    for (int64_t t = 0; t < rank / 128; ++t)
      e4m3_run_f32(r + 128 * t, 128, tile_scale(r, rank, t), out + 128 * t);
    const uint8_t* rp = r + rank + 4 * (rank / 128);
    for (int64_t c = 0; c < rope; c += 16)
      _mm512_storeu_ps(out + rank + c, _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(rp + 2 * c))), 16)));
  }
}

/* 32 e4m3fn bytes -> 32 fp16 bit patterns (value x 2^-8), on 512-bit words: the dot path's
 * conversion (AVX512BW). A NaN byte is rare: one compare finds whether the 32 hold one. */
static inline __attribute__((always_inline, BF16_ISA)) __m512i e4m3x32_fp16(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(raw), 7),
                                     _mm512_set1_epi16((short)0xBFFF));
  const __mmask32 nan = _mm256_cmpeq_epi8_mask(
      _mm256_and_si256(raw, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
  if (__builtin_expect(nan != 0, 0)) return _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
  return h;
}

/* count (% 32 == 0) e4m3fn bytes, each times `scale` -> bf16 (vcvtne2ps2bf16: exact for e4m3
 * and for e4m3 times a power of two whose products are normal floats; see the top). */
static inline __attribute__((always_inline, BF16_ISA)) void e4m3_run_bf16(
    const uint8_t* src, int64_t count, float scale, uint16_t* dst) {
  __m512 mult, post = _mm512_setzero_ps();
  const int two = split_scale(scale, &mult, &post);
  for (int64_t c = 0; c < count; c += 32) {
    const __m512i h = e4m3x32_fp16(src + c);
    __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), mult);
    __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), mult);
    if (two) lo = _mm512_mul_ps(lo, post), hi = _mm512_mul_ps(hi, post);
    _mm512_storeu_si512((void*)(dst + c), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

/* The dot path's tile on a CPU without AVX512-VBMI: as fp8_tile_f32, into bf16. */
static BF16_TARGET void fp8_tile_bf16_fp16(const mla_decode_args* a, const char* const* rows,
                                           int64_t n, uint16_t* dst) {
  const int64_t rank = a->rank, rope = a->rope, d = rank + rope;
  const int ds = a->cache_dt == MLA_CACHE_FP8_DS_MLA;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* r = (const uint8_t*)rows[j];
    uint16_t* out = dst + j * d;
    if (!ds) {
      e4m3_run_bf16(r, d, 1.f, out);
      continue;
    }
    for (int64_t t = 0; t < rank / 128; ++t)
      e4m3_run_bf16(r + 128 * t, 128, tile_scale(r, rank, t), out + 128 * t);
    memcpy(out + rank, r + rank + 4 * (rank / 128), sizeof(uint16_t) * (size_t)rope);
  }
}

/* e4m3_run_bf16 as a function of its own (the test hook's method 0). */
static BF16_TARGET void e4m3_run_bf16_target(const uint8_t* src, int64_t count, float scale,
                                             uint16_t* dst) {
  e4m3_run_bf16(src, count, scale, dst);
}

#include "mla_decode_cpu_fp8_vbmi.h" /* fp8_tile_bf16_vbmi: the same tile by table look-ups */

/* The dot path's tile: rows[j] (j < n) of an FP8 cache -> dst + j * d bf16 values, by table
 * look-ups where the CPU has AVX512-VBMI (decided at run time: never an instruction the CPU
 * lacks), else through fp16 and float32; the two give the same bits (a NaN's sign aside). */
static void fp8_tile_bf16(const mla_decode_args* a, const char* const* rows, int64_t n,
                          uint16_t* dst) {
  if (cpu_has_vbmi()) fp8_tile_bf16_vbmi(a, rows, n, dst);
  else fp8_tile_bf16_fp16(a, rows, n, dst);
}

/* The test hook (mla_decode_cpu.h): the tile's conversion on one run of bytes. */
int32_t mla_decode_cpu_e4m3_to_bf16(const uint8_t* src, int64_t count, float scale,
                                    int32_t method, uint16_t* dst) {
  int k;
  if (count < 0 || count % 32 != 0 || (method != 0 && method != 1) ||
      !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw"))
    return 1;
  if (method == 0) {
    e4m3_run_bf16_target(src, count, scale, dst);
    return 0;
  }
  if (!cpu_has_vbmi() || !table_exponent(scale, &k)) return 1;
  e4m3_run_table_scaled(src, count, k, dst);
  return 0;
}

#endif /* MLA_DECODE_CPU_FP8_H */
