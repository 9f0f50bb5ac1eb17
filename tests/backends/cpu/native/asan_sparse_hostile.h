/* The hostile cases of asan_sparse_driver.c (included by it, after attn_call, attn_launch,
 * attn_check and index_case): what mla_sparse_cpu.h says a caller may hand the attention
 * kernel, at its edges, and what it says is refused.
 *
 * - hostile indices: every entry one row, the first and the last row of kv (the last one
 *   ends its allocation: a read past it is an ASan report), repeats across tiles; indices out
 *   of range (kv_rows, -2, INT32_MIN, INT32_MAX) and items and merges out of range, which
 *   must be refused with nothing written;
 * - -1 rows: -1 first, last, everywhere but one entry, a whole tile of it, a row naming
 *   nothing (out 0, LSE -inf), whole, split into parts (a part or every part empty), with the
 *   LSE not asked for, into 16-bit outputs;
 * - NaN rows: a NaN in a named row (its rope or latent part: every score, so every head, of
 *   exactly the rows naming it turns NaN), a NaN query head, a NaN query row naming nothing,
 *   NaN in every unnamed row and in the padding between rows, NaN stored to bf16 / fp16;
 * - aliasing: q inside kv (query t head h is kv row t + h), heads sharing one q vector,
 *   inputs and outputs back to back in one allocation (a write outside out/lse changes an
 *   input, a read outside an input reads an output not yet written), one row named by every
 *   entry of every query.
 * Every case checks its inputs are unchanged after the call. Outputs start as 0x7B bytes (a
 * finite value in every dtype): an output left unwritten never passes for a NaN one. */
#ifndef ASAN_SPARSE_HOSTILE_H
#define ASAN_SPARSE_HOSTILE_H

#define H_RANK 64
#define H_ROPE 32
#define H_D (H_RANK + H_ROPE)
#define UNWRITTEN 0x7B

/* One hostile problem's buffers (layout 0: one allocation each, at exactly its size; 1 and 2:
 * all in one allocation, back to back, in two orders) and copies of its inputs. */
typedef struct {
  attn_call c;
  char* block;
  void *kv, *q, *out, *kv0, *q0;
  int32_t *idx, *idx0;
  float* lse;
  size_t kv_bytes, q_bytes, idx_bytes, out_bytes, lse_bytes;
} attn_bufs;

/* rows queries of heads heads over kv_rows rows in blocks of bs, rows H_D + pad elements
 * apart and blocks pad more (the padding NaN), every row and q random, every entry -1; the
 * output of out_dt. */
static void bufs_new_out(attn_bufs* b, int out_dt, int dt, int dot, int64_t rows, int64_t heads,
                         int64_t bs, int64_t kv_rows, int64_t topk, int split, int64_t pad,
                         int layout) {
  memset(b, 0, sizeof *b);
  const int64_t es = app_native_elem_size(dt), row_stride = H_D + pad;
  const int64_t block_stride = bs * row_stride + pad, blocks = (kv_rows + bs - 1) / bs;
  b->kv_bytes = (size_t)(blocks * block_stride * es);
  b->q_bytes = (size_t)(rows * heads * H_D * es);
  b->idx_bytes = sizeof(int32_t) * (size_t)(rows * topk);
  b->out_bytes = (size_t)(rows * heads * H_RANK * app_native_elem_size(out_dt));
  b->lse_bytes = sizeof(float) * (size_t)(rows * heads);
  if (layout == 0) {
    b->kv = malloc(b->kv_bytes), b->q = malloc(b->q_bytes), b->idx = malloc(b->idx_bytes);
    b->out = malloc(b->out_bytes), b->lse = malloc(b->lse_bytes);
  } else {
    char* p = b->block = malloc(b->kv_bytes + b->q_bytes + b->idx_bytes + b->out_bytes +
                                b->lse_bytes);
    if (layout == 1) { /* kv | out | idx | lse | q */
      b->kv = p, b->out = p += b->kv_bytes, b->idx = (int32_t*)(void*)(p += b->out_bytes);
      b->lse = (float*)(void*)(p += b->idx_bytes), b->q = p + b->lse_bytes;
    } else { /* out | q | lse | kv | idx */
      b->out = p, b->q = p += b->out_bytes, b->lse = (float*)(void*)(p += b->q_bytes);
      b->kv = p += b->lse_bytes, b->idx = (int32_t*)(void*)(p + b->kv_bytes);
    }
  }
  for (int64_t i = 0; i < blocks * block_stride; ++i) put(b->kv, i, NAN, dt);
  for (int64_t i = 0; i < kv_rows; ++i)
    for (int64_t k = 0; k < H_D; ++k)
      put(b->kv, (i / bs) * block_stride + (i % bs) * row_stride + k, uniform(), dt);
  for (int64_t i = 0; i < rows * heads * H_D; ++i) put(b->q, i, uniform(), dt);
  for (int64_t i = 0; i < rows * topk; ++i) b->idx[i] = -1;
  memset(b->out, UNWRITTEN, b->out_bytes), memset(b->lse, UNWRITTEN, b->lse_bytes);
  const attn_call c = {
      .dt = dt, .dot = dot, .out_dt = out_dt, .split = split, .rows = rows, .heads = heads,
      .rank = H_RANK, .rope = H_ROPE, .topk = topk, .bs = bs, .block_stride = block_stride,
      .row_stride = row_stride, .kv_rows = kv_rows, .q_st = heads * H_D, .q_sh = H_D,
      .kv = b->kv, .q = b->q, .idx = b->idx, .out = b->out, .lse = b->lse};
  b->c = c;
}

