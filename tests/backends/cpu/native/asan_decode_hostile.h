/* The hostile cases of asan_decode_driver.c (included by it, after dec_call, dec_launch and
 * dec_check): what mla_decode_cpu.h says a caller may hand the decode kernel, at its edges,
 * and what it says is refused; run on the FP8 caches (fp8_e4m3, fp8_ds_mla; float and dot
 * path) and a bf16 one (the AMX kernel's build runs the bf16 ones only).
 *
 * - hostile indices: the first and the last block of the cache (the last one ends its
 *   allocation); block ids out of range (num_blocks, -1, INT32_MIN, INT32_MAX) among the
 *   blocks a request reads, a seq_len below qlen, items out of range: refused, nothing
 *   written;
 * - -1 rows: table entries past a request's last block holding -1, INT32_MIN, INT32_MAX
 *   (never read), rows padded apart with NaN, rows only byte-aligned (an odd row stride);
 * - NaN rows: an e4m3 NaN (0x7F, 0xFF) or a bf16 NaN in a key's latent or rope part, seen by
 *   every row of one request or only by the last query row (causal), a NaN in one q head:
 *   exactly the rows that see it come out NaN; fp8_ds_mla's per-tile scales NaN, +inf, 0,
 *   -0, negative, subnormal, at and past the edges of the table look-ups (2^-117, 2^-118,
 *   2^119, 2^120: the two-step multiply); every e4m3 code in the cache;
 * - aliasing: requests sharing blocks, one block named by every entry of a table, q heads
 *   and rows sharing one vector, q stored in the cache's own allocation (a block no table
 *   names), the inputs and the outputs back to back in one allocation.
 * Every unread byte of the cache is 0xFF (NaN in every layout); outputs start as 0x7B bytes
 * (finite in every dtype: an output left unwritten never passes for a NaN one); every case
 * checks its inputs are unchanged after the call. */
#ifndef ASAN_DECODE_HOSTILE_H
#define ASAN_DECODE_HOSTILE_H

#define DH_UNWRITTEN 0x7B

/* One hostile problem's buffers (one allocation each at exactly its size, or all of them back
 * to back in one) and copies of its inputs. */
typedef struct {
  dec_call c;
  char *block, *cache;
  void *q, *out, *copy;
  int32_t *table, *seq;
  float* lse;
  int64_t need[2];
  size_t bytes[6]; /* cache, q, table, seq, out, lse */
} dec_bufs;

static size_t round4(size_t n) { return (n + 3) / 4 * 4; }

/* batch (<= 2) requests of lens[b] keys, qlen query rows of heads heads (rank, rope 64), in
 * blocks of bs with `spare` blocks no table names; rows row_bytes + pad units apart (bytes for
 * FP8, elements else) and blocks pad more; q of qdt, out of qdt; split key ranges; layout 1:
 * every buffer in one allocation. The table's entries past each request's blocks are -7. */
