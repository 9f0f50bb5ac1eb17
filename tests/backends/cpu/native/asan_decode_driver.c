/* Runs mla_decode_cpu_run_shares / _merge under AddressSanitizer + UBSan (built by
 * test_decode_kernel_asan.py) on shapes around every edge: block sizes 1..64, seq_len 1 and
 * not a multiple of the block size, query_len 1..16, head counts whose query rows are not a
 * multiple of 16, rope 0/32/64 (and DeepSeek's 512 + 64), every cache dtype (the FP8 ones,
 * fp8_e4m3 and fp8_ds_mla, with float32 and bf16 queries: the float and the dot path), whole
 * and split requests (built with mla_decode_amx.c and -DAPP_AMX_DRIVER: the bf16 cases only, on
 * the AMX kernel, and no tile operation the hardware would refuse). Every buffer (cache, table,
 * q, out, lse, partials, scratch) is allocated at
 * exactly the size the kernel is told, the unused rows of each last block hold NaN (reading
 * them would show), and the result is checked against a float64 reference. Then the hostile
 * cases (asan_decode_hostile.h: block ids at the edges and out of range, table entries past
 * the end, NaN rows and queries, fp8_ds_mla's scales, shared and overlapping inputs), with
 * their count per category. Prints "<cases> cases, <bad> bad". */
#include "asan_common.h"
#include "mla_decode_cpu.h"
#ifdef APP_AMX_DRIVER
#include <sys/syscall.h>
#include <unistd.h>
int32_t mla_decode_amx_emulated(void);
int64_t mla_decode_amx_faults(void);
#endif

static int bf16_dot = 0; /* run the bf16 cases on the AVX512-BF16 dot path */
static int q_dt_fp8 = APP_DT_F32; /* the query's dtype with an FP8 cache */

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

