/* mla_decode_cpu_run_shares, the OpenMP probes and items_ok, shared by mla_decode_cpu.c and
 * mla_decode_amx.c (the same exported functions over either kernel's mla_decode_cpu_run).
 * Included after shape_ok, before mla_decode_cpu_run (which calls items_ok). */
#ifndef MLA_DECODE_CPU_SHARES_H
#define MLA_DECODE_CPU_SHARES_H

/* Whether the n items at `items` read only what the call holds (mla_decode_cpu.h): request b
 * in [0, batch) with seq_lens[b] >= qlen, keys 0 <= first <= end <= seq_lens[b], and the block
 * ids of those keys in [0, num_blocks). Checked before anything is written, so that a refused
 * call writes nothing: one read per block an item reads, against the item's work of
 * qlen * heads * D per key. The Python side checks the same on a private copy of the table
 * (app/backends/decode/metadata.py); this keeps a bad call from reading outside the cache. */
static int items_ok(const mla_decode_args* a, const int64_t* items, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t* it = items + 4 * t;
    const int64_t b = it[0], k0 = it[1], k1 = it[2];
    if (b < 0 || b >= a->batch) return 0;
    const int64_t seq_len = a->seq_lens[b];
    if (seq_len < a->qlen || k0 < 0 || k0 > k1 || k1 > seq_len) return 0;
    const int32_t* table = a->block_table + b * a->bt_stride;
    for (int64_t blk = k0 / a->block_size; k1 > k0 && blk <= (k1 - 1) / a->block_size; ++blk)
      if (table[blk] < 0 || table[blk] >= a->num_blocks) return 0;
  }
  return 1;
}

/* The shares of one call at once, on the calling thread's OpenMP team (built with -fopenmp:
 * the team torch's own ops run on, whose threads are awake right after a torch op; without
 * OpenMP, one after the other). a->items holds every share's items back to back, share s
 * being items [share_end[s - 1], share_end[s]) (share_end[-1] = 0); a->scratch holds
 * n_shares buffers of scratch_stride floats each (a multiple of 16). The team has at most
 * `threads` threads and takes the shares in turn, so a smaller team (nested inside another
 * region, a thread limit) still does them all; returns once every share is done. */
int32_t mla_decode_cpu_run_shares(const mla_decode_args* a, const int64_t* share_end,
                                  int64_t n_shares, int64_t scratch_stride, int32_t threads) {
  if (!shape_ok(a) || n_shares < 0 || scratch_stride < 0 || scratch_stride % 16 ||
      threads < 1 || !items_ok(a, a->items, a->n_items))
    return 1;
  for (int64_t s = 0; s < n_shares; ++s)
    if (share_end[s] < (s ? share_end[s - 1] : 0) || share_end[s] > a->n_items) return 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n_shares > 1)
  for (int64_t s = 0; s < n_shares; ++s) {
    mla_decode_args mine = *a;
    const int64_t first = s ? share_end[s - 1] : 0;
    mine.items = a->items + 4 * first;
    mine.n_items = share_end[s] - first;
    mine.scratch = a->scratch + s * scratch_stride;
    mla_decode_cpu_run(&mine);
  }
  return 0;
}

/* 1 when built with OpenMP (mla_decode_cpu_run_shares runs its shares in parallel). */
int32_t mla_decode_cpu_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

/* The address of omp_get_max_threads in the OpenMP runtime this library is bound to (NULL
 * without OpenMP): the loader checks it is the runtime torch loaded, not a second one. */
const void* mla_decode_cpu_openmp_runtime(void) {
#ifdef _OPENMP
  return (const void*)&omp_get_max_threads;
#else
  return NULL;
#endif
}

#endif /* MLA_DECODE_CPU_SHARES_H */
