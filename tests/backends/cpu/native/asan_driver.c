/* Runs mla_prefill_cpu_attend under AddressSanitizer (built by test_cpu_native_asan.py) on
 * shapes around every tile, block and head-dim edge, with each tensor and the scratch
 * allocated at exactly the size the kernel is told, and checks the result against a float64
 * reference, also with a NaN planted in one key or value (the NaN rule of app/backends/prefill/_dense.py).
 * Prints "<cases> cases, <bad> bad"; exits 1 if any case is off. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mla_prefill_cpu.h"

enum { F32 = APP_DT_F32, BF16 = APP_DT_BF16 };
enum { HEADS = 2 };

static float uniform(void) { return (float)rand() / (float)RAND_MAX * 2.f - 1.f; }

static float bf16_round(float x) {  /* truncate to bf16: exact in both formats */
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  bits &= 0xFFFF0000u;
  memcpy(&x, &bits, sizeof x);
  return x;
}

/* n random values (scaled by amp) as `dt` in a fresh buffer of exactly n elements; `ref`
 * receives the same values as float. */
static void* random_tensor(long n, float amp, int dt, float* ref) {
  void* buf = malloc((size_t)n * (dt == F32 ? 4 : 2) + 1);
  for (long i = 0; i < n; ++i) {
    ref[i] = bf16_round(uniform() * amp);
    if (dt == F32) {
      ((float*)buf)[i] = ref[i];
    } else {
      uint32_t bits;
      memcpy(&bits, &ref[i], sizeof bits);
      ((uint16_t*)buf)[i] = (uint16_t)(bits >> 16);
    }
  }
  return buf;
}

static float read_out(const void* out, long i, int dt) {
  if (dt == F32) return ((const float*)out)[i];
  uint32_t bits = (uint32_t)((const uint16_t*)out)[i] << 16;
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}

/* Element i of a tensor of type dt set to NaN. */
static void set_nan(void* buf, long i, int dt) {
  if (dt == F32) ((float*)buf)[i] = NAN;
  else ((uint16_t*)buf)[i] = 0x7FC0;
}

/* Worst error of head h's output and LSE against float64. bad_key >= 0: head 0 of that key
 * holds a NaN in k (bad_in_v 0: rows that see it must be NaN throughout, LSE too) or in
 * column 0 of v (bad_in_v 1: that column of the rows that see it must be NaN); the
 * reference (f32 copies) keeps the finite value, which no other row may depend on. */
static double check_head(const float* q, const float* k, const float* v, const void* out,
                         const float* lse, long ql, long kl, long d, long dv, int causal,
                         float scale, int out_dt, long h, long bad_key, int bad_in_v) {
  double worst = 0.0, *s = malloc(sizeof(double) * (size_t)(kl + 1));
  for (long i = 0; i < ql; ++i) {
    long end = causal ? i + kl - ql + 1 : kl;
    if (end > kl) end = kl;
    if (end < 0) end = 0;
    double mx = -INFINITY, sum = 0.0;
    for (long j = 0; j < end; ++j) {
      double dot = 0.0;
      for (long c = 0; c < d; ++c)
        dot += (double)q[(i * HEADS + h) * d + c] * k[(j * HEADS + h) * d + c];
      s[j] = dot * scale;
      if (s[j] > mx) mx = s[j];
    }
    for (long j = 0; j < end; ++j) sum += (s[j] = exp(s[j] - mx));
    const int sees_bad = h == 0 && bad_key >= 0 && bad_key < end;
    if (sees_bad && !bad_in_v) {
      for (long c = 0; c < dv; ++c)
        if (!isnan(read_out(out, (i * HEADS + h) * dv + c, out_dt))) worst = INFINITY;
      if (!isnan(lse[h * ql + i])) worst = INFINITY;
      continue;
    }
    for (long c = 0; c < dv; ++c) {
      if (sees_bad && c == 0) {
        if (isfinite(read_out(out, (i * HEADS + h) * dv + c, out_dt))) worst = INFINITY;
        continue;
      }
      double o = 0.0;
      for (long j = 0; j < end; ++j) o += s[j] * v[(j * HEADS + h) * dv + c];
      o = end ? o / sum : 0.0;
      double err = fabs(o - read_out(out, (i * HEADS + h) * dv + c, out_dt));
      if (!(err <= worst)) worst = err;  /* NaN counts as worst */
    }
    double got = lse[h * ql + i];
    double err = end ? fabs(mx + log(sum) - got) : (isinf(got) && got < 0 ? 0.0 : INFINITY);
    if (!(err <= worst)) worst = err;
  }
  free(s);
  return worst;
}

