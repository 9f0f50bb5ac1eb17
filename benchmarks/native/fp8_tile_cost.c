/* What the FP8 tile conversion of the CPU decode kernel costs (docs/cpu-decode-kernel.md,
 * "FP8 latent caches"): the dot path's two conversions of e4m3 rows into the bf16 tile (by
 * AVX512-VBMI table look-ups, and through fp16 and float32, the fallback) in one process, and
 * the whole decode step with each beside a bf16 cache of the same shape. One thread; the
 * kernel's source is included, with __builtin_cpu_supports("avx512vbmi") turned into a switch
 * so that one build runs both conversions (the table one only where the CPU has VBMI).
 *
 *   cc -O3 -mavx512f -mfma -mf16c -I app/backends/cpu/csrc benchmarks/native/fp8_tile_cost.c \
 *      -o /tmp/fp8_tile_cost -lm
 *   /tmp/fp8_tile_cost tile ds pow2 20000     conversion alone, ns per key (576 values)
 *   /tmp/fp8_tile_cost step ds 4 8192 16 1 9  the step: batch, context, heads, query_len, rounds
 *
 * Layout: ds (fp8_ds_mla rows, 512 + 64) or e4m3 (fp8_e4m3 rows of 576). Scales (tile, ds):
 * pow2 (a power of two per 128-value block, drawn at random: k differs from block to block),
 * same (one power of two for every block), other (not powers of two: the fp16 path's).
 * The step's fp8_ds_mla rows have pow2 scales (the tables' worst case). It reads its caches
 * from memory: FLUSH_MB (default 256) MiB are written before each call; the three calls
 * (tables, fp16, bf16 cache) are interleaved round by round, and the best of each is printed,
 * with the bf16 cache's time over each FP8 one; then whether the two conversions gave the
 * same output, bit for bit (exit status 1 if not).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int vbmi_switch = 1; /* the conversion fp8_tile_bf16 takes: 1 tables, 0 fp16 */
static int cpu_supports(const char* feature) {
  if (strcmp(feature, "avx512vbmi") == 0) return vbmi_switch;
  __builtin_cpu_init();
  if (strcmp(feature, "avx512bf16") == 0) return __builtin_cpu_supports("avx512bf16");
  if (strcmp(feature, "avx512bw") == 0) return __builtin_cpu_supports("avx512bw");
  return 0;
}
#define __builtin_cpu_supports(feature) cpu_supports(feature)
#include "mla_decode_cpu.c"
#undef __builtin_cpu_supports

static int cpu_has_vbmi_for_real(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
}

enum { RANK = 512, ROPE = 64, D = RANK + ROPE };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* n rows of layout dt at `rows` (row_bytes apart): random e4m3 bytes (no NaN), scales of the
 * kind asked, random bf16 rope values. */
static void fill_rows(uint8_t* rows, int64_t n, int dt, const char* scales) {
  const int64_t row_bytes = cache_row_bytes(dt, RANK, ROPE);
  const int same_k = (rand() % 21) - 10;
  for (int64_t r = 0; r < n; ++r) {
    uint8_t* row = rows + r * row_bytes;
    for (int64_t c = 0; c < row_bytes; ++c) {
      const int v = rand() & 0xFF;
      row[c] = (uint8_t)((v & 0x7F) == 0x7F ? 0x30 : v);
    }
    if (dt != MLA_CACHE_FP8_DS_MLA) continue;
    for (int t = 0; t < RANK / 128; ++t) {
      float s = ldexpf(1.f, strcmp(scales, "same") == 0 ? same_k : (rand() % 21) - 10);
      if (strcmp(scales, "other") == 0) s *= 0.7371f;
      memcpy(row + RANK + 4 * t, &s, sizeof s);
    }
    for (int c = 0; c < ROPE; ++c) {
      const uint16_t b = (uint16_t)(0x3C00 + (rand() & 0x7F));
      memcpy(row + RANK + 4 * (RANK / 128) + 2 * c, &b, sizeof b);
    }
  }
}

