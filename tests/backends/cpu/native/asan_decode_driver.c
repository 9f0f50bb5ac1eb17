/* Runs mla_decode_cpu_run_shares / _merge under AddressSanitizer + UBSan (built by
 * test_decode_kernel_asan.py) on shapes around every edge: block sizes 1..64, seq_len 1 and
 * not a multiple of the block size, query_len 1..16, head counts whose query rows are not a
 * multiple of 16, rope 0/32/64 (and DeepSeek's 512 + 64), every cache dtype (the FP8 ones,
 * fp8_e4m3 and fp8_ds_mla, with float32 and bf16 queries: the float and the dot path), whole
 * and split requests (built with mla_decode_amx.c and -DAPP_AMX_DRIVER: the bf16 cases only, on
 * the AMX kernel, and no tile operation the hardware would refuse). Every buffer (cache, table,
 * q, out, lse, partials, scratch) is allocated at
 * exactly the size the kernel is told, the unused rows of each last block hold NaN (reading
 * them would show), and the result is checked against a float64 reference. Prints
 * "<cases> cases, <bad> bad". */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla_decode_cpu.h"
#ifdef APP_AMX_DRIVER
#include <sys/syscall.h>
#include <unistd.h>
int32_t mla_decode_amx_emulated(void);
int64_t mla_decode_amx_faults(void);
#endif

static float uniform(void) { return (float)rand() / (float)RAND_MAX * 2.f - 1.f; }

static uint16_t to_bf16(float x) { /* truncate: exact in both formats */
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return (uint16_t)(bits >> 16);
}

static void put(void* p, int64_t i, float x, int dt) {
  if (dt == APP_DT_BF16) ((uint16_t*)p)[i] = to_bf16(x);
  else if (dt == APP_DT_F16) ((uint16_t*)p)[i] = _cvtss_sh(x, 0);
  else ((float*)p)[i] = x;
}

static double get(const void* p, int64_t i, int dt) {
  if (dt == APP_DT_BF16) {
    uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  if (dt == APP_DT_F16) return _cvtsh_ss(((const uint16_t*)p)[i]);
  return ((const float*)p)[i];
}

static int bf16_dot = 0; /* run the bf16 cases on the AVX512-BF16 dot path */
static int q_dt_fp8 = APP_DT_F32; /* the query's dtype with an FP8 cache */

static double e4m3(uint8_t b) { /* float8 e4m3fn */
  const int e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7F) == 0x7F) return NAN;
  const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
  return b & 0x80 ? -v : v;
}

static uint8_t random_e4m3(void) { /* |value| in [2^-9, 3.75]: exponent 0..8 */
  return (uint8_t)((rand() & 0x80) | ((rand() % 9) << 3) | (rand() & 7));
}

static int is_fp8(int dt) { return dt == MLA_CACHE_FP8_E4M3 || dt == MLA_CACHE_FP8_DS_MLA; }

/* Bytes of a stored row. */
static int64_t row_bytes(int dt, int64_t rank, int64_t rope) {
  if (dt == MLA_CACHE_FP8_DS_MLA) return rank + 4 * (rank / 128) + 2 * rope;
  if (dt == MLA_CACHE_FP8_E4M3) return rank + rope;
  return (rank + rope) * app_native_elem_size(dt);
}

/* Fill stored row `row` (of `w` bytes) with random values. */
static void fill_row(char* cache, int dt, int64_t row, int64_t w, int64_t rank, int64_t rope) {
  char* r = cache + row * w;
  if (!is_fp8(dt)) {
    for (int64_t c = 0; c < rank + rope; ++c) put(cache, row * (rank + rope) + c, uniform(), dt);
    return;
  }
  const int64_t latent = dt == MLA_CACHE_FP8_DS_MLA ? rank : rank + rope;
  for (int64_t c = 0; c < latent; ++c) r[c] = (char)random_e4m3();
  if (dt != MLA_CACHE_FP8_DS_MLA) return;
  for (int64_t t = 0; t < rank / 128; ++t) { /* a power of two, or vLLM's amax / 448 */
    const float s = t % 2 ? 0.25f : 0.0137f;
    memcpy(r + rank + 4 * t, &s, sizeof s);
  }
  for (int64_t c = 0; c < rope; ++c) {
    const uint16_t h = to_bf16(uniform());
    memcpy(r + rank + 4 * (rank / 128) + 2 * c, &h, sizeof h);
  }
}

