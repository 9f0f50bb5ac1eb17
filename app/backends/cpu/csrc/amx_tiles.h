/* AMX tile operations for the kernels under app/backends/cpu/csrc/ (mla_decode_amx.c,
 * cpu_peaks_amx.c): the instructions themselves (a build with -mamx-tile -mamx-bf16), or,
 * with -DAPP_AMX_EMULATE, an emulation of them in plain C that runs on any x86-64 CPU.
 *
 * Why an emulation: an AMX kernel written on a machine without AMX cannot be run there, and
 * no AMX emulator is at hand (Intel SDE is not installed; QEMU's TCG has no AMX). The kernel
 * is therefore written against these macros only, and the same source is built twice: with
 * the instructions (run only where the CPU has AMX and Linux granted the tile state, after a
 * float64 self-test in a child process) and with this emulation (run by the test suite
 * everywhere, against float64, and under AddressSanitizer). The emulation follows Intel's
 * pseudocode (SDM vol. 2, LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBF16PS):
 *
 * - LDTILECFG: palette 1, start_row 0, reserved bytes 0, for each tile rows <= 16 and
 *   colsb <= 64 (both 0 or both non-zero), tiles 8..15 unused; otherwise #GP.
 * - TILELOADD t, [base + stride]: rows[t] rows of colsb[t] bytes from base + r * stride; the
 *   rest of the register zero. TILESTORED: the same rows written back.
 * - TDPBF16PS c, a, b: for m < rows[c], k < colsb[a] / 4, n < colsb[c] / 4:
 *   c[m][n] += fp32(a[m].bf16[2k]) * fp32(b[k].bf16[2n]) then += the odd pair; bf16 inputs
 *   that are denormal read as 0 (DAZ), fp32 results that are denormal are flushed to 0
 *   (FTZ), round to nearest even; #UD unless c, a and b are distinct, rows[c] == rows[a],
 *   colsb[c] == colsb[b], colsb[a] / 4 == rows[b] and every tile is configured.
 *
 * Every condition that would be a #GP or #UD on the hardware (which kills the process with
 * SIGSEGV / SIGILL) is counted instead (amx_emu_faults()): the tests require zero, so a
 * kernel that passes them configures and uses its tiles as the instructions demand. What the
 * emulation cannot prove is that the instructions behave as the SDM says; the child-process
 * self-test on an AMX machine is what checks that.
 */
#ifndef APP_AMX_TILES_H
#define APP_AMX_TILES_H

#include <stdint.h>
#include <string.h>

/* The 64-byte operand of LDTILECFG (palette 1: 8 tiles of up to 16 rows x 64 bytes). */
typedef struct amx_tile_config {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_tile_config;

/* Every one of the 8 tiles as 16 rows x 64 bytes (the only shape the kernels use). */
static inline void amx_full_config(amx_tile_config* cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg->rows[t] = 16;
    cfg->colsb[t] = 64;
  }
}

#ifdef APP_AMX_EMULATE

typedef struct amx_emu_state {
  int configured;
  uint8_t rows[8];
  uint16_t colsb[8];
  uint8_t data[8][16][64];
} amx_emu_state;

static __thread amx_emu_state amx_emu;
static int64_t amx_emu_fault_count;

static inline void amx_emu_fault(void) { __atomic_add_fetch(&amx_emu_fault_count, 1, __ATOMIC_RELAXED); }

static inline int amx_emu_tile_ok(int t) {
  if (!amx_emu.configured || t < 0 || t > 7 || amx_emu.rows[t] == 0) {
    amx_emu_fault();
    return 0;
  }
  return 1;
}

static inline void amx_emu_config(const amx_tile_config* cfg) {
  int ok = cfg->palette_id == 1 && cfg->start_row == 0;
  for (int i = 0; i < 14; ++i) ok = ok && cfg->reserved[i] == 0;
  for (int t = 0; t < 16; ++t) {
    const int used = cfg->rows[t] != 0 || cfg->colsb[t] != 0;
    if (!used) continue;
    ok = ok && t < 8 && cfg->rows[t] != 0 && cfg->colsb[t] != 0 && cfg->rows[t] <= 16 &&
         cfg->colsb[t] <= 64;
  }
  if (!ok) {
    amx_emu_fault();
    amx_emu.configured = 0;
    return;
  }
  memset(&amx_emu, 0, sizeof amx_emu);
  amx_emu.configured = 1;
  for (int t = 0; t < 8; ++t) {
    amx_emu.rows[t] = cfg->rows[t];
    amx_emu.colsb[t] = cfg->colsb[t];
  }
}

