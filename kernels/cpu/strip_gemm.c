/* The matmul of a linear layer, out = x @ W^T (+ bias), on a weight packed once into strips of
 * 16 output features laid out for AVX-512: fp32 as [strips][in][16], bf16 as
 * [strips][in / 2][16][2] (the pairs AVX512-BF16's dot product takes). A strip is one sequential
 * run of memory, so at a few tokens a thread streams its strips at close to the memory's
 * bandwidth: oneDNN's packed matmul reached about half of it at one token here. For many
 * tokens the inner loop is a register tile of 8 rows x 2 strips (16 accumulators, each weight
 * load and each broadcast of x used twice or more), as fast as oneDNN's on this machine's shapes.
 * While a pair of strips passes over a block of rows, its tiles ask for the next pair's weights
 * (into L2, a line a step of each tile's inner loop, the pair shared out among the block's
 * tiles): otherwise the block's first tile waited on memory for every weight it read, the
 * others reading them from L2. SmolLM2's 120 layer products in fp32 (weights from memory), 2-core
 * Xeon, interleaved builds: 64 rows 54.8 -> 48.6 ms, 32: 32.7 -> 27.3, 8: 19.8 -> 18.6,
 * 512: 351 -> 321; the bf16 vector path 8 rows 13.9 -> 12.0, 64: 89.7 -> 78.5. The matrix
 * units' path likewise asks for a thread's next job's strips during each block's tile steps
 * (Ahead): the same 120 products in bf16, 32 rows 15.8 -> 10.2 ms, 64: 21.9 -> 15.5, 256: 37.1
 * -> 33.0, 512: 59.7 -> 54.9; 1, 8 and 2,048 rows even.
 *
 * Where the CPU has matrix units (AMX-BF16) and the OS grants their tile state, bf16 products
 * whose input size is whole steps of 32 run on them instead, from the same packed weight: a bf16
 * strip, [in / 2][16][2], is the layout AMX takes for a tile product's second operand (16 pairs
 * of inputs by 16 outputs, 64 bytes a row). Two tiles of 16 rows of x by two of the weight. On
 * a 2-core Xeon with AMX, SmolLM2's 210 layer linears (each weight read from memory) took 9.8 ms
 * at one token against the vector path's 10.2, 10.1 at 8 (19.7) and 10.5 at 16 (26.7); against
 * oneDNN's AMX products, even or faster up to 512 tokens, ~1.3x slower at 2,048, and the
 * 49152-feature LM head 1.2x slower at 64 tokens and 1.6x at 256.
 *
 * 4-bit codes (GGUF Q4_0/Q4_1's w = scale * code + min per group of inputs) come in the same
 * strips, two codes a byte, with each group's 16 scales and minimums (fp16, as GGUF stores them):
 * a lookup turns 32 codes into 32 exact bf16 values at once, AVX512-BF16 dots them with x, and
 * the group's sum becomes scale * dot + min * sum(x over the group). A quarter of bf16's bytes.
 * Asked to round x (and where the CPU has AVX512-VNNI), x is rounded to 8 bits a group instead
 * and meets the codes, widened to bytes, in integer dot products (tile_int4_q8).
 * 8-bit codes (Q8_0's w = scale * code) come one a byte, [strips][in][16], widened to fp32.
 * Where the matrix units are on, a product of either at 8 rows or more decodes its codes into
 * bf16 strips instead and multiplies on them (decoded_on_matrix_units).
 *
 * fp32 accumulation; bf16 results rounded once at the end (to nearest even, as torch), after
 * the bias is added in fp32. Built by kernels/cpu_build.py; where the compiler targets no
 * AVX-512 (fp32) or no AVX512-BF16 (bf16), `strip_gemm_wide` answers 0 and the caller keeps
 * oneDNN's path.
 */
#define _GNU_SOURCE /* syscall (matrix_tiles.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "matrix_tiles.h"
#include "vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAS_F32_PATH 1
#else
#define HAS_F32_PATH 0
#endif
#if defined(__AVX512BF16__)
#define HAS_BF16_PATH 1
#else
#define HAS_BF16_PATH 0
#endif
#if defined(__AVX512VNNI__) && HAS_BF16_PATH
#define HAS_VNNI_PATH 1
#else
#define HAS_VNNI_PATH 0
#endif

#define STRIP 16     /* output features per strip: one AVX-512 register of fp32 */
#define ROW_TILE 8   /* rows of x sharing each weight load */
#define ROW_BLOCK 64 /* rows of x kept hot (L2) while every strip passes over them */
/* Bytes of a strip's codes asked for (into every cache level) before they are needed. A
 * non-temporal hint (prefetchnta) cost 4x on a Xeon with AMX: SmolLM2's 8-bit head at one token
 * 3.1 ms against 0.8, 4-bit codes at 16 rows 7.1 against 6.8. */
#define PREFETCH_AHEAD 1024

/* Whether this build has the vector path for the dtype (else the caller must not call). */
int strip_gemm_wide(int is_bf16) { return is_bf16 ? HAS_BF16_PATH : HAS_F32_PATH; }

#define INLINE static inline __attribute__((always_inline))

#if HAS_F32_PATH
/* acc[s][m] = sum over k of W[strip s][k][:] * x[m][k], for `rows` rows and `strips` (1 or 2)
 * strips; both constants where called, so the accumulators stay in registers. */
INLINE void tile_f32(const float *w0, const float *w1, const float *x, int64_t x_stride,
                     int64_t k, const int rows, const int strips, __m512 acc[2][ROW_TILE],
                     const char *ahead, int64_t ahead_lines) {
  for (int m = 0; m < rows; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p++) {
    if (p < ahead_lines) __builtin_prefetch(ahead + p * 64, 0, 2); /* the next pair's share */
    const __m512 v0 = _mm512_loadu_ps(w0 + p * STRIP);
    const __m512 v1 = strips == 2 ? _mm512_loadu_ps(w1 + p * STRIP) : v0;
    for (int m = 0; m < rows; m++) {
      const __m512 xb = _mm512_set1_ps(x[m * x_stride + p]);
      acc[0][m] = _mm512_fmadd_ps(v0, xb, acc[0][m]);
      if (strips == 2) acc[1][m] = _mm512_fmadd_ps(v1, xb, acc[1][m]);
    }
  }
}
#endif

