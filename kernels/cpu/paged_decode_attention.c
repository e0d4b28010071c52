/* Paged decode attention on the CPU: one query token per sequence over its cached context.
 *
 * Work is split over (sequence, kv head, context split): each item reads its keys and values
 * once for all the query heads that share the kv head (GQA), keeps an online softmax in fp32,
 * and writes a partial result (max, sum, accumulator); a second pass merges a sequence's splits.
 * Splits keep both threads busy when few sequences decode with long contexts. fp32 or bf16 caches
 * and queries (bf16 widened to fp32 on load); the output has the query's type. With AVX-512 (and
 * a head size that is a multiple of 32) a tile's 16 scores per query head come from 16 vector
 * partial dots folded into one vector (bf16 keys dotted as they are stored where the CPU has
 * AVX512-BF16): 64 bf16 decodes of SmolLM2 took 0.80 ms a layer here against 1.23 with a summed
 * dot per key, fp32 1.76 against 2.04.
 *
 * Built by kernels/cpu_build.py with the compiler's OpenMP against the libgomp torch already
 * loaded (one thread pool in the process).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define WIDE_SCORES 1 /* a tile's 16 scores per query head summed as one vector (below) */
#else
#define WIDE_SCORES 0
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define BLOCK_KEYS 16 /* keys scored together before the softmax update */

typedef struct {
  const void *q;            /* [n, hq, d] */
  const void *k_cache;      /* [blocks, block_size, hkv, d] */
  const void *v_cache;
  const int32_t *block_tables; /* [n, table_stride] */
  const int32_t *seq_lens;  /* [n] */
  float *partial;           /* [n, hkv, splits, group, d + 2]: acc, max, sum */
  int64_t n, hq, hkv, d, block_size, table_stride, splits, split_keys;
  float scale;
  int is_bf16;
} Job;

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; i++) sum += a[i] * b[i];
  return sum;
}

/* The cache row at element `at` as fp32: in place, or widened from bf16 into `buffer` once for
 * every query head of the group. */
static inline __attribute__((always_inline)) const float *cache_row(const void *cache, int64_t at,
                                                                    int64_t d, int is_bf16,
                                                                    float *buffer) {
  if (!is_bf16) return (const float *)cache + at;
  load_row(cache, at, d, 1, buffer);
  return buffer;
}

/* Ask for the key and value rows of keys [from, min(from + BLOCK_KEYS, end)) (of the kv head at
 * `head_offset` elements in a slot, `row_bytes` long) while this tile is scored: pages are
 * scattered, so the hardware prefetcher cannot see them coming. Into L2, not L1: the next tile's
 * 12 KB (SmolLM2, bf16) would evict the tile being worked on from a 32 KB L1. 64 decodes of
 * 180-320 keys, 30 layers' caches in turn: bf16 1.31 -> 1.04 ms a layer, fp32 1.84 -> 1.58. */
static inline void prefetch_keys(const Job *job, const int32_t *table, int64_t from, int64_t end,
                                 int64_t head_offset, int64_t row_bytes) {
  const int64_t to = from + BLOCK_KEYS < end ? from + BLOCK_KEYS : end;
  const int64_t width = job->is_bf16 ? 2 : 4, slot_elems = job->hkv * job->d;
  int64_t page = from / job->block_size, offset = from % job->block_size;
  for (int64_t pos = from; pos < to; pos++) {
    const int64_t slot = (int64_t)table[page] * job->block_size + offset;
    if (++offset == job->block_size) {
      offset = 0;
      page++;
    }
    const char *k = (const char *)job->k_cache + (slot * slot_elems + head_offset) * width;
    const char *v = (const char *)job->v_cache + (slot * slot_elems + head_offset) * width;
    for (int64_t line = 0; line < row_bytes; line += 64) {
      __builtin_prefetch(k + line, 0, 2);
      __builtin_prefetch(v + line, 0, 2);
    }
  }
}