static inline void amx_emu_release(void) { memset(&amx_emu, 0, sizeof amx_emu); }

static inline void amx_emu_zero(int t) {
  if (amx_emu_tile_ok(t)) memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
}

static inline void amx_emu_load(int t, const void* base, int64_t stride) {
  if (!amx_emu_tile_ok(t)) return;
  memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
  for (int r = 0; r < amx_emu.rows[t]; ++r)
    memcpy(amx_emu.data[t][r], (const char*)base + r * stride, amx_emu.colsb[t]);
}

static inline void amx_emu_store(int t, void* base, int64_t stride) {
  if (!amx_emu_tile_ok(t)) return;
  for (int r = 0; r < amx_emu.rows[t]; ++r)
    memcpy((char*)base + r * stride, amx_emu.data[t][r], amx_emu.colsb[t]);
}

/* A bf16 value as float32, a denormal read as a signed zero (DAZ). */
static inline float amx_emu_bf16(const uint8_t* p) {
  uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* x with a denormal result flushed to a signed zero (FTZ). */
static inline float amx_emu_ftz(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  memcpy(&x, &bits, sizeof x);
  return x;
}

static inline void amx_emu_dpbf16(int c, int a, int b) {
  if (!amx_emu_tile_ok(c) || !amx_emu_tile_ok(a) || !amx_emu_tile_ok(b)) return;
  if (c == a || c == b || a == b || amx_emu.rows[c] != amx_emu.rows[a] ||
      amx_emu.colsb[c] != amx_emu.colsb[b] || amx_emu.colsb[a] % 4 != 0 ||
      amx_emu.colsb[a] / 4 != amx_emu.rows[b] || amx_emu.colsb[c] % 4 != 0) {
    amx_emu_fault();
    return;
  }
  const int rows = amx_emu.rows[c], ks = amx_emu.colsb[a] / 4, ns = amx_emu.colsb[c] / 4;
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < ns; ++n) {
      float acc;
      memcpy(&acc, amx_emu.data[c][m] + 4 * n, sizeof acc);
      for (int k = 0; k < ks; ++k) {
        const uint8_t* ar = amx_emu.data[a][m] + 4 * k;
        const uint8_t* br = amx_emu.data[b][k] + 4 * n;
        acc = amx_emu_ftz(acc + amx_emu_bf16(ar) * amx_emu_bf16(br));
        acc = amx_emu_ftz(acc + amx_emu_bf16(ar + 2) * amx_emu_bf16(br + 2));
      }
      memcpy(amx_emu.data[c][m] + 4 * n, &acc, sizeof acc);
    }
}

#define AMX_CONFIGURE(cfg) amx_emu_config(cfg)
#define AMX_RELEASE() amx_emu_release()
#define AMX_ZERO(t) amx_emu_zero(t)
#define AMX_LOAD(t, base, stride) amx_emu_load((t), (base), (int64_t)(stride))
#define AMX_STORE(t, base, stride) amx_emu_store((t), (base), (int64_t)(stride))
#define AMX_DPBF16(c, a, b) amx_emu_dpbf16((c), (a), (b))
#define AMX_EMULATED 1
/* Conditions the hardware would have faulted on, since the library was loaded. */
static inline int64_t amx_emu_faults(void) {
  return __atomic_load_n(&amx_emu_fault_count, __ATOMIC_RELAXED);
}

#else /* the instructions: built with -mamx-tile -mamx-bf16 */

#include <immintrin.h>

#define AMX_CONFIGURE(cfg) _tile_loadconfig(cfg)
#define AMX_RELEASE() _tile_release()
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, base, stride) _tile_loadd(t, (base), (long)(stride))
#define AMX_STORE(t, base, stride) _tile_stored(t, (base), (long)(stride))
#define AMX_DPBF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_EMULATED 0
static inline int64_t amx_emu_faults(void) { return 0; }

#endif /* APP_AMX_EMULATE */

#endif /* APP_AMX_TILES_H */
