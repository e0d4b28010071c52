/* The row-wise ops between a decoder layer's matmuls, on the CPU, each one pass over its rows:
 * RMSNorm with the residual add fused in, rotary embedding of q and k, silu(gate) * up, and the
 * write of this step's keys and values into their cache pages.
 *
 * Eager PyTorch runs each of these as 3-10 small ops (casts, reductions, elementwise products,
 * boolean indexing) whose dispatch costs more than their arithmetic at decode batch sizes; here
 * each is one call. Arithmetic follows the torch references (in kernels/) step by step,
 * including where they round to bf16, so results differ from them only by the order of a sum
 * and the last bit of an exp: fp32 or bf16 tensors, fp32 arithmetic.
 *
 * Built by kernels/cpu_build.py with the compiler's OpenMP against the libgomp torch already
 * loaded (one thread pool in the process); large calls split their rows across threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "layer_rows.h"

#define PARALLEL_MIN_ELEMENTS 32768 /* below this a call runs on one thread: a fork costs more */
#define LANES 16 /* partial sums of a row's squares (one AVX-512 register of fp32) */

/* The sum of v[i]^2 in LANES columns (as a vector unit adds), then across them. */
static inline float sum_of_squares(const float *v, int64_t n) {
  float lanes[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int lane = 0; lane < LANES; lane++) lanes[lane] += v[i + lane] * v[i + lane];
  for (; i < n; i++) lanes[i % LANES] += v[i] * v[i];
  float total = 0.f;
  for (int lane = 0; lane < LANES; lane++) total += lanes[lane];
  return total;
}

#if defined(__AVX512F__)
#define WIDE_ROWS 1 /* rows of whole 16-lane vectors take the intrinsics below */

/* One row of rms_norm (below) with `hidden` a multiple of 16: the same operations in the same
 * order (products and sums unfused, the squares summed in 16 lanes then across them in lane
 * order), so the same bits, in vector registers. SmolLM2's bf16 rows of 576 with the residual
 * (same-process A/B, 2-core Xeon): 16 rows 9.4 -> 7.6 us, 64 rows 20.5 -> 17.9. */
static void rms_norm_row_wide(const void *x, const void *residual, const void *weight, void *out,
                              void *residual_out, int64_t row, int64_t hidden, int64_t x_stride,
                              float eps, int is_bf16) {
  float s[hidden];
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 v = load16(x, row * x_stride + i, is_bf16);
    if (residual) {
      v = as_dtype_x16(_mm512_add_ps(v, load16(residual, row * hidden + i, is_bf16)), is_bf16);
      store16(residual_out, row * hidden + i, v, is_bf16);
    }
    _mm512_storeu_ps(s + i, v);
    squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
  }
  float lanes[16], total = 0.f;
  _mm512_storeu_ps(lanes, squares);
  for (int lane = 0; lane < 16; lane++) total += lanes[lane];
  const __m512 inv_rms = _mm512_set1_ps(1.f / sqrtf(total / (float)hidden + eps));
  for (int64_t i = 0; i < hidden; i += 16) {
    const __m512 normed = as_dtype_x16(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv_rms), is_bf16);
    store16(out, row * hidden + i, _mm512_mul_ps(normed, load16(weight, i, is_bf16)), is_bf16);
  }
}
#else
#define WIDE_ROWS 0
#endif

/* out = weight * dtype(s * rsqrt(mean(s^2) + eps)) with s = dtype(x + residual) (or x alone when
 * residual is NULL); s is written to residual_out when given. Rows are `x_stride` elements apart
 * in x; every other tensor is contiguous [rows, hidden]. */