/* Fill the stored row at r with random values. */
static void fill_row(char* r, int dt, int64_t rank, int64_t rope) {
  if (!is_fp8(dt)) {
    for (int64_t c = 0; c < rank + rope; ++c) put(r, c, uniform(), dt);
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

/* Value c of the stored row at r. */
static double row_value(const char* r, int dt, int64_t c, int64_t rank, int64_t rope) {
  if (!is_fp8(dt)) return get(r, c, dt);
  if (dt == MLA_CACHE_FP8_E4M3) return e4m3((uint8_t)r[c]);
  if (c < rank) {
    float s;
    memcpy(&s, r + rank + 4 * (c / 128), sizeof s);
    return e4m3((uint8_t)r[c]) * (double)s;
  }
  uint16_t h;
  memcpy(&h, r + rank + 4 * (rank / 128) + 2 * (c - rank), sizeof h);
  return get(&h, 0, APP_DT_BF16);
}

/* One decode call as the kernel is told it: the cache's row (block k, offset o) at
 * k * block_stride + o * row_stride bytes (FP8) or elements; q[b, i, h] at b * q_sb +
 * i * q_si + h * q_sh elements of qdt; out [batch, qlen, heads, rank] of out_dt; lse or NULL;
 * split: key ranges per request (1: whole requests; a request shorter than split stays
 * whole); items (n_items of them), when given, replace split's (one share, no merge);
 * tol_scale: the tolerance's multiple (0: 1), or -1: each output column's tolerance times the
 * largest value its row sees there (values far from 1). */
typedef struct {
  int dt, qdt, out_dt, dot, split;
  int64_t batch, qlen, heads, rank, rope, bs, width, num_blocks, row_stride, block_stride;
  int64_t q_sb, q_si, q_sh, n_items;
  const char* cache;
  const void* q;
  const int32_t* table;
  const int32_t* seq;
  void* out;
  float* lse;
  const int64_t* items;
  double tol_scale;
} dec_call;

/* The stored row of request b's key t. */
static const char* key_row(const dec_call* c, int64_t b, int64_t t) {
  const int64_t blk = c->table[b * c->width + t / c->bs], unit = is_fp8(c->dt) ? 1 :
                      app_native_elem_size(c->dt);
  return c->cache + (blk * c->block_stride + t % c->bs * c->row_stride) * unit;
}

/* Runs the call: items (requests cut into split ranges, partials merged) in two shares (one
 * when there is one item) on the OpenMP team when built with -fopenmp; items, partials and
 * scratch allocated at exactly their sizes (the last share's scratch ends the allocation).
 * 0 when done, 1 when the run refused, 2 when the merge did. */
static int dec_launch(const dec_call* c) {
  const int64_t rows = c->qlen * c->heads, split = c->items ? 1 : c->split;
  int64_t n_items = 0, parts = 0, n_merge = 0;
  int64_t* items = malloc(sizeof(int64_t) * 4 * (size_t)(c->items ? c->n_items :
                                                           c->batch * (split > 1 ? split : 1)));
  int64_t* merge = malloc(sizeof(int64_t) * 3 * (size_t)c->batch);
  if (c->items) memcpy(items, c->items, sizeof(int64_t) * 4 * (size_t)(n_items = c->n_items));
  for (int64_t b = 0; b < c->batch && !c->items; ++b) {
    const int64_t len = c->seq[b], pieces = split > 1 && len >= split ? split : 1;
    if (pieces > 1) {
      merge[3 * n_merge] = b, merge[3 * n_merge + 1] = parts, merge[3 * n_merge + 2] = pieces;
      ++n_merge;
    }
    for (int64_t p = 0; p < pieces; ++p, ++n_items) {
      items[4 * n_items] = b;
      items[4 * n_items + 1] = len * p / pieces;
      items[4 * n_items + 2] = len * (p + 1) / pieces;
      items[4 * n_items + 3] = pieces > 1 ? parts + p : -1;
    }
    parts += pieces > 1 ? pieces : 0;
  }
  float* part_out = parts ? malloc(sizeof(float) * (size_t)(parts * rows * c->rank)) : NULL;
  float* part_lse = parts ? malloc(sizeof(float) * (size_t)(parts * rows)) : NULL;
  const int64_t floats = mla_decode_cpu_scratch_floats(c->qlen, c->heads, c->rank, c->rope);
  const int64_t stride = (floats + 15) / 16 * 16, n_shares = n_items > 1 ? 2 : 1;
  const int64_t share_end[2] = {n_shares > 1 ? n_items / 2 : n_items, n_items};
  float* scratch = malloc(sizeof(float) * (size_t)((n_shares - 1) * stride + floats));
  const float scale = 0.2f;
  mla_decode_args a = {
      .cache = c->cache, .q = c->q, .out = c->out, .lse = c->lse, .block_table = c->table,
      .seq_lens = c->seq, .items = items, .merge = merge, .part_out = part_out,
      .part_lse = part_lse, .scratch = scratch, .batch = c->batch, .qlen = c->qlen,
      .heads = c->heads, .rank = c->rank, .rope = c->rope, .num_blocks = c->num_blocks,
      .block_size = c->bs, .block_stride = c->block_stride, .row_stride = c->row_stride,
      .bt_stride = c->width, .q_sb = c->q_sb, .q_si = c->q_si, .q_sh = c->q_sh,
      .n_items = n_items, .n_merge = n_merge, .cache_dt = c->dt, .q_dt = c->qdt,
      .out_dt = c->out_dt, .bf16_dot = c->dot, .q_mult = scale * 1.4426950408889634f,
      .v_mult = 1.f};
  const int rc = mla_decode_cpu_run_shares(&a, share_end, n_shares, stride, 2) ? 1 :
                 mla_decode_cpu_merge(&a) ? 2 : 0;
  free(scratch), free(part_lse), free(part_out), free(merge), free(items);
  return rc;
}

/* Whether out (and lse) agree with a float64 reference from the inputs as given: row i of
 * request b sees keys [0, seq - qlen + i], NaN propagating (a NaN in a key a row sees, or in
 * its q, makes that row NaN; no other). */
static int dec_check(const dec_call* c) {
  const int64_t d = c->rank + c->rope, rows = c->qlen * c->heads;
  const double tol = (c->qdt == APP_DT_F32 && c->out_dt == APP_DT_F32 ? 1e-4 : 3e-2) *
                     (c->tol_scale > 0 ? c->tol_scale : 1);
  int64_t most = 1;
  for (int64_t b = 0; b < c->batch; ++b) most = c->seq[b] > most ? c->seq[b] : most;
  double* s = malloc(sizeof(double) * (size_t)most);
  int bad = 0;
  for (int64_t b = 0; b < c->batch && !bad; ++b)
    for (int64_t r = 0; r < rows && !bad; ++r) {
      const int64_t i = r / c->heads, h = r % c->heads, seen = c->seq[b] - c->qlen + i + 1;
      const int64_t qes = app_native_elem_size(c->qdt);
      const char* qr = (const char*)c->q + (b * c->q_sb + i * c->q_si + h * c->q_sh) * qes;
      double mx = -INFINITY, sum = 0;
      for (int64_t t = 0; t < seen; ++t) {
        const char* row = key_row(c, b, t);
        double dot = 0;
        for (int64_t k = 0; k < d; ++k)
          dot += get(qr, k, c->qdt) * row_value(row, c->dt, k, c->rank, c->rope);
        s[t] = dot * 0.2f;
        mx = s[t] > mx ? s[t] : mx;
      }
      for (int64_t t = 0; t < seen; ++t) sum += exp(s[t] - mx);
      if (c->lse && !agrees(c->lse[b * rows + r], mx + log(sum), tol)) bad = 1;
      for (int64_t k = 0; k < c->rank && !bad; ++k) {
        double o = 0, most_v = 1;
        for (int64_t t = 0; t < seen; ++t) {
          const double v = row_value(key_row(c, b, t), c->dt, k, c->rank, c->rope);
          o += exp(s[t] - mx) / sum * v;
          most_v = fabs(v) > most_v ? fabs(v) : most_v; /* false for a NaN */
        }
        const double tk = c->tol_scale < 0 ? tol * most_v : tol;
        if (!agrees(get(c->out, (b * rows + r) * c->rank + k, c->out_dt), o, tk)) bad = 1;
      }
    }
  free(s);
  return bad;
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
  for (int64_t i = 0; i < nblocks * bs; ++i) fill_row(cache + i * w, dt, rank, rope);
  for (int64_t b = 0; b < batch; ++b) /* NaN in the unused rows of the last block */
    for (int64_t r = lens[b] % bs ? lens[b] % bs : bs; r < bs; ++r) {
      const int64_t row = table[b * width + (lens[b] - 1) / bs] * bs + r;
      if (is_fp8(dt)) memset(cache + row * w, 0xFF, (size_t)w); /* NaN in e4m3, f32, bf16 */
      else
        for (int64_t c = 0; c < d; ++c) put(cache, row * d + c, NAN, dt);
    }
  for (int64_t i = 0; i < batch * rows * d; ++i) put(q, i, uniform(), qdt);
  const dec_call c = {
      .dt = dt, .qdt = qdt, .out_dt = qdt, .dot = qdt == APP_DT_BF16 ? bf16_dot : 0,
      .split = split, .batch = batch, .qlen = qlen, .heads = heads, .rank = rank,
      .rope = rope, .bs = bs, .width = width, .num_blocks = nblocks,
      .row_stride = is_fp8(dt) ? w : d, .block_stride = bs * (is_fp8(dt) ? w : d),
      .q_sb = rows * d, .q_si = heads * d, .q_sh = d, .cache = cache, .q = q, .table = table,
      .seq = seq, .out = out, .lse = lse};
  const int bad = dec_launch(&c) != 0 || dec_check(&c);
  if (bad)
    printf("BAD dt %d dot %d batch %ld qlen %ld heads %ld rank %ld rope %ld bs %ld split %d\n",
           dt, c.dot, (long)batch, (long)qlen, (long)heads, (long)rank, (long)rope, (long)bs,
           split);
  free(lse), free(out), free(q), free(seq), free(table), free(cache);
  return bad;
}

#include "asan_decode_hostile.h"

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
#ifdef APP_AMX_DRIVER /* the hostile cases of a bf16 cache */
  bad += decode_hostile(APP_DT_BF16, APP_DT_BF16, 1);
#else /* the FP8 caches' (float and dot path), and a bf16 cache's on the dot path */
  const int fp8s[2] = {MLA_CACHE_FP8_E4M3, MLA_CACHE_FP8_DS_MLA};
  for (int l = 0; l < 2; ++l) {
    bad += decode_hostile(fp8s[l], APP_DT_F32, 0);
    if (has_dot) bad += decode_hostile(fp8s[l], APP_DT_BF16, 1);
  }
  if (has_dot) bad += decode_hostile(APP_DT_BF16, APP_DT_BF16, 1);
#endif
  for (int k = 0; k < HOSTILE_KINDS; ++k) cases += hostile_count[k];
  print_hostile_counts("decode");
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