/* Value c of stored row `row` (of `w` bytes). */
static double cache_value(const char* cache, int dt, int64_t row, int64_t w, int64_t c,
                          int64_t rank, int64_t rope) {
  const char* r = cache + row * w;
  if (!is_fp8(dt)) return get(cache, row * (rank + rope) + c, dt);
  if (dt == MLA_CACHE_FP8_E4M3) return e4m3((uint8_t)r[c]);
  if (c < rank) {
    float s;
    memcpy(&s, r + rank + 4 * (c / 128), sizeof s);
    return e4m3((uint8_t)r[c]) * s;
  }
  uint16_t h;
  memcpy(&h, r + rank + 4 * (rank / 128) + 2 * (c - rank), sizeof h);
  return get(&h, 0, APP_DT_BF16);
}

static int run_case(int dt, int64_t batch, int64_t qlen, int64_t heads, int64_t rank,
                    int64_t rope, int64_t bs, const int64_t* lens, int split) {
  const int qdt = is_fp8(dt) ? q_dt_fp8 : dt; /* q and out */
  const int64_t d = rank + rope, rows = qlen * heads, es = app_native_elem_size(qdt);
  const int64_t w = row_bytes(dt, rank, rope);
  int64_t width = 1, nblocks = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t need = (lens[b] + bs - 1) / bs;
    width = need > width ? need : width;
    nblocks += need;
  }
  char* cache = malloc((size_t)(nblocks * bs * w));
  int32_t* table = malloc(sizeof(int32_t) * (size_t)(batch * width));
  int32_t* seq = malloc(sizeof(int32_t) * (size_t)batch);
  void* q = malloc((size_t)(batch * rows * d * es));
  void* out = malloc((size_t)(batch * rows * rank * es));
  float* lse = malloc(sizeof(float) * (size_t)(batch * rows));
  /* blocks handed out in reverse, so that no request's pages are in order */
  int64_t next = nblocks;
  for (int64_t b = 0; b < batch; ++b) {
    seq[b] = (int32_t)lens[b];
    for (int64_t j = 0; j < width; ++j)
      table[b * width + j] = j < (lens[b] + bs - 1) / bs ? (int32_t)--next : -7;
  }
  for (int64_t i = 0; i < nblocks * bs; ++i) fill_row(cache, dt, i, w, rank, rope);
  for (int64_t b = 0; b < batch; ++b) /* NaN in the unused rows of the last block */
    for (int64_t r = lens[b] % bs ? lens[b] % bs : bs; r < bs; ++r) {
      const int64_t row = table[b * width + (lens[b] - 1) / bs] * bs + r;
      if (is_fp8(dt)) memset(cache + row * w, 0xFF, (size_t)w); /* NaN in e4m3, f32, bf16 */
      else
        for (int64_t c = 0; c < d; ++c) put(cache, row * d + c, NAN, dt);
    }
  for (int64_t i = 0; i < batch * rows * d; ++i) put(q, i, uniform(), qdt);

  /* items: split requests into `split` ranges (partials), or one item each */
  int64_t n_items = 0, parts = 0;
  int64_t* items = malloc(sizeof(int64_t) * 4 * (size_t)(batch * (split > 1 ? split : 1)));
  int64_t* merge = malloc(sizeof(int64_t) * 3 * (size_t)batch);
  int64_t n_merge = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pieces = split > 1 && lens[b] >= split ? split : 1;
    if (pieces > 1) {
      merge[3 * n_merge] = b, merge[3 * n_merge + 1] = parts, merge[3 * n_merge + 2] = pieces;
      ++n_merge;
    }
    for (int64_t p = 0; p < pieces; ++p, ++n_items) {
      items[4 * n_items] = b;
      items[4 * n_items + 1] = lens[b] * p / pieces;
      items[4 * n_items + 2] = lens[b] * (p + 1) / pieces;
      items[4 * n_items + 3] = pieces > 1 ? parts + p : -1;
    }
    parts += pieces > 1 ? pieces : 0;
  }
  float* part_out = parts ? malloc(sizeof(float) * (size_t)(parts * rows * rank)) : NULL;
  float* part_lse = parts ? malloc(sizeof(float) * (size_t)(parts * rows)) : NULL;
  /* the items in two shares (one when there is one item), run on the OpenMP team when built
   * with -fopenmp; the last share's scratch ends exactly where the allocation does */
  const int64_t floats = mla_decode_cpu_scratch_floats(qlen, heads, rank, rope);
  const int64_t stride = (floats + 15) / 16 * 16, n_shares = n_items > 1 ? 2 : 1;
  const int64_t share_end[2] = {n_shares > 1 ? n_items / 2 : n_items, n_items};
  float* scratch = malloc(sizeof(float) * (size_t)((n_shares - 1) * stride + floats));
  const float scale = 0.2f;
  mla_decode_args a = {
      .cache = cache, .q = q, .out = out, .lse = lse, .block_table = table, .seq_lens = seq,
      .items = items, .merge = merge, .part_out = part_out, .part_lse = part_lse,
      .scratch = scratch, .batch = batch, .qlen = qlen, .heads = heads, .rank = rank,
      .rope = rope, .num_blocks = nblocks, .block_size = bs,
      .block_stride = bs * (is_fp8(dt) ? w : d), .row_stride = is_fp8(dt) ? w : d,
      .bt_stride = width, .q_sb = rows * d, .q_si = heads * d, .q_sh = d,
      .n_items = n_items, .n_merge = n_merge, .cache_dt = dt, .q_dt = qdt, .out_dt = qdt,
      .bf16_dot = qdt == APP_DT_BF16 ? bf16_dot : 0,
      .q_mult = scale * 1.4426950408889634f, .v_mult = 1.f};
  int bad = mla_decode_cpu_run_shares(&a, share_end, n_shares, stride, 2) != 0 ||
            mla_decode_cpu_merge(&a) != 0;
  const double tol = qdt == APP_DT_F32 ? 1e-4 : 3e-2;
  double* s = malloc(sizeof(double) * (size_t)(lens[0] > 0 ? 4096 : 1));
  for (int64_t b = 0; b < batch && !bad; ++b)
    for (int64_t r = 0; r < rows && !bad; ++r) {
      const int64_t i = r / heads, seen = lens[b] - qlen + i + 1;
      const char* qr = (const char*)q + ((b * rows + r) * d) * es;
      double mx = -INFINITY, sum = 0;
      for (int64_t t = 0; t < seen; ++t) {
        const int64_t row = table[b * width + t / bs] * bs + t % bs;
        double dot = 0;
        for (int64_t c = 0; c < d; ++c)
          dot += get(qr, c, qdt) * cache_value(cache, dt, row, w, c, rank, rope);
        s[t] = dot * scale;
        mx = s[t] > mx ? s[t] : mx;
      }
      for (int64_t t = 0; t < seen; ++t) sum += exp(s[t] - mx);
      const double ref_lse = mx + log(sum);
      if (fabs(lse[b * rows + r] - ref_lse) > tol) bad = 1;
      for (int64_t c = 0; c < rank && !bad; ++c) {
        double o = 0;
        for (int64_t t = 0; t < seen; ++t)
          o += exp(s[t] - mx) / sum *
               cache_value(cache, dt, table[b * width + t / bs] * bs + t % bs, w, c, rank, rope);
        if (!(fabs(get(out, (b * rows + r) * rank + c, qdt) - o) <= tol)) bad = 1;
      }
      if (bad)
        printf("BAD dt %d dot %d batch %ld qlen %ld heads %ld rank %ld rope %ld bs %ld split %d: "
               "request %ld row %ld\n", dt, qdt == APP_DT_BF16 ? bf16_dot : 0, (long)batch,
               (long)qlen, (long)heads, (long)rank, (long)rope, (long)bs, split, (long)b,
               (long)r);
    }
  free(s), free(scratch), free(part_lse), free(part_out), free(merge), free(items);
  free(lse), free(out), free(q), free(seq), free(table), free(cache);
  return bad;
}

