/* MLA decode over a paged latent cache on AMX tiles (bf16 cache and q, float32 sums).
 *
 * The same interface as mla_decode_cpu.c (its argument struct and exported functions, from
 * mla_decode_cpu.h), so app/backends/cpu/decode_kernel.py's wrapper runs either library; the
 * Python side sends only bf16 caches with a bf16 q here (anything else: refused, 1). Built by
 * app/backends/cpu/decode_kernel_amx.py twice: with the AMX instructions (-mamx-tile
 * -mamx-bf16: loaded only on a CPU with amx_tile and amx_bf16, after Linux granted the tile
 * state and a float64 self-test passed in a child process) and with -DAPP_AMX_EMULATE
 * (amx_tiles.h: the tile operations in plain C, so the index arithmetic below runs, and is
 * tested against float64 and under AddressSanitizer, on any x86-64 CPU).
 *
 * Per request (an item: a key range of one request), its qlen x heads query rows in groups
 * of G = 16; per chunk of BK = 64 keys:
 *
 * - q.k as S^T = K . Q^T: A = 16 keys x 32 dims of the cache (a tile loaded straight from the
 *   cache when the 16 rows are consecutive in one block, else copied to a staging tile), B =
 *   the group's q in pairs of dims (Qt: the 32-bit transpose of 16 rows x 16 dim pairs,
 *   packed once per item), C = 16 keys x 16 query rows in float32: stored, each key's scores
 *   are one vector with a lane per query row, as in the AVX-512 kernel, so the online
 *   softmax is lane-wise over the keys (base 2: scores times q_mult).
 * - p.v as O += P . V: A = the probabilities rounded to bf16, 16 rows x 32 keys (packed in
 *   key pairs, then 32-bit transposed), B = 32 keys x 16 latent columns in key pairs (Vp:
 *   every pair of cache rows interleaved once per chunk, shared by all groups), C = 16 rows x
 *   16 columns of the accumulators, which live in memory ([row][rank], natural column
 *   order) and go through 4 C tiles (64 columns) at a time.
 * - Keys seen by only some rows (the step's own last qlen - 1 keys, causal) are never given
 *   to the tiles' p.v: their rows are added with AVX-512 FMAs, each row only if it sees the
 *   key (0 * NaN is NaN: a hidden key must not reach a row, as in the AVX-512 kernel).
 * - Output normalised by the sum of the rounded probabilities, LSE from the float32 sum (as
 *   the AVX512-BF16 path: see docs/cpu-decode-kernel.md).
 *
 * Tiles: q.k uses C tiles 0-3 (64 keys), B tile 4 (q), A tiles 5/6 (keys); p.v uses C tiles
 * 0-3 (64 columns), A tiles 4/7 (the two halves of 64 keys' probabilities), B tiles 5/6.
 * Every tile is configured as 16 rows x 64 bytes (amx_full_config); each call to
 * mla_decode_cpu_run configures them on its thread and releases them at the end.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx_tiles.h"
#include "app_native_simd.h"
#include "mla_decode_cpu.h"

APP_NATIVE_LIBRARY(MLA_DECODE_CPU_ABI)
APP_NATIVE_STRUCT_LAYOUT(mla_decode_args, MLA_DECODE_ARGS)

#define G 16        /* query rows per group: a tile's 16 rows (C) / columns (q.k's C) */
#define BK 64       /* keys per chunk: 4 q.k C tiles, 2 p.v A tiles */
#define LN2 0.6931471805599453f
#define MAX_PARTS 64

