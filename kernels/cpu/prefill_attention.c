/* Prefill attention on the CPU's matrix units (AMX-BF16): runs of bf16 queries (prompt chunks,
 * a run of L at the end of a sequence of S tokens) over their sequences' paged caches, causal
 * bottom-right aligned (query i sees keys 0 .. S - L + i), GQA.
 *
 * Work items are (sequence, kv head, chunk of QUERY_CHUNK queries), taken by the threads as they
 * come free. An item walks the keys its queries see KEY_BLOCK at a time. It packs a block's keys
 * and values from the cache pages into the layouts a tile product takes for its second operand
 * (K^T: pairs of features by 16 keys; V: pairs of keys by 16 features), once for all its query
 * tiles and the query heads of its group; then per (tile of 16 queries, query head): scores
 * S = Q K^T on the tiles (fp32), the online-softmax update in vectors (each row's max, the
 * correction of what it had, P = exp(S - max), summed in fp32 and rounded to bf16 for the next
 * product, as torch's CPU flash attention rounds it), and P V on the tiles, added to the rows'
 * fp32 accumulators. Each query's output is its accumulator over its sum, in bf16.
 *
 * torch's SDPA, one call per sequence, ran SmolLM2's prompts at ~0.13 TFLOP/s on a 2-core Xeon
 * (a fifth of a 2,048-token prefill step); a tile product is 16 x 16 x 32 multiply-adds.
 *
 * Built by kernels/cpu_build.py; where the compiler's target has no AMX-BF16 (or the OS does not
 * grant the tile state) `prefill_attention` answers -1 and the caller runs SDPA.
 */
#define _GNU_SOURCE /* syscall (matrix_tiles.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "matrix_tiles.h"
#include "vector_math.h"

#define TILE 16         /* rows of a tile: queries of a query tile, keys of a key tile */
#define PAIR_STEP 32    /* bf16 inputs a tile product sums over: 16 pairs */
#define KEY_BLOCK 512   /* keys scored before an online-softmax update */
#define QUERY_CHUNK 64  /* queries of a work item */
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static int64_t amx_calls = 0; /* calls that ran on the matrix units (for tests) */

int64_t prefill_attention_calls(void) { return amx_calls; }

