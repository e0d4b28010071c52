/* Scalar helpers the CPU kernels share, written so that loops over them vectorize: bf16 <-> fp32
 * as torch converts, and exp as a polynomial (libm's expf is a call per element). */
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