static void bufs_new(attn_bufs* b, int dt, int dot, int64_t rows, int64_t heads, int64_t bs,
                     int64_t kv_rows, int64_t topk, int split, int64_t pad, int layout) {
  bufs_new_out(b, dt, dt, dot, rows, heads, bs, kv_rows, topk, split, pad, layout);
}

/* Element k of kv row i. */
static void kv_put(attn_bufs* b, int64_t i, int64_t k, float x) {
  put(b->kv, kv_at(&b->c, i) + k, x, b->c.dt);
}

/* Launch the call with copies of its inputs kept; whether it returned `want` (0: then its
 * results must agree with the reference; 1: refused, out and lse untouched) and left its
 * inputs as they were. */
static int bufs_run(attn_bufs* b, int kind, const char* what, int want) {
  ++hostile_count[kind];
  b->kv0 = malloc(b->kv_bytes), b->q0 = malloc(b->q_bytes), b->idx0 = malloc(b->idx_bytes);
  memcpy(b->kv0, b->kv, b->kv_bytes), memcpy(b->idx0, b->idx, b->idx_bytes);
  if (b->c.q == b->q) memcpy(b->q0, b->q, b->q_bytes);
  const int rc = attn_launch(&b->c);
  int bad = rc != want;
  if (!bad && want == 0) bad = attn_check(&b->c);
  if (!bad && want != 0)
    bad = !bytes_are(b->out, b->out_bytes, UNWRITTEN) ||
          !bytes_are(b->lse, b->lse_bytes, UNWRITTEN);
  if (memcmp(b->kv0, b->kv, b->kv_bytes) || memcmp(b->idx0, b->idx, b->idx_bytes) ||
      (b->c.q == b->q && memcmp(b->q0, b->q, b->q_bytes)))
    bad = 1;
  if (bad)
    printf("bad hostile sparse case (%s): dt %d dot %d out_dt %d split %d: returned %d\n", what,
           b->c.dt, b->c.dot, b->c.out_dt, b->c.split, rc);
  free(b->kv0), free(b->q0), free(b->idx0);
  if (b->block) free(b->block);
  else free(b->kv), free(b->q), free(b->idx), free(b->out), free(b->lse);
  return bad;
}