#if HAS_MATRIX_TILES
/* Every tile 16 rows of 64 bytes: 16 x 16 fp32 results, 16 x 32 bf16 inputs, 16 pairs x 16. */
static void configure_all_tiles(void) {
  const uint8_t rows[8] = {TILE, TILE, TILE, TILE, TILE, TILE, TILE, TILE};
  const uint16_t row_bytes[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  configure_tiles(8, rows, row_bytes);
}

/* Tiles by role. The intrinsics take a tile's number as written, so roles are macros. */
#define T_SCORES 0 /* S (fp32), then the first output tile */
#define T_QUERY 1
#define T_KEYS 2
#define T_WEIGHTS 3 /* P (bf16) */
#define T_VALUES 4
#define T_OUT1 5
#define T_OUT2 6
#define T_OUT3 7

typedef struct {
  const uint16_t *q, *k_cache, *v_cache;
  const int32_t *block_tables, *query_starts, *query_lens, *seq_lens;
  uint16_t *out;
  int64_t q_stride, out_stride, hq, hkv, d, block_size, table_stride;
  float scale;
} Job;

/* One thread's buffers for one item (sized by the call's head size and group). */
typedef struct {
  uint16_t *keys;    /* [KEY_BLOCK / TILE][d / PAIR_STEP][16 pairs][16 keys][2] */
  uint16_t *values;  /* [KEY_BLOCK / PAIR_STEP][d / TILE][16 pairs][16 features][2] */
  uint16_t *queries; /* [group][QUERY_CHUNK][d] */
  float *scores;     /* [TILE][KEY_BLOCK] */
  uint16_t *weights; /* [TILE][KEY_BLOCK] */
  float *tile_out;   /* [TILE][d] */
  float *acc;        /* [group][QUERY_CHUNK][d] */
  float *max, *sum;  /* [group][QUERY_CHUNK] */
} Scratch;

static __thread char *scratch_memory = NULL;
static __thread size_t scratch_capacity = 0;

static int take_scratch(Scratch *s, int64_t d, int64_t group) {
  const size_t sizes[8] = {KEY_BLOCK * d * 2,     KEY_BLOCK * d * 2,
                           group * QUERY_CHUNK * d * 2, TILE * KEY_BLOCK * 4,
                           TILE * KEY_BLOCK * 2,  TILE * d * 4,
                           group * QUERY_CHUNK * d * 4, 2 * group * QUERY_CHUNK * 4};
  size_t total = 0;
  for (int i = 0; i < 8; i++) total += (sizes[i] + 63) / 64 * 64;
  if (total > scratch_capacity) {
    free(scratch_memory);
    scratch_memory = aligned_alloc(64, total);
    scratch_capacity = scratch_memory ? total : 0;
    if (!scratch_memory) return 1;
  }
  char *at = scratch_memory;
  void *parts[8];
  for (int i = 0; i < 8; i++) parts[i] = at, at += (sizes[i] + 63) / 64 * 64;
  s->keys = parts[0], s->values = parts[1], s->queries = parts[2], s->scores = parts[3];
  s->weights = parts[4], s->tile_out = parts[5], s->acc = parts[6];
  s->max = parts[7], s->sum = (float *)parts[7] + group * QUERY_CHUNK;
  return 0;
}

/* The cache row of key `pos` of the sequence whose block table is `table`, kv head `kv`. */
static inline const uint16_t *cache_row(const Job *job, const uint16_t *cache,
                                        const int32_t *table, int64_t pos, int64_t kv) {
  const int64_t slot = (int64_t)table[pos / job->block_size] * job->block_size +
                       pos % job->block_size;
  return cache + (slot * job->hkv + kv) * job->d;
}

/* rows[j] <- column j of the 16 x 16 matrix of 32-bit words in rows[0..15]: unpacks of words,
 * of pairs, then two rounds of 128-bit lane shuffles (64 instructions where element by element
 * was 256 loads and stores). */
static inline void transpose_words_16(__m512i rows[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) { /* b[i + c], lane L: word 4L + c of rows i .. i + 3 */
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
    const __m512i e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xee);
    const __m512i e2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i e3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xee);
    rows[c] = _mm512_shuffle_i32x4(e0, e2, 0x88);
    rows[4 + c] = _mm512_shuffle_i32x4(e0, e2, 0xdd);
    rows[8 + c] = _mm512_shuffle_i32x4(e1, e3, 0x88);
    rows[12 + c] = _mm512_shuffle_i32x4(e1, e3, 0xdd);
  }
}

/* Keys [k0, k0 + n) packed as K^T tiles (a tile's row p: feature pair p of its 16 keys, a
 * transpose of the keys' 32-bit words) and values as V tiles (row p: keys 2p and 2p + 1's
 * features interleaved), zero past n up to whole steps. */
static void pack_block(const Job *job, const Scratch *s, const int32_t *table, int64_t kv,
                       int64_t k0, int64_t n) {
  const int64_t d = job->d, chunks = d / PAIR_STEP, features = d / TILE;
  const int64_t padded = (n + PAIR_STEP - 1) / PAIR_STEP * PAIR_STEP;
  for (int64_t j0 = 0; j0 < padded; j0 += TILE) {
    const uint16_t *rows[TILE];
    for (int64_t j = 0; j < TILE; j++)
      rows[j] = j0 + j < n ? cache_row(job, job->k_cache, table, k0 + j0 + j, kv) : NULL;
    for (int64_t c = 0; c < chunks; c++) {
      __m512i words[TILE];
      for (int64_t j = 0; j < TILE; j++)
        words[j] = rows[j] ? _mm512_loadu_si512(rows[j] + c * PAIR_STEP) : _mm512_setzero_si512();
      transpose_words_16(words);
      uint16_t *tile = s->keys + ((j0 / TILE) * chunks + c) * 512;
      for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(tile + p * 32, words[p]);
    }
  }
  for (int64_t j = 0; j < padded; j += 2) {
    const uint16_t *a = j < n ? cache_row(job, job->v_cache, table, k0 + j, kv) : NULL;
    const uint16_t *b = j + 1 < n ? cache_row(job, job->v_cache, table, k0 + j + 1, kv) : NULL;
    uint16_t *step = s->values + (j / PAIR_STEP) * features * 512 + (j % PAIR_STEP) / 2 * 32;
    for (int64_t f = 0; f < features; f++) {
      const __m512i low = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + f * 16)))
                            : _mm512_setzero_si512();
      const __m512i high = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + f * 16)))
                             : _mm512_setzero_si512();
      _mm512_storeu_si512(step + f * 512, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
    }
  }
}

