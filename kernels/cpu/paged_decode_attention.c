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
 * dot per key, fp32 1.76 against 2.04. bf16 on a CPU with AMX takes the matrix path
 * (MATRIX_DECODE, below): scores on the tiles, values by bf16 pair products.
 *
 * Built by kernels/cpu_build.py with the compiler's OpenMP against the libgomp torch already
 * loaded (one thread pool in the process).
 */
#define _GNU_SOURCE /* syscall (matrix_tiles.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_rows.h"
#include "matrix_tiles.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define WIDE_SCORES 1 /* a tile's 16 scores per query head summed as one vector (below) */
#else
#define WIDE_SCORES 0
#endif

#if WIDE_SCORES && HAS_MATRIX_TILES && defined(__AVX512BF16__)
#define MATRIX_DECODE 1 /* bf16 scores on the matrix units (below) */
#else
#define MATRIX_DECODE 0
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
  int matrix; /* bf16 items on the matrix units (matrix_path_for) */
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

/* The slots of keys [from, min(from + BLOCK_KEYS, end)) in `slots`; returns how many. */
static inline int64_t tile_slots(const int32_t *table, int64_t block_size, int64_t from,
                                 int64_t end, int64_t slots[BLOCK_KEYS]) {
  int64_t count = 0;
  for (int64_t pos = from; pos < end && count < BLOCK_KEYS; pos++)
    slots[count++] = (int64_t)table[pos / block_size] * block_size + pos % block_size;
  return count;
}

/* Ask for one kv head's key and value rows (`at` elements into each of `count` slots, `row_bytes`
 * long) of the next tile, into L1, just before this tile's work on that head: pages are
 * scattered, so the hardware prefetchers do not see them coming, and a head's rows at a time
 * keep the requests in flight few enough that the work goes on beside them (the whole next
 * tile asked for at once, into L2, stalled it behind the requests). 64 decodes of SmolLM2
 * (180-320 keys, 30 layers' caches in turn), 2-core Xeon, interleaved builds: fp32 1.48 -> 1.21
 * ms a layer, bf16 0.98 -> 0.87 (vector path), 1.01 -> 0.76 (matrix path); into L2 the same way
 * fp32 1.36. A plain read of the same pages runs at ~30 GB/s here (fp32 0.83 ms). */
static inline void prefetch_head_rows(const Job *job, const int64_t *slots, int64_t count,
                                      int64_t at, int64_t row_bytes) {
  const int64_t width = job->is_bf16 ? 2 : 4, stride = job->hkv * job->d;
  for (int64_t j = 0; j < count; j++) {
    const char *k = (const char *)job->k_cache + (slots[j] * stride + at) * width;
    const char *v = (const char *)job->v_cache + (slots[j] * stride + at) * width;
    for (int64_t line = 0; line < row_bytes; line += 64) {
      __builtin_prefetch(k + line, 0, 3);
      __builtin_prefetch(v + line, 0, 3);
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

#if MATRIX_DECODE
/* bf16 decodes on the matrix units: an item's scores for a tile of 16 keys (one page's rows at
 * a fixed stride) come from one tile product per 32 features, the 16 key rows loaded as they lie
 * in the cache times the group's queries transposed (pairs of features by query heads), so no
 * dot is summed across lanes; the values are weighed by the CPU's bf16 dot products, two keys at
 * a time (their rows interleaved, the pair of weights broadcast), the weights rounded to bf16 as
 * torch's CPU flash attention and the prefill kernel round them. 64 decodes of SmolLM2 (180-320
 * keys, 30 layers' caches in turn) on a 2-core Xeon with AMX, interleaved builds: 0.87 ms a layer
 * on the vector path, 0.67 here; from L2 (4 pages read over and over) 0.46 and 0.33. */
#define T_SCORES 0  /* 16 keys x the group's query heads, fp32 */
#define T_KEYS 1    /* 16 key rows x 32 bf16 */
#define T_QUERIES 2 /* 16 pairs of features x the group's query heads */
#define MATRIX_MAX_GROUP 16

static int matrix_allowed = 1; /* the tests' switch (paged_decode_set_matrix_units) */
static int64_t matrix_calls = 0;

static void configure_decode_tiles(int64_t group) {
  const uint8_t rows[3] = {BLOCK_KEYS, BLOCK_KEYS, BLOCK_KEYS};
  const uint16_t row_bytes[3] = {(uint16_t)(group * 4), 64, (uint16_t)(group * 4)};
  configure_tiles(3, rows, row_bytes);
}

/* Whether this call's decodes go to the matrix units: bf16, whole 32-feature steps, groups that
 * fit a tile's 16 columns, and every 16-key tile inside one page (pages and pieces of whole
 * tiles). */
static int matrix_path_for(const Job *job) {
  return matrix_allowed && job->is_bf16 && job->d % 32 == 0 &&
         job->hq / job->hkv <= MATRIX_MAX_GROUP && job->block_size % BLOCK_KEYS == 0 &&
         (job->splits == 1 || job->split_keys % BLOCK_KEYS == 0) && tiles_granted();
}

/* The first lanes of a 16-lane vector, up to `count`. */
static inline __mmask16 lanes_below(int64_t count) {
  return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}

/* acc (16 features of each half of a 32-feature step, in the order the interleaved products
 * leave them: lane 4L + i holds feature 8L + i of the low half, 8L + 4 + i of the high) back to
 * feature order, into `out`. */
static inline void store_in_feature_order(const float *acc, int64_t d, float *out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c = 0; c < d; c += 32) {
    const __m512 low = _mm512_loadu_ps(acc + c), high = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(low, first, high));
    _mm512_storeu_ps(out + c + 16, _mm512_permutex2var_ps(low, second, high));
  }
}

/* acc[g] = acc[g] * correction[g] + the tile's nk values weighed by pairs[g] (weights of keys
 * 2p and 2p + 1 as one bf16 pair), 32 features at a time with the group's sums in registers. */
static inline __attribute__((always_inline)) void weigh_values_in_pairs(
    float acc[][MAX_HEAD_DIM], const float *correction, const uint32_t pairs[][BLOCK_KEYS / 2],
    const uint16_t *values, int64_t stride, int64_t nk, int64_t d, int64_t group) {
  for (int64_t c = 0; c < d; c += 32) {
    __m512 low[MATRIX_MAX_GROUP], high[MATRIX_MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
      const __m512 by = _mm512_set1_ps(correction[g]);
      low[g] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + c), by);
      high[g] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + c + 16), by);
    }
    for (int64_t j = 0; j < nk; j += 2) {
      const __m512i a = _mm512_loadu_si512(values + j * stride + c);
      const __m512i b = j + 1 < nk ? _mm512_loadu_si512(values + (j + 1) * stride + c)
                                   : _mm512_setzero_si512(); /* past the context: not read */
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int64_t g = 0; g < group; g++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[g][j / 2]);
        low[g] = _mm512_dpbf16_ps(low[g], lo, w);
        high[g] = _mm512_dpbf16_ps(high[g], hi, w);
      }
    }
    for (int64_t g = 0; g < group; g++) {
      _mm512_storeu_ps(acc[g] + c, low[g]);
      _mm512_storeu_ps(acc[g] + c + 16, high[g]);
    }
  }
}

