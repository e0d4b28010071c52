/* A decode step's dense decoder layers in one call: for each layer, RMSNorm (with the residual
 * add), the fused q/k/v product, rotary + K/V write + decode attention, the output product,
 * RMSNorm again, the gated MLP's gate/up product with silu(gate) * up, and the down product.
 * Each piece is the kernel the layer-by-layer path calls (strip_gemm.c's products on packed
 * floats or on 4- or 8-bit codes, layer_pointwise.c's RMSNorm and silu-and-mul,
 * paged_decode_attention.c's decode step), reached through pointers the caller fills in, in the
 * same order on the same buffers' values: the same bits, with one call for the step's layers
 * where there were seven kernel calls and a dozen module calls a layer, each costing more in
 * Python than its arithmetic at decode batch sizes.
 * Nothing here computes on its own.
 */
#include <stdint.h>
#include <string.h>

typedef int (*GemmFn)(const void *packed, const void *x, const void *bias, void *out,
                      int64_t rows, int64_t n, int64_t k, int64_t x_stride, int is_bf16);
typedef int (*GatedGemmFn)(const void *packed, const void *x, const void *bias, void *out,
                           int64_t rows, int64_t inter, int64_t k, int64_t x_stride);
typedef void (*RmsNormFn)(const void *x, const void *residual, const void *weight, void *out,
                          void *residual_out, int64_t rows, int64_t hidden, int64_t x_stride,
                          float eps, int is_bf16);
typedef void (*SiluAndMulFn)(const void *x, void *out, int64_t rows, int64_t inter,
                             int64_t x_stride, int is_bf16);
typedef int (*Int4GemmFn)(const void *codes, const void *scales, const void *x, const void *bias,
                          void *out, int64_t rows, int64_t n, int64_t k, int64_t group,
                          int64_t x_stride, int round_x);
typedef int (*Int8GemmFn)(const void *codes, const void *scales, const void *x, const void *bias,
                          void *out, int64_t rows, int64_t n, int64_t k, int64_t group,
                          int64_t x_stride);
typedef int (*DecodeStepFn)(const void *step, const void *qkv, void *k_cache, void *v_cache,
                            void *q_rot, void *out, float *partial, float scale);

/* The kernels, the step's shapes and its scratch rows (all contiguous [rows, width]). */
typedef struct {
  GemmFn gemm;
  GatedGemmFn gated_gemm; /* answers nonzero where it has no path (then gemm, silu_and_mul) */
  Int4GemmFn int4_gemm;
  Int8GemmFn int8_gemm;
  RmsNormFn rms_norm;
  SiluAndMulFn silu_and_mul;
  DecodeStepFn decode_step;
  const void *decode_fields; /* the step's DecodeStep (paged_decode_attention.c) */
  void *normed, *qkv, *q_rot, *attn, *gate_up, *act; /* scratch */
  float *partial;                                    /* the decode kernel's scratch */
  int64_t rows, hidden, qkv_width, attn_width, inter;
  float eps, scale;
  int32_t is_bf16;
} LayerSteps;

/* A linear's weight: packed floats (bits 0: strip_gemm's strips), or 4- or 8-bit codes in
 * strips with their scales (strip_gemm_int4's and strip_gemm_int8's layouts; bf16 only). */
typedef struct {
  const void *weights, *scales;
  int64_t group;
  int32_t bits, round_x;
} Product;

/* One layer's norms ([hidden]), products and caches. */
typedef struct {
  const void *input_norm, *post_norm;
  Product qkv, o_proj, gate_up, down;
  void *k_cache, *v_cache;
} LayerWeights;

#define GEMM_REFUSED 16 /* a product had no path (the decode step's own answers are 1..3) */

/* out [rows, n] = x [rows, k] @ W^T by the product's kernel; nonzero where it has no path. */
static int product(const LayerSteps *s, const Product *p, const void *x, void *out, int64_t n,
                   int64_t k) {
  switch (p->bits) {
  case 0:
    return s->gemm(p->weights, x, NULL, out, s->rows, n, k, k, s->is_bf16);
  case 4:
    return s->int4_gemm(p->weights, p->scales, x, NULL, out, s->rows, n, k, p->group, k,
                        p->round_x);
  case 8:
    return s->int8_gemm(p->weights, p->scales, x, NULL, out, s->rows, n, k, p->group, k);
  }
  return GEMM_REFUSED;
}

/* The MLP's silu(gate) * up of `normed` into act. */
static int gated_mlp_act(const LayerSteps *s, const LayerWeights *w) {
  if (s->is_bf16 && w->gate_up.bits == 0 &&
      s->gated_gemm(w->gate_up.weights, s->normed, NULL, s->act, s->rows, s->inter, s->hidden,
                    s->hidden) == 0)
    return 0;
  if (product(s, &w->gate_up, s->normed, s->gate_up, 2 * s->inter, s->hidden))
    return GEMM_REFUSED;
  s->silu_and_mul(s->gate_up, s->act, s->rows, s->inter, 2 * s->inter, s->is_bf16);
  return 0;
}

/* x [rows, hidden] is the embedding's output, and `residual` [rows, hidden] the residual
 * stream's buffer; both are updated in place through `count` layers, so that the model's final
 * norm of (x, residual) follows. Returns 0, the decode step's refusal (1..3,
 * nothing of that layer written), or GEMM_REFUSED. */
int decoder_layers(const LayerSteps *s, const LayerWeights *layers, int64_t count, void *x,
                   void *residual) {
  const int64_t h = s->hidden;
  for (int64_t i = 0; i < count; i++) {
    const LayerWeights *w = &layers[i];
    if (i == 0) {
      memcpy(residual, x, (size_t)(s->rows * h * (s->is_bf16 ? 2 : 4)));
      s->rms_norm(x, NULL, w->input_norm, s->normed, NULL, s->rows, h, h, s->eps, s->is_bf16);
    } else {
      s->rms_norm(x, residual, w->input_norm, s->normed, residual, s->rows, h, h, s->eps,
                  s->is_bf16);
    }
    if (product(s, &w->qkv, s->normed, s->qkv, s->qkv_width, h)) return GEMM_REFUSED;
    const int status = s->decode_step(s->decode_fields, s->qkv, w->k_cache, w->v_cache, s->q_rot,
                                      s->attn, s->partial, s->scale);
    if (status) return status;
    if (product(s, &w->o_proj, s->attn, x, h, s->attn_width)) return GEMM_REFUSED;
    s->rms_norm(x, residual, w->post_norm, s->normed, residual, s->rows, h, h, s->eps,
                s->is_bf16);
    const int refused = gated_mlp_act(s, w);
    if (refused) return refused;
    if (product(s, &w->down, s->act, x, h, s->inter)) return GEMM_REFUSED;
  }
  return 0;
}
