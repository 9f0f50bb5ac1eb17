/* Prefetching for mla_decode_cpu.c: the cursor that deals the next chunk's lines out over
 * this chunk's q.k and p.v, how many calls it is dealt over, and the page touch for blocks of
 * 16. Included by mla_decode_cpu.c after its constants (G, BK, PR, QK_PF_STEPS). */
#ifndef MLA_DECODE_CPU_PREFETCH_H
#define MLA_DECODE_CPU_PREFETCH_H

/* Fetching the next chunk while this one computes. Pages are scattered (a hardware
 * prefetcher stops at every 4 KiB page, and prefetching only the first lines of each page
 * does not start it), so every line of the next chunk's rows is prefetched by hand. Issued
 * in bursts (the whole chunk at once, or a row per call) they fill the core's miss buffers
 * and stall the loads of the work they were meant to hide behind; so they are dealt out a
 * line or two at a time from the innermost loops of q.k (the dot path: every QK_PF_STEPS
 * steps of a scores tile; the float path: once per tile) and p.v (per key or key pair of a
 * tile). The cursor is copied into a local by each function that steps it, so it lives in
 * registers. Prefetches are hints and never fault; the rows
 * are those of keys the item reads anyway. */
typedef struct {
  const char* const* rows;   /* the next chunk's row pointers */
  int64_t n_rows, row_bytes; /* rows, and bytes per row rounded up to whole lines */
  int64_t r, per_call;       /* the row being issued (-1: none yet), lines per call */
  const char* p;             /* its next line */
  const char* end;           /* its end */
} pf_cursor;

static inline __attribute__((always_inline)) void pf_step(pf_cursor* c) {
  for (int64_t k = 0; k < c->per_call; ++k) {
    if (c->p >= c->end) {
      if (++c->r >= c->n_rows) {
        c->per_call = 0;
        return;
      }
      c->p = c->rows[c->r];
      c->end = c->p + c->row_bytes;
    }
    /* T0 (to L1): with the lines dealt evenly it measured 1.08-1.24x over T1 on 16 heads,
     * bf16 (the same on fp32 and 128 heads); when they went out in bursts it made no
     * difference. */
    _mm_prefetch(c->p, _MM_HINT_T0);
    c->p += 64;
  }
}

/* Whatever lines a cursor has not issued yet (its calls were fewer than planned). */
static inline void pf_finish(pf_cursor* c) {
  c->per_call = INT64_MAX;
  pf_step(c);
}

/* rows[j] = the cache row of key start + j (j < n): one division per chunk, not per key. */
static inline void row_pointers(const mla_decode_args* a, const int32_t* table, int64_t start,
                                int64_t n, int64_t es, const char** rows) {
  int64_t blk = start / a->block_size, off = start % a->block_size;
  for (int64_t j = 0; j < n; ++j) {
    rows[j] = (const char*)a->cache + ((int64_t)table[blk] * a->block_stride +
                                       off * a->row_stride) * es;
    if (++off == a->block_size) off = 0, ++blk;
  }
}

/* How often a chunk of n keys calls pf_step() (see its call sites), so that the next chunk's
 * lines are dealt evenly over it: per group of G rows, QK_PF_STEPS-th step of 32 dims of
 * each scores tile of 4 keys x 4 rows on the dot path (once per tile otherwise), and one per
 * key pair (dot path) or key of each p.v tile. */
static int64_t prefetch_calls(int64_t rows_m, int64_t n, int64_t rank, int64_t d, int dot) {
  int64_t calls = 0;
  const int64_t qk_steps = (d / 32 + QK_PF_STEPS - 1) / QK_PF_STEPS;
  for (int64_t g0 = 0; g0 < rows_m; g0 += G) {
    const int64_t valid = rows_m - g0 < G ? rows_m - g0 : G;
    const int64_t tiles = rank / 64 * ((valid + PR - 1) / PR);
    calls += dot ? (n + 3) / 4 * ((valid + 3) / 4) * qk_steps + tiles * (n / 2)
                 : (n + 3) / 4 * ((valid + 3) / 4) + tiles * n;
  }
  return calls > 0 ? calls : 1;
}

/* far[] = the rows of keys [start, start + n) (n <= BK), and one prefetch per 4 KiB page of
 * them, for a chunk two ahead when a chunk spans four or more cache blocks (blocks of 16
 * tokens, vLLM's): its pages are scattered, and touching each a chunk before its lines are
 * fetched measured 1.02-1.035x on 16x8k and 64x4k at 16 heads, bf16, block 16 (40 paired
 * rounds, the L3 flushed between calls); with blocks of 32 no change, with one block per
 * chunk (64) 0.97x, so it is off there. */
static inline __attribute__((always_inline)) void touch_pages_ahead(
    const mla_decode_args* a, const int32_t* table, int64_t start, int64_t n, int64_t es,
    const char** far) {
  row_pointers(a, table, start, n, es, far);
  uintptr_t last = 0;
  for (int64_t r = 0; r < n; ++r) {
    const uintptr_t page = (uintptr_t)far[r] >> 12;
    if (page != last) {
      _mm_prefetch(far[r], _MM_HINT_T1);
      last = page;
    }
  }
}

#endif /* MLA_DECODE_CPU_PREFETCH_H */
