/* DeepSeek Sparse Attention on an AVX-512 CPU, the selection half: the lightning indexer's
 * scores and their top-k (the attention over the selected rows is mla_sparse_cpu.c; one
 * library, one header: mla_sparse_cpu.h, whose contract each exported function follows).
 *
 * Indexer: an item is up to 8 query rows of one request and a range of its key positions.
 * Each row's q is packed once per item with the heads along the vector lanes (16 per vector,
 * padded with zero heads); keys are read in place through the block table, KB at a time, each
 * key's values (bf16 pairs on the dot path) broadcast against HG blocks of 16 heads, so one
 * reduction per key, after the heads' relu and weights. Positions a row does not see get -inf
 * (and are never read).
 *
 * Top-k: the k-th largest score by a radix select over the scores' order-preserving 32-bit
 * keys (four passes of 8 bits), then one pass in position order that keeps what is above it
 * and the earliest of what equals it: exactly app.backends.sparse.indexer.topk_positions.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "app_native_simd.h"
#include "mla_sparse_cpu.h"

#define IR 8  /* indexer: most query rows per item */

/* ---------------------------------------------------------------------------------------
 * The lightning indexer's scores */

#define KB 4 /* indexer: keys per register tile */
#define HG 4 /* indexer: blocks of 16 heads per register tile */

/* Row r's q packed heads-minor, hp = heads rounded up to 16 (the padding heads 0): uint32 bf16
 * pairs Q[pair * hp + h] on the dot path, else float32 Q[dim * hp + h]; wt[h] its weights
 * (0 for the padding). */
static void pack_row(const mla_sparse_index_args* a, int64_t r, int64_t hp, float* qt,
                     float* wt) {
  const int64_t heads = a->heads, dim = a->dim, qsize = app_native_elem_size(a->q_dt);
  const char* q = (const char*)a->q + r * a->q_st * qsize;
  if (a->bf16_dot) {
    uint32_t* Q = (uint32_t*)(void*)qt;
    for (int64_t p = 0; p < dim / 2; ++p)
      for (int64_t h = 0; h < hp; ++h)
        if (h < heads)
          memcpy(Q + p * hp + h, q + (h * a->q_sh + 2 * p) * qsize, 4);
        else
          Q[p * hp + h] = 0;
  } else {
    for (int64_t e = 0; e < dim; ++e)
      for (int64_t h = 0; h < hp; ++h)
        qt[e * hp + h] = h < heads ? app_load_elem(q + h * a->q_sh * qsize, e, a->q_dt) : 0.f;
  }
  for (int64_t h = 0; h < hp; ++h) wt[h] = h < heads ? a->weights[r * heads + h] : 0.f;
}

/* sum_h wt[h] * relu(c[h]) over 16 heads of one block, added to what s holds. */
static inline __m512 weigh(__m512 s, const float* wt, __m512 c) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(wt), _mm512_max_ps(_mm512_setzero_ps(), c), s);
}

/* The scores of KB keys (rows k[0..KB)) for one packed row, on AVX512-BF16 dot products: the
 * heads along the vector lanes, each key's bf16 pair broadcast. */
