/* The MLA prefill kernel's argument struct (mla_prefill_cpu.c), mirrored by MlaPrefillArgs in
 * app/backends/cpu/prefill_kernel.py; the loader checks the two layouts agree at load. */
#ifndef MLA_PREFILL_CPU_H
#define MLA_PREFILL_CPU_H

#include "app_native.h"

/* Bump on any change to this struct or to an exported function of mla_prefill_cpu.c. */
#define MLA_PREFILL_CPU_ABI 2

/* One worker's share of a ragged batch. Strides are in elements: q [tokens, heads, d] with
 * strides (q_row, q_head, 1), likewise k, v (dv columns) and out; lse [heads, tokens] float32
 * with strides (lse_head, 1). Request b is q rows q_start[b] .. + q_len[b] against k/v rows
 * kv_start[b] .. + kv_len[b]; items[2 i] is a request and items[2 i + 1] a head, for
 * i < n_items. in_dt: q/k/v's element type, out_dt: out's (APP_DT_*). causal: bottom-right.
 * scratch: mla_prefill_cpu_scratch_floats() floats for the share's largest request. */
#define MLA_PREFILL_ARGS(X)                                                              \
  X(const void*, q) X(const void*, k) X(const void*, v) X(void*, out) X(float*, lse)      \
  X(const int64_t*, q_start) X(const int64_t*, q_len) X(const int64_t*, kv_start)         \
  X(const int64_t*, kv_len) X(const int64_t*, items) X(float*, scratch)                   \
  X(int64_t, q_row) X(int64_t, q_head) X(int64_t, k_row) X(int64_t, k_head)               \
  X(int64_t, v_row) X(int64_t, v_head) X(int64_t, o_row) X(int64_t, o_head)               \
  X(int64_t, lse_head) X(int64_t, n_items) X(int64_t, d) X(int64_t, dv)                   \
  X(int32_t, in_dt) X(int32_t, out_dt) X(int32_t, causal) X(float, scale)

APP_NATIVE_STRUCT(mla_prefill_args, MLA_PREFILL_ARGS)

/* 0 when done; 1 (nothing written) for an unknown element type or dv not a multiple of 64. */
APP_NATIVE_EXPORT int32_t mla_prefill_cpu_attend(const mla_prefill_args* a);
/* Scratch floats one (request, head) of these sizes needs. */
APP_NATIVE_EXPORT int64_t mla_prefill_cpu_scratch_floats(int64_t q_len, int64_t kv_len,
                                                         int64_t d, int64_t dv);

#endif /* MLA_PREFILL_CPU_H */