/* In place: r[i][j] <- r[j][i] for a 16 x 16 matrix of 32-bit elements, one row a vector. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  /* u[4q + j]: column 4L + j of rows 4q .. 4q + 3 in 128-bit lane L */
  for (int q = 0; q < 4; ++q) {
    u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

/* The next chunk's cache lines, prefetched a few at a time from the loops of this one (the
 * pages are scattered: the hardware prefetchers stop at every 4 KiB page). */
typedef struct prefetch_cursor {
  const char* const* rows; /* the next chunk's row pointers (NULL: nothing to fetch) */
  int64_t n, lines, per_call, key, line;
} prefetch_cursor;

static inline void prefetch_some(prefetch_cursor* pc) {
  for (int64_t i = 0; i < pc->per_call && pc->key < pc->n; ++i) {
    _mm_prefetch(pc->rows[pc->key] + 64 * pc->line, _MM_HINT_T0);
    if (++pc->line == pc->lines) pc->line = 0, ++pc->key;
  }
}

/* Row pointers of keys [k, k + n) of the request whose block table is `table`. */
static void row_pointers(const mla_decode_args* a, const int32_t* table, int64_t k, int64_t n,
                         const char** rows) {
  const char* base = (const char*)a->cache;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = k + j, blk = table[pos / a->block_size];
    rows[j] = base + 2 * (blk * a->block_stride + (pos % a->block_size) * a->row_stride);
  }
}

/* Where the scratch regions of one thread start (mla_decode_cpu_scratch_floats). */
typedef struct amx_scratch {
  uint32_t* qt;    /* [groups][D / 32][16 dim pairs][16 rows]: q.k's B tiles */
  float* acc;      /* [mp][rank] */
  float *m, *l, *lr;
  int32_t* limit;  /* [mp]: the last key position each row sees */
  float* S;        /* [BK][G] scores, then the rounded probabilities */
  uint32_t* pt;    /* [2][16 rows][16 key pairs]: p.v's A tiles */
  uint16_t* kst;   /* [4][16 keys][D]: staged q.k A tiles */
  uint32_t* vp;    /* [2][rank / 16][16 key pairs][16 columns]: p.v's B tiles */
} amx_scratch;

static amx_scratch carve(float* scratch, int64_t mp, int64_t d, int64_t rank) {
  float* p = scratch + (16 - ((uintptr_t)scratch / sizeof(float)) % 16) % 16;
  amx_scratch s;
  s.qt = (uint32_t*)p, p += mp * d / 2;
  s.acc = p, p += mp * rank;
  s.m = p, p += mp;
  s.l = p, p += mp;
  s.lr = p, p += mp;
  s.limit = (int32_t*)p, p += mp;
  s.S = p, p += BK * G;
  s.pt = (uint32_t*)p, p += 2 * 256;
  s.kst = (uint16_t*)p, p += 4 * 16 * d / 2;
  s.vp = (uint32_t*)p;
  return s;
}

/* The tiles read bf16 caches only (CPU_MLA sends the FP8 caches to mla_decode_cpu): no FP8
 * layout has a code here. */
int32_t mla_decode_cpu_cache_code(const char* name) {
  (void)name;
  return -1;
}

int64_t mla_decode_cpu_scratch_floats(int64_t qlen, int64_t heads, int64_t rank, int64_t rope) {
  const int64_t mp = app_round_up(qlen * heads, G), d = rank + rope;
  /* 16 to align; q tiles; accumulators; m, l, lr, limit; scores; P tiles; K staging; Vp */
  return 16 + mp * d / 2 + mp * rank + 4 * mp + BK * G + 2 * 256 + 32 * d + 32 * rank;
}

/* Qt for every group of the item: pair k of row n's 32-dim slice s at qt[(g * ns + s) * 256
 * + k * 16 + n]; rows past rows_m are zero. */