#if WIDE_SCORES
/* Folding 16 vectors of 16 partial sums into one vector of 16 totals: at each level, pairs of
 * vectors whose lanes hold segments of one key each are folded into one vector of half-length
 * segments (each half of a segment added to the other), 16 -> 8 -> 4 -> 2 -> 1 lanes per key,
 * 15 folds of two permutes and an add in all where summing each vector alone costs about 8
 * instructions a key. The keys come out in bit-reversed order, so the inputs are given that
 * way (BIT_REVERSED) and the totals come out in key order. */
static const int32_t FOLD_LO[4][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const int32_t FOLD_HI[4][16] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
static const int BIT_REVERSED[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* out[j] = the sum of the lanes of partial[BIT_REVERSED[j]]; `partial` is overwritten. */
static inline __attribute__((always_inline)) __m512 sum_lanes_16(__m512 partial[16]) {
#pragma GCC unroll 4
  for (int level = 0; level < 4; level++) {
    const __m512i lo = _mm512_loadu_si512(FOLD_LO[level]);
    const __m512i hi = _mm512_loadu_si512(FOLD_HI[level]);
    const int pairs = 8 >> level;
#pragma GCC unroll 8
    for (int i = 0; i < pairs; i++) {
      const __m512 a = partial[2 * i], b = partial[2 * i + 1];
      partial[i] = _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
    }
  }
  return partial[0];
}

/* q . key as 16 partial sums (d a multiple of 32): bf16 pairs multiplied and summed by the CPU's
 * bf16 dot product where it has one (`query` then holds the unscaled bf16 row), else widened to
 * fp32 (`query` holds the scaled fp32 row). */
static inline __attribute__((always_inline)) __m512 partial_dot(const void *query, const void *key,
                                                                int64_t d, int is_bf16) {
  __m512 acc = _mm512_setzero_ps();
  if (!is_bf16) {
    for (int64_t i = 0; i < d; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)query + i),
                            _mm512_loadu_ps((const float *)key + i), acc);
    return acc;
  }
#if defined(__AVX512BF16__)
  for (int64_t i = 0; i < d; i += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const uint16_t *)query + i),
                           (__m512bh)_mm512_loadu_si512((const uint16_t *)key + i));
#else
  for (int64_t i = 0; i < d; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)query + i), load16(key, i, 1), acc);
#endif
  return acc;
}

/* acc[g] = acc[g] * correction[g] + sum over the tile's keys j of p[g][j] * value j, 16 dims at a
 * time so the group's accumulators stay in registers while the values stream by. */
static inline __attribute__((always_inline)) void accumulate_tile(
    float acc[][MAX_HEAD_DIM], const float *correction, float p[][BLOCK_KEYS],
    const void *values[BLOCK_KEYS], int64_t nk, int64_t d, int64_t group, int is_bf16) {
  for (int64_t c = 0; c < d; c += 16) {
    __m512 sums[MAX_GROUP];
    for (int64_t g = 0; g < group; g++)
      sums[g] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + c), _mm512_set1_ps(correction[g]));
    for (int64_t j = 0; j < nk; j++) {
      const __m512 value = load16(values[j], c, is_bf16);
      for (int64_t g = 0; g < group; g++)
        sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][j]), value, sums[g]);
    }
    for (int64_t g = 0; g < group; g++) _mm512_storeu_ps(acc[g] + c, sums[g]);
  }
}

#if defined(__AVX512BF16__)
#define DOT_TAKES_BF16 1 /* partial_dot's bf16 query is the raw row, scaled after */
#else
#define DOT_TAKES_BF16 0
#endif

/* rows[j] = where the tile's key j has its row (`at` elements into its slot) in `cache`. */
static inline __attribute__((always_inline)) void tile_rows(const void *cache, const int64_t *slot,
                                                            int64_t nk, int64_t stride, int64_t at,
                                                            int64_t width, const void *rows[BLOCK_KEYS]) {
  for (int64_t j = 0; j < nk; j++) rows[j] = (const char *)cache + (slot[j] * stride + at) * width;
}