/* attend_split_with's item on the matrix units (the calling thread's tiles configured for the
 * call's group). */
static inline __attribute__((always_inline)) void attend_split_matrix(
    const Job *job, int64_t seq, int64_t kv_first, int64_t kv_count, int64_t split,
    const int64_t d, const int64_t group) {
  const int64_t len = job->seq_lens[seq];
  const int64_t start = split * job->split_keys;
  int64_t end = start + job->split_keys;
  if (end > len) end = len;
  const int64_t heads = kv_count * group, first_head = seq * job->hq + kv_first * group;
  const int64_t steps = d / 32, stride = job->hkv * d;
  /* queries[kv][step][pair p][g]: features 2p, 2p + 1 of the step, query head g of kv head kv */
  uint32_t queries[MAX_GROUP * (MAX_HEAD_DIM / 32) * 16];
  float acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP], correction[MAX_GROUP];
  float weights[BLOCK_KEYS], scores[BLOCK_KEYS * BLOCK_KEYS];
  uint32_t pairs[MAX_GROUP][BLOCK_KEYS / 2];
  for (int64_t h = 0; h < heads; h++) {
    const uint32_t *row = (const uint32_t *)((const uint16_t *)job->q + (first_head + h) * d);
    const int64_t kv = h / group, g = h % group;
    for (int64_t w = 0; w < d / 2; w++)
      queries[((kv * steps + w / 16) * 16 + w % 16) * group + g] = row[w];
    memset(acc[h], 0, d * sizeof(float));
    m[h] = -INFINITY;
    l[h] = 0.f;
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)group));
  const __m512 scale = _mm512_set1_ps(job->scale);
  const int32_t *table = job->block_tables + seq * job->table_stride;
  const int64_t block_size = job->block_size;
  for (int64_t t0 = start; t0 < end; t0 += BLOCK_KEYS) {
    const int64_t nk = end - t0 < BLOCK_KEYS ? end - t0 : BLOCK_KEYS;
    const int64_t first_slot = (int64_t)table[t0 / block_size] * block_size + t0 % block_size;
    int64_t next[BLOCK_KEYS];
    const int64_t coming = tile_slots(table, block_size, t0 + BLOCK_KEYS, end, next);
    const __mmask16 valid = lanes_below(nk);
    for (int64_t kv = 0; kv < kv_count; kv++) {
      const int64_t at = first_slot * stride + (kv_first + kv) * d, h0 = kv * group;
      const uint16_t *keys = (const uint16_t *)job->k_cache + at;
      prefetch_head_rows(job, next, coming, (kv_first + kv) * d, d * 2);
      _tile_zero(T_SCORES);
      for (int64_t step = 0; step < steps; step++) {
        _tile_loadd(T_KEYS, keys + step * 32, stride * 2);
        _tile_loadd(T_QUERIES, queries + (kv * steps + step) * 16 * group, group * 4);
        _tile_dpbf16ps(T_SCORES, T_KEYS, T_QUERIES);
      }
      _tile_stored(T_SCORES, scores, group * 4); /* row j: key j's score by each query head */
      for (int64_t g = 0; g < group; g++) {
        const __m512 s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, column, scores + g, 4);
        correction[h0 + g] = softmax_tile(_mm512_mul_ps(s, scale), valid, &m[h0 + g], &l[h0 + g], weights);
        _mm256_storeu_si256((__m256i *)pairs[h0 + g], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights)));
      }
      weigh_values_in_pairs(acc + h0, correction + h0, pairs + h0,
                            (const uint16_t *)job->v_cache + at, stride, nk, d, group);
    }
  }
  for (int64_t kv = 0; kv < kv_count; kv++) {
    float *out = job->partial + ((seq * job->hkv + kv_first + kv) * job->splits + split) * group * (d + 2);
    for (int64_t g = 0; g < group; g++) {
      const int64_t h = kv * group + g;
      store_in_feature_order(acc[h], d, out + g * (d + 2));
      out[g * (d + 2) + d] = m[h];
      out[g * (d + 2) + d + 1] = l[h];
    }
  }
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
    int64_t next[BLOCK_KEYS];
    const int64_t coming = tile_slots(table, block_size, t0 + BLOCK_KEYS, end, next);
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
      prefetch_head_rows(job, next, coming, at, d * (is_bf16 ? 2 : 4));
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
#if MATRIX_DECODE
#define MATRIX_SHAPE(D, G)                                                   \
  if (d == D && group == G) {                                                \
    attend_split_matrix(job, seq, kv_first, kv_count, split, D, G);          \
    return;                                                                  \
  }