static void pack_q(const mla_decode_args* a, int64_t b, int64_t rows_m, int64_t mp, int64_t d,
                   uint32_t* qt) {
  const int64_t ns = d / 32;
  for (int64_t g0 = 0; g0 < mp; g0 += G)
    for (int64_t s = 0; s < ns; ++s) {
      __m512i r[16];
      for (int n = 0; n < G; ++n) {
        const int64_t row = g0 + n;
        if (row >= rows_m) {
          r[n] = _mm512_setzero_si512();
          continue;
        }
        const int64_t i = row / a->heads, h = row % a->heads;
        const uint16_t* src = (const uint16_t*)a->q + b * a->q_sb + i * a->q_si + h * a->q_sh;
        r[n] = _mm512_loadu_si512((const void*)(src + 32 * s));
      }
      transpose16(r);
      uint32_t* dst = qt + (g0 / G * ns + s) * 256;
      for (int k = 0; k < 16; ++k) _mm512_storeu_si512((void*)(dst + 16 * k), r[k]);
    }
}

/* The source of q.k's A tile t (keys 16t .. 16t + 15 of the chunk): the cache itself when
 * those are 16 consecutive rows, else the staging tile (missing keys zero). */
static const char* key_tile(const char* const* rows, int64_t n, int t, int64_t row_bytes,
                            int64_t d, uint16_t* stage, int64_t* stride) {
  const int64_t first = 16 * t, have = n - first;
  if (have >= 16) {
    int together = 1;
    for (int i = 1; i < 16 && together; ++i) together = rows[first + i] == rows[first] + i * row_bytes;
    if (together) {
      *stride = row_bytes;
      return rows[first];
    }
  }
  for (int i = 0; i < 16; ++i) {
    uint16_t* dst = stage + i * d;
    if (i < have) memcpy(dst, rows[first + i], (size_t)(2 * d));
    else memset(dst, 0, (size_t)(2 * d));
  }
  *stride = 2 * d;
  return (const char*)stage;
}

/* Vp for keys [0, n_main) of the chunk (the pairs of the halves that hold any; rows past
 * n_main zero): pair k of half h, columns 16c .. 16c + 15, at vp[((h * nc + c) * 16 + k) *
 * 16 + column], nc = rank / 16. */