static void dh_new(dec_bufs* b, int dt, int qdt, int dot, int64_t batch, int64_t qlen,
                   int64_t heads, int64_t rank, int64_t bs, const int64_t* lens, int split,
                   int64_t pad, int64_t spare, int layout) {
  memset(b, 0, sizeof *b);
  const int64_t rope = 64, d = rank + rope, qes = app_native_elem_size(qdt);
  const int64_t unit = is_fp8(dt) ? 1 : app_native_elem_size(dt);
  const int64_t row_stride = (is_fp8(dt) ? row_bytes(dt, rank, rope) : d) + pad;
  const int64_t block_stride = bs * row_stride + pad;
  int64_t blocks = spare, width = 1;
  for (int64_t r = 0; r < batch; ++r) {
    b->need[r] = (lens[r] + bs - 1) / bs;
    blocks += b->need[r];
    width = b->need[r] + 2 > width ? b->need[r] + 2 : width;
  }
  const size_t sizes[6] = {(size_t)(blocks * block_stride * unit),
                           (size_t)(batch * qlen * heads * d * qes),
                           sizeof(int32_t) * (size_t)(batch * width),
                           sizeof(int32_t) * (size_t)batch,
                           (size_t)(batch * qlen * heads * rank * qes),
                           sizeof(float) * (size_t)(batch * qlen * heads)};
  void* p[6];
  if (layout == 0) {
    for (int k = 0; k < 6; ++k) p[k] = malloc(b->bytes[k] = sizes[k]);
  } else { /* cache | out | table | q | lse | seq */
    const int order[6] = {0, 4, 2, 1, 5, 3};
    size_t total = 0;
    for (int k = 0; k < 6; ++k) total += b->bytes[k] = round4(sizes[k]);
    char* at = b->block = malloc(total);
    for (int k = 0; k < 6; ++k) p[order[k]] = at, at += b->bytes[order[k]];
  }
  b->cache = p[0], b->q = p[1], b->table = p[2], b->seq = p[3], b->out = p[4], b->lse = p[5];
  memset(b->cache, 0xFF, b->bytes[0]); /* NaN wherever no request reads */
  int64_t next = blocks; /* blocks handed out in reverse; the spare ones are the lowest */
  for (int64_t r = 0; r < batch; ++r) {
    b->seq[r] = (int32_t)lens[r];
    for (int64_t j = 0; j < width; ++j)
      b->table[r * width + j] = j < b->need[r] ? (int32_t)--next : -7;
  }
  for (int64_t i = 0; i < (int64_t)(batch * qlen * heads * d); ++i) put(b->q, i, uniform(), qdt);
  memset(b->out, DH_UNWRITTEN, b->bytes[4]), memset(b->lse, DH_UNWRITTEN, b->bytes[5]);
  const dec_call c = {
      .dt = dt, .qdt = qdt, .out_dt = qdt, .dot = dot, .split = split, .batch = batch,
      .qlen = qlen, .heads = heads, .rank = rank, .rope = rope, .bs = bs, .width = width,
      .num_blocks = blocks, .row_stride = row_stride, .block_stride = block_stride,
      .q_sb = qlen * heads * d, .q_si = heads * d, .q_sh = d, .cache = b->cache, .q = b->q,
      .table = b->table, .seq = b->seq, .out = b->out, .lse = b->lse};
  b->c = c;
  for (int64_t r = 0; r < batch; ++r) /* every row a request reads: random */
    for (int64_t t = 0; t < lens[r]; ++t) fill_row((char*)key_row(&b->c, r, t), dt, rank, rope);
}

/* The stored row of request r's key t, to write. */
static char* dh_row(dec_bufs* b, int64_t r, int64_t t) { return (char*)key_row(&b->c, r, t); }

/* A NaN at value k of request r's key t: an e4m3 NaN (byte `nan`) in an FP8 latent, a bf16
 * one in fp8_ds_mla's rope, the dtype's own elsewhere. */
static void dh_nan(dec_bufs* b, int64_t r, int64_t t, int64_t k, uint8_t nan) {
  char* row = dh_row(b, r, t);
  const int64_t rank = b->c.rank;
  if (b->c.dt == MLA_CACHE_FP8_DS_MLA && k >= rank) {
    const uint16_t h = nan & 0x80 ? 0xFFC0 : 0x7FC0;
    memcpy(row + rank + 4 * (rank / 128) + 2 * (k - rank), &h, sizeof h);
  } else if (is_fp8(b->c.dt)) {
    row[k] = (char)nan;
  } else {
    put(row, k, NAN, b->c.dt);
  }
}

/* Launch with copies of the inputs kept; whether it returned `want` (0: results as the
 * reference; else refused, out and lse untouched) and left its inputs as they were. */
static int dh_run(dec_bufs* b, int kind, const char* what, int want) {
  ++hostile_count[kind];
  const size_t in = b->bytes[0] + b->bytes[1] + b->bytes[2] + b->bytes[3];
  char* copy = malloc(in);
  void* inputs[4] = {b->cache, b->q, b->table, b->seq};
  for (size_t k = 0, at = 0; k < 4; at += b->bytes[k++]) memcpy(copy + at, inputs[k], b->bytes[k]);
  const int rc = dec_launch(&b->c);
  int bad = rc != want;
  if (!bad && want == 0) bad = dec_check(&b->c);
  if (!bad && want != 0)
    bad = !bytes_are(b->out, b->bytes[4], DH_UNWRITTEN) ||
          !bytes_are(b->lse, b->bytes[5], DH_UNWRITTEN);
  for (size_t k = 0, at = 0; k < 4; at += b->bytes[k++])
    bad |= memcmp(copy + at, inputs[k], b->bytes[k]) != 0;
  if (bad)
    printf("bad hostile decode case (%s): cache %d q %d dot %d split %d: returned %d\n", what,
           b->c.dt, b->c.qdt, b->c.dot, b->c.split, rc);
  free(copy);
  if (b->block) free(b->block);
  else free(b->cache), free(b->q), free(b->table), free(b->seq), free(b->out), free(b->lse);
  return bad;
}

