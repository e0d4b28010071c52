/* The CPU's matrix units (AMX) as the kernels use them: whether this build targets them, asking
 * the OS for the tile state once per process, and loading a tile configuration (palette 1). */
#ifndef SHOAL_MATRIX_TILES_H
#define SHOAL_MATRIX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HAS_MATRIX_TILES 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether the OS lets this process use the tile registers (asked once). */
static inline int tiles_granted(void) {
  static int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

/* Tiles 0 .. count - 1 configured as rows[t] rows of row_bytes[t] bytes, for this thread. */
static inline void configure_tiles(int count, const uint8_t *rows, const uint16_t *row_bytes) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t row_bytes[16];
    uint8_t rows[16];
  } config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < count; t++) config.rows[t] = rows[t], config.row_bytes[t] = row_bytes[t];
  /* gcc 12 takes ldtilecfg's intrinsic for one that reads no memory and can drop the stores
   * above (the tiles then fault as unconfigured): the empty asm makes them land first. */
  __asm__ volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#else
#define HAS_MATRIX_TILES 0
#endif

#endif