static void pack_v(const char* const* rows, int64_t n_main, int64_t rank, uint32_t* vp,
                   prefetch_cursor* pc) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56,
                                      24, 55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17,
                                      48, 16);
  const int64_t nc = rank / 16, pairs = (n_main + 31) / 32 * 16;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const char* r0 = 2 * kp < n_main ? rows[2 * kp] : NULL;
    const char* r1 = 2 * kp + 1 < n_main ? rows[2 * kp + 1] : NULL;
    uint32_t* dst = vp + ((kp / 16) * nc * 16 + kp % 16) * 16;
    prefetch_some(pc);
    for (int64_t c = 0; c < rank; c += 32) {
      const __m512i x = r0 ? _mm512_loadu_si512((const void*)(r0 + 2 * c)) : _mm512_setzero_si512();
      const __m512i y = r1 ? _mm512_loadu_si512((const void*)(r1 + 2 * c)) : _mm512_setzero_si512();
      _mm512_storeu_si512((void*)(dst + (c / 16) * 256), _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512((void*)(dst + (c / 16 + 1) * 256), _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

/* S (stride 64 bytes) = the group's scores of keys [0, 64) as C tiles 0..3 (only the tiles
 * holding any of the n keys are computed and stored). */
static void qk_tiles(const char* const ksrc[4], const int64_t kstride[4], int nt,
                     const uint32_t* qt, int64_t ns, float* S, prefetch_cursor* pc) {
  AMX_ZERO(0);
  AMX_ZERO(1);
  AMX_ZERO(2);
  AMX_ZERO(3);
  for (int64_t s = 0; s < ns; ++s) {
    if (pc != NULL) prefetch_some(pc);
    AMX_LOAD(4, qt + s * 256, 64);
    AMX_LOAD(5, ksrc[0] + 64 * s, kstride[0]);
    AMX_DPBF16(0, 5, 4);
    if (nt > 1) {
      AMX_LOAD(6, ksrc[1] + 64 * s, kstride[1]);
      AMX_DPBF16(1, 6, 4);
    }
    if (nt > 2) {
      AMX_LOAD(5, ksrc[2] + 64 * s, kstride[2]);
      AMX_DPBF16(2, 5, 4);
    }
    if (nt > 3) {
      AMX_LOAD(6, ksrc[3] + 64 * s, kstride[3]);
      AMX_DPBF16(3, 6, 4);
    }
  }
  AMX_STORE(0, S, 64);
  if (nt > 1) AMX_STORE(1, S + 256, 64);
  if (nt > 2) AMX_STORE(2, S + 512, 64);
  if (nt > 3) AMX_STORE(3, S + 768, 64);
}

/* The online softmax of one group over the chunk's n keys (positions pos0 + j), lane = row:
 * scores scaled to base 2 and hidden keys masked; S then holds the probabilities rounded to
 * bf16 (0 for hidden keys); m, l (float32 sum), lr (sum of the rounded ones) updated, the
 * accumulator rows rescaled. */
static void softmax(float* S, int64_t n, int64_t pos0, int64_t tail, const int32_t* limit,
                    float q_mult, float* m, float* l, float* lr, float* acc, int64_t rank) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(q_mult);
  const __m512i lim = _mm512_loadu_si512((const void*)limit);
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 mx = m_old;
  for (int64_t j = 0; j < n; ++j) {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(S + j * G), scale);
    if (pos0 + j >= tail)
      s = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(_mm512_set1_epi32((int)(pos0 + j)), lim), s);
    _mm512_storeu_ps(S + j * G, s);
    mx = _mm512_max_ps(mx, s);
  }
  const __mmask16 none = _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ);
  const __m512 ref = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
  const __m512 alpha = app_exp2_nonpositive(_mm512_sub_ps(m_old, ref));
  __m512 sum = _mm512_setzero_ps(), sum_r = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = app_exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(S + j * G), ref));
    const __m512 pr = app_round_to_bf16(p);
    sum = _mm512_add_ps(sum, p);
    sum_r = _mm512_add_ps(sum_r, pr);
    _mm512_storeu_ps(S + j * G, pr);
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
  _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), alpha, sum_r));
  _mm512_storeu_ps(m, mx);
  const __mmask16 rescale = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ);
  if (!rescale) return;
  float al[G];
  _mm512_storeu_ps(al, alpha);
  for (int r = 0; r < G; ++r) {
    if (!((rescale >> r) & 1)) continue;
    const __m512 va = _mm512_set1_ps(al[r]);
    for (int64_t c = 0; c < rank; c += 16)
      _mm512_storeu_ps(acc + r * rank + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * rank + c), va));
  }
}

/* p.v's A tiles from the rounded probabilities of keys [0, n_main) (the rest 0): the pair
 * (key 2k, key 2k + 1) of row r at pt[h * 256 + r * 16 + k] for half h. */
static void pack_p(const float* S, int64_t n_main, uint32_t* pt) {
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int h = 0; h * 32 < n_main; ++h) {
    __m512i r[16];
    for (int k = 0; k < 16; ++k) {
      const int64_t j = 32 * h + 2 * k;
      const __m512i p0 = j < n_main ? _mm512_castps_si512(_mm512_loadu_ps(S + j * G))
                                    : _mm512_setzero_si512();
      const __m512i p1 = j + 1 < n_main ? _mm512_castps_si512(_mm512_loadu_ps(S + (j + 1) * G))
                                        : _mm512_setzero_si512();
      /* p is already a bf16 value held in float32: its top 16 bits are exact */
      r[k] = _mm512_or_si512(_mm512_and_si512(p1, high), _mm512_srli_epi32(p0, 16));
    }
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void*)(pt + h * 256 + i * 16), r[i]);
  }
}

