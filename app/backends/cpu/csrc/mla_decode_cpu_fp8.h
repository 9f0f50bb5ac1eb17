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
 * On a CPU with AVX512-VBMI the dot path's tile is made by table look-ups instead (the same
 * bits; fp8_tile_bf16_vbmi below): 2x (fp8_ds_mla) to 3x (fp8_e4m3) cheaper.
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

/* The dot path's tile by table look-ups (AVX512-VBMI), bit for bit what fp8_tile_bf16_fp16
 * writes.
 *
 * Each e4m3fn byte's magnitude (its low 7 bits) indexes a 128-entry table of the bf16 bits of
 * that magnitude; vpermi2b looks up 64 bytes in a 128-byte table held in two registers, so the
 * table is kept as its low bytes (two registers) and its high bytes (two more), the sign bit
 * is OR-ed into the high byte (vpternlogd), and vpunpck{l,h}bw interleave them into 64 bf16
 * words, the 64 bytes having first been put in the order those interleave in (one vpermb):
 * 6 vector instructions per 64 values, against ~12 per 32 through fp16 and float32. (Two
 * vpermt2b interleaves instead of vpermb + two unpacks: 5 instructions, but slower on Zen 4.)
 *
 * A scale 2^k is applied to the table, not to the values: k is added to the exponent field of
 * each entry (zero and NaN kept as they are), once per scale (fp8_ds_mla: per 128-value block,
 * only when k differs from the last block's; fp8_e4m3: k = 0, its scale is in q_mult), as
 * one byte add to the high-byte tables of 2^(k & 1), made once per chunk. e4m3
 * times 2^k is a bf16 value, so the tile is exact and the same as the fp16 path's, as long as
 * every product is a normal number: e4m3's magnitudes are 2^-9 .. 448, so k must lie in
 * -117 .. 119. Any other scale (not a positive power of two, as vLLM's amax / 448, or out of
 * that range) goes the fp16 path for its block (e4m3_run_bf16).
 *
 * The one difference: a NaN keeps its sign bit here (e4m3fn 0xFF -> 0xFFC0) where the fp16
 * path makes every NaN 0x7FC0; both are NaN, which is all the kernel's rule reads.
 */
#ifndef VBMI_ISA
#define VBMI_ISA target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")
#endif

/* Whether the CPU runs AVX512-VBMI (fp8_tile_bf16_vbmi's byte permutes). */
static inline int cpu_has_vbmi(void) { return __builtin_cpu_supports("avx512vbmi"); }

/* bf16 bits of the e4m3fn magnitude m (0 .. 127): m = 0 is +0, m = 127 bf16's quiet NaN. */
static const uint16_t e4m3_bf16_bits[128] __attribute__((aligned(64))) = {
    0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60, 0x3C80, 0x3C90, 0x3CA0, 0x3CB0,
    0x3CC0, 0x3CD0, 0x3CE0, 0x3CF0, 0x3D00, 0x3D10, 0x3D20, 0x3D30, 0x3D40, 0x3D50, 0x3D60, 0x3D70,
    0x3D80, 0x3D90, 0x3DA0, 0x3DB0, 0x3DC0, 0x3DD0, 0x3DE0, 0x3DF0, 0x3E00, 0x3E10, 0x3E20, 0x3E30,
    0x3E40, 0x3E50, 0x3E60, 0x3E70, 0x3E80, 0x3E90, 0x3EA0, 0x3EB0, 0x3EC0, 0x3ED0, 0x3EE0, 0x3EF0,
    0x3F00, 0x3F10, 0x3F20, 0x3F30, 0x3F40, 0x3F50, 0x3F60, 0x3F70, 0x3F80, 0x3F90, 0x3FA0, 0x3FB0,
    0x3FC0, 0x3FD0, 0x3FE0, 0x3FF0, 0x4000, 0x4010, 0x4020, 0x4030, 0x4040, 0x4050, 0x4060, 0x4070,
    0x4080, 0x4090, 0x40A0, 0x40B0, 0x40C0, 0x40D0, 0x40E0, 0x40F0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4190, 0x41A0, 0x41B0, 0x41C0, 0x41D0, 0x41E0, 0x41F0,
    0x4200, 0x4210, 0x4220, 0x4230, 0x4240, 0x4250, 0x4260, 0x4270, 0x4280, 0x4290, 0x42A0, 0x42B0,
    0x42C0, 0x42D0, 0x42E0, 0x42F0, 0x4300, 0x4310, 0x4320, 0x4330, 0x4340, 0x4350, 0x4360, 0x4370,
    0x4380, 0x4390, 0x43A0, 0x43B0, 0x43C0, 0x43D0, 0x43E0, 0x7FC0,
};