static const int64_t dh_lens[2] = {33, 7};

static int dh_indices(int dt, int qdt, int dot) {
  int bad = 0;
  dec_bufs b;
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 0, 0);
  bad += dh_run(&b, HOSTILE_INDEX, "blocks 0 .. num_blocks - 1", 0);
  const int32_t outside[4] = {0, -1, INT32_MIN, INT32_MAX};
  for (int v = 0; v < 4; ++v) { /* a block read out of range: request 0's first, 1's last */
    dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, v % 2 ? 2 : 1, 0, 0, 0);
    b.table[v % 2 ? b.c.width + b.need[1] - 1 : 0] = v ? outside[v] : (int32_t)b.c.num_blocks;
    bad += dh_run(&b, HOSTILE_INDEX, "a block id out of range", 1);
  }
  dh_new(&b, dt, qdt, dot, 2, 4, 3, 128, 5, dh_lens, 1, 0, 0, 0);
  b.seq[1] = 3; /* below qlen */
  bad += dh_run(&b, HOSTILE_INDEX, "a seq_len below qlen", 1);
  const int64_t items[4][4] = {{2, 0, 7, -1}, {1, 0, 8, -1}, {0, 3, 2, -1}, {0, -1, 33, -1}};
  for (int k = 0; k < 4; ++k) {
    dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 1, 0, 0, 0);
    b.c.items = items[k], b.c.n_items = 1;
    bad += dh_run(&b, HOSTILE_INDEX, "an item out of range", 1);
  }
  return bad;
}

static int dh_padding(int dt, int qdt, int dot) {
  int bad = 0;
  dec_bufs b;
  const int32_t past[3] = {-1, INT32_MIN, INT32_MAX};
  for (int v = 0; v < 3; ++v) { /* never read: past the last block, and two spare blocks */
    dh_new(&b, dt, qdt, dot, 2, 3, 5, 128, 4, dh_lens, v == 1 ? 3 : 1, 0, 2, 0);
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t j = b.need[r]; j < b.c.width; ++j) b.table[r * b.c.width + j] = past[v];
    bad += dh_run(&b, HOSTILE_PADDING, "table entries past the end", 0);
  }
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 16, 0, 0); /* NaN between rows */
  bad += dh_run(&b, HOSTILE_PADDING, "rows padded with NaN", 0);
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 1, 1, 1, 0); /* an odd row stride */
  bad += dh_run(&b, HOSTILE_PADDING, "rows one unit apart", 0);
  return bad;
}

/* fp8_ds_mla: tile 0 of request 0's key 4 (seen by every row) holding every positive e4m3
 * code up to `most` (0x7E: 448; 0x77: 240, where 448 times the scale would not be a float)
 * and -most, scaled by `scale`; q's first 128 values zero where the scale's products would
 * overflow float32 in q . k. */
static int dh_scale(int qdt, int dot, float scale, int zero_q, int most) {
  dec_bufs b;
  dh_new(&b, MLA_CACHE_FP8_DS_MLA, qdt, dot, 2, 2, 3, 256, 5, dh_lens, 2, 0, 0, 0);
  for (int k = 0; k < 128; ++k) dh_row(&b, 0, 4)[k] = (char)(k < most ? k : most);
  dh_row(&b, 0, 4)[127] = (char)(0x80 | most);
  memcpy(dh_row(&b, 0, 4) + 256, &scale, sizeof scale);
  for (int64_t i = 0; zero_q && i < 2 * 2 * 3; ++i)
    for (int64_t k = 0; k < 128; ++k) put(b.q, i * 320 + k, 0.f, qdt);
  b.c.tol_scale = -1; /* each column against its largest value */
  return dh_run(&b, HOSTILE_NAN, "an fp8_ds_mla scale", 0);
}

