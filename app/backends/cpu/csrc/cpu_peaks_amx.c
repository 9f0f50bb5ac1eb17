/* The AMX-BF16 peak of one core: TDPBF16PS into 6 independent accumulator tiles (C tiles 0-5,
 * A and B tiles 6 and 7 loaded once), a loop held in the tiles like cpu_peaks.c's register
 * loops. Built by app/backends/cpu/amx_probe.py with -mamx-tile -mamx-bf16, loaded and called
 * only where the CPU has AMX and Linux granted the tile state, after its self-test passed in
 * a child process (as the AMX decode kernel); the same source with -DAPP_AMX_EMULATE runs the
 * tile operations in C (amx_tiles.h), for the tests on any CPU. One TDPBF16PS on 16 x 16
 * tiles of 16 bf16 pairs each is 16 x 16 x 32 x 2 = 16384 FLOPs; 6 chains cover its latency. */
#include <stdint.h>

#include "amx_tiles.h"
#include "app_native.h"

/* Bump on any change to an exported function's signature or meaning (amx_probe.ABI_VERSION). */
APP_NATIVE_LIBRARY(1)

#define TDP_FLOPS (16 * 16 * 32 * 2)

APP_NATIVE_EXPORT int64_t cpu_peak_amx_bf16_flops_per_iter(void) { return 6 * TDP_FLOPS; }

/* iters x 6 TDPBF16PS; `bits` is the bf16 pair in every 32-bit element of A and B. Returns
 * element [0][0] of accumulator 0 (iters * 32 * a * b for a bf16 pair (a, a)). */
APP_NATIVE_EXPORT float cpu_peak_amx_bf16(int64_t iters, uint32_t bits) {
  amx_tile_config cfg;
  amx_full_config(&cfg);
  uint32_t operand[256], result[256];
  for (int i = 0; i < 256; ++i) operand[i] = bits;
  AMX_CONFIGURE(&cfg);
  AMX_LOAD(6, operand, 64);
  AMX_LOAD(7, operand, 64);
  AMX_ZERO(0);
  AMX_ZERO(1);
  AMX_ZERO(2);
  AMX_ZERO(3);
  AMX_ZERO(4);
  AMX_ZERO(5);
  for (int64_t it = 0; it < iters; ++it) {
    AMX_DPBF16(0, 6, 7);
    AMX_DPBF16(1, 6, 7);
    AMX_DPBF16(2, 6, 7);
    AMX_DPBF16(3, 6, 7);
    AMX_DPBF16(4, 6, 7);
    AMX_DPBF16(5, 6, 7);
  }
  AMX_STORE(0, result, 64);
  AMX_RELEASE();
  float out;
  __builtin_memcpy(&out, result, sizeof out);
  return out;
}

/* 1 for the build with emulated tiles; tile operations the hardware would refuse (#GP/#UD). */
APP_NATIVE_EXPORT int32_t cpu_peak_amx_emulated(void) { return AMX_EMULATED; }
APP_NATIVE_EXPORT int64_t cpu_peak_amx_faults(void) { return amx_emu_faults(); }
