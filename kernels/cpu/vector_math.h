/* Helpers the CPU kernels share: scalar ones written so that loops over them vectorize (bf16 <->
 * fp32 as torch converts, exp as a polynomial: libm's expf is a call per element), and the
 * bf16 <-> fp32 conversions of 16 lanes where the compiler targets AVX-512. */
#ifndef SHOAL_VECTOR_MATH_H
#define SHOAL_VECTOR_MATH_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; NaN kept */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40;
  return (uint16_t)((bits & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* f32_to_bf16 of 16 lanes at once (to nearest even, NaN kept quiet). */
static inline __m256i f32_to_bf16_x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* 16 bf16 values widened to fp32. */
static inline __m512 bf16_to_f32_x16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* 16 values of an fp32 or bf16 array from element `at` on, as fp32. */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t at,
                                                          int is_bf16) {
  if (!is_bf16) return _mm512_loadu_ps((const float *)base + at);
  return bf16_to_f32_x16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at)));
}
#endif

/* exp(x): x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for exp(r) (relative error ~2e-7),
 * 2^n built in the exponent bits; x clamped to [-87, 88] (no inf, no denormals: exp(-inf) is
 * about 1.6e-38, not 0). The clamp vectorizes under -fno-trapping-math (cpu_build's flags). */
static inline float exp_clamped(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_roundf(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

/* What torch's op in the tensor's dtype leaves of fp32 results: themselves, or rounded to bf16. */
static inline void as_dtype(float *v, int64_t n, int is_bf16) {
  if (is_bf16)
    for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

/* gate[i] = dtype(dtype(silu(gate[i])) * up[i]) (before the final rounding): silu-and-mul as
 * kernels/activation.py's torch reference rounds it. */
static inline void silu_times(float *restrict gate, const float *restrict up, int64_t n,
                              int is_bf16) {
  for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.f + exp_clamped(-gate[i]));
  as_dtype(gate, n, is_bf16);
  for (int64_t i = 0; i < n; i++) gate[i] *= up[i];
}

#endif