/* S[0:16][0:16 * key_tiles] = the query tile (16 rows of d at `queries`) times the packed keys. */
static void score_tile(const Scratch *s, const uint16_t *queries, int64_t d, int64_t key_tiles) {
  const int64_t chunks = d / PAIR_STEP;
  for (int64_t t = 0; t < key_tiles; t++) {
    _tile_zero(T_SCORES);
    for (int64_t c = 0; c < chunks; c++) {
      _tile_loadd(T_QUERY, queries + c * PAIR_STEP, d * 2);
      _tile_loadd(T_KEYS, s->keys + (t * chunks + c) * 512, 64);
      _tile_dpbf16ps(T_SCORES, T_QUERY, T_KEYS);
    }
    _tile_stored(T_SCORES, s->scores + t * TILE, KEY_BLOCK * 4);
  }
}

/* The lanes of a 16-lane vector that hold the first `count` of its values (none when count is
 * not positive). */
static inline __mmask16 first_lanes(int64_t count) {
  return count <= 0 ? 0 : count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1);
}

/* Row r's online-softmax step over its `visible` scores (its weights zero from there to
 * `width`): returns the factor its accumulator is scaled by. */
static float softmax_row(const Scratch *s, int64_t r, int64_t visible, int64_t width,
                         float scale, float *max, float *sum) {
  const float *scores = s->scores + r * KEY_BLOCK;
  uint16_t *weights = s->weights + r * KEY_BLOCK;
  if (visible <= 0) {
    memset(weights, 0, width * 2);
    return 1.f;
  }
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < visible; j += 16) {
    const __mmask16 lanes = first_lanes(visible - j);
    top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, scores + j));
  }
  const float block_max = _mm512_reduce_max_ps(top) * scale;
  const float new_max = block_max > *max ? block_max : *max;
  const float correction = *max == -INFINITY ? 0.f : exp_clamped(*max - new_max);
  const __m512 scale_v = _mm512_set1_ps(scale), max_v = _mm512_set1_ps(new_max);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(
        first_lanes(visible - j), exp_fused_x16(_mm512_fmsub_ps(_mm512_loadu_ps(scores + j), scale_v, max_v)));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256((__m256i *)(weights + j), f32_to_bf16_x16(e));
  }
  *sum = *sum * correction + _mm512_reduce_add_ps(total);
  *max = new_max;
  return correction;
}

/* tile_out[0:16][0:d] = P (16 rows, `steps` steps of 32 keys) times the packed values. */
static void weigh_values(const Scratch *s, int64_t d, int64_t steps) {
  const int64_t features = d / TILE;
  for (int64_t f0 = 0; f0 < features; f0 += 4) {
    const int64_t n = features - f0 < 4 ? features - f0 : 4;
    _tile_zero(T_SCORES);
    if (n > 1) _tile_zero(T_OUT1);
    if (n > 2) _tile_zero(T_OUT2);
    if (n > 3) _tile_zero(T_OUT3);
    for (int64_t j = 0; j < steps; j++) {
      const uint16_t *v = s->values + (j * features + f0) * 512;
      _tile_loadd(T_WEIGHTS, s->weights + j * PAIR_STEP, KEY_BLOCK * 2);
      _tile_loadd(T_VALUES, v, 64);
      _tile_dpbf16ps(T_SCORES, T_WEIGHTS, T_VALUES);
      if (n > 1) {
        _tile_loadd(T_KEYS, v + 512, 64);
        _tile_dpbf16ps(T_OUT1, T_WEIGHTS, T_KEYS);
      }
      if (n > 2) {
        _tile_loadd(T_QUERY, v + 1024, 64);
        _tile_dpbf16ps(T_OUT2, T_WEIGHTS, T_QUERY);
      }
      if (n > 3) {
        _tile_loadd(T_VALUES, v + 1536, 64);
        _tile_dpbf16ps(T_OUT3, T_WEIGHTS, T_VALUES);
      }
    }
    float *out = s->tile_out + f0 * TILE;
    _tile_stored(T_SCORES, out, d * 4);
    if (n > 1) _tile_stored(T_OUT1, out + TILE, d * 4);
    if (n > 2) _tile_stored(T_OUT2, out + 2 * TILE, d * 4);
    if (n > 3) _tile_stored(T_OUT3, out + 3 * TILE, d * 4);
  }
}