#if HAS_BF16_PATH
/* As tile_f32, over pairs of the input: each dot product adds W[2p] x[2p] + W[2p+1] x[2p+1]. */
INLINE void tile_bf16(const uint16_t *w0, const uint16_t *w1, const uint16_t *x, int64_t x_stride,
                      int64_t k, const int rows, const int strips, __m512 acc[2][ROW_TILE],
                      const char *ahead, int64_t ahead_lines) {
  const int64_t pairs = k / 2;
  for (int m = 0; m < rows; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p++) {
    if (p < ahead_lines) __builtin_prefetch(ahead + p * 64, 0, 2); /* the next pair's share */
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + p * 2 * STRIP);
    const __m512bh v1 = strips == 2 ? (__m512bh)_mm512_loadu_si512(w1 + p * 2 * STRIP) : v0;
    for (int m = 0; m < rows; m++) {
      uint32_t pair;
      memcpy(&pair, x + m * x_stride + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], v0, xb);
      if (strips == 2) acc[1][m] = _mm512_dpbf16_ps(acc[1][m], v1, xb);
    }
  }
}
#endif

#if HAS_F32_PATH
/* One strip's results for `rows` rows: the bias added, written (the last strip cut to width). */
static void store_strip(const __m512 *acc, int rows, const void *bias, void *out, int64_t n,
                        int64_t row0, int64_t col0, int is_bf16) {
  const int64_t width = n - col0 < STRIP ? n - col0 : STRIP;
  const __mmask16 keep = (__mmask16)((1u << width) - 1u);
  __m512 b = _mm512_setzero_ps();
  if (bias && is_bf16) {
    float wide[STRIP] = {0.f};
    for (int64_t j = 0; j < width; j++) wide[j] = bf16_to_f32(((const uint16_t *)bias)[col0 + j]);
    b = _mm512_loadu_ps(wide);
  } else if (bias) {
    b = _mm512_maskz_loadu_ps(keep, (const float *)bias + col0);
  }
  for (int m = 0; m < rows; m++) {
    const __m512 v = _mm512_add_ps(acc[m], b);
    if (!is_bf16) {
      _mm512_mask_storeu_ps((float *)out + (row0 + m) * n + col0, keep, v);
      continue;
    }
    uint16_t *row = (uint16_t *)out + (row0 + m) * n + col0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    _mm256_mask_storeu_epi16(row, keep, f32_to_bf16_x16(v));
#else
    float lanes[STRIP];
    _mm512_storeu_ps(lanes, v);
    for (int64_t j = 0; j < width; j++) row[j] = f32_to_bf16(lanes[j]);
#endif
  }
}

/* Rows [row0, row0 + rows) against strips s (and s + 1 when `strips` is 2). */
INLINE void run_tile(const void *packed, const void *x, const void *bias, void *out, int64_t n,
                     int64_t k, int64_t x_stride, int64_t row0, int64_t s, const int rows,
                     const int strips, int is_bf16, const char *ahead, int64_t ahead_lines) {
  __m512 acc[2][ROW_TILE];
#if HAS_BF16_PATH
  if (is_bf16) {
    const uint16_t *w0 = (const uint16_t *)packed + s * k * STRIP;
    tile_bf16(w0, w0 + k * STRIP, (const uint16_t *)x + row0 * x_stride, x_stride, k, rows,
              strips, acc, ahead, ahead_lines);
  } else
#endif
  {
    const float *w0 = (const float *)packed + s * k * STRIP;
    tile_f32(w0, w0 + k * STRIP, (const float *)x + row0 * x_stride, x_stride, k, rows, strips,
             acc, ahead, ahead_lines);
  }
  for (int t = 0; t < strips; t++)
    store_strip(acc[t], rows, bias, out, n, row0, (s + t) * STRIP, is_bf16);
}

/* run_tile with `rows` (1..ROW_TILE) and `strips` (1, 2) as constants. */
static void dispatch_tile(const void *packed, const void *x, const void *bias, void *out,
                          int64_t n, int64_t k, int64_t x_stride, int64_t row0, int64_t s,
                          int rows, int strips, int is_bf16, const char *ahead,
                          int64_t ahead_lines) {
#define TILE(R)                                                                                \
  case R:                                                                                      \
    if (strips == 2)                                                                           \
      run_tile(packed, x, bias, out, n, k, x_stride, row0, s, R, 2, is_bf16, ahead, ahead_lines); \
    else                                                                                       \
      run_tile(packed, x, bias, out, n, k, x_stride, row0, s, R, 1, is_bf16, ahead, ahead_lines); \
    break;
  switch (rows) {
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
  }
#undef TILE
}
#endif

#if HAS_MATRIX_TILES && HAS_BF16_PATH
#define HAS_AMX_PATH 1
#else
#define HAS_AMX_PATH 0
#endif

#define AMX_K_STEP 32 /* inputs a tile product takes: 16 pairs */
/* Rows are taken 128 at a time (4 blocks of 32), every strip pair passing over them while they
 * sit in the thread's L2: with the strip pairs outermost, a 2,048-token prefill read all of x
 * (2.4 MB for SmolLM2) from L3 again for every pair. SmolLM2's 16 products at 2,048 rows: ~50
 * -> ~37 ms; a 64 x 128-token prefill 3,000-3,100 -> 3,300-3,600 tokens/s (A/B, two runs each). */
#define CHUNK_BLOCKS 4

/* -1: not asked yet; 0: off (not built, refused by the OS, or turned off); 1: on. */
static int amx_state = -1;
static int64_t amx_products = 0; /* calls that ran on the matrix units (for tests) */

static int64_t decoded_products = 0; /* products of codes that ran decoded (for tests) */

int64_t strip_gemm_amx_products(void) { return amx_products; }
int64_t strip_gemm_decoded_products(void) { return decoded_products; }

#if HAS_AMX_PATH
/* Tiles: 2 x 2 results, 2 of x, 2 of the weight. The intrinsics name a tile by its number's
 * spelling, so the names pass through one more macro (TZERO, TLOAD, TDOT, TSTORE) to expand. */
#define C00 0
#define C01 1
#define C10 2
#define C11 3
#define A0 4
#define A1 5
#define B0 6
#define B1 7
#define TZERO(t) _tile_zero(t)
#define TLOAD(t, at, stride) _tile_loadd(t, at, stride)
#define TSTREAM(t, at, stride) _tile_stream_loadd(t, at, stride)
#define TDOT(c, a, b) _tile_dpbf16ps(c, a, b)
#define TSTORE(t, at, stride) _tile_stored(t, at, stride)

/* Tiles of `rows0` and `rows1` rows of x (rows1 may be 0: one tile of x) against full weight
 * tiles, loaded where `loaded` (the thread's current rows, {-1, -1} at first) differs. */
static void configure_block_tiles(int rows0, int rows1, int loaded[2]) {
  if (rows0 == loaded[0] && rows1 == loaded[1]) return;
  const int wanted[8] = {rows0, rows0, rows1, rows1, rows0, rows1, AMX_K_STEP / 2, AMX_K_STEP / 2};
  uint8_t rows[8];
  uint16_t row_bytes[8];
  for (int t = 0; t < 8; t++) rows[t] = (uint8_t)(wanted[t] ? wanted[t] : 1), row_bytes[t] = 64;
  configure_tiles(8, rows, row_bytes);
  loaded[0] = rows0, loaded[1] = rows1;
}

