/* mla_decode_cpu_run_shares and the OpenMP probes, shared by mla_decode_cpu.c and
 * mla_decode_amx.c (the same exported functions over either kernel's mla_decode_cpu_run).
 * Included after shape_ok and mla_decode_cpu_run. */
#ifndef MLA_DECODE_CPU_SHARES_H
#define MLA_DECODE_CPU_SHARES_H

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
      threads < 1)
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