/* One item: queries [c0, c1) of sequence `seq` (indices within its run), kv head `kv`. */
static void attend_item(const Job *job, const Scratch *s, int64_t seq, int64_t kv, int64_t c0,
                        int64_t c1) {
  const int64_t d = job->d, group = job->hq / job->hkv, rows = c1 - c0;
  const int64_t context = job->seq_lens[seq] - job->query_lens[seq];
  const int32_t *table = job->block_tables + seq * job->table_stride;
  const int64_t first_token = job->query_starts[seq] + c0;
  for (int64_t g = 0; g < group; g++) {
    uint16_t *queries = s->queries + g * QUERY_CHUNK * d;
    for (int64_t r = 0; r < QUERY_CHUNK; r++) {
      if (r < rows)
        memcpy(queries + r * d, job->q + (first_token + r) * job->q_stride + (kv * group + g) * d,
               d * 2);
      else
        memset(queries + r * d, 0, d * 2);
    }
    for (int64_t r = 0; r < rows; r++) {
      s->max[g * QUERY_CHUNK + r] = -INFINITY;
      s->sum[g * QUERY_CHUNK + r] = 0.f;
    }
    memset(s->acc + g * QUERY_CHUNK * d, 0, QUERY_CHUNK * d * 4);
  }
  const int64_t end = context + c1; /* keys the item's last query sees */
  for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
    const int64_t n = end - k0 < KEY_BLOCK ? end - k0 : KEY_BLOCK;
    pack_block(job, s, table, kv, k0, n);
    for (int64_t q0 = 0; q0 < rows; q0 += TILE) {
      const int64_t tile_rows = rows - q0 < TILE ? rows - q0 : TILE;
      const int64_t last_pos = context + c0 + q0 + tile_rows - 1; /* the tile's last query */
      if (last_pos < k0) continue;
      const int64_t seen = last_pos + 1 - k0 < n ? last_pos + 1 - k0 : n;
      const int64_t key_tiles = (seen + TILE - 1) / TILE;
      const int64_t steps = (seen + PAIR_STEP - 1) / PAIR_STEP;
      for (int64_t g = 0; g < group; g++) {
        const int64_t state = g * QUERY_CHUNK + q0;
        score_tile(s, s->queries + state * d, d, key_tiles);
        float correction[TILE];
        for (int64_t r = 0; r < tile_rows; r++) {
          const int64_t pos = context + c0 + q0 + r, visible = pos + 1 - k0;
          correction[r] = softmax_row(s, r, visible < seen ? visible : seen, steps * PAIR_STEP,
                                      job->scale, &s->max[state + r], &s->sum[state + r]);
        }
        for (int64_t r = tile_rows; r < TILE; r++) /* padding rows weigh nothing */
          memset(s->weights + r * KEY_BLOCK, 0, steps * PAIR_STEP * 2);
        weigh_values(s, d, steps);
        for (int64_t r = 0; r < tile_rows; r++) {
          float *acc = s->acc + (state + r) * d;
          const float *add = s->tile_out + r * d;
          const __m512 c = _mm512_set1_ps(correction[r]);
          for (int64_t f = 0; f < d; f += 16)
            _mm512_storeu_ps(acc + f, _mm512_fmadd_ps(_mm512_loadu_ps(acc + f), c,
                                                      _mm512_loadu_ps(add + f)));
        }
      }
    }
  }
  for (int64_t g = 0; g < group; g++)
    for (int64_t r = 0; r < rows; r++) {
      const int64_t state = g * QUERY_CHUNK + r;
      const float *acc = s->acc + state * d;
      const __m512 inv = _mm512_set1_ps(s->sum[state] > 0.f ? 1.f / s->sum[state] : 0.f);
      uint16_t *out = job->out + (first_token + r) * job->out_stride + (kv * group + g) * d;
      for (int64_t f = 0; f < d; f += 16)
        _mm256_storeu_si256((__m256i *)(out + f),
                            f32_to_bf16_x16(_mm512_mul_ps(_mm512_loadu_ps(acc + f), inv)));
    }
}
#endif

