/* Runs the sparse kernels of mla_sparse_cpu.c and mla_sparse_index_cpu.c under
 * AddressSanitizer + UBSan (built by test_sparse_kernel_asan.py): attention
 * (mla_sparse_attn_run / _merge) over paged and flat rows with block sizes 1..16, head counts
 * around the 4- and 16-head groups, DeepSeek's 512 + 64 and small dims, -1 padding, repeats, a
 * row naming nothing, whole and split rows, every dtype and the bf16 dot path; the indexer's
 * scores (mla_sparse_index_run) with items of 1..8 rows, key ranges cut anywhere, rows seeing
 * fewer keys than their item; and top-k (mla_sparse_topk) with ties, against a brute force.
 * Every buffer is allocated at exactly the size the kernel is told, and rows nothing names
 * hold NaN. Then the hostile cases (asan_sparse_hostile.h): indices at the edges, repeated,
 * out of range (refused), -1 anywhere, NaN rows, NaN queries, NaN scores, inputs overlapping
 * each other and outputs placed against the inputs. Prints "<cases> cases, <bad> bad". */
#include "asan_common.h"
#include "mla_sparse_cpu.h"

/* One attention call as the kernel is told it: kv row i at elements (i / bs) * block_stride
 * + (i % bs) * row_stride of kv (kv_rows rows), q[t, h] at t * q_st + h * q_sh, out [rows,
 * heads, rank] of out_dt, lse [rows, heads] or NULL; split 0: one item per row, else each
 * row's entries cut into `split` parts merged by LSE; items (n_items of them), when given,
 * replace the ones split makes (and nothing is merged). */
typedef struct {
  int dt, dot, out_dt, split;
  int64_t rows, heads, rank, rope, topk, bs, block_stride, row_stride, kv_rows, q_st, q_sh;
  const void* kv;
  const void* q;
  const int32_t* idx;
  void* out;
  float* lse;
  const int64_t* items;
  int64_t n_items;
} attn_call;

static int64_t kv_at(const attn_call* c, int64_t i) {
  return (i / c->bs) * c->block_stride + (i % c->bs) * c->row_stride;
}

/* Runs the call, its items, partials and scratch allocated at exactly their sizes: 0 when
 * done, 1 when the run refused, 2 when the merge did. */
static int attn_launch(const attn_call* c) {
  const int64_t split = c->items ? 0 : c->split, rows = c->rows;
  const int64_t n_items = c->items ? c->n_items : split ? rows * split : rows;
  int64_t* items = malloc(sizeof(int64_t) * 4 * (size_t)(n_items ? n_items : 1));
  int64_t* merge = malloc(sizeof(int64_t) * 3 * (size_t)(rows ? rows : 1));
  float* part_out = split ? malloc(sizeof(float) * (size_t)(n_items * c->heads * c->rank)) : NULL;
  float* part_lse = split ? malloc(sizeof(float) * (size_t)(n_items * c->heads)) : NULL;
  if (c->items) memcpy(items, c->items, sizeof(int64_t) * 4 * (size_t)n_items);
  for (int64_t t = 0, k = 0; t < rows && !c->items; ++t) {
    if (!split) {
      int64_t* it = items + 4 * k++;
      it[0] = t, it[1] = 0, it[2] = c->topk, it[3] = -1;
      continue;
    }
    merge[3 * t] = t, merge[3 * t + 1] = t * split, merge[3 * t + 2] = split;
    for (int64_t p = 0; p < split; ++p) {
      int64_t* it = items + 4 * k++;
      it[0] = t, it[1] = c->topk * p / split, it[2] = c->topk * (p + 1) / split;
      it[3] = t * split + p;
    }
  }
  const int64_t floats = mla_sparse_attn_scratch_floats(c->heads, c->rank, c->rope);
  float* scratch = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
  mla_sparse_attn_args a = {
      .kv = c->kv, .q = c->q, .indices = c->idx, .out = c->out, .lse = c->lse, .items = items,
      .merge = merge, .part_out = part_out, .part_lse = part_lse, .scratch = scratch,
      .rows = rows, .heads = c->heads, .rank = c->rank, .rope = c->rope, .topk = c->topk,
      .block_size = c->bs, .block_stride = c->block_stride, .row_stride = c->row_stride,
      .q_st = c->q_st, .q_sh = c->q_sh, .n_items = n_items, .n_merge = split ? rows : 0,
      .kv_rows = c->kv_rows, .kv_dt = c->dt, .q_dt = c->dt, .out_dt = c->out_dt,
      .bf16_dot = c->dot, .q_mult = 0.1f * 1.4426950408889634f, .v_mult = 1.f};
  const int rc = mla_sparse_attn_run(&a) ? 1 : split && mla_sparse_attn_merge(&a) ? 2 : 0;
  free(scratch), free(part_lse), free(part_out), free(merge), free(items);
  return rc;
}

