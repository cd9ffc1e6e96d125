/* Block-quantized matrix products that are the same for a row whatever rows share the pass.
 *
 * y[m, n] = sum over blocks b of 32 inputs of
 *     dx[m,b] * scale[n,b] * sum_k code[n,k] * qx[m,k]  +  offset[n,b] * qsum[m,b]
 * with x quantized per row and block to int8 (qx, scale dx, qsum = dx * sum of its codes),
 * so the product is exactly that of the dequantized weight (scale * code + offset) and the
 * dequantized activation, up to float rounding. The integer sums are exact, and every row
 * runs the same float operations in the same order whatever M is and however the columns
 * are split among threads: a token's outputs are bitwise the same fed alone or in a pass.
 *
 * Weight layout: columns in tiles of 16, inputs in blocks of 32, each block in 8 groups of
 * 4 inputs, so one group of a tile is 16 lanes of 4 codes (what VNNI's dot product takes):
 *   bits 8: 64 bytes at ((t*nb + b)*8 + g)*64, byte i = column t*16 + i/4, input b*32 + g*4 + i%4
 *   bits 4: 32 bytes at ((t*nb + b)*8 + g)*32, byte i's low nibble = column t*16 + i/4, its
 *           high nibble = column t*16 + 8 + i/4, both at input b*32 + g*4 + i%4
 *   scales, offsets: float at (t*nb + b)*16 + n%16.
 */
#ifndef EDGESPEC_BLOCKQ_H
#define EDGESPEC_BLOCKQ_H

#include <stdint.h>

void blockq_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *qx, float *dx,
                          float *qsum);

void blockq_columns(const int8_t *qx, const float *dx, const float *qsum, int64_t M, int64_t K,
                    int64_t N, const uint8_t *codes, const float *scales, const float *offsets,
                    int64_t bits, float *y, int64_t tile_begin, int64_t tile_end);

/* Which column kernel runs here: 1 AVX-512 VNNI, 0 portable C (the same results). */
int blockq_simd(void);

/* Force the portable kernel (tests compare the two). */
void blockq_set_portable(int portable);

#endif