static int dh_nan_rows(int dt, int qdt, int dot) {
  int bad = 0;
  dec_bufs b;
  dh_new(&b, dt, qdt, dot, 2, 3, 3, 128, 5, dh_lens, 1, 0, 0, 0); /* the last row only */
  dh_nan(&b, 0, 32, 3, 0x7F);
  bad += dh_run(&b, HOSTILE_NAN, "a NaN in the key only the last row sees", 0);
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 0, 0); /* every row of request 1 */
  dh_nan(&b, 1, 0, 100, 0xFF);
  bad += dh_run(&b, HOSTILE_NAN, "a NaN in a key every row sees", 0);
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 0, 0); /* in the rope */
  dh_nan(&b, 0, 10, 128 + 5, 0x7F);
  bad += dh_run(&b, HOSTILE_NAN, "a NaN in a key's rope", 0);
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 0, 0); /* one q head */
  put(b.q, ((0 * 2 + 1) * 3 + 2) * 192 + 9, NAN, qdt);
  bad += dh_run(&b, HOSTILE_NAN, "a NaN q head", 0);
  if (is_fp8(dt)) { /* every e4m3 code but the NaNs, q small enough for finite scores */
    dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 0, 0);
    for (int64_t r = 0, code = 0; r < 2; ++r)
      for (int64_t t = 0; t < dh_lens[r]; ++t)
        for (int64_t k = 0; k < (dt == MLA_CACHE_FP8_DS_MLA ? 128 : 192); ++k, ++code)
          dh_row(&b, r, t)[k] = (char)((code & 0x7F) == 0x7F ? 0 : code & 0xFF);
    for (int64_t i = 0; i < 2 * 2 * 3 * 192; ++i)
      put(b.q, i, (float)get(b.q, i, qdt) / 256, qdt);
    b.c.tol_scale = -1;
    bad += dh_run(&b, HOSTILE_NAN, "every e4m3 code", 0);
  }
  if (dt != MLA_CACHE_FP8_DS_MLA) return bad;
  const float scales[10] = {NAN, INFINITY, 0.f, -0.f, -0.5f, 0x1p-140f, 0x1p-117f, 0x1p-118f,
                            0x1p119f, 0x1p120f};
  for (int k = 0; k < 10; ++k)
    bad += dh_scale(qdt, dot, scales[k], k >= 8, k == 9 ? 0x77 : 0x7E);
  return bad;
}

static int dh_aliasing(int dt, int qdt, int dot) {
  int bad = 0;
  dec_bufs b;
  const int64_t same[2] = {23, 23};
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, same, 2, 0, 0, 0); /* request 1 reads 0's blocks */
  for (int64_t j = 0; j < b.c.width; ++j) b.table[b.c.width + j] = b.table[j];
  bad += dh_run(&b, HOSTILE_ALIAS, "requests sharing blocks", 0);
  const int64_t lens[2] = {30, 7};
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 8, lens, 2, 0, 0, 0); /* one block, every entry */
  for (int64_t j = 1; j < b.need[0]; ++j) b.table[j] = b.table[0];
  bad += dh_run(&b, HOSTILE_ALIAS, "one block named by every entry", 0);
  dh_new(&b, dt, qdt, dot, 2, 3, 4, 128, 5, dh_lens, 2, 0, 0, 0); /* q rows and heads shared */
  b.c.q_si = 0, b.c.q_sh = 0;
  bad += dh_run(&b, HOSTILE_ALIAS, "q rows and heads sharing one vector", 0);
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 12, 0); /* q in spare blocks */
  for (int64_t i = 0; i < 2 * 2 * 3 * 192; ++i)
    put(b.cache, i, (float)get(b.q, i, qdt), qdt);
  b.c.q = b.cache;
  bad += dh_run(&b, HOSTILE_ALIAS, "q stored in the cache's allocation", 0);
  dh_new(&b, dt, qdt, dot, 2, 2, 3, 128, 5, dh_lens, 2, 0, 0, 1);
  bad += dh_run(&b, HOSTILE_ALIAS, "inputs and outputs back to back", 0);
  return bad;
}

/* Every hostile case of one path: cache dtype, q (and out) dtype, dot products. */
static int decode_hostile(int dt, int qdt, int dot) {
  return dh_indices(dt, qdt, dot) + dh_padding(dt, qdt, dot) + dh_nan_rows(dt, qdt, dot) +
         dh_aliasing(dt, qdt, dot);
}

#endif /* ASAN_DECODE_HOSTILE_H */