/* Whether this build has the matrix-unit path and the OS grants the tile state. */
int prefill_attention_ready(void) {
#if HAS_MATRIX_TILES
  return tiles_granted();
#else
  return 0;
#endif
}

/* out rows of m sequences' query runs (bf16): sequence i's queries are the query_lens[i] tokens
 * from row query_starts[i] of q ([tokens, q_stride]: hq heads of d from the row's start), the
 * last of its seq_lens[i] positions; its keys and values are in the paged caches ([blocks,
 * block_size, hkv, d]) by its block table row. Returns 0; -1 where this build or the OS has no
 * matrix units, 1 for a shape it does not take (d not whole pairs of tiles or over 256, GQA
 * groups over 16), 2 when its buffers cannot be allocated. */
int prefill_attention(const void *q, const void *k_cache, const void *v_cache, int64_t q_stride,
                      const int32_t *block_tables, const int32_t *query_starts,
                      const int32_t *query_lens, const int32_t *seq_lens, void *out,
                      int64_t out_stride, int64_t m, int64_t hq, int64_t hkv, int64_t d,
                      int64_t block_size, int64_t table_stride, float scale) {
#if HAS_MATRIX_TILES
  if (!tiles_granted()) return -1;
  if (d % PAIR_STEP || d > MAX_HEAD_DIM || hq % hkv || hq / hkv > MAX_GROUP) return 1;
  int64_t chunks = 0;
  for (int64_t i = 0; i < m; i++) chunks += (query_lens[i] + QUERY_CHUNK - 1) / QUERY_CHUNK;
  int64_t *firsts = malloc((chunks > 0 ? chunks : 1) * 2 * sizeof(int64_t)); /* (seq, c0) */
  if (!firsts) return 2;
  int64_t at = 0;
  for (int64_t i = 0; i < m; i++)
    for (int64_t c0 = 0; c0 < query_lens[i]; c0 += QUERY_CHUNK) firsts[at++] = i, firsts[at++] = c0;
  const Job job = {q, k_cache, v_cache, block_tables, query_starts, query_lens, seq_lens, out,
                   q_stride, out_stride, hq, hkv, d, block_size, table_stride, scale};
  int failed = 0; /* a thread without buffers: its items are not done */
#pragma omp parallel
  {
    Scratch s = {0};
    const int ready = take_scratch(&s, d, hq / hkv) == 0;
    if (ready) configure_all_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < chunks * hkv; item++) {
      const int64_t seq = firsts[2 * (item / hkv)], c0 = firsts[2 * (item / hkv) + 1];
      const int64_t c1 = c0 + QUERY_CHUNK < query_lens[seq] ? c0 + QUERY_CHUNK : query_lens[seq];
      if (ready) {
        attend_item(&job, &s, seq, item % hkv, c0, c1);
      } else {
#pragma omp atomic write
        failed = 1;
      }
    }
    if (ready) _tile_release();
  }
  free(firsts);
  if (failed) return 2;
  amx_calls++;
  return 0;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)q_stride, (void)block_tables, (void)query_starts;
  (void)query_lens, (void)seq_lens, (void)out, (void)out_stride, (void)m, (void)hq, (void)hkv;
  (void)d, (void)block_size, (void)table_stride, (void)scale;
  return -1;
#endif
}