/* Lane j = q . key j (times `after`) for the tile's nk <= 16 keys; 0 past nk. */
static inline __attribute__((always_inline)) __m512 score_tile(const void *query, const void *keys[BLOCK_KEYS],
                                                               int64_t nk, int64_t d, int is_bf16,
                                                               float after) {
  __m512 partial[16];
  for (int64_t j = 0; j < BLOCK_KEYS; j++)
    partial[BIT_REVERSED[j]] = j < nk ? partial_dot(query, keys[j], d, is_bf16) : _mm512_setzero_ps();
  return _mm512_mul_ps(sum_lanes_16(partial), _mm512_set1_ps(after));
}

/* One query head's online-softmax step over a tile's scores (lanes outside `valid` ignored):
 * the running max `m` and sum `l` updated, the tile's weights written to `weights` (0 outside
 * `valid`); returns the factor the head's accumulator is scaled by (1 without an exp when the
 * max holds). In registers, where scalar loops over the tile's scores spent their time moving
 * lanes: SmolLM2's decodes, 30 layers' caches in turn, 2-core Xeon (same-process A/B), bf16 64
 * sequences 0.99 -> 0.85 ms a layer, 32: 0.46 -> 0.41, 8: 0.090 -> 0.071; fp32 64: 1.54 ->
 * 1.32. */
