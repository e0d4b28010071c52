/* Helpers the CPU kernels share: scalar ones written so that loops over them vectorize (bf16 <->
 * fp32 as torch converts, exp as a polynomial: libm's expf is a call per element), and where the
 * compiler targets AVX-512 their 16-lane forms with the same bits (the conversions, the bf16
 * rounding, exp and silu-and-mul) for kernels that keep a row in registers. */
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

/* f32_to_bf16 of 16 lanes at once (to nearest even, NaN kept quiet). Where the CPU converts to
 * bf16 itself (AVX512-BF16), one instruction: the same bits, except that it reads a denormal
 * (below 1.2e-38) as zero, where f32_to_bf16 keeps it. */
#if defined(__AVX512BF16__)
static inline __m256i f32_to_bf16_x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
static inline __m256i f32_to_bf16_x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}
#endif

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

#if defined(__AVX512F__)
/* as_dtype of 16 lanes (the same bits as f32_to_bf16 then back): within 32-bit lanes, or where
 * the CPU converts to bf16 itself, its conversion there and back (4 instructions against 10). */
static inline __attribute__((always_inline)) __m512 as_dtype_x16(__m512 v, int is_bf16) {
  if (!is_bf16) return v;
#if defined(__AVX512BF16__)
  return bf16_to_f32_x16(f32_to_bf16_x16(v)); /* the conversion instruction, there and back */
#else
  const __m512i bits = _mm512_castps_si512(v), high = _mm512_set1_epi32((int32_t)0xffff0000);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, bias), high);
  const __m512i quiet =
      _mm512_or_si512(_mm512_and_si512(bits, high), _mm512_set1_epi32(0x400000));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, rounded, quiet));
#endif
}

/* exp_clamped of 16 lanes, operation for operation (products and sums unfused, as the build's
 * -std=c11 leaves the scalar code), so the same bits in every lane (exp_fused_x16 below: faster,
 * other bits). */
static inline __attribute__((always_inline)) __m512 exp_clamped_x16(__m512 x) {
  /* the clamp (NaN kept), then n = roundf(x log2 e) as gcc writes it: truncate y + copysign(0.5
   * less half an ulp, y) */
  x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-87.f), x));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(INT32_MIN));
  const __m512 nudge = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x3effffff)));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_add_ps(y, nudge), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-06f)));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f / 120.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f / 24.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f / 6.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* exp_clamped of 16 lanes with the same reduction and polynomial, fused (multiply-adds) and 2^n
 * applied by scalef: faster, not the same bits, for kernels whose weights share no bits with the
 * scalar exp (the attention kernels' softmax). */
static inline __attribute__((always_inline)) __m512 exp_fused_x16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

/* silu_times of 16 lanes (the same bits): dtype(dtype(silu(gate)) * up). */
static inline __attribute__((always_inline)) __m512 silu_times_x16(__m512 gate, __m512 up,
                                                                    int is_bf16) {
  const __m512i sign = _mm512_set1_epi32(INT32_MIN); /* -gate by its sign bit, as the scalar */
  const __m512 e = exp_clamped_x16(_mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(gate), sign))); /* exp(-gate) */
  const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(as_dtype_x16(silu, is_bf16), up);
}
#endif

/* gate[i] = dtype(dtype(silu(gate[i])) * up[i]) (before the final rounding): silu-and-mul as
 * kernels/activation.py's torch reference rounds it. */
static inline void silu_times(float *restrict gate, const float *restrict up, int64_t n,
                              int is_bf16) {
  for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.f + exp_clamped(-gate[i]));
  as_dtype(gate, n, is_bf16);
  for (int64_t i = 0; i < n; i++) gate[i] *= up[i];
}

#endif