void rms_norm(const void *x, const void *residual, const void *weight, void *out,
              void *residual_out, int64_t rows, int64_t hidden, int64_t x_stride, float eps,
              int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
  for (int64_t row = 0; row < rows; row++) {
#if WIDE_ROWS
    if (hidden % 16 == 0) {
      rms_norm_row_wide(x, residual, weight, out, residual_out, row, hidden, x_stride, eps,
                        is_bf16);
      continue;
    }
#endif
    float s[hidden], other[hidden];
    load_row(x, row * x_stride, hidden, is_bf16, s);
    if (residual) {
      load_row(residual, row * hidden, hidden, is_bf16, other);
      for (int64_t i = 0; i < hidden; i++) s[i] += other[i];
      as_dtype(s, hidden, is_bf16);
      store_row(residual_out, row * hidden, hidden, is_bf16, s);
    }
    const float inv_rms = 1.f / sqrtf(sum_of_squares(s, hidden) / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) s[i] *= inv_rms;
    as_dtype(s, hidden, is_bf16);
    load_row(weight, 0, hidden, is_bf16, other);
    for (int64_t i = 0; i < hidden; i++) s[i] *= other[i];
    store_row(out, row * hidden, hidden, is_bf16, s);
  }
}

/* Rotated copies of q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] (tokens
 * `q_stride`/`k_stride` elements apart, heads `head_dim` apart) into contiguous q_out and k_out;
 * cos/sin rows from the fp32 cache [num_positions, 2 * half] (cos then sin), cast to the dtype
 * first. Returns how many positions were outside the cache (those tokens are left unwritten). */
int64_t rotary(const void *q, const void *k, void *q_out, void *k_out, const int64_t *positions,
               const float *cos_sin_cache, int64_t tokens, int64_t q_heads, int64_t kv_heads,
               int64_t head_dim, int64_t half, int64_t q_stride, int64_t k_stride,
               int64_t cache_stride, int64_t num_positions, int is_neox, int is_bf16) {
  int64_t outside = 0;
#pragma omp parallel for schedule(static) reduction(+ : outside) \
    if (tokens * (q_heads + kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t t = 0; t < tokens; t++) {
    if (positions[t] < 0 || positions[t] >= num_positions) {
      outside++;
      continue;
    }
    const Rotation rotation = {cos_sin_cache + positions[t] * cache_stride, half, head_dim,
                               is_neox, is_bf16};
    rotate_heads(&rotation, q, t * q_stride, q_heads, q_out, (t * q_heads) * head_dim);
    rotate_heads(&rotation, k, t * k_stride, kv_heads, k_out, (t * kv_heads) * head_dim);
  }
  return outside;
}

/* out[r, i] = dtype(dtype(silu(x[r, i])) * x[r, inter + i]); x rows `x_stride` apart, out
 * contiguous [rows, inter]. */
void silu_and_mul(const void *x, void *out, int64_t rows, int64_t inter, int64_t x_stride,
                  int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    float gate[inter], up[inter];
    load_row(x, r * x_stride, inter, is_bf16, gate);
    load_row(x, r * x_stride + inter, inter, is_bf16, up);
    silu_times(gate, up, inter, is_bf16);
    store_row(out, r * inter, inter, is_bf16, gate);
  }
}

/* Cache slot slots[t] (block * block_size + offset) of each cache gets token t's row of
 * `row_elems` values (its kv heads); a negative slot skips the token. Rows of key and value are
 * `key_stride`/`value_stride` elements apart; caches hold `num_slots` rows contiguously, tensors
 * one dtype. Returns how many slots were past the caches (not written). */
int64_t write_kv(const void *key, const void *value, void *k_cache, void *v_cache,
                 const int64_t *slots, int64_t tokens, int64_t row_elems, int64_t key_stride,
                 int64_t value_stride, int64_t num_slots, int is_bf16) {
  const int64_t width = is_bf16 ? 2 : 4, row_bytes = row_elems * width;
  int64_t past_end = 0;
  /* split across the threads for a prompt's rows: each thread's stores wait on their own lines */
#pragma omp parallel for schedule(static) reduction(+ : past_end) \
    if (tokens * row_elems >= PARALLEL_MIN_ELEMENTS)
  for (int64_t t = 0; t < tokens; t++) {
    if (slots[t] < 0) continue;
    if (slots[t] >= num_slots) {
      past_end++;
      continue;
    }
    memcpy((char *)k_cache + slots[t] * row_bytes, (const char *)key + t * key_stride * width,
           row_bytes);
    memcpy((char *)v_cache + slots[t] * row_bytes, (const char *)value + t * value_stride * width,
           row_bytes);
  }
  return past_end;
}