/* acc rows of the group (row stride rank) += P . V over keys [0, n_main), on the tiles. */
static void pv_tiles(const uint32_t* pt, const uint32_t* vp, int64_t n_main, float* acc,
                     int64_t rank) {
  const int64_t nc = rank / 16, stride = 4 * rank;
  AMX_LOAD(4, pt, 64);
  if (n_main > 32) AMX_LOAD(7, pt + 256, 64);
  for (int64_t c0 = 0; c0 < rank; c0 += 64) {
    float* o = acc + c0;
    const uint32_t* v0 = vp + (c0 / 16) * 256;
    AMX_LOAD(0, o, stride);
    AMX_LOAD(1, o + 16, stride);
    AMX_LOAD(2, o + 32, stride);
    AMX_LOAD(3, o + 48, stride);
    AMX_LOAD(5, v0, 64);
    AMX_DPBF16(0, 4, 5);
    AMX_LOAD(6, v0 + 256, 64);
    AMX_DPBF16(1, 4, 6);
    AMX_LOAD(5, v0 + 512, 64);
    AMX_DPBF16(2, 4, 5);
    AMX_LOAD(6, v0 + 768, 64);
    AMX_DPBF16(3, 4, 6);
    if (n_main > 32) {
      const uint32_t* v1 = v0 + nc * 256;
      AMX_LOAD(5, v1, 64);
      AMX_DPBF16(0, 7, 5);
      AMX_LOAD(6, v1 + 256, 64);
      AMX_DPBF16(1, 7, 6);
      AMX_LOAD(5, v1 + 512, 64);
      AMX_DPBF16(2, 7, 5);
      AMX_LOAD(6, v1 + 768, 64);
      AMX_DPBF16(3, 7, 6);
    }
    AMX_STORE(0, o, stride);
    AMX_STORE(1, o + 16, stride);
    AMX_STORE(2, o + 32, stride);
    AMX_STORE(3, o + 48, stride);
  }
}

/* acc rows += p . v for the keys [n_main, n) that only some rows see (AVX-512 FMAs; a row
 * takes a key only if it sees it). */
static void pv_tail(const float* S, const char* const* rows, int64_t n_main, int64_t n,
                    int64_t pos0, const int32_t* limit, int64_t valid, float* acc, int64_t rank) {
  for (int64_t j = n_main; j < n; ++j) {
    const uint16_t* v = (const uint16_t*)rows[j];
    for (int64_t r = 0; r < valid; ++r) {
      if (pos0 + j > limit[r]) continue;
      const __m512 p = _mm512_set1_ps(S[j * G + r]);
      float* o = acc + r * rank;
      for (int64_t c = 0; c < rank; c += 16) {
        const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + c)));
        const __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        _mm512_storeu_ps(o + c, _mm512_fmadd_ps(p, vf, _mm512_loadu_ps(o + c)));
      }
    }
  }
}

/* The item's rows, normalised, into out/lse (part < 0) or a partial result. */
static void write_rows(const mla_decode_args* a, const amx_scratch* s, int64_t b, int64_t part,
                       int64_t rows_m) {
  const int64_t rank = a->rank;
  for (int64_t r = 0; r < rows_m; ++r) {
    const float inv = s->lr[r] == 0.f ? 0.f : 1.f / s->lr[r];
    const float lse2 = s->l[r] == 0.f ? -INFINITY : s->m[r] + log2f(s->l[r]);
    const float* row = s->acc + r * rank;
    if (part >= 0) {
      float* po = a->part_out + (part * rows_m + r) * rank;
      for (int64_t c = 0; c < rank; c += 16)
        _mm512_storeu_ps(po + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(inv)));
      a->part_lse[part * rows_m + r] = lse2;
      continue;
    }
    const __m512 vi = _mm512_set1_ps(inv * a->v_mult);
    for (int64_t c = 0; c < rank; c += 16)
      app_store16(a->out, (b * rows_m + r) * rank + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), vi),
                  a->out_dt);
    if (a->lse) a->lse[b * rows_m + r] = lse2 * LN2;
  }
}