/* A block's results, stored from the tiles, waiting to be written with the bias (rounded, and
 * for a gated product as silu(gate) * up) while the next block's tile products run: a share of
 * its rows after each of their steps, in registers, so the vector units write while the matrix
 * units multiply. Written right after their own products (the core waiting for them first), the
 * epilogues took a third of the time: SmolLM2's 120 products at 2,048 rows 351-358 -> 300-310
 * ms, its 30 gated ones 205 -> 164-176, all after the next block's products were issued; row by
 * row between those products (2026-12-06, same-process A/B): the gated ones at 64 / 512 / 2,048
 * rows 6.9 / 35.9 / 129.0 -> 5.6 / 28.7 / 99.3 ms, the 120 at 2,048 190.9 -> 176.3 (through
 * arrays of a tile, rows between the steps had cost 502). Tiles C00, C01, C10, C11 as
 * tiles[0..3]: row m of the block is in tiles [0] and [1] (m < 16), else [2] and [3]. */
typedef struct {
  float tiles[4][16][STRIP];
  const void *bias;
  void *out;
  int64_t n;    /* out's row length: n, or inter for a gated product */
  int rows;     /* the block's rows (0: none pending) */
  int64_t row0; /* its first row */
  int64_t s;    /* its first strip (a gated product's gate strip) */
  int gated, strips;
  int written; /* rows of it written */
} Pending;

static void write_pending(Pending *p);
static void write_rows_to(Pending *p, int to);

/* Lines of the thread's next job's strips to ask for (into L2) during a block's tile steps:
 * lines [first, first + count) of each (strip1 NULL: one strip). */
typedef struct {
  const char *strip0, *strip1;
  int64_t first, count;
} Ahead;

/* Lines [from, from + n) of the ahead share asked for (those within it). */
static inline void ask_ahead(const Ahead *a, int64_t from, int64_t n) {
  const int64_t end = from + n < a->count ? from + n : a->count;
  for (int64_t line = a->first + from; line < a->first + end; line++) {
    __builtin_prefetch(a->strip0 + line * 64, 0, 2);
    if (a->strip1) __builtin_prefetch(a->strip1 + line * 64, 0, 2);
  }
}

/* Rows [row0, row0 + rows) (1..32) of x against strips s0 and s1 (s1 < 0: none), every input,
 * left in the result tiles: C00 and C01 for the first 16 rows, C10 and C11 for the rest; the
 * pending block (the one before) is written out a share of rows after each tile step, all of it
 * by the end. Two tiles of x by two of the
 * weight, 32 inputs a product. The strips' bf16 layout, [in / 2][16][2] a strip, is the layout
 * AMX takes for its second operand. The weight's tiles are loaded with the streaming hint (each
 * is used for one block and gone), so they pass without evicting x's rows from L1, which every
 * strip pair loads again: SmolLM2's 120 products, same-process A/B on a 2-core Xeon, at 64 rows
 * 22.6 -> 21.3 ms, 256: 49.9 -> 48.2, 2,048: 350 -> 312; its 49152 x 576 head at 2,048 rows
 * 139 -> 106 ms; 1 and 16 rows 2-5% faster. */
static void tile_products(const uint16_t *packed, const uint16_t *x, int64_t k, int64_t x_stride,
                         int64_t row0, int rows, int64_t s0, int64_t s1, int loaded[2],
                         Pending *pending, const Ahead *ahead) {
  const int rows0 = rows < 16 ? rows : 16, rows1 = rows - rows0, both = s1 >= 0;
  configure_block_tiles(rows0, rows1, loaded);
  const uint16_t *x0 = x + row0 * x_stride, *x1 = x0 + 16 * x_stride;
  const uint16_t *w0 = packed + s0 * k * STRIP, *w1 = packed + (both ? s1 : s0) * k * STRIP;
  const int64_t x_bytes = x_stride * 2;
  TZERO(C00);
  TZERO(C01);
  TZERO(C10);
  TZERO(C11);
  const int steps = (int)(k / AMX_K_STEP), pending_rows = pending->rows;
  const int64_t per_step = (ahead->count + steps - 1) / steps;
  int step = 0;
  for (int64_t p = 0; p < k; p += AMX_K_STEP) {
    ask_ahead(ahead, step * per_step, per_step);
    TSTREAM(B0, w0 + p * STRIP, 64);
    if (both) TSTREAM(B1, w1 + p * STRIP, 64);
    TLOAD(A0, x0 + p, x_bytes);
    TDOT(C00, A0, B0);
    if (both) TDOT(C01, A0, B1);
    if (rows1) {
      TLOAD(A1, x1 + p, x_bytes);
      TDOT(C10, A1, B0);
      if (both) TDOT(C11, A1, B1);
    }
    /* a share of the pending block's rows while these products run */
    write_rows_to(pending, (int)((int64_t)pending_rows * ++step / steps));
  }
  write_pending(pending);
}

/* The result tiles of a block of `rows` rows, kept as the thread's pending block (tile_products
 * wrote the one before). */
static void keep_tiles(Pending *pending, int rows, int64_t row0, int64_t s, int gated,
                       int strips) {
  TSTORE(C00, pending->tiles[0], 64);
  if (strips == 2) TSTORE(C01, pending->tiles[1], 64);
  if (rows > 16) {
    TSTORE(C10, pending->tiles[2], 64);
    if (strips == 2) TSTORE(C11, pending->tiles[3], 64);
  }
  pending->rows = rows, pending->row0 = row0, pending->s = s;
  pending->gated = gated, pending->strips = strips, pending->written = 0;
}

/* Row m of the pending block written out: silu(gate) * up of its gate and up tiles' rows (as
 * strip_gemm then silu_and_mul round them), or each strip's row with the bias. */