static int tile_cost(int dt, const char* scales, int calls) {
  const int64_t row_bytes = cache_row_bytes(dt, RANK, ROPE);
  uint8_t* cache = aligned_alloc(64, (size_t)(BK * row_bytes + 64) / 64 * 64);
  uint16_t* tile = aligned_alloc(64, sizeof(uint16_t) * BK * D);
  fill_rows(cache, BK, dt, scales);
  const char* rows[BK];
  for (int j = 0; j < BK; ++j) rows[j] = (const char*)cache + j * row_bytes;
  mla_decode_args a;
  memset(&a, 0, sizeof a);
  a.rank = RANK, a.rope = ROPE, a.cache_dt = dt;
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < 45; ++round)
    for (int v = 0; v < 2; ++v) {
      vbmi_switch = v == 0;
      if (v == 0 && !cpu_has_vbmi_for_real()) continue;
      const double t0 = now();
      for (int i = 0; i < calls; ++i) fp8_tile_bf16(&a, rows, BK, tile);
      const double ns = (now() - t0) / calls / BK * 1e9;
      if (ns < best[v]) best[v] = ns;
    }
  printf("tile %s %s: tables %.1f ns per key, fp16 %.1f ns per key (best of 45 x %d calls)\n",
         dt == MLA_CACHE_FP8_DS_MLA ? "fp8_ds_mla" : "fp8_e4m3", scales, best[0], best[1], calls);
  free(cache);
  free(tile);
  return 0;
}

static int step_cost(int dt, int64_t batch, int64_t context, int64_t heads, int64_t qlen,
                     int rounds) {
  const int64_t bs = 64, blocks = batch * ((context + bs - 1) / bs), rows = blocks * bs;
  const int64_t row_bytes = cache_row_bytes(dt, RANK, ROPE);
  uint8_t* fp8 = aligned_alloc(64, (size_t)(rows * row_bytes + 63) / 64 * 64);
  uint16_t* bf16 = aligned_alloc(64, sizeof(uint16_t) * (size_t)(rows * D));
  fill_rows(fp8, rows, dt, "pow2");
  for (int64_t i = 0; i < rows * D; ++i) bf16[i] = (uint16_t)(0x3C00 + (rand() & 0x3FF) - 0x200);
  int32_t* table = malloc(sizeof(int32_t) * (size_t)blocks);
  for (int64_t i = 0; i < blocks; ++i) table[i] = (int32_t)((i * 7919) % blocks);
  int32_t* lens = malloc(sizeof(int32_t) * (size_t)batch);
  int64_t* items = malloc(4 * sizeof(int64_t) * (size_t)batch);
  for (int64_t b = 0; b < batch; ++b) {
    lens[b] = (int32_t)context;
    items[4 * b] = b, items[4 * b + 1] = 0, items[4 * b + 2] = context, items[4 * b + 3] = -1;
  }
  const int64_t qn = batch * qlen * heads;
  uint16_t* q = malloc(sizeof(uint16_t) * (size_t)(qn * D));
  for (int64_t i = 0; i < qn * D; ++i) q[i] = (uint16_t)(0x3C00 + (rand() & 0x3FF) - 0x200);
  uint16_t* out = malloc(sizeof(uint16_t) * (size_t)(qn * RANK));
  float* scratch = aligned_alloc(64, sizeof(float) * (size_t)(
      (mla_decode_cpu_scratch_floats(qlen, heads, RANK, ROPE) + 15) / 16 * 16));
  mla_decode_args a;
  memset(&a, 0, sizeof a);
  a.q = q, a.out = out, a.block_table = table, a.seq_lens = lens, a.items = items;
  a.scratch = scratch, a.batch = batch, a.qlen = qlen, a.heads = heads, a.rank = RANK;
  a.rope = ROPE, a.num_blocks = blocks, a.block_size = bs, a.bt_stride = blocks / batch;
  a.q_sb = qlen * heads * D, a.q_si = heads * D, a.q_sh = D, a.n_items = batch;
  a.q_dt = APP_DT_BF16, a.out_dt = APP_DT_BF16, a.bf16_dot = 1, a.q_mult = 0.06f, a.v_mult = 1.f;
  mla_decode_args on_fp8 = a, on_bf16 = a;
  on_fp8.cache = fp8, on_fp8.cache_dt = dt, on_fp8.block_stride = bs * row_bytes;
  on_fp8.row_stride = row_bytes;
  on_bf16.cache = bf16, on_bf16.cache_dt = APP_DT_BF16, on_bf16.block_stride = bs * D;
  on_bf16.row_stride = D;
  const char* env = getenv("FLUSH_MB");
  const size_t flush_bytes = (size_t)(env ? atoi(env) : 256) << 20;
  char* flush = flush_bytes ? malloc(flush_bytes) : NULL;
  double best[3] = {1e30, 1e30, 1e30};
  for (int round = 0; round < rounds; ++round)
    for (int v = 0; v < 3; ++v) {
      if (v == 0 && !cpu_has_vbmi_for_real()) continue;
      if (flush) memset(flush, round + v, flush_bytes);
      vbmi_switch = v == 0;
      const double t0 = now();
      if (mla_decode_cpu_run(v == 2 ? &on_bf16 : &on_fp8) != 0) {
        fprintf(stderr, "the kernel refused the call\n");
        return 1;
      }
      const double t = now() - t0;
      if (t < best[v]) best[v] = t;
    }
  int same = 1; /* the two conversions' outputs, bit for bit */
  if (cpu_has_vbmi_for_real()) {
    uint16_t* first = malloc(sizeof(uint16_t) * (size_t)(qn * RANK));
    vbmi_switch = 1;
    mla_decode_cpu_run(&on_fp8);
    memcpy(first, out, sizeof(uint16_t) * (size_t)(qn * RANK));
    vbmi_switch = 0;
    mla_decode_cpu_run(&on_fp8);
    same = memcmp(first, out, sizeof(uint16_t) * (size_t)(qn * RANK)) == 0;
    free(first);
  }
  printf("tables and fp16: outputs bit-identical: %s\n", same ? "yes" : "NO");
  const double keys = (double)(batch * context);
  printf("step %s %ldx%ld heads %ld query_len %ld (1 thread, best of %d): tables %.3f ms "
         "(%.1f ns per key), fp16 %.3f ms (%.1f), bf16 cache %.3f ms (%.1f); bf16 cache over "
         "FP8: tables %.3fx, fp16 %.3fx\n",
         dt == MLA_CACHE_FP8_DS_MLA ? "fp8_ds_mla" : "fp8_e4m3", (long)batch, (long)context,
         (long)heads, (long)qlen, rounds, best[0] * 1e3, best[0] * 1e9 / keys, best[1] * 1e3,
         best[1] * 1e9 / keys, best[2] * 1e3, best[2] * 1e9 / keys, best[2] / best[0],
         best[2] / best[1]);
  free(fp8), free(bf16), free(table), free(lens), free(items), free(q), free(out);
  free(scratch), free(flush);
  return same ? 0 : 1;
}