/* Keys [k0, k1) of request b, all its query rows (see mla_decode_args); `after`: the next
 * item of the call, whose first chunk the last chunk prefetches (or NULL). */
static void run_item(const mla_decode_args* a, int64_t b, int64_t k0, int64_t k1, int64_t part,
                     const int64_t* after) {
  const int64_t heads = a->heads, qlen = a->qlen, rows_m = qlen * heads, rank = a->rank;
  const int64_t d = rank + a->rope, mp = app_round_up(rows_m, G), ns = d / 32;
  const int64_t seq_len = a->seq_lens[b], tail = seq_len - qlen + 1, row_bytes = 2 * a->row_stride;
  const amx_scratch s = carve(a->scratch, mp, d, rank);
  pack_q(a, b, rows_m, mp, d, s.qt);
  for (int64_t r = 0; r < mp; ++r) {
    s.limit[r] = (int32_t)(r >= rows_m ? seq_len - 1 : seq_len - qlen + r / heads);
    s.m[r] = -INFINITY;
    s.l[r] = 0.f;
    s.lr[r] = 0.f;
  }
  memset(s.acc, 0, sizeof(float) * (size_t)(mp * rank));
  const int32_t* table = a->block_table + b * a->bt_stride;
  const char* ring[2][BK];
  row_pointers(a, table, k0, k1 - k0 < BK ? k1 - k0 : BK, ring[0]);
  for (int64_t t = 0, cs = k0; cs < k1; ++t, cs += BK) {
    const int64_t n = k1 - cs < BK ? k1 - cs : BK;
    const char* const* rows = ring[t % 2];
    const char** next = ring[(t + 1) % 2];
    int64_t n_next = k1 - cs - BK < BK ? k1 - cs - BK : BK;
    if (n_next > 0) {
      row_pointers(a, table, cs + BK, n_next, next);
    } else if (after != NULL) { /* the next item's first chunk */
      n_next = after[2] - after[1] < BK ? after[2] - after[1] : BK;
      if (n_next > 0) row_pointers(a, a->block_table + after[0] * a->bt_stride, after[1], n_next, next);
    }
    int64_t n_main = tail - cs;
    n_main = n_main < 0 ? 0 : n_main > n ? n : n_main;
    const int64_t pairs = (n_main + 31) / 32 * 16;
    /* the next chunk's lines, dealt over the V packing and the first group's q.k */
    prefetch_cursor pc = {n_next > 0 ? next : NULL, n_next > 0 ? n_next : 0, (2 * d + 63) / 64,
                          0, 0, 0};
    pc.per_call = (pc.n * pc.lines + pairs + ns - 1) / (pairs + ns > 0 ? pairs + ns : 1);
    const int nt = (int)((n + 15) / 16);
    const char* ksrc[4];
    int64_t kstride[4];
    for (int i = 0; i < 4; ++i) {
      ksrc[i] = NULL, kstride[i] = 0;
      if (i < nt) ksrc[i] = key_tile(rows, n, i, row_bytes, d, s.kst + i * 16 * d, &kstride[i]);
    }
    if (n_main > 0) pack_v(rows, n_main, rank, s.vp, &pc);
    for (int64_t g0 = 0; g0 < rows_m; g0 += G) {
      const int64_t valid = rows_m - g0 < G ? rows_m - g0 : G;
      qk_tiles(ksrc, kstride, nt, s.qt + g0 / G * ns * 256, ns, s.S, g0 == 0 ? &pc : NULL);
      softmax(s.S, n, cs, tail, s.limit + g0, a->q_mult, s.m + g0, s.l + g0, s.lr + g0,
              s.acc + g0 * rank, rank);
      if (n_main > 0) {
        pack_p(s.S, n_main, s.pt);
        pv_tiles(s.pt, s.vp, n_main, s.acc + g0 * rank, rank);
      }
      if (n_main < n)
        pv_tail(s.S, rows, n_main, n, cs, s.limit + g0, valid, s.acc + g0 * rank, rank);
    }
    pc.per_call = pc.n * pc.lines; /* whatever is left */
    prefetch_some(&pc);
  }
  write_rows(a, &s, b, part, rows_m);
}