static __attribute__((APP_AVX512BF16_ISA)) void keys_bf16(const uint32_t* Q, const float* wt,
                                                          int64_t hp, int64_t pairs,
                                                          const char* const* k, float* out) {
  __m512 s[KB];
  for (int j = 0; j < KB; ++j) s[j] = _mm512_setzero_ps();
  int64_t hb = 0;
  for (; hb + 16 * HG <= hp; hb += 16 * HG) {
    __m512 c[KB][HG];
    for (int j = 0; j < KB; ++j)
      for (int g = 0; g < HG; ++g) c[j][g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh qv[HG];
      for (int g = 0; g < HG; ++g)
        qv[g] = (__m512bh)_mm512_loadu_si512((const void*)(Q + p * hp + hb + 16 * g));
      for (int j = 0; j < KB; ++j) {
        uint32_t bits;
        memcpy(&bits, k[j] + 4 * p, sizeof bits);
        const __m512bh kv = (__m512bh)_mm512_set1_epi32((int32_t)bits);
        for (int g = 0; g < HG; ++g) c[j][g] = _mm512_dpbf16_ps(c[j][g], qv[g], kv);
      }
    }
    for (int j = 0; j < KB; ++j)
      for (int g = 0; g < HG; ++g) s[j] = weigh(s[j], wt + hb + 16 * g, c[j][g]);
  }
  for (; hb < hp; hb += 16) {
    __m512 c[KB];
    for (int j = 0; j < KB; ++j) c[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void*)(Q + p * hp + hb));
      for (int j = 0; j < KB; ++j) {
        uint32_t bits;
        memcpy(&bits, k[j] + 4 * p, sizeof bits);
        c[j] = _mm512_dpbf16_ps(c[j], qv, (__m512bh)_mm512_set1_epi32((int32_t)bits));
      }
    }
    for (int j = 0; j < KB; ++j) s[j] = weigh(s[j], wt + hb, c[j]);
  }
  for (int j = 0; j < KB; ++j) out[j] = _mm512_reduce_add_ps(s[j]);
}

/* As keys_bf16 in float32 FMAs, q packed as float32, keys of type dt. */
static void keys_f32(const float* Q, const float* wt, int64_t hp, int64_t dim,
                     const char* const* k, int dt, float* out) {
  __m512 s[KB];
  for (int j = 0; j < KB; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t hb = 0; hb < hp; hb += 16) {
    __m512 c[KB];
    for (int j = 0; j < KB; ++j) c[j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < dim; ++e) {
      const __m512 qv = _mm512_loadu_ps(Q + e * hp + hb);
      for (int j = 0; j < KB; ++j)
        c[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(app_load_elem(k[j], e, dt)), c[j]);
    }
    for (int j = 0; j < KB; ++j) s[j] = weigh(s[j], wt + hb, c[j]);
  }
  for (int j = 0; j < KB; ++j) out[j] = _mm512_reduce_add_ps(s[j]);
}

/* Walks a request's key positions in order through its block table: one division when it
 * starts, none per key (a division per key cost a quarter of the indexer's time). */
typedef struct key_cursor {
  const mla_sparse_index_args* a;
  const int32_t* table;
  int64_t block, offset, esize;
} key_cursor;

static inline key_cursor cursor_at(const mla_sparse_index_args* a, const int32_t* table,
                                   int64_t pos, int64_t esize) {
  key_cursor c = {a, table, pos / a->block_size, pos % a->block_size, esize};
  return c;
}

/* The row under the cursor; the cursor moves to the next position. */
static inline const char* cursor_next(key_cursor* c) {
  const char* row = (const char*)c->a->key_cache +
                    ((int64_t)c->table[c->block] * c->a->block_stride +
                     c->offset * c->a->row_stride) * c->esize;
  if (++c->offset == c->a->block_size) c->offset = 0, ++c->block;
  return row;
}

static void index_item(const mla_sparse_index_args* a, int64_t b, int64_t r0, int64_t r1,
                       int64_t k0, int64_t k1) {
  const int32_t* table = a->block_table + b * a->bt_stride;
  const int64_t hp = app_round_up(a->heads, 16), esize = app_native_elem_size(a->key_dt);
  const int64_t bytes = a->dim * esize;
  float* qt = a->scratch; /* hp * dim */
  float* wt = qt + hp * a->dim;
  for (int64_t r = r0; r < r1; ++r) {
    float* srow = a->scores + (r - a->score_row0) * a->score_stride;
    const int64_t end = a->visible[r] < k1 ? a->visible[r] : k1;
    if (k0 < end) pack_row(a, r, hp, qt, wt);
    key_cursor at = cursor_at(a, table, k0, esize);
    key_cursor ahead = cursor_at(a, table, k0, esize); /* 4 tiles ahead: asked for */
    for (int64_t j = k0; j < k0 + 4 * KB && j < end; ++j)
      app_prefetch_lines(cursor_next(&ahead), bytes);
    for (int64_t p = k0; p < end; p += KB) {
      const int64_t nk = end - p < KB ? end - p : KB;
      const char* k[KB];
      float got[KB];
      for (int j = 0; j < KB; ++j) k[j] = j < nk ? cursor_next(&at) : k[0];
      for (int64_t j = p + 4 * KB; j < p + 5 * KB && j < end; ++j)
        app_prefetch_lines(cursor_next(&ahead), bytes);
      if (a->bf16_dot)
        keys_bf16((const uint32_t*)(const void*)qt, wt, hp, a->dim / 2, k, got);
      else
        keys_f32(qt, wt, hp, a->dim, k, a->key_dt, got);
      for (int64_t j = 0; j < nk; ++j) srow[p + j] = got[j];
    }
    for (int64_t p = end > k0 ? end : k0; p < k1; ++p) srow[p] = -INFINITY;
  }
}