/* attend_split_matrix likewise, for the calls matrix_path_for sends it. */
static void attend_matrix(const Job *job, int64_t seq, int64_t kv_first, int64_t kv_count,
                          int64_t split) {
  const int64_t d = job->d, group = job->hq / job->hkv;
  MATRIX_SHAPE(64, 1) MATRIX_SHAPE(64, 2) MATRIX_SHAPE(64, 3) MATRIX_SHAPE(64, 4)
  MATRIX_SHAPE(64, 8) MATRIX_SHAPE(128, 1) MATRIX_SHAPE(128, 2) MATRIX_SHAPE(128, 4)
  MATRIX_SHAPE(128, 8)
  attend_split_matrix(job, seq, kv_first, kv_count, split, d, group);
}
#endif

static void attend_split(const Job *job, int64_t seq, int64_t kv_first, int64_t kv_count,
                         int64_t split) {
  const int64_t d = job->d, group = job->hq / job->hkv;
#if MATRIX_DECODE
  if (job->matrix) {
    attend_matrix(job, seq, kv_first, kv_count, split);
    return;
  }
#endif
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
             block_size, table_stride, splits, split_keys, scale, is_bf16, 0};
#if MATRIX_DECODE
  job.matrix = matrix_path_for(&job);
#endif
  /* An item takes kv_per_item kv heads of a sequence (the caller's choice: 1, or all). */
  const int64_t kv_items = hkv / kv_per_item;
  const int64_t items = n * kv_items * splits;
#pragma omp parallel
  {
#if MATRIX_DECODE
    if (job.matrix) configure_decode_tiles(hq / hkv);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
      const int64_t seq = item / (kv_items * splits), rest = item % (kv_items * splits);
      const int64_t split = rest % splits, kv_first = (rest / splits) * kv_per_item;
      if (split * split_keys < seq_lens[seq]) attend_split(&job, seq, kv_first, kv_per_item, split);
    }
#if MATRIX_DECODE
    if (job.matrix) _tile_release();
#endif
  }
#if MATRIX_DECODE
  if (job.matrix) matrix_calls++;
#endif
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

/* The tests' view of the matrix path: whether this build and the OS give it the tiles, calls it
 * served, and a switch (on unless set off) to run bf16 decodes on the vector path instead. */
int paged_decode_matrix_ready(void) {
#if MATRIX_DECODE
  return tiles_granted();
#else
  return 0;
#endif
}

int64_t paged_decode_matrix_calls(void) {
#if MATRIX_DECODE
  return matrix_calls;
#else
  return 0;
#endif
}

void paged_decode_set_matrix_units(int allowed) {
#if MATRIX_DECODE
  matrix_allowed = allowed;
#else
  (void)allowed;
#endif
}