/* Whether out (and lse) agree with a float64 reference from the inputs as given: -1 skipped,
 * every other entry one term, NaN propagating (a NaN in a named row or in q reaches exactly the
 * scores, and so the rows, it touches), a row naming nothing 0 with LSE -inf. */
static int attn_check(const attn_call* c) {
  const int64_t d = c->rank + c->rope, topk = c->topk;
  const double tol = c->dt == APP_DT_F32 && c->out_dt == APP_DT_F32 ? 1e-4 : 3e-2;
  double* s = malloc(sizeof(double) * (size_t)topk);
  int bad = 0;
  for (int64_t t = 0; t < c->rows && !bad; ++t)
    for (int64_t h = 0; h < c->heads && !bad; ++h) {
      const int32_t* idx = c->idx + t * topk;
      double mx = -INFINITY, sum = 0;
      for (int64_t e = 0; e < topk; ++e) {
        s[e] = -INFINITY;
        if (idx[e] < 0) continue;
        double dotp = 0;
        for (int64_t k = 0; k < d; ++k)
          dotp += get(c->q, t * c->q_st + h * c->q_sh + k, c->dt) *
                  get(c->kv, kv_at(c, idx[e]) + k, c->dt);
        s[e] = 0.1 * dotp;
        if (s[e] > mx) mx = s[e];
      }
      for (int64_t e = 0; e < topk; ++e) sum += idx[e] < 0 ? 0 : exp(s[e] - mx);
      const double want_lse = sum == 0 ? -INFINITY : mx + log(sum);
      if (c->lse && !agrees(c->lse[t * c->heads + h], want_lse, 2e-3)) bad = 1;
      for (int64_t k = 0; k < c->rank && !bad; ++k) {
        double o = 0;
        for (int64_t e = 0; e < topk; ++e)
          if (idx[e] >= 0) o += exp(s[e] - mx) / sum * get(c->kv, kv_at(c, idx[e]) + k, c->dt);
        if (!agrees(get(c->out, (t * c->heads + h) * c->rank + k, c->out_dt), o, tol)) bad = 1;
      }
    }
  free(s);
  return bad;
}

static int attention_case(int dt, int dot, int64_t rows, int64_t heads, int64_t rank,
                          int64_t rope, int64_t bs, int64_t nblocks, int64_t topk, int split) {
  const int64_t d = rank + rope, es = app_native_elem_size(dt), nrows = nblocks * bs;
  void* kv = malloc((size_t)(nrows * d * es));
  void* q = malloc((size_t)(rows * heads * d * es));
  int32_t* idx = malloc((size_t)(rows * topk) * sizeof(int32_t));
  float* out = malloc((size_t)(rows * heads * rank) * sizeof(float));
  float* lse = malloc((size_t)(rows * heads) * sizeof(float));
  char* named = calloc((size_t)nrows, 1);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t e = 0; e < topk; ++e) {
      const int r = rand() % 8;
      int32_t v = r == 0 ? -1 : (int32_t)(rand() % nrows);
      if (r == 1 && e) v = idx[t * topk + e - 1]; /* a repeat */
      if (t == rows - 1 && rows > 1) v = -1;      /* the last row names nothing */
      idx[t * topk + e] = v;
      if (v >= 0) named[v] = 1;
    }
  for (int64_t i = 0; i < nrows * d; ++i) put(kv, i, named[i / d] ? uniform() : NAN, dt);
  for (int64_t i = 0; i < rows * heads * d; ++i) put(q, i, uniform(), dt);
  const attn_call c = {
      .dt = dt, .dot = dot, .out_dt = APP_DT_F32, .split = split, .rows = rows,
      .heads = heads, .rank = rank, .rope = rope, .topk = topk, .bs = bs,
      .block_stride = bs * d, .row_stride = d, .kv_rows = nrows, .q_st = heads * d, .q_sh = d,
      .kv = kv, .q = q, .idx = idx, .out = out, .lse = lse};
  const int bad = attn_launch(&c) != 0 || attn_check(&c);
  if (bad)
    printf("bad attention case: dt %d dot %d rows %ld heads %ld rank %ld rope %ld bs %ld "
           "topk %ld split %d\n", dt, dot, (long)rows, (long)heads, (long)rank, (long)rope,
           (long)bs, (long)topk, split);
  free(named), free(lse), free(out), free(idx), free(q), free(kv);
  return bad;
}