int main(void) {
  srand(1);
#if defined(APP_AMX_DRIVER) && !defined(APP_AMX_EMULATE)
  /* the real tiles: Linux hands out the tile state on request only (ARCH_REQ_XCOMP_PERM,
   * XFEATURE_XTILEDATA); without it the first tile instruction is a SIGILL */
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    printf("Linux refused the AMX tile state: not run\n");
    return 77;
  }
#endif
  int cases = 0, bad = 0;
  /* the last four: FP8 caches with a float32 q (the float path), then a bf16 q (the dot
   * path where the CPU has it) */
  const int dts[8] = {APP_DT_F32, APP_DT_BF16, APP_DT_F16, APP_DT_BF16, MLA_CACHE_FP8_E4M3,
                      MLA_CACHE_FP8_DS_MLA, MLA_CACHE_FP8_E4M3, MLA_CACHE_FP8_DS_MLA};
  const int64_t lens_a[3] = {1, 17, 70}, lens_b[2] = {16, 33}, lens_c[1] = {300};
  /* more than two chunks of keys: the pages two chunks ahead (blocks <= 16) and the next
   * item's first chunk are prefetched */
  const int64_t lens_d[2] = {700, 260};
  const int has_dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#ifdef APP_AMX_DRIVER /* the AMX kernel reads bf16 caches only */
  for (int di = 1; di < 2; ++di) {
#else
  for (int di = 0; di < 8; ++di) {
#endif
    const int dt = dts[di];
    if (di == 3 && !has_dot) continue;
    bf16_dot = di == 3 || (di >= 6 && has_dot);
    q_dt_fp8 = di >= 6 ? APP_DT_BF16 : APP_DT_F32;
    const int64_t bss[4] = {1, 5, 16, 64};
    const int64_t r64 = dt == MLA_CACHE_FP8_DS_MLA ? 128 : 64; /* ds_mla: 128 per scale */
    for (int bi = 0; bi < 4; ++bi) {
      bad += run_case(dt, 3, 1, 3, r64, 32, bss[bi], lens_a, 1), ++cases;
      bad += run_case(dt, 2, 3, 7, 128, 0, bss[bi], lens_b, 1), ++cases;
      bad += run_case(dt, 1, 16, 2, r64, 64, bss[bi], lens_b + 1, 1), ++cases;
      bad += run_case(dt, 1, 2, 20, r64, 32, bss[bi], lens_c, 3), ++cases;
      bad += run_case(dt, 2, 4, 1, r64, 32, bss[bi], lens_b, 2), ++cases;
      bad += run_case(dt, 1, 16, 3, r64, 32, bss[bi], lens_b + 1, 3), ++cases; /* empty part */
      bad += run_case(dt, 2, 1, 5, r64, 32, bss[bi], lens_d, 1), ++cases;
      bad += run_case(dt, 2, 2, 3, r64, 32, bss[bi], lens_d, 2), ++cases;
      /* DeepSeek's 512 + 64: q.k's unrolled copy (D_MLA in mla_decode_cpu.c) */
      bad += run_case(dt, 2, 1, 16, 512, 64, bss[bi], lens_d, 2), ++cases;
      bad += run_case(dt, 1, 2, 10, 512, 64, bss[bi], lens_d + 1, 1), ++cases; /* 16 + 4 rows */
    }
  }
#ifdef APP_AMX_DRIVER
  if (mla_decode_amx_faults() != 0) {
    printf("AMX: %ld tile operations the hardware would refuse\n", (long)mla_decode_amx_faults());
    ++bad;
  }
  printf("AMX kernel (%s)\n", mla_decode_amx_emulated() ? "emulated tiles" : "AMX tiles");
#endif
  printf("%d cases, %d bad\n", cases, bad);
  return bad != 0;
}