static void write_row(Pending *p, int m) {
  const int t = m < 16 ? 0 : 2, r = m % 16;
  const int64_t row = p->row0 + m, col0 = p->s * STRIP;
  if (p->gated) {
    /* the bias added (zeros without one, as store_strip adds them: -0 becomes +0) */
    const uint16_t *bias = (const uint16_t *)p->bias;
    __m512 gate_bias = _mm512_setzero_ps(), up_bias = _mm512_setzero_ps();
    if (bias) {
      gate_bias = bf16_to_f32_x16(_mm256_loadu_si256((const __m256i *)(bias + col0)));
      up_bias = bf16_to_f32_x16(_mm256_loadu_si256((const __m256i *)(bias + p->n + col0)));
    }
    const __m512 gate = _mm512_add_ps(_mm512_loadu_ps(p->tiles[t][r]), gate_bias);
    const __m512 up = _mm512_add_ps(_mm512_loadu_ps(p->tiles[t + 1][r]), up_bias);
    const __m512 act = silu_times_x16(as_dtype_x16(gate, 1), as_dtype_x16(up, 1), 1);
    uint16_t *at = (uint16_t *)p->out + row * p->n + col0;
    _mm256_storeu_si256((__m256i *)at, f32_to_bf16_x16(act));
    return;
  }
  for (int strip = 0; strip < p->strips; strip++) {
    const __m512 acc = _mm512_loadu_ps(p->tiles[t + strip][r]);
    store_strip(&acc, 1, p->bias, p->out, p->n, row, (p->s + strip) * STRIP, 1);
  }
}

/* The pending block's rows up to `to` written (those not yet). */
static void write_rows_to(Pending *p, int to) {
  for (; p->written < to; p->written++) write_row(p, p->written);
}

/* Write the pending block out (nothing when none is pending). */
static void write_pending(Pending *p) {
  write_rows_to(p, p->rows);
  p->rows = 0;
}

/* A job's first strip (of `packed`'s) and its partner (-1: none): a gate strip and its up
 * strip, inter / STRIP strips on; or a strip pair. */
static inline int64_t job_strip(int64_t job, int gated) { return gated ? job : 2 * job; }

static inline int64_t job_partner(int64_t job, int gated, int64_t n, int64_t strips) {
  if (gated) return job + n / 2 / STRIP;
  return 2 * job + 1 < strips ? 2 * job + 1 : -1;
}

/* A product on the matrix units: every (chunk of rows, job, block of 32 rows), the threads
 * splitting the chunks (or, with one chunk, the jobs). A job is a strip pair of out [rows][n]
 * (strip_gemm), or with `gated` a gate strip and its up strip of out [rows][n / 2]
 * (strip_gemm_gated). `packed` holds strips [first_strip, end_strip) of the weight (all of
 * them but for decoded codes, which come a run of strips at a time); out's columns are the
 * weight's own. Each thread configures its tiles within the call and releases them at its end
 * (oneDNN's products, on the same threads, configure their own). */
static void run_on_matrix_units(const uint16_t *packed, const uint16_t *x, const void *bias,
                                void *out, int64_t rows, int64_t n, int64_t k, int64_t x_stride,
                                int gated, int64_t first_strip, int64_t end_strip) {
  const int64_t strips = end_strip - first_strip, jobs = gated ? strips / 2 : (strips + 1) / 2;
  const int64_t blocks = (rows + 31) / 32, chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
#pragma omp parallel
  {
    int loaded[2] = {-1, -1};
    Pending pending; /* the tiles left unset: no 4 KB cleared per thread per call */
    pending.bias = bias, pending.out = out, pending.n = gated ? n / 2 : n, pending.rows = 0;
    pending.written = 0;
#pragma omp for schedule(static) collapse(2)
    for (int64_t c = 0; c < chunks; c++)
      for (int64_t job = 0; job < jobs; job++) {
        const int64_t b0 = c * CHUNK_BLOCKS, b1 = blocks < b0 + CHUNK_BLOCKS ? blocks : b0 + CHUNK_BLOCKS;
        /* the next job's strips (the next chunk's first after the last), a share a block */
        const int64_t next = job + 1 < jobs ? job + 1 : 0, strip_lines = k * STRIP * 2 / 64;
        const int64_t share = (strip_lines + (b1 - b0) - 1) / (b1 - b0);
        for (int64_t b = b0; b < b1; b++) {
          const int64_t row0 = 32 * b;
          const int block_rows = rows - row0 < 32 ? (int)(rows - row0) : 32;
          const int64_t s = job_strip(job, gated), partner = job_partner(job, gated, n, strips);
          const int64_t next_partner = job_partner(next, gated, n, strips);
          const int64_t first = (b - b0) * share;
          const Ahead ahead = {
              (const char *)(packed + job_strip(next, gated) * k * STRIP),
              next_partner < 0 ? NULL : (const char *)(packed + next_partner * k * STRIP), first,
              strip_lines - first < share ? strip_lines - first : share};
          tile_products(packed, x, k, x_stride, row0, block_rows, s, partner, loaded, &pending,
                        &ahead);
          keep_tiles(&pending, block_rows, row0, first_strip + s, gated, partner >= 0 ? 2 : 1);
        }
      }
    write_pending(&pending);
    if (loaded[0] >= 0) _tile_release();
  }
}
#endif

/* Turns the matrix-unit path on (asking the OS for the tile state the first time) or off;
 * returns whether it is on. Off where the build has no AMX or the OS refuses. */
int strip_gemm_set_amx(int on) {
#if HAS_AMX_PATH
  amx_state = on && tiles_granted();
#else
  (void)on;
  amx_state = 0;
#endif
  return amx_state;
}

/* out [rows, n] = x [rows, k] (rows `x_stride` elements apart) @ W^T + bias [n] (or NULL), W
 * packed as above; bias and out in x's dtype. bf16 on the matrix units where they are on (the
 * first call asks for them) and k is whole tile steps. 0, or -1 where this build has no path for
 * the dtype (strip_gemm_wide) or bf16's k is odd. */
int strip_gemm(const void *packed, const void *x, const void *bias, void *out, int64_t rows,
               int64_t n, int64_t k, int64_t x_stride, int is_bf16) {
  if (!strip_gemm_wide(is_bf16) || (is_bf16 && k % 2)) return -1;
#if HAS_AMX_PATH
  if (amx_state < 0) strip_gemm_set_amx(1);
  if (is_bf16 && amx_state && k % AMX_K_STEP == 0) {
    run_on_matrix_units(packed, x, bias, out, rows, n, k, x_stride, 0, 0,
                        (n + STRIP - 1) / STRIP);
    amx_products++;
    return 0;
  }
#endif
#if HAS_F32_PATH
  const int64_t strips = (n + STRIP - 1) / STRIP, strip_pairs = (strips + 1) / 2;
  const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t b = 0; b < blocks; b++)
    for (int64_t sp = 0; sp < strip_pairs; sp++) {
      const int64_t s = 2 * sp, end = (b + 1) * ROW_BLOCK < rows ? (b + 1) * ROW_BLOCK : rows;
      const int both = s + 1 < strips ? 2 : 1;
      /* the next pair's strips (this block's, or the next block's first), a share a tile */
      const int64_t next = s + 2 < strips ? s + 2 : 0, width = is_bf16 ? 2 : 4;
      const int64_t next_lines = (strips - next < 2 ? strips - next : 2) * k * STRIP * width / 64;
      const int64_t tiles = (end - b * ROW_BLOCK + ROW_TILE - 1) / ROW_TILE;
      const int64_t share = (next_lines + tiles - 1) / tiles;
      const char *ahead = (const char *)packed + next * k * STRIP * width;
      for (int64_t row0 = b * ROW_BLOCK, t = 0; row0 < end; row0 += ROW_TILE, t++) {
        const int tile = end - row0 < ROW_TILE ? (int)(end - row0) : ROW_TILE;
        const int64_t first = t * share;
        const int64_t lines = next_lines - first < share ? next_lines - first : share;
        dispatch_tile(packed, x, bias, out, n, k, x_stride, row0, s, tile, both, is_bf16,
                      ahead + first * 64, lines);
      }
    }
