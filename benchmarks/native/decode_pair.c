/* Paired timing of builds of the CPU decode kernel: the instrument behind every "paired"
 * figure in docs/cpu-decode-kernel.md.
 *
 * Each argument after the case is a shared library built from a variant of
 * app/backends/cpu/csrc/mla_decode_cpu.c. All of them are loaded into one process and run on
 * one cache, their calls interleaved round by round (the order rotated every round), so a
 * slow spell of a shared machine hits every build alike; medians are what to compare.
 *
 *   cc -O2 -I app/backends/cpu/csrc benchmarks/native/decode_pair.c -o /tmp/decode_pair \
 *      -ldl -lpthread -lm
 *   cc -fPIC -shared -fvisibility=hidden -O3 -mavx512f -mfma -mf16c \
 *      -I app/backends/cpu/csrc app/backends/cpu/csrc/mla_decode_cpu.c -o /tmp/a.so -lm
 *   (the same for each variant, e.g. -o /tmp/b.so from a copy of csrc/ with the change)
 *   FLUSH_MB=1024 /tmp/decode_pair 16 8192 16 1 64 bf16 20 /tmp/a.so /tmp/b.so
 *
 * Arguments: batch, context (keys per request, this step's included), heads, query_len,
 * block_size, dtype (bf16 or fp32), rounds, then the libraries. Pages are handed out in a
 * random order, as `bench decode` does; two threads split the requests (the kernel's shares).
 * Environment:
 *   FLUSH_MB=N  read N MiB before every call (1024: the L3 holds nothing of the cache, as in
 *               `bench decode`, whose calls follow its stream probe); unset: back to back.
 *   ALIAS=N     every page aliased onto the first N blocks: the cache stays resident in L2.
 *   HUGE=1      the cache on transparent huge pages (madvise); HUGE=pair: libraries at even
 *               positions read a huge-page copy, odd ones a 4 KiB-page copy (pass one build
 *               twice to compare the two).
 *   THREADS=1   one thread instead of two.  NODOT=1  bf16 without the AVX512-BF16 path.
 *   CMP=1       also check that the first two libraries' outputs are bit-identical.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "mla_decode_cpu.h"

#define MAX_LIBS 16
#define MAX_THREADS 2
#define RANK 512
#define ROPE 64

typedef int32_t (*run_fn)(const mla_decode_args*);
typedef int64_t (*scratch_fn)(int64_t, int64_t, int64_t, int64_t);

typedef struct {
  mla_decode_args args;
  run_fn run;
  double seconds;
} job;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void* work(void* p) {
  job* j = p;
  const double t = now();
  if (j->run(&j->args)) fprintf(stderr, "decode_pair: the kernel refused the call\n");
  j->seconds = now() - t;
  return NULL;
}

static int by_value(const void* x, const void* y) {
  const double a = *(const double*)x, b = *(const double*)y;
  return a < b ? -1 : a > b;
}

static uint32_t lcg(uint32_t* s) { return *s = *s * 1664525u + 1013904223u; }

/* A 2 MiB-aligned anonymous mapping, on huge pages or explicitly not. */
static char* map_cache(size_t bytes, int huge) {
  const size_t two_mib = (size_t)2 << 20;
  char* p = mmap(NULL, bytes + two_mib, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) return NULL;
  p = (char*)(((uintptr_t)p + two_mib - 1) & ~(uintptr_t)(two_mib - 1));
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  return p;
}

/* Values near 1 (bf16) or in [-0.5, 0.5) (fp32): finite scores, every key weighed. */
static void fill(char* p, size_t elems, int bf16, uint32_t* seed) {
  for (size_t i = 0; i < elems; ++i) {
    const uint32_t x = lcg(seed);
    if (bf16) ((uint16_t*)p)[i] = (uint16_t)(0x3c00u + ((x >> 8) & 0xffu));
    else ((float*)p)[i] = (float)(x >> 8) / 16777216.f - 0.5f;
  }
}

