/* Block-quantized matrix products, batch-invariant by construction (see blockq.h).
 *
 * Two column kernels with bitwise the same results: portable C, and AVX-512 VNNI where the
 * CPU has it (chosen at run time, so the library is built without global ISA flags). Both
 * compute, per output, acc = fma(offset, qsum, fma(float(I), scale * dx, acc)) block after
 * block, I the exact integer dot product of a block's codes and the row's int8 codes.
 * Build with -ffp-contract=off so the compiler fuses nothing the other kernel does not.
 */
#include "blockq.h"

#include <math.h>
#include <string.h>

#define GROUPS 8 /* groups of 4 inputs in a block of 32 */
#define LANES 16 /* columns in a tile */

void blockq_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *qx, float *dx,
                          float *qsum) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const float *v = x + m * K + b * 32;
            int8_t *q = qx + m * K + b * 32;
            float peak = 0.0f;
            for (int i = 0; i < 32; ++i) {
                const float a = fabsf(v[i]);
                peak = a > peak ? a : peak;
            }
            const float d = peak / 127.0f;
            const float inv = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < 32; ++i) {
                float r = nearbyintf(v[i] * inv);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                q[i] = (int8_t)r;
                sum += q[i];
            }
            dx[m * nb + b] = d;
            qsum[m * nb + b] = d * (float)sum;
        }
    }
}

/* The code of column lane c (0..15), input j (0..3) of group g of a tile's block. */
static inline int code_at(const uint8_t *block, int64_t bits, int g, int c, int j) {
    if (bits == 8) return block[g * 64 + c * 4 + j];
    const uint8_t byte = block[g * 32 + (c % 8) * 4 + j];
    return c < 8 ? (byte & 0x0F) : (byte >> 4);
}

static void columns_portable(const int8_t *qx, const float *dx, const float *qsum, int64_t M,
                             int64_t K, int64_t N, const uint8_t *codes, const float *scales,
                             const float *offsets, int64_t bits, float *y, int64_t t0,
                             int64_t t1) {
    const int64_t nb = K / 32, block_bytes = GROUPS * 4 * LANES * bits / 8;
    for (int64_t t = t0; t < t1; ++t) {
        for (int c = 0; c < LANES; ++c) {
            for (int64_t m = 0; m < M; ++m) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; ++b) {
                    const uint8_t *block = codes + (t * nb + b) * block_bytes;
                    const int8_t *q = qx + m * K + b * 32;
                    int32_t dot = 0;
                    for (int g = 0; g < GROUPS; ++g)
                        for (int j = 0; j < 4; ++j) dot += code_at(block, bits, g, c, j) * q[g * 4 + j];
                    const int64_t at = (t * nb + b) * LANES + c;
                    acc = fmaf((float)dot, scales[at] * dx[m * nb + b], acc);
                    acc = fmaf(offsets[at], qsum[m * nb + b], acc);
                }
                y[m * N + t * LANES + c] = acc;
            }
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define MAX_ROWS 6

/* Rows m0 .. m0+R-1 of T adjacent tiles (T*16 columns): each weight group is unpacked once
 * for all R rows and each activation group broadcast once for all T tiles. */
VNNI static inline __attribute__((always_inline)) void
tile_rows(const int8_t *qx, const float *dx, const float *qsum, int64_t K, int64_t N,
          const uint8_t *codes, const float *scales, const float *offsets, int64_t bits,
          float *y, int64_t t, int64_t m0, const int T, const int R) {
    const int64_t nb = K / 32, block_bytes = GROUPS * 4 * LANES * bits / 8;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m512 acc[2][MAX_ROWS];
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dot[2][MAX_ROWS];
        for (int i = 0; i < T; ++i)
            for (int r = 0; r < R; ++r) dot[i][r] = _mm512_setzero_si512();
        for (int g = 0; g < GROUPS; ++g) {
            __m512i w[2];
            for (int i = 0; i < T; ++i) {
                const uint8_t *at = codes + ((t + i) * nb + b) * block_bytes;
                if (bits == 4) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(at + g * 32));
                    const __m256i lo = _mm256_and_si256(raw, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    w[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                } else {
                    w[i] = _mm512_loadu_si512((const void *)(at + g * 64));
                }
            }
            for (int r = 0; r < R; ++r) {
                int32_t four;
                memcpy(&four, qx + (m0 + r) * K + b * 32 + g * 4, 4);
                const __m512i a = _mm512_set1_epi32(four);
                for (int i = 0; i < T; ++i) dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], w[i], a);
            }
        }
        for (int i = 0; i < T; ++i) {
            const int64_t at = ((t + i) * nb + b) * LANES;
            const __m512 s = _mm512_loadu_ps(scales + at), o = _mm512_loadu_ps(offsets + at);
            for (int r = 0; r < R; ++r) {
                const int64_t row = (m0 + r) * nb + b;
                const __m512 d = _mm512_mul_ps(s, _mm512_set1_ps(dx[row]));
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), d, acc[i][r]);
                acc[i][r] = _mm512_fmadd_ps(o, _mm512_set1_ps(qsum[row]), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + (t + i) * LANES, acc[i][r]);
}

#define ROWS_CASE(T, n) \
    case n: tile_rows(qx, dx, qsum, K, N, codes, scales, offsets, bits, y, t, m0, T, n); break;
#define ROWS_SWITCH(T, rows)                                                   \
    switch (rows) {                                                            \
        ROWS_CASE(T, 1) ROWS_CASE(T, 2) ROWS_CASE(T, 3) ROWS_CASE(T, 4)        \
        ROWS_CASE(T, 5) ROWS_CASE(T, 6)                                        \
    }

VNNI static void columns_vnni(const int8_t *qx, const float *dx, const float *qsum, int64_t M,
                              int64_t K, int64_t N, const uint8_t *codes, const float *scales,
                              const float *offsets, int64_t bits, float *y, int64_t t0,
                              int64_t t1) {
    /* rows in near-equal chunks of at most MAX_ROWS (17 -> 6, 6, 5) */
    const int64_t chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
    for (int64_t t = t0; t < t1; t += 2) {
        for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
            const int64_t rows = (M - m0) / (chunks - c);
            if (t + 1 < t1) {
                ROWS_SWITCH(2, rows)
            } else {
                ROWS_SWITCH(1, rows)
            }
            m0 += rows;
        }
    }
}

static int has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#else
static int has_vnni(void) { return 0; }
#endif

static int portable_only = 0;

int blockq_simd(void) {
    static int vnni = -1;
    if (vnni < 0) vnni = has_vnni();
    return !portable_only && vnni;
}

void blockq_set_portable(int portable) { portable_only = portable; }

void blockq_columns(const int8_t *qx, const float *dx, const float *qsum, int64_t M, int64_t K,
                    int64_t N, const uint8_t *codes, const float *scales, const float *offsets,
                    int64_t bits, float *y, int64_t tile_begin, int64_t tile_end) {
#if defined(__GNUC__) && defined(__x86_64__)
    if (blockq_simd()) {
        columns_vnni(qx, dx, qsum, M, K, N, codes, scales, offsets, bits, y, tile_begin, tile_end);
        return;
    }
#endif
    columns_portable(qx, dx, qsum, M, K, N, codes, scales, offsets, bits, y, tile_begin, tile_end);
}