APP_NATIVE_EXPORT int64_t mla_sparse_index_scratch_floats(int64_t heads, int64_t dim) {
  return app_round_up(heads, 16) * (dim + 1);
}

APP_NATIVE_EXPORT int32_t mla_sparse_index_run(const mla_sparse_index_args* a) {
  const int dts = a->key_dt == APP_DT_F32 || a->key_dt == APP_DT_BF16 || a->key_dt == APP_DT_F16;
  const int qdts = a->q_dt == APP_DT_F32 || a->q_dt == APP_DT_BF16 || a->q_dt == APP_DT_F16;
  if (!dts || !qdts || a->heads < 1 || a->dim < 1 || a->block_size < 1 ||
      (a->bf16_dot && (a->key_dt != APP_DT_BF16 || a->q_dt != APP_DT_BF16 || a->dim % 2)))
    return 1;
  for (int64_t it = 0; it < a->n_items; ++it) {
    const int64_t* item = a->items + 5 * it;
    if (item[2] - item[1] > IR || item[2] < item[1]) return 1;
  }
  for (int64_t it = 0; it < a->n_items; ++it) {
    const int64_t* item = a->items + 5 * it;
    index_item(a, item[0], item[1], item[2], item[3], item[4]);
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * Top-k */

/* x's order-preserving unsigned key (-0 and +0 the same key, as they compare equal). */
static inline uint32_t order_key(float x) {
  x += 0.0f;
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* The k-th largest (1 <= k <= n) of keys[0 .. n). */
static uint32_t kth_largest(const uint32_t* keys, int64_t n, int64_t k) {
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    int64_t hist[256];
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; ++i)
      if ((keys[i] & mask) == prefix) ++hist[(keys[i] >> shift) & 0xFFu];
    int b = 255;
    while (b > 0 && hist[b] < k) k -= hist[b--];
    prefix |= (uint32_t)b << shift;
    mask |= 0xFFu << shift;
  }
  return prefix;
}

APP_NATIVE_EXPORT int32_t mla_sparse_topk(const float* scores, int64_t score_stride,
                                          const int64_t* count, int64_t first_row,
                                          int64_t end_row, int64_t topk, int32_t* out,
                                          int64_t out_stride, int32_t* flags,
                                          uint32_t* scratch) {
  if (topk < 1) return 1;
  for (int64_t t = first_row; t < end_row; ++t) {
    const float* s = scores + t * score_stride;
    const int64_t n = count[t];
    int32_t* o = out + t * out_stride;
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      memcpy(&bits, s + i, sizeof bits);
      bad |= (bits & 0x7F800000u) == 0x7F800000u;
      scratch[i] = order_key(s[i]);
    }
    flags[t] = bad;
    if (bad) continue;
    if (n <= topk) {
      for (int64_t i = 0; i < n; ++i) o[i] = (int32_t)i;
      continue;
    }
    const uint32_t kth = kth_largest(scratch, n, topk);
    int64_t above = 0;
    for (int64_t i = 0; i < n; ++i) above += scratch[i] > kth;
    int64_t room = topk - above, w = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = scratch[i];
      if (u > kth || (u == kth && room-- > 0)) o[w++] = (int32_t)i;
    }
  }
  return 0;
}