static int run_case(long ql, long kl, long d, long dv, int causal, int in_dt, int out_dt,
                    long bad_key, int bad_in_v) {
  float* qf = malloc(sizeof(float) * (size_t)(ql * HEADS * d + 1));
  float* kf = malloc(sizeof(float) * (size_t)(kl * HEADS * d + 1));
  float* vf = malloc(sizeof(float) * (size_t)(kl * HEADS * dv + 1));
  void* q = random_tensor(ql * HEADS * d, 2.f, in_dt, qf);
  void* k = random_tensor(kl * HEADS * d, 2.f, in_dt, kf);
  void* v = random_tensor(kl * HEADS * dv, 1.f, in_dt, vf);
  if (bad_key >= 0 && !bad_in_v) set_nan(k, bad_key * HEADS * d + 5 % d, in_dt);
  if (bad_key >= 0 && bad_in_v) set_nan(v, bad_key * HEADS * dv, in_dt);
  void* out = malloc((size_t)(ql * HEADS * dv) * (out_dt == F32 ? 4 : 2) + 1);
  float* lse = malloc(sizeof(float) * (size_t)(HEADS * ql) + 1);
  float* scratch =
      malloc(sizeof(float) * (size_t)mla_prefill_cpu_scratch_floats(ql, kl, d, dv));
  int64_t q_start = 0, q_len = ql, kv_start = 0, kv_len = kl, items[2 * HEADS];
  for (long h = 0; h < HEADS; ++h) items[2 * h] = 0, items[2 * h + 1] = h;
  const float scale = 1.f / sqrtf((float)d);
  const mla_prefill_args args = {
      .q = q, .k = k, .v = v, .out = out, .lse = lse, .q_start = &q_start, .q_len = &q_len,
      .kv_start = &kv_start, .kv_len = &kv_len, .items = items, .scratch = scratch,
      .q_row = HEADS * d, .q_head = d, .k_row = HEADS * d, .k_head = d, .v_row = HEADS * dv,
      .v_head = dv, .o_row = HEADS * dv, .o_head = dv, .lse_head = ql, .n_items = HEADS,
      .d = d, .dv = dv, .in_dt = in_dt, .out_dt = out_dt, .causal = causal, .scale = scale};
  if (mla_prefill_cpu_attend(&args) != 0) {
    printf("refused: q %ld kv %ld d %ld dv %ld\n", ql, kl, d, dv);
    return 1;
  }
  double worst = 0.0;
  for (long h = 0; h < HEADS; ++h) {
    double err = check_head(qf, kf, vf, out, lse, ql, kl, d, dv, causal, scale, out_dt, h,
                            bad_key, bad_in_v);
    if (!(err <= worst)) worst = err;
  }
#ifdef MLA_PREFILL_BF16  /* bf16 products: probabilities rounded to bf16 before p.v */
  const double tol = out_dt == F32 && in_dt == F32 ? 1e-4 : 1e-2;
#else
  const double tol = out_dt == F32 ? 1e-4 : 1e-2;
#endif
  if (!(worst <= tol))
    printf("off: q %ld kv %ld d %ld dv %ld causal %d in %d out %d NaN key %ld%s: error %g\n",
           ql, kl, d, dv, causal, in_dt, out_dt, bad_key, bad_in_v ? " (v)" : "", worst);
  free(qf), free(kf), free(vf), free(q), free(k), free(v), free(out), free(lse), free(scratch);
  return !(worst <= tol);
}

int main(void) {
  const long q_lens[] = {1, 5, 6, 7, 13, 14, 15, 16, 17, 31, 32, 33, 125, 126, 127, 300};
  const long dims[][2] = {{192, 128}, {33, 64}, {80, 128}, {16, 64}};
  int cases = 0, bad = 0;
  srand(7);
  for (int a = 0; a < (int)(sizeof q_lens / sizeof q_lens[0]); ++a)
    for (int b = 0; b < 4; ++b)
      for (int causal = 0; causal < 2; ++causal) {
        const long ql = q_lens[a];
        const long kl = a % 3 == 0 ? ql : a % 3 == 1 ? ql + 37 : ql / 2 + 1;
        const int in_dt = (a + b) % 2 ? BF16 : F32, out_dt = (a + causal) % 2 ? BF16 : F32;
        bad += run_case(ql, kl, dims[b][0], dims[b][1], causal, in_dt, out_dt, -1, 0);
        /* a NaN in a key, then in a value, near the middle (on a tile diagonal) */
        bad += run_case(ql, kl, dims[b][0], dims[b][1], causal, in_dt, out_dt, kl / 2, 0);
        bad += run_case(ql, kl, dims[b][0], dims[b][1], causal, in_dt, out_dt, kl / 2, 1);
        cases += 3;
      }
  /* past one 512-key block */
  bad += run_case(600, 600, 192, 128, 1, F32, F32, -1, 0);
  bad += run_case(600, 600, 192, 128, 1, F32, F32, 555, 1);
  /* odd d and keys past a block, bf16 in (the bf16-products build's pairs) */
  bad += run_case(601, 601, 193, 128, 1, BF16, F32, -1, 0);
  bad += run_case(601, 601, 193, 128, 1, BF16, F32, 555, 1);
  bad += run_case(601, 601, 193, 128, 1, BF16, F32, 556, 1);
  cases += 5;
  printf("%d cases, %d bad\n", cases, bad);
  return bad != 0;
}