static int hostile_indices(int dt, int dot) {
  int bad = 0;
  attn_bufs b;
  bufs_new(&b, dt, dot, 3, 5, 5, 15, 40, 0, 0, 0); /* every entry row 0: 40 repeats */
  for (int64_t i = 0; i < 3 * 40; ++i) b.idx[i] = 0;
  bad += bufs_run(&b, HOSTILE_INDEX, "every entry row 0", 0);
  bufs_new(&b, dt, dot, 3, 5, 5, 15, 40, 3, 0, 0); /* the first and the last row in turn */
  for (int64_t i = 0; i < 3 * 40; ++i) b.idx[i] = i % 2 ? 14 : 0;
  bad += bufs_run(&b, HOSTILE_INDEX, "rows 0 and kv_rows - 1", 0);
  bufs_new(&b, dt, dot, 2, 20, 5, 15, 24, 2, 16, 0); /* every row backwards, then repeats */
  for (int64_t i = 0; i < 2 * 24; ++i) b.idx[i] = (int32_t)(i % 24 < 15 ? 14 - i % 24 : i % 3);
  bad += bufs_run(&b, HOSTILE_INDEX, "every row, then repeats", 0);
  const int32_t outside[4] = {15, -2, INT32_MIN, INT32_MAX};
  for (int v = 0; v < 4; ++v)
    for (int split = 0; split < 2; ++split) { /* refused, nothing written */
      bufs_new(&b, dt, dot, 3, 5, 5, 15, 40, split ? 3 : 0, 0, 0);
      for (int64_t i = 0; i < 3 * 40; ++i) b.idx[i] = (int32_t)(i % 15);
      b.idx[split ? 0 : 3 * 40 - 1] = outside[v];
      bad += bufs_run(&b, HOSTILE_INDEX, "an index out of range", 1);
    }
  return bad;
}

/* Items and merges out of range, refused with nothing written (dtype-independent: once). */
static int hostile_items(void) {
  int bad = 0;
  const int64_t items[5][4] = {{3, 0, 8, -1}, {-1, 0, 8, -1}, {0, 0, 9, -1}, {0, 3, 2, -1},
                               {0, -1, 8, -1}};
  for (int k = 0; k < 5; ++k) {
    attn_bufs b;
    bufs_new(&b, APP_DT_F32, 0, 3, 4, 1, 6, 8, 0, 0, 0);
    b.c.items = items[k], b.c.n_items = 1;
    bad += bufs_run(&b, HOSTILE_INDEX, "an item out of range", 1);
  }
  const int64_t merges[4][3] = {{3, 0, 1}, {-1, 0, 1}, {0, -1, 1}, {0, 0, 65}};
  for (int k = 0; k < 4; ++k) {
    float part_out[4 * H_RANK], part_lse[4], out[3 * 4 * H_RANK], lse[3 * 4];
    memset(out, UNWRITTEN, sizeof out), memset(lse, UNWRITTEN, sizeof lse);
    mla_sparse_attn_args a = {
        .out = out, .lse = lse, .merge = merges[k], .part_out = part_out,
        .part_lse = part_lse, .rows = 3, .heads = 4, .rank = H_RANK, .rope = H_ROPE,
        .block_size = 1, .n_merge = 1, .kv_dt = APP_DT_F32, .q_dt = APP_DT_F32,
        .out_dt = APP_DT_F32};
    ++hostile_count[HOSTILE_INDEX];
    if (mla_sparse_attn_merge(&a) != 1 || !bytes_are(out, sizeof out, UNWRITTEN) ||
        !bytes_are(lse, sizeof lse, UNWRITTEN)) {
      printf("bad hostile sparse case: merge %d out of range not refused\n", k);
      ++bad;
    }
  }
  return bad;
}

/* Row 0: -1 first; row 1: -1 last; row 2: -1 but for its middle entry; row 3: nothing. */
static void minus_one_rows(attn_bufs* b) {
  const int64_t topk = b->c.topk;
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t e = 0; e < topk; ++e) b->idx[t * topk + e] = (int32_t)((e * 5 + t) % 15);
  b->idx[0] = -1, b->idx[2 * topk - 1] = -1;
  for (int64_t e = 0; e < topk; ++e)
    if (e != topk / 2) b->idx[2 * topk + e] = -1;
}

