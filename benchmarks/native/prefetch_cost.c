/* What a software prefetch that misses to memory costs the core that issues it.
 *
 * A diagnostic for the CPU decode kernel (docs/cpu-decode-kernel.md, "Round 5"), not a
 * target: one thread runs vdpbf16ps on registers only (24 independent accumulators, the
 * shape of the bf16 peak probe in app/backends/cpu/csrc/cpu_peaks.c) and issues one prefetch
 * every N products, walking a buffer the way the kernel walks a paged cache: 72 KiB blocks
 * (64 keys x 576 bf16) in a random order, lines in order inside a block. The products never
 * read what is prefetched, so any slowdown is the prefetch's own cost to the core.
 *
 *   gcc -O2 -mavx512f -mavx512bw -mavx512bf16 benchmarks/native/prefetch_cost.c \
 *       -o /tmp/prefetch_cost && /tmp/prefetch_cost [MiB] [huge]
 *
 * MiB: the buffer (default 1024: from memory; 16 stays in L3). "huge": ask for transparent
 * huge pages (madvise) for it. Prints GFLOP/s without prefetches, then for each hint (T0, T1,
 * NTA, and a plain load for comparison) at one line per 24 and per 48 products, the ratio to
 * the loop without prefetches and the bandwidth the prefetches asked for.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BLOCK 73728 /* 64 keys x 576 bf16: one cache block of the kernel's chunk */
#define ITERS 20000000L

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define REP24(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) X(16) \
  X(17) X(18) X(19) X(20) X(21) X(22) X(23)

enum hint { NONE, T0, T1, NTA, LOAD };

/* ITERS rounds of 24 products; every `every`-th round touches the next line with `hint`. */
__attribute__((target("avx512bf16,avx512f,avx512bw"), noinline)) static float run(
    const char* buf, const int32_t* order, long nblk, enum hint hint, long every) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3c003c00);
#define DECL(i) __m512 c##i = _mm512_set1_ps((float)(i));
  REP24(DECL)
#undef DECL
  long b = 0;
  const char* p = buf + (size_t)order[0] * BLOCK;
  const char* end = p + BLOCK;
  volatile char sink = 0;
  for (long it = 0; it < ITERS; ++it) {
#define STEP(i) c##i = _mm512_dpbf16_ps(c##i, x, x);
    REP24(STEP)
#undef STEP
    if (hint == NONE || it % every) continue;
    if (hint == T0) _mm_prefetch(p, _MM_HINT_T0);
    else if (hint == T1) _mm_prefetch(p, _MM_HINT_T1);
    else if (hint == NTA) _mm_prefetch(p, _MM_HINT_NTA);
    else sink = *p;
    p += 64;
    if (p >= end) {
      b = b + 1 == nblk ? 0 : b + 1;
      p = buf + (size_t)order[b] * BLOCK;
      end = p + BLOCK;
    }
  }
  (void)sink;
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, c##i);
  REP24(SUM)
#undef SUM
  return _mm512_reduce_add_ps(s);
}

int main(int argc, char** argv) {
  const long mib = argc > 1 ? atol(argv[1]) : 1024;
  const int huge = argc > 2 && strcmp(argv[2], "huge") == 0;
  const long nblk = (mib << 20) / BLOCK > 0 ? (mib << 20) / BLOCK : 1;
  const size_t two_mib = (size_t)2 << 20, bytes = (size_t)nblk * BLOCK;
  char* buf = aligned_alloc(two_mib, (bytes + two_mib - 1) / two_mib * two_mib);
  int32_t* order = malloc(sizeof(int32_t) * (size_t)nblk);
  if (buf == NULL || order == NULL) {
    fprintf(stderr, "prefetch_cost: out of memory for %ld MiB\n", mib);
    return 1;
  }
  if (huge) madvise(buf, bytes, MADV_HUGEPAGE);
  memset(buf, 1, bytes);
  uint32_t seed = 1;
  for (long i = 0; i < nblk; ++i) order[i] = (int32_t)i;
  for (long i = nblk - 1; i > 0; --i) { /* Fisher-Yates with an LCG: the same order every run */
    seed = seed * 1664525u + 1013904223u;
    const long k = (long)(seed % (uint32_t)(i + 1));
    const int32_t t = order[i];
    order[i] = order[k];
    order[k] = t;
  }
  const double flop = ITERS * 24.0 * 64;
  double t0 = now();
  volatile float f = run(buf, order, nblk, NONE, 1);
  const double base = now() - t0;
  printf("buffer %ld MiB%s; no prefetch: %.0f GFLOP/s\n", mib, huge ? " (huge pages asked)" : "",
         flop / base / 1e9);
  const char* names[] = {"", "T0", "T1", "NTA", "load"};
  for (int h = T0; h <= LOAD; ++h)
    for (long every = 1; every <= 2; ++every) {
      t0 = now();
      f = run(buf, order, nblk, (enum hint)h, every);
      const double t = now() - t0;
      printf("%-4s one line / %2ld products: %.0f GFLOP/s (%.3f of none), %.1f GB/s asked\n",
             names[h], 24 * every, flop / t / 1e9, base / t, ITERS / every * 64.0 / t / 1e9);
    }
  (void)f;
  return 0;
}
