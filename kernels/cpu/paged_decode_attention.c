/* Paged decode attention on the CPU: one query token per sequence over its cached context.
 *
 * Work is split over (sequence, kv head, context split): each item reads its keys and values
 * once for all the query heads that share the kv head (GQA), keeps an online softmax in fp32,
 * and writes a partial result (max, sum, accumulator); a second pass merges a sequence's splits.
 * Splits keep both threads busy when few sequences decode with long contexts. fp32 or bf16 caches
 * and queries (bf16 widened to fp32 on load); the output has the query's type.
 *
 * Built by kernels/cpu_build.py with the compiler's OpenMP against the libgomp torch already
 * loaded (one thread pool in the process).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define BLOCK_KEYS 16 /* keys scored together before the softmax update */

static inline __attribute__((always_inline)) void load_row(const void *base, int64_t offset, int is_bf16, int d, float *out) {
  if (is_bf16) {
    const uint16_t *p = (const uint16_t *)base + offset;
#pragma omp simd
    for (int i = 0; i < d; i++) out[i] = bf16_to_f32(p[i]);
  } else {
    const float *p = (const float *)base + offset;
#pragma omp simd
    for (int i = 0; i < d; i++) out[i] = p[i];
  }
}

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
  load_row(cache, at, 1, (int)d, buffer);
  return buffer;
}

/* Ask for the key and value rows of keys [from, min(from + BLOCK_KEYS, end)) (of the kv head at
 * `head_offset` elements in a slot, `row_bytes` long) while this tile is scored: pages are
 * scattered, so the hardware prefetcher cannot see them coming. */
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
      __builtin_prefetch(k + line, 0, 3);
      __builtin_prefetch(v + line, 0, 3);
    }
  }
}

/* One (sequence, kv head, split): online softmax over keys [start, end), BLOCK_KEYS at a time;
 * each key row is read once and dotted with every query head of the group. (Storing a tile of
 * keys transposed to skip the dots' horizontal sums was slower: 3.9 against 2.7 ms for 64 fp32
 * decodes, both before `d` was made a constant; its scattered stores cost more than the sums.) Inlined with
 * `d`, `group` and the dtype constants for the common shapes (attend_split), so the group's queries
 * and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_split_with(
    const Job *job, int64_t seq, int64_t kvh, int64_t split, const int64_t d, const int64_t group,
    const int is_bf16) {
  const int64_t len = job->seq_lens[seq];
  const int64_t start = split * job->split_keys;
  int64_t end = start + job->split_keys;
  if (end > len) end = len;
  float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
  float m[MAX_GROUP], l[MAX_GROUP];
  float row[MAX_HEAD_DIM];
  float scores[MAX_GROUP][BLOCK_KEYS];
  for (int64_t g = 0; g < group; g++) {
    load_row(job->q, (seq * job->hq + kvh * group + g) * d, is_bf16, (int)d, q[g]);
    for (int64_t i = 0; i < d; i++) { q[g][i] *= job->scale; acc[g][i] = 0.f; }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  const int32_t *table = job->block_tables + seq * job->table_stride;
  const int64_t stride = job->hkv * d; /* elements from one slot to the next */
  const int64_t block_size = job->block_size;
  int64_t page = start / block_size, offset = start % block_size; /* of the next key */
  for (int64_t t0 = start; t0 < end; t0 += BLOCK_KEYS) {
    const int64_t nk = end - t0 < BLOCK_KEYS ? end - t0 : BLOCK_KEYS;
    prefetch_keys(job, table, t0 + BLOCK_KEYS, end, kvh * d, d * (is_bf16 ? 2 : 4));
    int64_t slot[BLOCK_KEYS];
    float raw[MAX_GROUP][BLOCK_KEYS];
    for (int64_t j = 0; j < nk; j++) {
      slot[j] = (int64_t)table[page] * block_size + offset;
      if (++offset == block_size) {
        offset = 0;
        page++;
      }
      const float *key = cache_row(job->k_cache, slot[j] * stride + kvh * d, d, is_bf16, row);
      for (int64_t g = 0; g < group; g++) raw[g][j] = dot(q[g], key, d);
    }
    for (int64_t g = 0; g < group; g++) {
      float s[BLOCK_KEYS];
      for (int64_t j = 0; j < BLOCK_KEYS; j++) s[j] = j < nk ? raw[g][j] : -INFINITY;
      float block_max = m[g];
      for (int64_t j = 0; j < nk; j++)
        if (s[j] > block_max) block_max = s[j];
      const float correction = exp_clamped(m[g] - block_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < BLOCK_KEYS; j++) {
        const float p = j < nk ? exp_clamped(s[j] - block_max) : 0.f;
        scores[g][j] = p;
        sum += p;
      }
      l[g] = l[g] * correction + sum;
#pragma omp simd
      for (int64_t i = 0; i < d; i++) acc[g][i] *= correction;
      m[g] = block_max;
    }
    for (int64_t j = 0; j < nk; j++) {
      const float *value = cache_row(job->v_cache, slot[j] * stride + kvh * d, d, is_bf16, row);
      for (int64_t g = 0; g < group; g++) {
        const float p = scores[g][j];
#pragma omp simd
        for (int64_t i = 0; i < d; i++) acc[g][i] += p * value[i];
      }
    }
  }
  float *out = job->partial + ((seq * job->hkv + kvh) * job->splits + split) * group * (d + 2);
  for (int64_t g = 0; g < group; g++) {
    memcpy(out + g * (d + 2), acc[g], d * sizeof(float));
    out[g * (d + 2) + d] = m[g];
    out[g * (d + 2) + d + 1] = l[g];
  }
}