static inline __attribute__((always_inline)) float softmax_tile(__m512 s, __mmask16 valid, float *m,
                                                                float *l, float weights[BLOCK_KEYS]) {
  const float tile_max = _mm512_mask_reduce_max_ps(valid, s);
  const float new_max = tile_max > *m ? tile_max : *m;
  const float correction = new_max > *m ? exp_clamped(*m - new_max) : 1.f; /* exp(0) is 1 */
  const __m512 w = _mm512_maskz_mov_ps(valid, exp_fused_x16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
  _mm512_storeu_ps(weights, w);
  *l = *l * correction + _mm512_reduce_add_ps(w);
  *m = new_max;
  return correction;
}
#endif

/* One (sequence, kv heads, split): online softmax over keys [start, end), BLOCK_KEYS at a time,
 * for the query heads of kv heads [kv_first, kv_first + kv_count); each key row is read once and
 * dotted with every query head of its group. An item takes all of a sequence's kv heads when the
 * caller asks (many sequences, query heads that fit the buffers): a slot holds the kv heads' rows
 * side by side, so the item then reads each page's rows in one run rather than one head's rows
 * in every few lines of it. (Storing a tile of keys transposed to skip the dots' horizontal sums was slower: 3.9
 * against 2.7 ms for 64 fp32 decodes, both before `d` was made a constant; its scattered stores
 * cost more than the sums.) Inlined with `d`, `group` and the dtype constants for the common
 * shapes (attend_split), so a group's queries and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_split_with(
    const Job *job, int64_t seq, int64_t kv_first, int64_t kv_count, int64_t split,
    const int64_t d, const int64_t group, const int is_bf16) {
  const int64_t len = job->seq_lens[seq];
  const int64_t start = split * job->split_keys;
  int64_t end = start + job->split_keys;
  if (end > len) end = len;
  const int64_t heads = kv_count * group, first_head = seq * job->hq + kv_first * group;
  float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
  float m[MAX_GROUP], l[MAX_GROUP];
  float row[MAX_HEAD_DIM];
  float scores[MAX_GROUP][BLOCK_KEYS];
  for (int64_t h = 0; h < heads; h++) {
    load_row(job->q, (first_head + h) * d, d, is_bf16, q[h]);
    for (int64_t i = 0; i < d; i++) { q[h][i] *= job->scale; acc[h][i] = 0.f; }
    m[h] = -INFINITY;
    l[h] = 0.f;
  }
#if WIDE_SCORES
  const int wide = d % 32 == 0;
  const int raw_query = wide && is_bf16 && DOT_TAKES_BF16; /* the bf16 row, scaled after */
  const int64_t width = is_bf16 ? 2 : 4;
  const void *query[MAX_GROUP];
  for (int64_t h = 0; h < heads; h++)
    query[h] = raw_query ? (const void *)((const uint16_t *)job->q + (first_head + h) * d)
                         : (const void *)q[h];
  const float after = raw_query ? job->scale : 1.f;
#else
  const int wide = 0;
#endif
  const int32_t *table = job->block_tables + seq * job->table_stride;
  const int64_t stride = job->hkv * d; /* elements from one slot to the next */
  const int64_t block_size = job->block_size;
  int64_t page = start / block_size, offset = start % block_size; /* of the next key */
  for (int64_t t0 = start; t0 < end; t0 += BLOCK_KEYS) {
    const int64_t nk = end - t0 < BLOCK_KEYS ? end - t0 : BLOCK_KEYS;
    prefetch_keys(job, table, t0 + BLOCK_KEYS, end, kv_first * d,
                  kv_count * d * (is_bf16 ? 2 : 4));
    int64_t slot[BLOCK_KEYS];
    float raw[MAX_GROUP][BLOCK_KEYS], correction[MAX_GROUP];
    for (int64_t j = 0; j < nk; j++) {
      slot[j] = (int64_t)table[page] * block_size + offset;
      if (++offset == block_size) {
        offset = 0;
        page++;
      }
    }
    for (int64_t kv = 0; kv < kv_count; kv++) {
      const int64_t at = (kv_first + kv) * d, h0 = kv * group;
#if WIDE_SCORES
      if (wide) {
        const void *keys[BLOCK_KEYS];
        tile_rows(job->k_cache, slot, nk, stride, at, width, keys);
        const __mmask16 valid = (__mmask16)((1u << nk) - 1);
        for (int64_t h = h0; h < h0 + group; h++)
          correction[h] = softmax_tile(score_tile(query[h], keys, nk, d, is_bf16, after), valid,
                                       &m[h], &l[h], scores[h]);
        continue;
      }
#endif
      for (int64_t j = 0; j < nk; j++) {
        const float *key = cache_row(job->k_cache, slot[j] * stride + at, d, is_bf16, row);
        for (int64_t g = 0; g < group; g++) raw[h0 + g][j] = dot(q[h0 + g], key, d);
      }
    }
    for (int64_t h = 0; h < (wide ? 0 : heads); h++) { /* the wide path's came with its scores */
      float s[BLOCK_KEYS];
      for (int64_t j = 0; j < BLOCK_KEYS; j++) s[j] = j < nk ? raw[h][j] : -INFINITY;
      float block_max = m[h];
      for (int64_t j = 0; j < nk; j++)
        if (s[j] > block_max) block_max = s[j];
      correction[h] = exp_clamped(m[h] - block_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < BLOCK_KEYS; j++) {
        const float p = j < nk ? exp_clamped(s[j] - block_max) : 0.f;
        scores[h][j] = p;
        sum += p;
      }
      l[h] = l[h] * correction[h] + sum;
      m[h] = block_max;
    }
    for (int64_t kv = 0; kv < kv_count; kv++) {
      const int64_t at = (kv_first + kv) * d, h0 = kv * group;
#if WIDE_SCORES
      if (wide) {
        const void *values[BLOCK_KEYS];
        tile_rows(job->v_cache, slot, nk, stride, at, width, values);
        accumulate_tile(acc + h0, correction + h0, scores + h0, values, nk, d, group, is_bf16);
        continue;
      }
#endif
      for (int64_t g = 0; g < group; g++) {
#pragma omp simd
        for (int64_t i = 0; i < d; i++) acc[h0 + g][i] *= correction[h0 + g];
      }
      for (int64_t j = 0; j < nk; j++) {
        const float *value = cache_row(job->v_cache, slot[j] * stride + at, d, is_bf16, row);
        for (int64_t g = 0; g < group; g++) {
          const float p = scores[h0 + g][j];
#pragma omp simd
          for (int64_t i = 0; i < d; i++) acc[h0 + g][i] += p * value[i];
        }
      }
    }
  }
  for (int64_t kv = 0; kv < kv_count; kv++) {
    float *out = job->partial + ((seq * job->hkv + kv_first + kv) * job->splits + split) * group * (d + 2);
    for (int64_t g = 0; g < group; g++) {
      const int64_t h = kv * group + g;
      memcpy(out + g * (d + 2), acc[h], d * sizeof(float));
      out[g * (d + 2) + d] = m[h];
      out[g * (d + 2) + d + 1] = l[h];
    }
  }
}