/* The indexer's scores over a request of seq keys in shuffled blocks of bs (its table's entries
 * past the last block INT32_MIN: never read). nan 1: a NaN in the key at position seq - 2
 * (seen by the last rows only), 2: a NaN weight in row rows / 2 (all its scores NaN). */
static int index_case(int dt, int dot, int64_t rows, int64_t heads, int64_t dim, int64_t bs,
                      int64_t seq, int64_t span, int nan) {
  const int64_t es = app_native_elem_size(dt), per = (seq + bs - 1) / bs, width = per + 3;
  const int64_t nblocks = per + 2;
  void* cache = malloc((size_t)(nblocks * bs * dim * es));
  void* q = malloc((size_t)(rows * heads * dim * es));
  float* w = malloc((size_t)(rows * heads) * sizeof(float));
  int32_t* table = malloc((size_t)width * sizeof(int32_t));
  int64_t* visible = malloc((size_t)rows * sizeof(int64_t));
  float* scores = malloc((size_t)(rows * seq) * sizeof(float));
  for (int64_t b = 0; b < width; ++b)
    table[b] = b < per ? (int32_t)((b * 7 + 1) % nblocks) : INT32_MIN;
  for (int64_t i = 0; i < nblocks * bs * dim; ++i) {
    const int64_t blk = i / (bs * dim), pos_in = (i / dim) % bs;
    int used = 0;
    for (int64_t b = 0; b < per; ++b) used |= table[b] == blk && b * bs + pos_in < seq;
    put(cache, i, used ? uniform() : NAN, dt);
  }
  for (int64_t i = 0; i < rows * heads * dim; ++i) put(q, i, uniform(), dt);
  for (int64_t i = 0; i < rows * heads; ++i) w[i] = uniform();
  if (nan == 1 && seq >= 2)
    put(cache, ((int64_t)table[(seq - 2) / bs] * bs + (seq - 2) % bs) * dim + dim / 2, NAN, dt);
  if (nan == 2) w[rows / 2 * heads] = NAN;
  for (int64_t r = 0; r < rows; ++r)
    visible[r] = seq - (rows - 1 - r) * 3 > 1 ? seq - (rows - 1 - r) * 3 : 1;
  int64_t n_items = 0, cap = 8 * (seq / span + 2) * ((rows + 7) / 8);
  int64_t* items = malloc((size_t)(5 * cap) * sizeof(int64_t));
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t r1 = r0 + 8 < rows ? r0 + 8 : rows;
    int64_t seen = 0;
    for (int64_t r = r0; r < r1; ++r) seen = visible[r] > seen ? visible[r] : seen;
    for (int64_t k0 = 0; k0 < seen; k0 += span) {
      int64_t* it = items + 5 * n_items++;
      it[0] = 0, it[1] = r0, it[2] = r1, it[3] = k0, it[4] = k0 + span < seen ? k0 + span : seen;
    }
  }
  float* scratch = aligned_alloc(64, (size_t)((mla_sparse_index_scratch_floats(heads, dim) * 4 +
                                               63) / 64 * 64));
  mla_sparse_index_args a = {
      .q = q, .weights = w, .key_cache = cache, .block_table = table, .visible = visible,
      .scores = scores, .items = items, .scratch = scratch, .heads = heads, .dim = dim,
      .block_size = bs, .block_stride = bs * dim, .row_stride = dim, .q_st = heads * dim,
      .q_sh = dim, .bt_stride = width, .score_stride = seq, .score_row0 = 0,
      .n_items = n_items, .key_dt = dt, .q_dt = dt, .bf16_dot = dot};
  int bad = mla_sparse_index_run(&a);
  for (int64_t r = 0; r < rows && !bad; ++r) {
    int64_t seen = 0; /* what the row's block of 8 sees: the positions written */
    for (int64_t o = r / 8 * 8; o < r / 8 * 8 + 8 && o < rows; ++o)
      seen = visible[o] > seen ? visible[o] : seen;
    for (int64_t p = 0; p < seen; ++p) {
      const int64_t row = (int64_t)table[p / bs] * bs + p % bs;
      double total = p < visible[r] ? 0 : -INFINITY;
      for (int64_t h = 0; h < heads && p < visible[r]; ++h) {
        double x = 0;
        for (int64_t e = 0; e < dim; ++e)
          x += get(q, (r * heads + h) * dim + e, dt) * get(cache, row * dim + e, dt);
        total += w[r * heads + h] * (isnan(x) || x > 0 ? x : 0); /* relu keeps a NaN */
      }
      if (!agrees(scores[r * seq + p], total, 1e-3 * (1 + fabs(total)))) bad = 1;
    }
  }
  if (bad)
    printf("bad index case: dt %d dot %d rows %ld heads %ld dim %ld bs %ld seq %ld span %ld "
           "nan %d\n", dt, dot, (long)rows, (long)heads, (long)dim, (long)bs, (long)seq,
           (long)span, nan);
  free(scratch), free(items), free(scores), free(visible), free(table), free(w), free(q);
  free(cache);
  return bad;
}