static void call(job* jobs, int threads) {
  pthread_t th;
  if (threads == 1) {
    work(&jobs[0]);
    return;
  }
  pthread_create(&th, NULL, work, &jobs[1]);
  work(&jobs[0]);
  pthread_join(th, NULL);
}

int main(int argc, char** argv) {
  if (argc < 9 || argc - 8 > MAX_LIBS) {
    fprintf(stderr, "usage: %s BATCH CONTEXT HEADS QLEN BLOCK_SIZE bf16|fp32 ROUNDS LIB.so...\n"
            "(at most %d libraries)\n", argv[0], MAX_LIBS);
    return 2;
  }
  const int64_t batch = atol(argv[1]), ctx = atol(argv[2]), heads = atol(argv[3]);
  const int64_t qlen = atol(argv[4]), bs = atol(argv[5]);
  const int bf16 = strcmp(argv[6], "bf16") == 0, rounds = atoi(argv[7]), nlib = argc - 8;
  const int threads = getenv("THREADS") && atoi(getenv("THREADS")) == 1 ? 1 : MAX_THREADS;
  if (batch < 1 || ctx < qlen || heads < 1 || qlen < 1 || bs < 1 || rounds < 1 ||
      (!bf16 && strcmp(argv[6], "fp32") != 0)) {
    fprintf(stderr, "decode_pair: bad case (need batch, heads, qlen, block size, rounds >= 1, "
            "context >= qlen, dtype bf16 or fp32)\n");
    return 2;
  }
  const int dt = bf16 ? APP_DT_BF16 : APP_DT_F32;
  const int64_t d = RANK + ROPE, es = bf16 ? 2 : 4, per = (ctx + bs - 1) / bs;
  const int64_t nblocks = batch * per, rows = qlen * heads;
  const size_t bytes = (size_t)(nblocks * bs * d * es);
  const char* huge = getenv("HUGE");
  const int pair_pages = huge && strcmp(huge, "pair") == 0;
  uint32_t seed = 12345;
  char* cache = map_cache(bytes, huge != NULL);
  char* cache_4k = pair_pages ? map_cache(bytes, 0) : NULL;
  if (cache == NULL || (pair_pages && cache_4k == NULL)) {
    fprintf(stderr, "decode_pair: cannot map %zu bytes of cache\n", bytes);
    return 1;
  }
  fill(cache, bytes / (size_t)es, bf16, &seed);
  if (cache_4k) memcpy(cache_4k, cache, bytes);

  int32_t* table = malloc(sizeof(int32_t) * (size_t)nblocks);
  int32_t* seq = malloc(sizeof(int32_t) * (size_t)batch);
  char* q = malloc((size_t)(batch * rows * d * es));
  char* out = malloc((size_t)(batch * rows * RANK * 4));
  float* lse = malloc(sizeof(float) * (size_t)(batch * rows));
  int64_t* items[MAX_THREADS];
  int64_t n_items[MAX_THREADS] = {0, 0};
  for (int t = 0; t < threads; ++t) items[t] = malloc(sizeof(int64_t) * 4 * (size_t)batch);
  for (int64_t i = 0; i < nblocks; ++i) table[i] = (int32_t)i;
  for (int64_t i = nblocks - 1; i > 0; --i) { /* pages in a random order */
    const int64_t k = lcg(&seed) % (uint32_t)(i + 1);
    const int32_t t = table[i];
    table[i] = table[k];
    table[k] = t;
  }
  if (getenv("ALIAS"))
    for (int64_t i = 0; i < nblocks; ++i) table[i] %= atoi(getenv("ALIAS"));
  fill(q, (size_t)(batch * rows * d), bf16, &seed);
  for (int64_t b = 0; b < batch; ++b) {
    seq[b] = (int32_t)ctx;
    int64_t* it = items[b % threads] + 4 * n_items[b % threads]++;
    it[0] = b, it[1] = 0, it[2] = ctx, it[3] = -1; /* the whole request, written directly */
  }

  job jobs[MAX_LIBS][MAX_THREADS];
  for (int i = 0; i < nlib; ++i) {
    void* lib = dlopen(argv[8 + i], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
      fprintf(stderr, "decode_pair: %s\n", dlerror());
      return 1;
    }
    const run_fn run = (run_fn)dlsym(lib, "mla_decode_cpu_run");
    const scratch_fn floats = (scratch_fn)dlsym(lib, "mla_decode_cpu_scratch_floats");
    if (run == NULL || floats == NULL) {
      fprintf(stderr, "decode_pair: %s is not a decode kernel build\n", argv[8 + i]);
      return 1;
    }
    for (int t = 0; t < threads; ++t) {
      float* scratch = aligned_alloc(64, (size_t)(floats(qlen, heads, RANK, ROPE) * 4 + 63) / 64 * 64);
      jobs[i][t].run = run;
      jobs[i][t].args = (mla_decode_args){
          .cache = (cache_4k && i % 2) ? cache_4k : cache, .q = q, .out = out, .lse = lse,
          .block_table = table, .seq_lens = seq, .items = items[t], .scratch = scratch,
          .batch = batch, .qlen = qlen, .heads = heads, .rank = RANK, .rope = ROPE,
          .num_blocks = nblocks, .block_size = bs, .block_stride = bs * d, .row_stride = d,
          .bt_stride = per, .q_sb = rows * d, .q_si = heads * d, .q_sh = d,
          .n_items = n_items[t], .cache_dt = dt, .q_dt = dt, .out_dt = dt,
          .bf16_dot = bf16 && !getenv("NODOT"), .q_mult = 0.06f, .v_mult = 1.f};
    }
  }

  const size_t flush_bytes = getenv("FLUSH_MB") ? (size_t)atol(getenv("FLUSH_MB")) << 20 : 0;
  char* flush = flush_bytes ? malloc(flush_bytes) : NULL;
  if (flush) memset(flush, 1, flush_bytes);
  volatile long sink = 0;
  double* seconds = malloc(sizeof(double) * (size_t)(nlib * rounds));
  for (int i = 0; i < nlib; ++i) call(jobs[i], threads); /* warm-up: pages, code, clocks */
  for (int r = 0; r < rounds; ++r)
    for (int k = 0; k < nlib; ++k) {
      const int i = (k + r) % nlib;
      if (flush) {
        long acc = 0;
        for (size_t o = 0; o < flush_bytes; o += 64) acc += flush[o];
        sink += acc;
      }
      const double t = now();
      call(jobs[i], threads);
      seconds[i * rounds + r] = now() - t;
    }

  if (getenv("CMP") && nlib >= 2) {
    const size_t ob = (size_t)(batch * rows * RANK * es);
    char* first = malloc(ob);
    call(jobs[0], threads);
    memcpy(first, out, ob);
    call(jobs[1], threads);
    printf("outputs of the first two libraries bit-identical: %s\n",
           memcmp(first, out, ob) == 0 ? "yes" : "NO");
    free(first);
  }
  const double flop = 2.0 * (2 * RANK + ROPE) * (double)(heads * batch) *
                      (double)(qlen * (ctx - qlen) + qlen * (qlen + 1) / 2);
  for (int i = 0; i < nlib; ++i) {
    double* s = seconds + i * rounds;
    qsort(s, (size_t)rounds, sizeof(double), by_value);
    printf("%-32s best %7.3f ms  median %7.3f ms  (%.0f / %.0f GFLOP/s)\n", argv[8 + i],
           s[0] * 1e3, s[rounds / 2] * 1e3, flop / s[0] / 1e9, flop / s[rounds / 2] / 1e9);
  }
  return 0;
}