#define SHAPE(D, G)                                                                     \
  if (d == D && group == G) {                                                           \
    if (job->is_bf16)                                                                   \
      attend_split_with(job, seq, kv_first, kv_count, split, D, G, 1);                  \
    else                                                                                \
      attend_split_with(job, seq, kv_first, kv_count, split, D, G, 0);                  \
    return;                                                                             \
  }

/* attend_split_with compiled for the common head sizes and GQA groups (constant trip counts
 * vectorize fully and keep the group in registers); any other shape through the general copy. */
static void attend_split(const Job *job, int64_t seq, int64_t kv_first, int64_t kv_count,
                         int64_t split) {
  const int64_t d = job->d, group = job->hq / job->hkv;
  SHAPE(64, 1) SHAPE(64, 2) SHAPE(64, 3) SHAPE(64, 4) SHAPE(64, 5) SHAPE(64, 6) SHAPE(64, 7)
  SHAPE(64, 8) SHAPE(128, 1) SHAPE(128, 2) SHAPE(128, 3) SHAPE(128, 4) SHAPE(128, 5)
  SHAPE(128, 6) SHAPE(128, 7) SHAPE(128, 8)
  attend_split_with(job, seq, kv_first, kv_count, split, d, group, job->is_bf16);
}

/* Merge one (sequence, query head)'s splits into the output row. */
static void merge_splits(const Job *job, void *out, int64_t seq, int64_t head) {
  const int64_t d = job->d, group = job->hq / job->hkv, kvh = head / group, g = head % group;
  const int64_t len = job->seq_lens[seq];
  const int64_t used = len <= 0 ? 0 : (len + job->split_keys - 1) / job->split_keys;
  float total_max = -INFINITY, total = 0.f, result[MAX_HEAD_DIM];
  const int64_t stride = group * (d + 2);
  const float *base = job->partial + (seq * job->hkv + kvh) * job->splits * stride + g * (d + 2);
  for (int64_t s = 0; s < used; s++)
    if (base[s * stride + d] > total_max) total_max = base[s * stride + d];
  for (int64_t i = 0; i < d; i++) result[i] = 0.f;
  for (int64_t s = 0; s < used; s++) {
    const float *part = base + s * stride;
    const float w = exp_clamped(part[d] - total_max);
    total += w * part[d + 1];
    for (int64_t i = 0; i < d; i++) result[i] += w * part[i];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const int64_t at = (seq * job->hq + head) * d;
  if (job->is_bf16) {
    uint16_t *o = (uint16_t *)out + at;
    for (int64_t i = 0; i < d; i++) o[i] = f32_to_bf16(result[i] * inv);
  } else {
    float *o = (float *)out + at;
    for (int64_t i = 0; i < d; i++) o[i] = result[i] * inv;
  }
}

/* Returns 0, or 1 when a shape exceeds the fixed buffers or kv_per_item does not divide the kv
 * heads (the caller falls back). */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, void *out,
                           float *partial, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                           int64_t block_size, int64_t table_stride, int64_t splits,
                           int64_t split_keys, int64_t kv_per_item, float scale, int is_bf16) {
  if (d > MAX_HEAD_DIM || hq % hkv != 0 || hq / hkv > MAX_GROUP) return 1;
  if (kv_per_item < 1 || hkv % kv_per_item != 0 || kv_per_item * (hq / hkv) > MAX_GROUP) return 1;
  Job job = {q, k_cache, v_cache, block_tables, seq_lens, partial, n, hq, hkv, d,
             block_size, table_stride, splits, split_keys, scale, is_bf16};
  /* An item takes kv_per_item kv heads of a sequence (the caller's choice: 1, or all). */
  const int64_t kv_items = hkv / kv_per_item;
  const int64_t items = n * kv_items * splits;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; item++) {
    const int64_t seq = item / (kv_items * splits), rest = item % (kv_items * splits);
    const int64_t split = rest % splits, kv_first = (rest / splits) * kv_per_item;
    if (split * split_keys < seq_lens[seq]) attend_split(&job, seq, kv_first, kv_per_item, split);
  }
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < n * hq; item++) merge_splits(&job, out, item / hq, item % hq);
  return 0;
}