#define SHAPE(D, G)                                                                     \
  if (d == D && group == G) {                                                           \
    if (job->is_bf16)                                                                   \
      attend_split_with(job, seq, kvh, split, D, G, 1);                                 \
    else                                                                                \
      attend_split_with(job, seq, kvh, split, D, G, 0);                                 \
    return;                                                                             \
  }

/* attend_split_with compiled for the common head sizes and GQA groups (constant trip counts
 * vectorize fully and keep the group in registers); any other shape through the general copy. */
static void attend_split(const Job *job, int64_t seq, int64_t kvh, int64_t split) {
  const int64_t d = job->d, group = job->hq / job->hkv;
  SHAPE(64, 1) SHAPE(64, 2) SHAPE(64, 3) SHAPE(64, 4) SHAPE(64, 5) SHAPE(64, 6) SHAPE(64, 7)
  SHAPE(64, 8) SHAPE(128, 1) SHAPE(128, 2) SHAPE(128, 3) SHAPE(128, 4) SHAPE(128, 5)
  SHAPE(128, 6) SHAPE(128, 7) SHAPE(128, 8)
  attend_split_with(job, seq, kvh, split, d, group, job->is_bf16);
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

/* Returns 0, or 1 when a shape exceeds the fixed buffers (the caller falls back). */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, void *out,
                           float *partial, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                           int64_t block_size, int64_t table_stride, int64_t splits,
                           int64_t split_keys, float scale, int is_bf16) {
  if (d > MAX_HEAD_DIM || hq % hkv != 0 || hq / hkv > MAX_GROUP) return 1;
  Job job = {q, k_cache, v_cache, block_tables, seq_lens, partial, n, hq, hkv, d,
             block_size, table_stride, splits, split_keys, scale, is_bf16};
  const int64_t items = n * hkv * splits;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < items; item++) {
    const int64_t seq = item / (hkv * splits), rest = item % (hkv * splits);
    if ((rest % splits) * split_keys < seq_lens[seq]) attend_split(&job, seq, rest / splits, rest % splits);
  }
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < n * hq; item++) merge_splits(&job, out, item / hq, item % hq);
  return 0;
}