/* 0 .. 63: the byte-permute indices are made from it. */
static const uint8_t byte_iota[64] __attribute__((aligned(64))) = {
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
    44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63,
};

/* The look-up tables: those of the scale 2^k now in use (the low and the high bytes of
 * entries 0 .. 63 and 64 .. 127), the ones they are made from (2^0 and 2^1: [k & 1]), and
 * the byte permute that puts 64 bytes in the order the words are interleaved in. */
typedef struct {
  __m512i lo0, lo1, hi0, hi1;
  __m512i base_lo[2][2], base_hi[2][2], order;
  int k;
} e4m3_tables;

/* t at 2^0, with its bases. Entry 0 (zero) and entry 127 (NaN) are never scaled. */
static inline __attribute__((always_inline, VBMI_ISA)) void e4m3_tables_init(e4m3_tables* t) {
  const __m512i iota = _mm512_load_si512((const void*)byte_iota);
  const __m512i even = _mm512_add_epi8(iota, iota);
  const __m512i odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
  const __m512i* w = (const __m512i*)e4m3_bf16_bits;
  for (int p = 0; p < 2; ++p) {
    const __m512i add = _mm512_set1_epi16((short)(p * 128)); /* 2^p on the exponent field */
    const __m512i w0 = _mm512_mask_add_epi16(w[0], 0xFFFFFFFEu, w[0], add);
    const __m512i w1 = _mm512_add_epi16(w[1], add), w2 = _mm512_add_epi16(w[2], add);
    const __m512i w3 = _mm512_mask_add_epi16(w[3], 0x7FFFFFFFu, w[3], add);
    t->base_lo[p][0] = _mm512_permutex2var_epi8(w0, even, w1);
    t->base_hi[p][0] = _mm512_permutex2var_epi8(w0, odd, w1);
    t->base_lo[p][1] = _mm512_permutex2var_epi8(w2, even, w3);
    t->base_hi[p][1] = _mm512_permutex2var_epi8(w2, odd, w3);
  }
  /* vpunpck{l,h}bw interleave within 128-bit lanes: lane L's first 8 bytes must be bytes
   * 8L .. 8L + 7 (-> words 0 .. 31), its last 8 bytes 32 + 8L .. (-> words 32 .. 63) */
  const __m512i lane = _mm512_and_si512(iota, _mm512_set1_epi8(0x30));
  const __m512i low3 = _mm512_and_si512(iota, _mm512_set1_epi8(7));
  const __m512i upper = _mm512_and_si512(_mm512_slli_epi16(iota, 2), _mm512_set1_epi8(0x20));
  t->order = _mm512_or_si512(_mm512_or_si512(_mm512_srli_epi16(lane, 1), low3), upper);
  t->lo0 = t->base_lo[0][0], t->lo1 = t->base_lo[0][1];
  t->hi0 = t->base_hi[0][0], t->hi1 = t->base_hi[0][1];
  t->k = 0;
}

/* t at 2^k (k in -117 .. 119): k = 2m + p adds m to the high byte of the 2^p tables (the
 * exponent field's upper 7 bits; no carry: every result stays a normal number). */