/* One decode-only step's attention for a layer in one call, from the fused projection's rows:
 * each token's q and k rotated (layer_rows.h's rotary, the same code as layer_pointwise.c's),
 * its rotated k and its v written into its cache slot, then paged_decode_attention over the
 * rotated queries: what the rotary, KV write and decode calls answer one after the other, bit
 * for bit, with one call where there were three (each call a few microseconds of Python). The
 * step's fields are the same for every layer. */
typedef struct {
  const int64_t *positions, *slots; /* [n]: a negative slot is not written */
  const float *cos_sin;             /* [num_positions, 2 * half] fp32 */
  const int32_t *block_tables, *seq_lens;
  int64_t n, hq, hkv, d, half, cos_sin_stride, num_positions, num_slots, qkv_stride;
  int64_t block_size, table_stride, splits, split_keys, kv_per_item;
  int32_t is_neox, is_bf16;
} DecodeStep;

/* Returns 0; 2 where a position is outside the cos/sin cache, 3 where a slot is past the cache
 * (nothing written then); else paged_decode_attention's answer. qkv: [n, qkv_stride] rows of q
 * (hq heads), k and v (hkv heads each); q_rot: [n, hq, d] scratch; out: [n, hq, d]. */
int paged_decode_step(const DecodeStep *s, const void *qkv, void *k_cache, void *v_cache,
                      void *q_rot, void *out, float *partial, float scale) {
  for (int64_t t = 0; t < s->n; t++) {
    if (s->positions[t] < 0 || s->positions[t] >= s->num_positions) return 2;
    if (s->slots[t] >= s->num_slots) return 3;
  }
  const int64_t d = s->d, width = s->is_bf16 ? 2 : 4, row = s->hkv * d;
#pragma omp parallel for schedule(static) if (s->n * (s->hq + s->hkv) * d >= 32768)
  for (int64_t t = 0; t < s->n; t++) {
    const Rotation rotation = {s->cos_sin + s->positions[t] * s->cos_sin_stride, s->half, d,
                               s->is_neox, s->is_bf16};
    const int64_t at = t * s->qkv_stride;
    rotate_heads(&rotation, qkv, at, s->hq, q_rot, t * s->hq * d);
    if (s->slots[t] < 0) continue;
    rotate_heads(&rotation, qkv, at + s->hq * d, s->hkv, k_cache, s->slots[t] * row);
    memcpy((char *)v_cache + s->slots[t] * row * width,
           (const char *)qkv + (at + (s->hq + s->hkv) * d) * width, row * width);
  }
  return paged_decode_attention(q_rot, k_cache, v_cache, s->block_tables, s->seq_lens, out,
                                partial, s->n, s->hq, s->hkv, d, s->block_size, s->table_stride,
                                s->splits, s->split_keys, s->kv_per_item, scale, s->is_bf16);
}