static int usage(void) {
  fprintf(stderr, "usage: fp8_tile_cost tile ds|e4m3 pow2|same|other CALLS\n"
                  "       fp8_tile_cost step ds|e4m3 BATCH CONTEXT HEADS QUERY_LEN ROUNDS\n");
  return 2;
}

int main(int argc, char** argv) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) {
    fprintf(stderr, "the dot path needs AVX512-BF16 and AVX512BW\n");
    return 2;
  }
  if (argc < 3 || (strcmp(argv[2], "ds") != 0 && strcmp(argv[2], "e4m3") != 0)) return usage();
  const int dt = strcmp(argv[2], "ds") == 0 ? MLA_CACHE_FP8_DS_MLA : MLA_CACHE_FP8_E4M3;
  srand(1);
  if (strcmp(argv[1], "tile") == 0 && argc == 5 && atoi(argv[4]) > 0 &&
      (!strcmp(argv[3], "pow2") || !strcmp(argv[3], "same") || !strcmp(argv[3], "other")))
    return tile_cost(dt, argv[3], atoi(argv[4]));
  if (strcmp(argv[1], "step") == 0 && argc == 8) {
    const int64_t batch = atol(argv[3]), context = atol(argv[4]), heads = atol(argv[5]);
    const int64_t qlen = atol(argv[6]);
    const int rounds = atoi(argv[7]);
    if (batch > 0 && context >= qlen && qlen > 0 && qlen <= 16 && heads > 0 && rounds > 0)
      return step_cost(dt, batch, context, heads, qlen, rounds);
  }
  return usage();
}