#endif
  return 0;
}

#if HAS_BF16_PATH
#define CODE_ROW_TILE 8 /* rows of a 4- or 8-bit tile */

/* 32 bytes of codes -> the bf16 values of two pairs of inputs (low nibbles, high nibbles). */
INLINE void decode_quad(const uint8_t *at, __m512i table, __m512bh *first, __m512bh *second) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)at));
  const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0f));
  *first = (__m512bh)_mm512_permutexvar_epi16(low, table);
  *second = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
}

/* Rows [0, rows) of x (bf16) against `strips` (1, 2) strips of 4-bit codes: codes [k / 4][32]
 * bytes a strip (byte b: lane b of a pair of inputs in its low nibble, of the next pair in its
 * high), scales [groups][2][16] fp16 a strip (scale, min), x_sums [rows][groups] fp32. With one
 * or two rows each half of a quad gets its own accumulator (more dot products in flight). */
INLINE void tile_int4(const uint8_t *codes, const uint16_t *scales, int64_t strip_codes,
                      int64_t strip_scales, const uint16_t *x, const float *x_sums,
                      int64_t x_stride, int64_t k, int64_t group, const int rows,
                      const int strips, __m512 total[2][CODE_ROW_TILE]) {
  static const uint16_t SMALL_BF16[32] = {/* 0..15 as bf16, twice */
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
      0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_loadu_si512(SMALL_BF16);
  const int halves = rows <= 2 ? 2 : 1;
  const int64_t groups = k / group, quads = group / 4;
  for (int t = 0; t < strips; t++)
    for (int m = 0; m < rows; m++) total[t][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 acc[2][2][CODE_ROW_TILE]; /* strip, half, row */
    for (int t = 0; t < strips; t++)
      for (int h = 0; h < halves; h++)
        for (int m = 0; m < rows; m++) acc[t][h][m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < quads; j++) {
      const int64_t quad = g * quads + j;
      __m512bh first[2], second[2];
      for (int t = 0; t < strips; t++) {
        __builtin_prefetch(codes + t * strip_codes + quad * 32 + PREFETCH_AHEAD, 0, 3);
        decode_quad(codes + t * strip_codes + quad * 32, table, &first[t], &second[t]);
      }
      for (int m = 0; m < rows; m++) {
        uint32_t pair[2];
        memcpy(pair, x + m * x_stride + quad * 4, 8);
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)pair[0]);
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)pair[1]);
        for (int t = 0; t < strips; t++) {
          acc[t][0][m] = _mm512_dpbf16_ps(acc[t][0][m], first[t], x0);
          acc[t][halves - 1][m] = _mm512_dpbf16_ps(acc[t][halves - 1][m], second[t], x1);
        }
      }
    }
    for (int t = 0; t < strips; t++) {
      const uint16_t *at = scales + t * strip_scales + g * 32;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
      const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 16)));
      for (int m = 0; m < rows; m++) {
        const __m512 dot = halves == 2 ? _mm512_add_ps(acc[t][0][m], acc[t][1][m]) : acc[t][0][m];
        total[t][m] = _mm512_fmadd_ps(dot, scale, total[t][m]);
        total[t][m] = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sums[m * groups + g]), total[t][m]);
      }
    }
  }
}

/* tile_int4 with `rows` (1..CODE_ROW_TILE) and `strips` (1, 2) as constants. */
static void dispatch_int4(const uint8_t *codes, const uint16_t *scales, int64_t strip_codes,
                          int64_t strip_scales, const uint16_t *x, const float *x_sums,
                          int64_t x_stride, int64_t k, int64_t group, int rows, int strips,
                          __m512 total[2][CODE_ROW_TILE]) {
#define TILE(R)                                                                               \
  case R:                                                                                     \
    if (strips == 2)                                                                          \
      tile_int4(codes, scales, strip_codes, strip_scales, x, x_sums, x_stride, k, group, R,  \
                2, total);                                                                    \
    else                                                                                      \
      tile_int4(codes, scales, strip_codes, strip_scales, x, x_sums, x_stride, k, group, R,  \
                1, total);                                                                    \
    break;
  switch (rows) {
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
  }
#undef TILE
}

#if HAS_VNNI_PATH
/* A quad's 32 bytes of 4-bit codes (tile_int4's layout) as 16 lanes of 4 unsigned bytes: lane o
 * holds output o's codes for inputs 4j..4j+3 in order, as AVX512-VNNI's byte dot product takes
 * them. A lane's 16 bits are (byte 2o, byte 2o+1); shifted left by 12 their high nibbles land in
 * bytes 2 and 3, and one mask keeps the four low nibbles of the two. */
INLINE __m512i widen_quad_u8(const uint8_t *at) {
  const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at));
  return _mm512_ternarylogic_epi32(pairs, _mm512_slli_epi32(pairs, 12),
                                   _mm512_set1_epi32(0x0f0f0f0f), 0xa8 /* (a | b) & c */);
}

/* One quad of tile_int4_q8: each row's 4 bytes of x against each strip's codes. */
INLINE void quad_q8(const uint8_t *codes, int64_t strip_codes, const int8_t *xq, int64_t k,
                    int64_t quad, const int rows, const int strips,
                    __m512i acc[2][CODE_ROW_TILE]) {
  __m512i w[2];
  for (int t = 0; t < strips; t++) {
    __builtin_prefetch(codes + t * strip_codes + quad * 32 + PREFETCH_AHEAD, 0, 3);
    w[t] = widen_quad_u8(codes + t * strip_codes + quad * 32);
  }
  for (int m = 0; m < rows; m++) {
    int32_t four;
    memcpy(&four, xq + m * k + quad * 4, 4);
    const __m512i xb = _mm512_set1_epi32(four);
    for (int t = 0; t < strips; t++) acc[t][m] = _mm512_dpbusd_epi32(acc[t][m], w[t], xb);
  }
}