static int topk_case(int64_t n, int64_t topk, int levels) {
  float* s = malloc((size_t)(n ? n : 1) * sizeof(float));
  int32_t* out = malloc((size_t)topk * sizeof(int32_t));
  uint32_t* scratch = malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
  int32_t flag = 0;
  for (int64_t i = 0; i < n; ++i) s[i] = (float)(rand() % levels) - levels / 2.f;
  for (int64_t i = 0; i < topk; ++i) out[i] = -1;
  const int64_t count = n;
  int bad = mla_sparse_topk(s, n, &count, 0, 1, topk, out, topk, &flag, scratch) || flag;
  /* brute force: position i is kept when fewer than topk positions beat it (higher, or equal
   * and earlier) */
  int64_t w = 0;
  for (int64_t i = 0; i < n && !bad; ++i) {
    int64_t beaten = 0;
    for (int64_t j = 0; j < n; ++j) beaten += s[j] > s[i] || (s[j] == s[i] && j < i);
    if (beaten < topk && out[w++] != i) bad = 1;
  }
  for (int64_t i = w; i < topk && !bad; ++i) bad = out[i] != -1;
  if (bad) printf("bad top-k case: n %ld topk %ld levels %d\n", (long)n, (long)topk, levels);
  free(scratch), free(out), free(s);
  return bad;
}

#include "asan_sparse_hostile.h"

int main(void) {
  srand(1);
  int cases = 0, bad = 0;
  const int has_dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  const int dts[4] = {APP_DT_F32, APP_DT_BF16, APP_DT_F16, APP_DT_BF16};
  for (int di = 0; di < (has_dot ? 4 : 3); ++di) {
    const int dt = dts[di], dot = di == 3;
    const int64_t bss[3] = {1, 5, 16};
    for (int bi = 0; bi < 3; ++bi) {
      bad += attention_case(dt, dot, 3, 3, 64, 32, bss[bi], 12, 40, 0), ++cases;
      bad += attention_case(dt, dot, 2, 20, 64, 32, bss[bi], 9, 70, 3), ++cases;
      bad += attention_case(dt, dot, 1, 1, 16, 16, bss[bi], 4, 1, 0), ++cases;
      bad += attention_case(dt, dot, 2, 16, 512, 64, bss[bi], 6, 37, 2), ++cases;
      bad += attention_case(dt, dot, 3, 4, 64, 0, bss[bi], 7, 33, 4), ++cases;
      bad += index_case(dt, dot, 1, 64, 128, bss[bi], 70, 32, 0), ++cases;
      bad += index_case(dt, dot, 11, 6, 64, bss[bi], 100, 40, 0), ++cases;
      bad += index_case(dt, dot, 3, 3, 2, bss[bi], 33, 1000, 0), ++cases;
      bad += index_case(dt, dot, 9, 5, 18, bss[bi], 45, 7, 0), ++cases;
    }
  }
  const int64_t ns[6] = {0, 1, 5, 64, 300, 1000};
  for (int i = 0; i < 6; ++i) {
    const int64_t ks[4] = {1, 3, 64, 301};
    for (int k = 0; k < 4; ++k) {
      bad += topk_case(ns[i], ks[k], 3), ++cases;
      bad += topk_case(ns[i], ks[k], 1000), ++cases;
    }
  }
  for (int di = 0; di < (has_dot ? 4 : 3); ++di) bad += sparse_hostile(dts[di], di == 3);
  bad += hostile_items();
  const float poison[3] = {NAN, INFINITY, -INFINITY};
  for (int i = 0; i < 3; ++i) bad += hostile_topk(poison[i], (i + 1) % 3);
  for (int k = 0; k < HOSTILE_KINDS; ++k) cases += hostile_count[k];
  print_hostile_counts("sparse attention, indexer and top-k");
  printf("%d cases, %d bad\n", cases, bad);
  return bad != 0;
}