static int shape_ok(const mla_decode_args* a) {
  const int out_ok = a->out_dt == APP_DT_F32 || a->out_dt == APP_DT_BF16 || a->out_dt == APP_DT_F16;
  return a->cache_dt == APP_DT_BF16 && a->q_dt == APP_DT_BF16 && out_ok && a->rank > 0 &&
         a->rank % 64 == 0 && a->rope >= 0 && (a->rank + a->rope) % 32 == 0 && a->qlen > 0 &&
         a->heads > 0 && a->block_size > 0;
}

#include "mla_decode_cpu_shares.h" /* as in mla_decode_cpu.c */

int32_t mla_decode_cpu_run(const mla_decode_args* a) {
  if (!shape_ok(a) || !items_ok(a, a->items, a->n_items)) return 1;
  amx_tile_config cfg;
  amx_full_config(&cfg);
  AMX_CONFIGURE(&cfg);
  for (int64_t t = 0; t < a->n_items; ++t) {
    const int64_t* it = a->items + 4 * t;
    run_item(a, it[0], it[1], it[2], it[3], t + 1 < a->n_items ? it + 4 : NULL);
  }
  AMX_RELEASE();
  return 0;
}

/* As in mla_decode_cpu.c, for partial rows in natural column order. */
int32_t mla_decode_cpu_merge(const mla_decode_args* a) {
  if (!shape_ok(a)) return 1;
  const int64_t rows_m = a->qlen * a->heads, rank = a->rank;
  for (int64_t t = 0; t < a->n_merge; ++t)
    if (a->merge[3 * t + 2] < 1 || a->merge[3 * t + 2] > MAX_PARTS) return 1;
  for (int64_t t = 0; t < a->n_merge; ++t) {
    const int64_t b = a->merge[3 * t], p0 = a->merge[3 * t + 1], np = a->merge[3 * t + 2];
    for (int64_t r = 0; r < rows_m; ++r) {
      float mx = -INFINITY, tot = 0.f, w[MAX_PARTS];
      for (int64_t p = 0; p < np; ++p) {
        const float x = a->part_lse[(p0 + p) * rows_m + r];
        if (x > mx) mx = x;
      }
      const float ref = mx == -INFINITY ? 0.f : mx;
      for (int64_t p = 0; p < np; ++p) {
        w[p] = exp2f(a->part_lse[(p0 + p) * rows_m + r] - ref);
        tot += w[p];
      }
      const float inv = tot == 0.f ? 0.f : a->v_mult / tot;
      const int64_t o = (b * rows_m + r) * rank;
      for (int64_t c = 0; c < rank; c += 16) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < np; ++p)
          sum = _mm512_fmadd_ps(_mm512_set1_ps(w[p]),
                                _mm512_loadu_ps(a->part_out + ((p0 + p) * rows_m + r) * rank + c), sum);
        app_store16(a->out, o + c, _mm512_mul_ps(sum, _mm512_set1_ps(inv)), a->out_dt);
      }
      if (a->lse) a->lse[b * rows_m + r] = tot == 0.f ? -INFINITY : (ref + log2f(tot)) * LN2;
    }
  }
  return 0;
}

/* 1 for the build whose tiles are emulated in C (-DAPP_AMX_EMULATE), 0 for AMX itself. */
APP_NATIVE_EXPORT int32_t mla_decode_amx_emulated(void) { return AMX_EMULATED; }

/* Tile operations the hardware would have refused (#GP / #UD) since the library was loaded:
 * counted by the emulation, always 0 for the real build. */
APP_NATIVE_EXPORT int64_t mla_decode_amx_faults(void) { return amx_emu_faults(); }