/* As tile_int4, with x rounded to 8 bits a group (xq [rows][k] int8, x_scales [rows][groups]:
 * x ~ x_scale * xq) and the codes dotted with it in integers, 64 products an instruction (the
 * bf16 path's dot takes 32 and a lookup): a group's sum is scale * x_scale * dot + min * sum(x),
 * sum(x) of the unrounded x. With one or two rows, alternate quads go to two accumulators. */
INLINE void tile_int4_q8(const uint8_t *codes, const uint16_t *scales, int64_t strip_codes,
                         int64_t strip_scales, const int8_t *xq, const float *x_scales,
                         const float *x_sums, int64_t k, int64_t group, const int rows,
                         const int strips, __m512 total[2][CODE_ROW_TILE]) {
  const int64_t groups = k / group, quads = group / 4;
  for (int t = 0; t < strips; t++)
    for (int m = 0; m < rows; m++) total[t][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512i even[2][CODE_ROW_TILE], odd[2][CODE_ROW_TILE];
    for (int t = 0; t < strips; t++)
      for (int m = 0; m < rows; m++) even[t][m] = odd[t][m] = _mm512_setzero_si512();
    int64_t j = 0;
    if (rows <= 2)
      for (; j + 1 < quads; j += 2) {
        quad_q8(codes, strip_codes, xq, k, g * quads + j, rows, strips, even);
        quad_q8(codes, strip_codes, xq, k, g * quads + j + 1, rows, strips, odd);
      }
    for (; j < quads; j++) quad_q8(codes, strip_codes, xq, k, g * quads + j, rows, strips, even);
    for (int t = 0; t < strips; t++) {
      const uint16_t *at = scales + t * strip_scales + g * 32;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
      const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 16)));
      for (int m = 0; m < rows; m++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[t][m], odd[t][m]));
        const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[m * groups + g]));
        total[t][m] = _mm512_fmadd_ps(dot, row_scale, total[t][m]);
        total[t][m] = _mm512_fmadd_ps(min, _mm512_set1_ps(x_sums[m * groups + g]), total[t][m]);
      }
    }
  }
}

/* tile_int4_q8 with `rows` (1..CODE_ROW_TILE) and `strips` (1, 2) as constants. */
static void dispatch_int4_q8(const uint8_t *codes, const uint16_t *scales, int64_t strip_codes,
                             int64_t strip_scales, const int8_t *xq, const float *x_scales,
                             const float *x_sums, int64_t k, int64_t group, int rows, int strips,
                             __m512 total[2][CODE_ROW_TILE]) {
#define TILE(R)                                                                              \
  case R:                                                                                    \
    if (strips == 2)                                                                         \
      tile_int4_q8(codes, scales, strip_codes, strip_scales, xq, x_scales, x_sums, k, group, \
                   R, 2, total);                                                             \
    else                                                                                     \
      tile_int4_q8(codes, scales, strip_codes, strip_scales, xq, x_scales, x_sums, k, group, \
                   R, 1, total);                                                             \
    break;
  switch (rows) {
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
  }
#undef TILE
}
#endif

/* Rows [0, rows) of x (bf16) against `strips` (1, 2) strips of 8-bit codes (w = scale * code
 * per group): codes [k][16] int8 a strip, scales [groups][16] fp16 a strip. Codes widen to fp32
 * (exact) and meet x in fp32 products. */
INLINE void tile_int8(const int8_t *codes, const uint16_t *scales, int64_t strip_codes,
                      int64_t strip_scales, const uint16_t *x, int64_t x_stride, int64_t k,
                      int64_t group, const int rows, const int strips,
                      __m512 total[2][CODE_ROW_TILE]) {
  const int64_t groups = k / group;
  for (int t = 0; t < strips; t++)
    for (int m = 0; m < rows; m++) total[t][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 acc[2][CODE_ROW_TILE];
    for (int t = 0; t < strips; t++)
      for (int m = 0; m < rows; m++) acc[t][m] = _mm512_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; i++) {
      __m512 w[2];
      for (int t = 0; t < strips; t++) {
        const int8_t *at = codes + t * strip_codes + i * STRIP;
        __builtin_prefetch(at + PREFETCH_AHEAD, 0, 3);
        w[t] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
      }
      for (int m = 0; m < rows; m++) {
        const __m512 xb = _mm512_set1_ps(bf16_to_f32(x[m * x_stride + i]));
        for (int t = 0; t < strips; t++) acc[t][m] = _mm512_fmadd_ps(w[t], xb, acc[t][m]);
      }
    }
    for (int t = 0; t < strips; t++) {
      const uint16_t *at = scales + t * strip_scales + g * STRIP;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
      for (int m = 0; m < rows; m++) total[t][m] = _mm512_fmadd_ps(acc[t][m], scale, total[t][m]);
    }
  }
}

static void dispatch_int8(const int8_t *codes, const uint16_t *scales, int64_t strip_codes,
                          int64_t strip_scales, const uint16_t *x, int64_t x_stride, int64_t k,
                          int64_t group, int rows, int strips, __m512 total[2][CODE_ROW_TILE]) {
#define TILE(R)                                                                                \
  case R:                                                                                      \
    if (strips == 2)                                                                           \
      tile_int8(codes, scales, strip_codes, strip_scales, x, x_stride, k, group, R, 2, total); \
    else                                                                                       \
      tile_int8(codes, scales, strip_codes, strip_scales, x, x_stride, k, group, R, 1, total); \
    break;
  switch (rows) {
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
  }
#undef TILE
}

/* Every (row block, strip pair) of a product over codes of `bits` (4: x_sums given, and with
 * xq and x_scales x's 8-bit rounding; 8: none), split across the threads; each row tile's
 * totals stored with the bias. */