static int hostile_padding(int dt, int dot) {
  int bad = 0;
  attn_bufs b;
  for (int split = 0; split < 4; split += 3) {
    bufs_new(&b, dt, dot, 4, 5, 5, 15, 40, split, 0, 0);
    minus_one_rows(&b);
    bad += bufs_run(&b, HOSTILE_PADDING, "-1 first, last, all but one, all", 0);
  }
  bufs_new(&b, dt, dot, 4, 5, 5, 15, 40, 0, 0, 0); /* no LSE asked for */
  minus_one_rows(&b);
  b.c.lse = NULL;
  bad += bufs_run(&b, HOSTILE_PADDING, "-1 rows without an LSE", 0);
  if (dt == APP_DT_F32) { /* into bf16 outputs (zero rows included) */
    bufs_new_out(&b, APP_DT_BF16, dt, dot, 4, 5, 5, 15, 40, 0, 0, 0);
    minus_one_rows(&b);
    bad += bufs_run(&b, HOSTILE_PADDING, "-1 rows into bf16", 0);
  }
  bufs_new(&b, dt, dot, 2, 20, 1, 15, 80, 2, 0, 0); /* whole tiles of -1 */
  for (int64_t e = 32; e < 80; ++e) b.idx[e] = (int32_t)(e % 15);
  for (int64_t e = 64; e < 80; ++e) b.idx[80 + e] = (int32_t)(14 - e % 15);
  bad += bufs_run(&b, HOSTILE_PADDING, "a tile of -1, then rows", 0);
  for (int split = 0; split < 5; split += 4) { /* every row names nothing */
    bufs_new(&b, dt, dot, 3, 5, 5, 15, 40, split, 0, 0);
    bad += bufs_run(&b, HOSTILE_PADDING, "nothing named", 0);
  }
  return bad;
}

/* Rows 0 and 2 name row 7 (row 0 first, row 2 last), rows 1 and 3 never. */
static void name_row7(attn_bufs* b) {
  const int64_t topk = b->c.topk;
  for (int64_t i = 0; i < 4 * topk; ++i) b->idx[i] = (int32_t)(i % 7);
  b->idx[0] = 7, b->idx[3 * topk - 1] = 7;
}

static int hostile_nan(int dt, int dot) {
  int bad = 0;
  attn_bufs b;
  const int out_dts[3] = {dt, APP_DT_BF16, APP_DT_F16};
  for (int o = 0; o < 3; ++o) { /* NaN in a named row's rope part, stored as each dtype */
    if (o && out_dts[o] == dt) continue;
    bufs_new_out(&b, out_dts[o], dt, dot, 4, 5, 5, 15, 40, 0, 0, 0);
    name_row7(&b);
    kv_put(&b, 7, H_RANK + 3, NAN);
    bad += bufs_run(&b, HOSTILE_NAN, "a NaN in a named row's rope", 0);
  }
  bufs_new(&b, dt, dot, 4, 5, 5, 15, 40, 2, 0, 0); /* in its latent part, split */
  name_row7(&b);
  b.idx[0] = 0, b.idx[30] = 7; /* row 0 names it in its second part only */
  kv_put(&b, 7, 5, NAN);
  bad += bufs_run(&b, HOSTILE_NAN, "a NaN in a named row's latent, split", 0);
  bufs_new(&b, dt, dot, 4, 5, 5, 15, 40, 0, 0, 0); /* one query head */
  name_row7(&b);
  put(b.q, (1 * 5 + 2) * H_D + 7, NAN, dt);
  bad += bufs_run(&b, HOSTILE_NAN, "a NaN query head", 0);
  bufs_new(&b, dt, dot, 4, 5, 5, 15, 40, 3, 0, 0); /* a NaN query row naming nothing */
  name_row7(&b);
  for (int64_t e = 0; e < 40; ++e) b.idx[3 * 40 + e] = -1;
  for (int64_t k = 0; k < 5 * H_D; ++k) put(b.q, 3 * 5 * H_D + k, NAN, dt);
  bad += bufs_run(&b, HOSTILE_NAN, "a NaN query naming nothing", 0);
  bufs_new(&b, dt, dot, 3, 20, 5, 15, 70, 0, 0, 0); /* only NaN, then NaN after finite rows */
  for (int64_t e = 0; e < 70; ++e) b.idx[e] = 4, b.idx[70 + e] = (int32_t)(e % 4);
  for (int64_t e = 0; e < 70; ++e) b.idx[140 + e] = (int32_t)(e % 3);
  b.idx[70 + 69] = 4;
  kv_put(&b, 4, 0, NAN);
  bad += bufs_run(&b, HOSTILE_NAN, "a row naming only a NaN row, one naming it last", 0);
  bufs_new(&b, dt, dot, 4, 5, 5, 20, 33, 2, 16, 0); /* NaN wherever nothing names */
  for (int64_t i = 0; i < 4 * 33; ++i) b.idx[i] = (int32_t)((i * 7) % 20 < 10 ? (i * 7) % 20 : -1);
  for (int64_t i = 10; i < 20; ++i)
    for (int64_t k = 0; k < H_D; ++k) kv_put(&b, i, k, NAN);
  bad += bufs_run(&b, HOSTILE_NAN, "NaN in unnamed rows and the padding", 0);
  return bad;
}

