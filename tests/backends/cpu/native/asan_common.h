/* Helpers shared by the sanitizer drivers of this folder (asan_sparse_driver.c,
 * asan_decode_driver.c): random values, element access in every dtype, float8 e4m3fn decoding,
 * the comparison against a float64 reference that also judges non-finite results, and the
 * per-category counts of the hostile cases. Header-only (static): each driver is one
 * translation unit with the kernel's sources. */
#ifndef ASAN_COMMON_H
#define ASAN_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "app_native.h"

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

static double e4m3(uint8_t b) { /* float8 e4m3fn: no infinities, S.1111.111 the NaN */
  const int e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7F) == 0x7F) return NAN;
  const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
  return b & 0x80 ? -v : v;
}

/* Whether a kernel's result `got` agrees with the float64 reference `want`: a NaN reference (a
 * NaN reached it) asks for a NaN (not an infinity: a poisoned row's LSE is not the -inf of a
 * row that sees nothing), an infinite one for that same infinity, a finite one for a finite
 * result within tol. So a poisoned row must come out poisoned and every other row clean. */
static int agrees(double got, double want, double tol) {
  if (isnan(want)) return isnan(got);
  if (isinf(want)) return got == want;
  return fabs(got - want) <= tol; /* false for a NaN got */
}

/* Whether the n bytes at p all hold `byte` (an output a refused call must not have written). */
static int bytes_are(const void* p, size_t n, int byte) {
  for (size_t i = 0; i < n; ++i)
    if (((const unsigned char*)p)[i] != byte) return 0;
  return 1;
}

/* The hostile cases run, per category (each driver prints them before its last line). */
enum { HOSTILE_INDEX, HOSTILE_PADDING, HOSTILE_NAN, HOSTILE_ALIAS, HOSTILE_KINDS };
static int hostile_count[HOSTILE_KINDS];

static void print_hostile_counts(const char* surface) {
  printf("%s hostile cases: %d hostile indices, %d -1 rows, %d NaN rows, %d aliasing\n",
         surface, hostile_count[HOSTILE_INDEX], hostile_count[HOSTILE_PADDING],
         hostile_count[HOSTILE_NAN], hostile_count[HOSTILE_ALIAS]);
}

#endif /* ASAN_COMMON_H */