static void run_code_strips(int bits, const void *codes, const uint16_t *scales,
                            const uint16_t *x, const float *x_sums, const int8_t *xq,
                            const float *x_scales, const uint16_t *bias, uint16_t *out,
                            int64_t rows, int64_t n, int64_t k, int64_t group, int64_t x_stride) {
  const int64_t groups = k / group, strips = (n + STRIP - 1) / STRIP;
  const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK, strip_pairs = (strips + 1) / 2;
  const int64_t strip_codes = bits == 4 ? k * 8 : k * STRIP; /* bytes a strip */
  const int64_t strip_scales = groups * (bits == 4 ? 2 : 1) * STRIP;
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t b = 0; b < blocks; b++)
    for (int64_t sp = 0; sp < strip_pairs; sp++) {
      const int64_t s = 2 * sp, end = (b + 1) * ROW_BLOCK < rows ? (b + 1) * ROW_BLOCK : rows;
      const int both = s + 1 < strips ? 2 : 1;
      const char *strip = (const char *)codes + s * strip_codes;
      for (int64_t row0 = b * ROW_BLOCK; row0 < end; row0 += CODE_ROW_TILE) {
        const int tile = end - row0 < CODE_ROW_TILE ? (int)(end - row0) : CODE_ROW_TILE;
        __m512 total[2][CODE_ROW_TILE];
#if HAS_VNNI_PATH
        if (xq)
          dispatch_int4_q8((const uint8_t *)strip, scales + s * strip_scales, strip_codes,
                           strip_scales, xq + row0 * k, x_scales + row0 * groups,
                           x_sums + row0 * groups, k, group, tile, both, total);
        else
#endif
        if (bits == 4)
          dispatch_int4((const uint8_t *)strip, scales + s * strip_scales, strip_codes,
                        strip_scales, x + row0 * x_stride, x_sums + row0 * groups, x_stride, k,
                        group, tile, both, total);
        else
          dispatch_int8((const int8_t *)strip, scales + s * strip_scales, strip_codes,
                        strip_scales, x + row0 * x_stride, x_stride, k, group, tile, both, total);
        for (int t = 0; t < both; t++)
          store_strip(total[t], tile, bias, out, n, row0, (s + t) * STRIP, 1);
      }
    }
}
#endif

#if HAS_BF16_PATH
/* Each row's sum of x over each group (x_sums [rows][groups]) and, where xq is given, x rounded
 * to 8 bits a group: xq [rows][k], x_scales [rows][groups] (max |x| / 127; 0 for all zeros). */
static void summarize_groups(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k,
                             int64_t group, float *x_sums, int8_t *xq, float *x_scales) {
  const int64_t groups = k / group;
#pragma omp parallel for schedule(static) if (rows >= ROW_BLOCK)
  for (int64_t m = 0; m < rows; m++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *at = x + m * x_stride + g * group;
      float sum = 0.f, max = 0.f;
#pragma omp simd reduction(+ : sum) reduction(max : max)
      for (int64_t i = 0; i < group; i++) {
        const float v = bf16_to_f32(at[i]);
        sum += v;
        max = fmaxf(max, fabsf(v));
      }
      x_sums[m * groups + g] = sum;
      if (!xq) continue;
      const float scale = max / 127.f, inverse = max > 0.f ? 127.f / max : 0.f;
      x_scales[m * groups + g] = scale;
      for (int64_t i = 0; i < group; i++)
        xq[m * k + g * group + i] = (int8_t)lrintf(bf16_to_f32(at[i]) * inverse);
    }
}
#endif

#if HAS_AMX_PATH
/* Code strips at many rows: the codes' own dots issue about half an instruction a cycle, so at
 * CODES_DECODED_ROWS rows and more a product decodes its weight once into bf16 strips (w =
 * scale * code (+ min) in fp32, rounded to bf16 to nearest even) and runs on the matrix units,
 * as a bf16 weight does (the weight a bf16 checkpoint of it would hold, not the codes' exact
 * one). The decoded strips are scratch of the calling thread, kept from call to call. Below
 * those rows the codes' path reads fewer bytes for the same time. SmolLM2's 120 4-bit products,
 * 2-core Xeon, ms (codes / decoded): 8 rows 14.0 / 8.6, 32: 50.9 / 11.1, 512: 733 / 61; its
 * 8-bit 49152 x 576 head at 32 rows 10.4 / 2.8. */
#define CODES_DECODED_ROWS 8
#define CODES_DECODED_BYTES (2 << 20)

static __thread uint16_t *decoded_scratch = NULL;
static __thread size_t decoded_capacity = 0;

/* The calling thread's scratch of at least `bytes` (NULL where it cannot be had). */
static uint16_t *decoded_strips(size_t bytes) {
  if (bytes <= decoded_capacity) return decoded_scratch;
  free(decoded_scratch);
  decoded_capacity = (bytes + 63) / 64 * 64;
  decoded_scratch = aligned_alloc(64, decoded_capacity);
  if (!decoded_scratch) decoded_capacity = 0;
  return decoded_scratch;
}

/* Lanes (output o, input e) of a bf16 pair, [16][2], from lanes o of the outputs' values: the
 * first 8 outputs' pairs, then the last 8's. */
static const int32_t PAIR_LO[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const int32_t PAIR_HI[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

/* 4-bit strips (tile_int4's layout) as bf16 strips: a quad's low nibbles are the pair of inputs
 * 4j, 4j + 1 in the bf16 layout's own order, its high nibbles the pair 4j + 2, 4j + 3. */
static void decode_int4_strips(const uint8_t *codes, const uint16_t *scales, uint16_t *out,
                               int64_t strips, int64_t k, int64_t group) {
  const int64_t groups = k / group, quads = group / 4;
  const __m512i lo = _mm512_loadu_si512(PAIR_LO), hi = _mm512_loadu_si512(PAIR_HI);
  const __m512i nibble = _mm512_set1_epi32(0x0f);
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < strips; s++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *at = scales + (s * groups + g) * 2 * STRIP;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
      const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + STRIP)));
      const __m512 scale_lo = _mm512_permutexvar_ps(lo, scale);
      const __m512 scale_hi = _mm512_permutexvar_ps(hi, scale);
      const __m512 min_lo = _mm512_permutexvar_ps(lo, min), min_hi = _mm512_permutexvar_ps(hi, min);
      for (int64_t quad = g * quads; quad < (g + 1) * quads; quad++) {
        const uint8_t *bytes = codes + s * k * 8 + quad * 32;
        /* bytes 0-15 hold outputs 0-7's codes, bytes 16-31 outputs 8-15's */
        const __m512i first8 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
        const __m512i last8 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16)));
        uint16_t *pair = out + (s * k + quad * 4) * STRIP; /* pairs 2 quad, 2 quad + 1 */
        for (int half = 0; half < 2; half++) { /* low nibbles, then high */
          const int shift = 4 * half;
          const __m512i code0 = _mm512_and_si512(_mm512_srli_epi32(first8, shift), nibble);
          const __m512i code1 = _mm512_and_si512(_mm512_srli_epi32(last8, shift), nibble);
          const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code0), scale_lo, min_lo);
          const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code1), scale_hi, min_hi);
          _mm512_storeu_si512(pair + half * 2 * STRIP, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
      }
    }
}

/* 8-bit strips (tile_int8's layout, [k][16] a strip) as bf16 strips: inputs 2p and 2p + 1
 * interleaved output by output (a group of an even number of inputs). */
