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
 *   bits 4: 64 bytes at ((t*nb + b)*4 + h)*64, byte i = column t*16 + i/4 at input
 *           b*32 + 2h*4 + i%4 (low nibble) and b*32 + (2h+1)*4 + i%4 (high nibble)
 *   bits 5, 6: 64*bits bytes per tile and block: the codes' low 4 bits laid out as for bits
 *           4 (256 bytes), then a bit plane per higher bit p (0: bit 4, 1: bit 5), group g's
 *           in 8 bytes at 256 + (p*8 + g)*8, whose bit i (bit i%8 of byte i/8) is that bit
 *           of the code at byte i of the group's 64 (column i/4, input i%4): GGUF's Q5_*
 *           and Q6_K read at their own width, not widened to a byte.
 *   scales, offsets: float or half at (t*nb + b)*16 + n%16.
 * K-quant tables (GGUF's Q2_K-Q6_K, IQ4_XS: a float16 per super-block of 256 inputs times
 * a small integer per sub-block of 16 or 32), kept at their own size: w = D·σ·u + M·μ with
 *   D, M (scales, offsets): half at (t*ng + g)*16 + n%16, g = super-block, ng = K/256;
 *   σ, μ (sub_scales, sub_offsets): int8 at (t*ns + j)*16 + n%16, j = sub-block, ns = K/sub.
 * The kernel forms D·σ and M·μ (exact in float: 11 by 8 bits) and goes on as with a
 * block's float scale and offset, once per sub-block: a block of 32 with sub-blocks of 16
 * takes two integer dot products, each with its own scale, and the offset of each half
 * multiplies that half's activation sum (sum16).
 *
 * Row-wise products (`rowwise`, op RowQMatMul: a rotated int8 export): one scale per
 * activation row (its codes all taken by the row's peak) and one per weight column (8-bit
 * codes u = w + 128, symmetric), so a row's integer dot product runs over all of K and the
 * float work is one step per output, y[m, n] = float(I) * (scale[n] * d[m]) with
 * I = sum_k (u[n,k] - 128) * qx[m,k]: exact, so any kernel (AMX tiles included) gives it.
 */
#ifndef EDGESPEC_BLOCKQ_H
#define EDGESPEC_BLOCKQ_H

#include <stdint.h>

/* The version of the weight layout below and of the library's ops (5: AttentionHalf,
 * 6: BlockQMatMul's codebook, 7: BlockQMatMulK, 8: 5- and 6-bit codes, 9: RowQMatMul,
 * 10: RowQMatMul's gated and hadamard, SkipRMSNorm);
 * edgespec/kernels/__init__.py's LAYOUT must match, so a library built from other sources
 * is never used on this package's bundles. */
#define BLOCKQ_LAYOUT 10
int blockq_layout(void);

/* Activations [M, K] quantized per row and block of 32 (blockq_quantize_rows): int8 codes
 * q (round to nearest even of x / d, d = max|x| / 127, 0 for a zero block), and per row and
 * block d, sum = d * (sum of the codes) and isum = the sum of the codes. Block-major: row m's
 * codes of block b at q + (b*M + m)*32, its d, sum and isum at b*M + m, so the rows a kernel
 * multiplies together lie side by side at fixed offsets. With sum16 and isum16 (else NULL),
 * the same of each half of a block too, at (b*M + m)*2 + half: what weights in sub-blocks
 * of 16 need. `rowwise`: every block of a row is coded by the row's peak, for row-wise
 * products, and d, sum and isum are the row's, at m (the sum over all of K); where
 * K % 64 == 0 such rows keep each pair of blocks together, row m's codes of blocks 2c and
 * 2c+1 at q + (c*M + m)*64 (64 bytes a row: an AMX tile's). */
typedef struct {
    int8_t *q;
    float *d, *sum;
    int32_t *isum;
    int64_t M, K;
    float *sum16;
    int32_t *isum16;
    int rowwise;
} BlockqRows;

void blockq_quantize_rows(const float *x, BlockqRows *rows);

/* Rows [m0, m1) of blockq_quantize_rows (x is all of them): what a thread takes of a pass. */
void blockq_quantize_range(const float *x, BlockqRows *rows, int64_t m0, int64_t m1);

/* out[m, k] = silu(x[m, k]) * x[m, K + k] for x [M, 2K]: a gated MLP's activation, taken
 * as the down projection reads its input (no Split, Sigmoid and Mul nodes between). The
 * exponential is edgespec's own (Cephes' polynomial, within 2 ulp), the same operations on
 * every path, so the result is bitwise the same on each. */
void blockq_silu_mul(const float *x, int64_t M, int64_t K, float *out);

/* In place, each block of B values of each row of x [M, K] times Sylvester's Hadamard
 * matrix unnormalized (B a power of two dividing K, K % 16 == 0): the fast Walsh-Hadamard
 * transform, stages h = 1, 2, .., B/2 in turn, each butterfly (a, b) -> (a + b, a - b) of
 * the values at j and j + h (j's bit h clear). Every path runs these very additions, so
 * its results are bitwise the same, and a row's depend on that row alone: RowQMatMul's
 * `hadamard`, a rotated export's down projection taking its input's rotation itself. */
void blockq_hadamard(float *x, int64_t M, int64_t K, int64_t B);

/* A weight [N, K] in the layout above: codes (bits 4, 5, 6 or 8), and per block scales and
 * offsets, float or (half != 0) IEEE half, where every value is one exactly (half the bytes to read). With
 * `book` (4-bit codes only), a code is an index and the weight's code is book[index]: the
 * 16 values of a non-uniform grid (GGUF's IQ4_NL and IQ4_XS: blockq_iq4), which may take
 * all 8 bits, read at 4 bits a weight. With `sub` (16 or 32; 0: per-block tables), the
 * K-quant tables: scales and offsets per super-block (half), sub_scales and sub_offsets
 * per sub-block of `sub` inputs (K % 256 == 0; sub 16 needs the rows' sum16 and isum16).
 * `rowwise` (8-bit codes, rows quantized rowwise): scales is one float per column [N],
 * offsets unused. */
typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets;
    int64_t N, bits;
    int half;
    const uint8_t *book;
    const int8_t *sub_scales, *sub_offsets;
    int64_t sub;
    int rowwise;
} BlockqWeight;

/* GGUF's IQ4 grid (gguf-py's IQ4_NL.kvalues) + 128, as unsigned codes with zero point 128. */
extern const uint8_t blockq_iq4[16];

/* y[m, n] for n in [tile_begin*16, tile_end*16): columns in tiles of 16 (N % 16 == 0). */
void blockq_columns(const BlockqRows *rows, const BlockqWeight *weight, float *y,
                    int64_t tile_begin, int64_t tile_end);

/* The column kernel that runs here: 3 AVX-512 VNNI with AMX tiles for row-wise passes of
 * BLOCKQ_AMX_ROWS rows or more, 2 AVX-512 VNNI, 1 AVX2, 0 portable C (same results). */
int blockq_path(void);
#define BLOCKQ_AMX_ROWS 8

/* The vector width the path runs (2 AVX-512, 1 AVX2, 0 none): what attention takes. */
int blockq_simd(void);

/* Run no kernel above `path` (tests compare them; -1 lifts the limit). */
void blockq_limit_path(int path);

#endif