static inline __attribute__((always_inline, VBMI_ISA)) void e4m3_tables_scale(e4m3_tables* t,
                                                                               int k) {
  const int p = k & 1;
  const __m512i m = _mm512_set1_epi8((char)((k - p) / 2));
  t->lo0 = t->base_lo[p][0], t->lo1 = t->base_lo[p][1];
  t->hi0 = _mm512_mask_add_epi8(t->base_hi[p][0], ~(__mmask64)1, t->base_hi[p][0], m);
  t->hi1 = _mm512_mask_add_epi8(t->base_hi[p][1], ~(__mmask64)0 >> 1, t->base_hi[p][1], m);
  t->k = k;
}

/* count (% 32 == 0) e4m3fn bytes -> bf16 bits through the tables t: the bytes put in
 * interleave order, looked up (low and high bytes, the sign OR-ed into the high one) and
 * interleaved into words. */
static inline __attribute__((always_inline, VBMI_ISA)) void e4m3_run_table(
    const uint8_t* src, int64_t count, const e4m3_tables* t, uint16_t* dst) {
  for (int64_t c = 0; c < count; c += 64) {
    const int whole = count - c >= 64;
    const __m512i raw = _mm512_permutexvar_epi8(
        t->order, _mm512_maskz_loadu_epi8(whole ? ~(__mmask64)0 : 0xFFFFFFFFu, src + c));
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, raw, t->lo1);
    const __m512i hi = _mm512_ternarylogic_epi32( /* hi | (raw & 0x80): the sign */
        _mm512_permutex2var_epi8(t->hi0, raw, t->hi1), raw, _mm512_set1_epi8((char)0x80), 0xF8);
    _mm512_storeu_si512((void*)(dst + c), _mm512_unpacklo_epi8(lo, hi));
    if (whole) _mm512_storeu_si512((void*)(dst + c + 32), _mm512_unpackhi_epi8(lo, hi));
  }
}

/* k where scale = 2^k and every e4m3 value times it is a normal bf16 (k in -117 .. 119);
 * 0 for any other scale (negative, zero, not finite, not a power of two, out of range). */
static inline int table_exponent(float scale, int* k) {
  uint32_t bits;
  memcpy(&bits, &scale, sizeof bits);
  const int field = (int)(bits >> 23); /* with the sign bit: >= 256 when negative */
  *k = field - 127;
  return (bits & 0x7FFFFFu) == 0 && *k >= -117 && *k <= 119;
}

/* The dot path's tile (as fp8_tile_bf16_fp16, the same bits) by table look-ups. */
static __attribute__((VBMI_ISA, noinline)) void fp8_tile_bf16_vbmi(
    const mla_decode_args* a, const char* const* rows, int64_t n, uint16_t* dst) {
  const int64_t rank = a->rank, rope = a->rope, d = rank + rope;
  e4m3_tables tables;
  e4m3_tables_init(&tables);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* r = (const uint8_t*)rows[j];
    uint16_t* out = dst + j * d;
    if (a->cache_dt != MLA_CACHE_FP8_DS_MLA) {
      e4m3_run_table(r, d, &tables, out);
      continue;
    }
    for (int64_t t = 0; t < rank / 128; ++t) {
      const float scale = tile_scale(r, rank, t);
      int k;
      if (!table_exponent(scale, &k)) {
        e4m3_run_bf16(r + 128 * t, 128, scale, out + 128 * t);
        continue;
      }
      if (k != tables.k) e4m3_tables_scale(&tables, k);
      e4m3_run_table(r + 128 * t, 128, &tables, out + 128 * t);
    }
    memcpy(out + rank, r + rank + 4 * (rank / 128), sizeof(uint16_t) * (size_t)rope);
  }
}

/* count (% 32 == 0) e4m3fn bytes times 2^k (k in -117 .. 119) -> bf16 bits (the test hook). */
static __attribute__((VBMI_ISA, noinline)) void e4m3_run_table_scaled(
    const uint8_t* src, int64_t count, int k, uint16_t* dst) {
  e4m3_tables tables;
  e4m3_tables_init(&tables);
  e4m3_tables_scale(&tables, k);
  e4m3_run_table(src, count, &tables, dst);
}

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