static void decode_int8_strips(const int8_t *codes, const uint16_t *scales, uint16_t *out,
                               int64_t strips, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  static const int32_t MIX_LO[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  static const int32_t MIX_HI[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i lo = _mm512_loadu_si512(MIX_LO), hi = _mm512_loadu_si512(MIX_HI);
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < strips; s++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *at = scales + (s * groups + g) * STRIP;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
      for (int64_t i = g * group; i < (g + 1) * group; i += 2) {
        const int8_t *row = codes + (s * k + i) * STRIP; /* inputs i and i + 1 */
        const __m512i code0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row));
        const __m512i code1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + STRIP)));
        const __m512 w0 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(code0));
        const __m512 w1 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(code1));
        const __m512 first = _mm512_permutex2var_ps(w0, lo, w1);
        const __m512 second = _mm512_permutex2var_ps(w0, hi, w1);
        _mm512_storeu_si512(out + (s * k + i) * STRIP, (__m512i)_mm512_cvtne2ps_pbh(second, first));
      }
    }
}

/* The product on the matrix units through decoded strips, a run of strips of at most
 * CODES_DECODED_BYTES at a time (kept in the caches from its decoding to its products): 1 when
 * it ran, 0 where it does not fit (rows, shape, scratch). */
static int decoded_on_matrix_units(int bits, const void *codes, const uint16_t *scales,
                                   const uint16_t *x, const uint16_t *bias, uint16_t *out,
                                   int64_t rows, int64_t n, int64_t k, int64_t group,
                                   int64_t x_stride) {
  if (amx_state < 0) strip_gemm_set_amx(1);
  if (!amx_state || rows < CODES_DECODED_ROWS || k % AMX_K_STEP || group % 2) return 0;
  const int64_t strips = (n + STRIP - 1) / STRIP, strip_bytes = k * STRIP * 2;
  int64_t run = CODES_DECODED_BYTES / strip_bytes / 2 * 2; /* whole strip pairs */
  if (run < 2) run = 2;
  if (run > strips) run = strips;
  uint16_t *decoded = decoded_strips((size_t)(run * strip_bytes));
  if (!decoded) return 0;
  const int64_t groups = k / group, strip_codes = bits == 4 ? k * 8 : k * STRIP;
  const int64_t strip_scales = groups * (bits == 4 ? 2 : 1) * STRIP;
  for (int64_t first = 0; first < strips; first += run) {
    const int64_t end = first + run < strips ? first + run : strips;
    const char *at = (const char *)codes + first * strip_codes;
    const uint16_t *at_scales = scales + first * strip_scales;
    if (bits == 4)
      decode_int4_strips((const uint8_t *)at, at_scales, decoded, end - first, k, group);
    else
      decode_int8_strips((const int8_t *)at, at_scales, decoded, end - first, k, group);
    run_on_matrix_units(decoded, x, bias, out, rows, n, k, x_stride, 0, first, end);
  }
  amx_products++;
  decoded_products++;
  return 1;
}
#endif

/* out [rows, n] (bf16) = x [rows, k] (bf16, rows `x_stride` apart) @ W^T + bias (bf16 or NULL),
 * W as 4-bit codes in strips (tile_int4's layout; `group` inputs per scale, a multiple of 4
 * dividing k). With `round_x`, x is rounded to 8 bits a group and dotted in integers
 * (tile_int4_q8; where the CPU has AVX512-VNNI), else in bf16. 0, or -1 where this build has no
 * path for that or the group does not fit. */
int strip_gemm_int4(const uint8_t *codes, const uint16_t *scales, const uint16_t *x,
                    const uint16_t *bias, uint16_t *out, int64_t rows, int64_t n, int64_t k,
                    int64_t group, int64_t x_stride, int round_x) {
  if (!HAS_BF16_PATH || group % 4 || k % group || (round_x && !HAS_VNNI_PATH)) return -1;
#if HAS_AMX_PATH
  if (!round_x &&
      decoded_on_matrix_units(4, codes, scales, x, bias, out, rows, n, k, group, x_stride))
    return 0;
#endif
#if HAS_BF16_PATH
  const int64_t groups = k / group;
  float *x_sums = malloc(sizeof(float) * (2 * rows * groups + 1));
  int8_t *xq = round_x ? malloc(rows * k + 1) : NULL;
  if (!x_sums || (round_x && !xq)) {
    free(x_sums);
    return -1;
  }
  float *x_scales = round_x ? x_sums + rows * groups : NULL;
  summarize_groups(x, x_stride, rows, k, group, x_sums, xq, x_scales);
  run_code_strips(4, codes, scales, x, x_sums, xq, x_scales, bias, out, rows, n, k, group,
                  x_stride);
  free(xq);
  free(x_sums);
#endif
  return 0;
}

/* Whether strip_gemm_int4 can round x to 8 bits here (AVX512-VNNI). */
int strip_gemm_int4_rounds_x(void) { return HAS_VNNI_PATH; }

/* out [rows, inter] = silu(x @ G^T + bias_g) * (x @ U^T + bias_u), bf16, for a weight packed as
 * above whose 2 * inter rows are G then U (a gated MLP's fused gate and up projection), bias
 * [2 * inter] or NULL: the same bits as strip_gemm and then layer_pointwise's silu_and_mul,
 * without the [rows, 2 * inter] products between them. On the matrix units only: -1 where they
 * are off, or k is not whole tile steps, or inter is not whole strips (the caller then runs the
 * two calls). */
int strip_gemm_gated(const uint16_t *packed, const uint16_t *x, const uint16_t *bias,
                     uint16_t *out, int64_t rows, int64_t inter, int64_t k, int64_t x_stride) {
#if HAS_AMX_PATH
  if (amx_state < 0) strip_gemm_set_amx(1);
  if (amx_state && k % AMX_K_STEP == 0 && inter % STRIP == 0) {
    run_on_matrix_units(packed, x, bias, out, rows, 2 * inter, k, x_stride, 1, 0,
                        2 * inter / STRIP);
    amx_products++;
    return 0;
  }
#else
  (void)packed, (void)x, (void)bias, (void)out, (void)rows, (void)inter, (void)k, (void)x_stride;
#endif
  return -1;
}

/* As strip_gemm_int4 for 8-bit codes (tile_int8's layout, w = scale * code). */
int strip_gemm_int8(const int8_t *codes, const uint16_t *scales, const uint16_t *x,
                    const uint16_t *bias, uint16_t *out, int64_t rows, int64_t n, int64_t k,
                    int64_t group, int64_t x_stride) {
  if (!HAS_BF16_PATH || k % group) return -1;
#if HAS_AMX_PATH
  if (decoded_on_matrix_units(8, codes, scales, x, bias, out, rows, n, k, group, x_stride))
    return 0;
#endif
#if HAS_BF16_PATH
  run_code_strips(8, codes, scales, x, NULL, NULL, NULL, bias, out, rows, n, k, group, x_stride);
#endif
  return 0;
}