static int hostile_aliasing(int dt, int dot) {
  int bad = 0;
  attn_bufs b;
  for (int same = 0; same < 2; ++same) { /* q read from kv's rows: t + h, or t for every head */
    bufs_new(&b, dt, dot, 3, 5, 1, 12, 20, same ? 2 : 0, 0, 0);
    for (int64_t i = 0; i < 3 * 20; ++i) b.idx[i] = (int32_t)((i * 5) % 12);
    b.c.q = b.kv, b.c.q_st = b.c.block_stride, b.c.q_sh = same ? 0 : b.c.block_stride;
    bad += bufs_run(&b, HOSTILE_ALIAS, same ? "heads sharing a q row of kv" : "q rows of kv", 0);
  }
  for (int layout = 1; layout < 3; ++layout) { /* back to back in one allocation */
    bufs_new(&b, dt, dot, 4, 5, 5, 15, 40, layout == 2 ? 3 : 0, 0, layout);
    minus_one_rows(&b);
    b.idx[4 * 40 - 1] = 14;
    bad += bufs_run(&b, HOSTILE_ALIAS, "inputs and outputs back to back", 0);
  }
  bufs_new(&b, dt, dot, 4, 20, 5, 15, 70, 2, 0, 0); /* one row for every entry of every query */
  for (int64_t i = 0; i < 4 * 70; ++i) b.idx[i] = 14;
  bad += bufs_run(&b, HOSTILE_ALIAS, "one row named by every entry", 0);
  return bad;
}

/* Top-k of rows holding non-finite scores: flagged and left alone; a clean row beside them
 * is still ordered. Scores of three rows of 50; row `poisoned` gets `x` at position 17. */
static int hostile_topk(float x, int poisoned) {
  float s[3 * 50];
  int32_t out[3 * 4], flags[3] = {7, 7, 7};
  uint32_t scratch[50];
  const int64_t count[3] = {50, 50, 50};
  for (int i = 0; i < 150; ++i) s[i] = (float)(i * 37 % 101);
  s[poisoned * 50 + 17] = x;
  for (int i = 0; i < 12; ++i) out[i] = -1;
  ++hostile_count[HOSTILE_NAN];
  int bad = mla_sparse_topk(s, 50, count, 0, 3, 4, out, 4, flags, scratch) != 0;
  for (int t = 0; t < 3 && !bad; ++t) {
    bad |= flags[t] != (t == poisoned);
    for (int k = 0; k < 4; ++k) /* a flagged row untouched, the others their best four */
      if (t == poisoned ? out[t * 4 + k] != -1 : out[t * 4 + k] < 0) bad = 1;
  }
  if (bad) printf("bad hostile top-k case: %g in row %d\n", (double)x, poisoned);
  return bad;
}

/* Every hostile case of one dtype path. */
static int sparse_hostile(int dt, int dot) {
  int bad = hostile_indices(dt, dot) + hostile_padding(dt, dot) + hostile_nan(dt, dot) +
            hostile_aliasing(dt, dot);
  for (int nan = 1; nan <= 2; ++nan, ++hostile_count[HOSTILE_NAN])
    bad += index_case(dt, dot, 9, 5, 18, 5, 45, 7, nan);
  return bad;
}

#endif /* ASAN_SPARSE_HOSTILE_H */
