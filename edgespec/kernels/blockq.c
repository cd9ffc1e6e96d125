/* Block-quantized matrix products, batch-invariant by construction (see blockq.h).
 *
 * Three column kernels with bitwise the same results: portable C, AVX2 and AVX-512 VNNI,
 * the best the CPU has chosen at run time (the library is built without global ISA flags).
 * All compute, per output, acc = fma(offset, sum, fma(float(I), scale * d, acc)) block
 * after block, I the exact integer dot product of a block's codes and the row's int8 codes.
 * Build with -ffp-contract=off so the compiler fuses nothing the other kernels do not.
 */
#define _GNU_SOURCE /* syscall(): asking Linux for AMX's tile state */
#include "blockq.h"
#include "simd.h"

#if defined(EDGESPEC_X86) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define EDGESPEC_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#endif


#define GROUPS 8 /* groups of 4 inputs in a block of 32 */
#define LANES 16 /* columns in a tile */
#define PLANES_AT 256 /* where a 5- or 6-bit block's bit planes begin, after its low nibbles */

/* Bit planes a block's codes have after their low nibbles: bits - 4 for 5 and 6 bits. */
static inline int planes_of(int64_t bits) { return bits == 8 ? 0 : (int)bits - 4; }

/* Whether rows keep each pair of blocks together (blockq.h: row-wise rows, K % 64 == 0). */
static inline int paired(const BlockqRows *x) { return x->rowwise && x->K % 64 == 0; }

/* Where row m's codes of block b begin. */
static inline int64_t codes_at(const BlockqRows *x, int64_t m, int64_t b) {
    return paired(x) ? ((b / 2) * x->M + m) * 64 + (b % 2) * 32 : (b * x->M + m) * 32;
}

/* Per row and block: d = peak / 127, and the factor taking x to codes (0 for a zero block). */
static float to_codes(float peak, float *d) {
    *d = peak / 127.0f;
    return *d != 0.0f ? 1.0f / *d : 0.0f;
}

/* A block's d and sums at `at`; `first`: the sum of its first 16 codes (the halves' sums
 * where the rows keep them). */
static void store_block(BlockqRows *rows, int64_t at, float d, int32_t sum, int32_t first) {
    rows->d[at] = d;
    rows->sum[at] = d * (float)sum;
    rows->isum[at] = sum;
    if (rows->isum16 != NULL) {
        const int32_t halves[2] = {first, sum - first};
        for (int j = 0; j < 2; ++j) {
            rows->isum16[2 * at + j] = halves[j];
            rows->sum16[2 * at + j] = d * (float)halves[j];
        }
    }
}

/* Block b of row m quantized: its sums stored, or for row-wise rows added to the row's
 * `total` (stored once by store_row: a row-wise kernel needs the row's, not a block's). */
static inline void store_sums(BlockqRows *rows, int64_t m, int64_t b, float d, int32_t sum,
                              int32_t first, int32_t *total) {
    if (rows->rowwise)
        *total += sum;
    else
        store_block(rows, b * rows->M + m, d, sum, first);
}

/* A row-wise row's d and code sum, at m (blockq.h). */
static inline void store_row(BlockqRows *rows, int64_t m, float d, int32_t total) {
    if (rows->rowwise) store_block(rows, m, d, total, 0);
}

/* The largest |x[i]| of n values (exact, so every path's is the same). */
static float peak_portable(const float *x, int64_t n) {
    float peak = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float a = fabsf(x[i]);
        peak = a > peak ? a : peak;
    }
    return peak;
}

/* Codes by int8_code (simd.h): the SIMD paths' rounding, with no libm call. */
static void quantize_portable(const float *x, BlockqRows *rows, int64_t m0, int64_t m1) {
    const int64_t K = rows->K, nb = K / 32;
    for (int64_t m = m0; m < m1; ++m) {
        float row_d = 0.0f;
        int32_t total = 0;
        const float row_inv = rows->rowwise ? to_codes(peak_portable(x + m * K, K), &row_d) : 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const float *v = x + m * K + b * 32;
            int8_t *q = rows->q + codes_at(rows, m, b);
            float d = row_d;
            const float inv = rows->rowwise ? row_inv : to_codes(peak_portable(v, 32), &d);
            int32_t sum = 0, first = 0;
            for (int i = 0; i < 32; ++i) {
                q[i] = int8_code(v[i] * inv);
                sum += q[i];
                if (i == 15) first = sum;
            }
            store_sums(rows, m, b, d, sum, first, &total);
        }
        store_row(rows, m, row_d, total);
    }
}

static void silu_mul_portable(const float *x, int64_t M, int64_t K, float *out) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) {
            const float g = x[m * 2 * K + k];
            out[m * K + k] = g / (1.0f + exp_portable(0.0f - g)) * x[m * 2 * K + K + k];
        }
}

/* blockq_hadamard: stages h = 1, 2, .., B/2 of each block, each butterfly in place. */
static void hadamard_portable(float *x, int64_t M, int64_t K, int64_t B) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < K; c += B) {
            float *v = x + m * K + c;
            for (int64_t h = 1; h < B; h *= 2)
                for (int64_t j = 0; j < B; j += 2 * h)
                    for (int64_t i = j; i < j + h; ++i) {
                        const float a = v[i], b = v[i + h];
                        v[i] = a + b;
                        v[i + h] = a - b;
                    }
        }
}

const uint8_t blockq_iq4[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                 129, 141, 153, 166, 181, 197, 217, 241};

/* The code of column lane c (0..15), input j (0..3) of group g of a tile's block. */
static inline int code_at(const uint8_t *block, int64_t bits, const uint8_t *book, int g,
                          int c, int j) {
    if (bits == 8) return block[g * 64 + c * 4 + j];
    const uint8_t byte = block[(g / 2) * 64 + c * 4 + j];
    int code = g % 2 ? (byte >> 4) : (byte & 0x0F);
    if (book) return book[code];
    const int i = c * 4 + j; /* 5 and 6 bits: the higher bits from their planes */
    for (int p = 0; p < planes_of(bits); ++p)
        code |= ((block[PLANES_AT + (p * GROUPS + g) * 8 + i / 8] >> (i % 8)) & 1) << (4 + p);
    return code;
}

static float table_at(const void *table, int half, int64_t i) {
    return half ? from_half(((const uint16_t *)table)[i]) : ((const float *)table)[i];
}

/* Sub-blocks a block of 32 has: 2 for K-quant tables in sub-blocks of 16, else 1. */
static inline int parts_of(int64_t sub) { return sub == 16 ? 2 : 1; }

/* Where lane c's tables of tile t, block b, sub-block j (of parts_of) are: per block, or
 * for K-quant tables its super-block's (at) and its sub-block's (sub_at). */
static inline int64_t table_index(int64_t nb, int64_t t, int64_t b, int64_t sub) {
    return sub ? (t * (nb / 8) + b / 8) * LANES : (t * nb + b) * LANES;
}
static inline int64_t sub_index(int64_t nb, int64_t t, int64_t b, int j, int64_t sub) {
    return ((t * nb + b) * parts_of(sub) + j) * LANES;
}

/* Lane c's scale and offset for sub-block j of block b of tile t. */
static void lane_tables(const BlockqWeight *w, int64_t nb, int64_t t, int64_t b, int j, int c,
                        float *s, float *o) {
    const int64_t at = table_index(nb, t, b, w->sub) + c;
    *s = table_at(w->scales, w->half, at);
    *o = table_at(w->offsets, w->half, at);
    if (w->sub) {
        const int64_t sub_at = sub_index(nb, t, b, j, w->sub) + c;
        *s *= (float)w->sub_scales[sub_at];
        *o *= (float)w->sub_offsets[sub_at];
    }
}

/* A row's activation sum over sub-block j of block row `row` (b*M + m). */
static inline float row_sum(const BlockqRows *x, int64_t row, int j, int64_t sub) {
    return sub == 16 ? x->sum16[2 * row + j] : x->sum[row];
}

static void columns_portable(const BlockqRows *x, const BlockqWeight *w, float *y, int64_t t0,
                             int64_t t1) {
    const int64_t K = x->K, N = w->N, bits = w->bits, nb = K / 32;
    const int64_t block_bytes = GROUPS * 4 * LANES * bits / 8;
    const uint8_t *codes = w->codes;
    const int parts = parts_of(w->sub), part_groups = GROUPS / parts;
    for (int64_t t = t0; t < t1; ++t) {
        for (int c = 0; c < LANES; ++c) {
            for (int64_t m = 0; m < x->M; ++m) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; ++b) {
                    const uint8_t *block = codes + (t * nb + b) * block_bytes;
                    const int8_t *q = x->q + (b * x->M + m) * 32;
                    const int64_t row = b * x->M + m;
                    for (int p = 0; p < parts; ++p) {
                        int32_t dot = 0;
                        for (int g = p * part_groups; g < (p + 1) * part_groups; ++g)
                            for (int j = 0; j < 4; ++j)
                                dot += code_at(block, bits, w->book, g, c, j) * q[g * 4 + j];
                        float s, o;
                        lane_tables(w, nb, t, b, p, c, &s, &o);
                        acc = fmaf((float)dot, s * x->d[row], acc);
                        acc = fmaf(o, row_sum(x, row, p, w->sub), acc);
                    }
                }
                y[m * N + t * LANES + c] = acc;
            }
        }
    }
}

/* Row-wise: output n of row m is float(I) * (scale[n] * d[m]) (blockq.h). */
static inline float row_output(const BlockqRows *x, const BlockqWeight *w, int64_t m, int64_t n,
                               int32_t exact) {
    return (float)exact * (((const float *)w->scales)[n] * x->d[m]);
}

static void columns_portable_row(const BlockqRows *x, const BlockqWeight *w, float *y,
                                 int64_t t0, int64_t t1) {
    const int64_t K = x->K, N = w->N, nb = K / 32;
    for (int64_t t = t0; t < t1; ++t)
        for (int c = 0; c < LANES; ++c)
            for (int64_t m = 0; m < x->M; ++m) {
                int32_t dot = 0;
                for (int64_t b = 0; b < nb; ++b) {
                    const uint8_t *block = w->codes + (t * nb + b) * GROUPS * 4 * LANES;
                    const int8_t *q = x->q + codes_at(x, m, b);
                    for (int g = 0; g < GROUPS; ++g)
                        for (int j = 0; j < 4; ++j)
                            dot += (block[g * 64 + c * 4 + j] - 128) * q[g * 4 + j];
                }
                y[m * N + t * LANES + c] = row_output(x, w, m, t * LANES + c, dot);
            }
}

#ifdef EDGESPEC_X86
#define MAX_ROWS 6

/* The tiles a kernel prefetches while it works on others: `tiles` tiles from `tile`, and of
 * each block this pass's share of cache lines (`part` of `parts`: the passes over the same
 * tiles for other rows take the rest), so that the weights of the next tiles stream in
 * while this tile's are multiplied, evenly over the passes. Measured (2 threads, weights
 * beyond the L3 cache): 5-row products 1.4-1.6x faster, 17-row 1.25x; results unchanged.
 * Non-temporal (prefetchnta) on AMD: a step streams ~100 MB of weights that are not read
 * again before the next step, and would otherwise push out of the caches what is (the KV
 * cache, a draft head's 8 MB of weights between target passes). SmolLM2's default export
 * on an AMD EPYC, 2 threads: AR 1.05-1.10x and the default mode 1.02-1.11x the tokens/s
 * (two runs, 36 and 60 prompt pairs, interleaved), passes of 1-17 rows 0.96-1.03x the
 * time. Ordinary (prefetcht0) elsewhere: on an Intel Xeon (Sapphire Rapids class, 2 cores),
 * weights streamed from memory through prefetchnta at 3.5-5 GB/s and through prefetcht0
 * (or t1, t2) at 6-9 (six 285 MB weights in turn, 2 threads), and one step of Gemma 3
 * 270M took 0.5x the time, of a Llama-1B-shaped Q4_K_M model 0.6x.
 * The last tiles of a range prefetch the first of the next range (up to the weight's last
 * tile), which a thread takes next: each of a product's ranges (up to 4 a thread) had begun
 * on weights that were not on their way. SmolLM2's default export, 2 threads, the kernel
 * libraries side by side (tools/ab_kernels.py, 2 runs of 8 rounds, orders reversed): passes
 * of 1 / 2 / 5 / 17 rows 0.84-0.94x / 0.94-0.95x / 0.89-0.91x / 0.98-0.99x the time. */
typedef struct {
    int64_t tile, tiles;
    int part, parts;
} Ahead;

static int prefetch_nta; /* set with the path (best_path): on AMD CPUs */

static inline void prefetch(const void *at) {
    if (prefetch_nta)
        __builtin_prefetch(at, 0, 0);
    else
        __builtin_prefetch(at, 0, 3);
}

static inline void prefetch_block(const BlockqWeight *w, const Ahead *a, int64_t nb, int64_t b) {
    const int64_t block_bytes = GROUPS * 4 * LANES * w->bits / 8, entry = w->half ? 2 : 4;
    for (int64_t i = 0; i < a->tiles; ++i) {
        const int64_t at = (a->tile + i) * nb + b;
        const char *codes = (const char *)(w->codes + at * block_bytes);
        for (int64_t line = a->part * 64; line < block_bytes; line += 64 * a->parts)
            prefetch(codes + line);
        if (a->part == 0 && !w->rowwise) {
            const int64_t table = table_index(nb, a->tile + i, b, w->sub) * entry;
            prefetch((const char *)w->scales + table);
            prefetch((const char *)w->offsets + table);
            if (w->sub) {
                const int64_t sub_at = sub_index(nb, a->tile + i, b, 0, w->sub);
                prefetch(w->sub_scales + sub_at);
                prefetch(w->sub_offsets + sub_at);
            }
        }
    }
}

static int32_t four_codes(const BlockqRows *x, int64_t m, int64_t b, int g) {
    int32_t four;
    memcpy(&four, x->q + codes_at(x, m, b) + g * 4, 4);
    return four;
}

/* 16 table entries from `at` as floats. */
VNNI INLINE __m512 table16(const void *table, int half, int64_t at) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)table + at)));
    return _mm512_loadu_ps((const float *)table + at);
}

/* A super-block's 16 lanes (D or M) times a sub-block's int8 factors: exact in float. */
VNNI INLINE __m512 times16(__m512 table, const int8_t *factors) {
    return _mm512_mul_ps(table, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)factors))));
}

/* AVX-512 VNNI: rows m0 .. m0+R-1 of T adjacent tiles (T*16 columns, one register each);
 * each weight group is unpacked once for all R rows and each activation group broadcast
 * once for all T tiles. Sub-blocks of 16 (SUB) take the block in two parts, each scaled
 * as it ends. */
VNNI INLINE void tile_rows_vnni(const BlockqRows *x, const BlockqWeight *wt, float *y,
                                int64_t t, int64_t m0, const int T, const int R,
                                const Ahead *ahead, const int64_t bits, const int half,
                                const int book, const int64_t SUB) {
    const int64_t N = wt->N, nb = x->K / 32;
    const int64_t block_bytes = GROUPS * 4 * LANES * bits / 8;
    const int parts = parts_of(SUB), part_pairs = GROUPS / 2 / parts;
    const int planes = planes_of(bits);
    const uint8_t *codes = wt->codes;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i values = book ? _mm512_broadcast_i32x4(
        _mm_loadu_si128((const __m128i *)wt->book)) : _mm512_setzero_si512();
    __m512 acc[2][MAX_ROWS];
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_block(wt, ahead, nb, b);
        /* this block's codes, scales and sums of rows m0.. are adjacent (blockq.h) */
        const int8_t *qb = x->q + (b * x->M + m0) * 32;
        const float *db = x->d + b * x->M + m0;
        for (int p = 0; p < parts; ++p) {
            __m512i dot[2][MAX_ROWS];
            for (int i = 0; i < T; ++i)
                for (int r = 0; r < R; ++r) dot[i][r] = _mm512_setzero_si512();
            for (int h = p * part_pairs; h < (p + 1) * part_pairs; ++h) { /* 64 bytes: groups 2h, 2h+1 */
                __m512i w[2][2];
                for (int i = 0; i < T; ++i) {
                    const uint8_t *at = codes + ((t + i) * nb + b) * block_bytes;
                    if (bits != 8) {
                        const __m512i v = _mm512_loadu_si512((const void *)(at + h * 64));
                        w[i][0] = _mm512_and_si512(v, low);
                        w[i][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                        if (book) { /* indices -> the book's codes (16 bytes, every 128-bit lane) */
                            w[i][0] = _mm512_shuffle_epi8(values, w[i][0]);
                            w[i][1] = _mm512_shuffle_epi8(values, w[i][1]);
                        }
                        /* 5 and 6 bits: add 16 << p to the codes whose plane-p bit is set */
                        for (int p = 0; p < planes; ++p)
                            for (int g = 0; g < 2; ++g) {
                                const __mmask64 set = _load_mask64(
                                    (__mmask64 *)(at + PLANES_AT + (p * GROUPS + 2 * h + g) * 8));
                                w[i][g] = _mm512_mask_add_epi8(w[i][g], set, w[i][g],
                                                               _mm512_set1_epi8(16 << p));
                            }
                    } else {
                        w[i][0] = _mm512_loadu_si512((const void *)(at + 2 * h * 64));
                        w[i][1] = _mm512_loadu_si512((const void *)(at + (2 * h + 1) * 64));
                    }
                }
                for (int g = 0; g < 2; ++g) {
                    for (int r = 0; r < R; ++r) {
                        int32_t four;
                        memcpy(&four, qb + r * 32 + (2 * h + g) * 4, 4);
                        const __m512i a = _mm512_set1_epi32(four);
                        for (int i = 0; i < T; ++i)
                            dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], w[i][g], a);
                    }
                }
            }
            for (int i = 0; i < T; ++i) {
                const int64_t at = table_index(nb, t + i, b, SUB);
                __m512 s = table16(wt->scales, half, at), o = table16(wt->offsets, half, at);
                if (SUB) {
                    const int64_t sub_at = sub_index(nb, t + i, b, p, SUB);
                    s = times16(s, wt->sub_scales + sub_at);
                    o = times16(o, wt->sub_offsets + sub_at);
                }
                for (int r = 0; r < R; ++r) {
                    const __m512 d = _mm512_mul_ps(s, _mm512_set1_ps(db[r]));
                    acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), d, acc[i][r]);
                    acc[i][r] = _mm512_fmadd_ps(
                        o, _mm512_set1_ps(row_sum(x, b * x->M + m0 + r, p, SUB)), acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + (t + i) * LANES, acc[i][r]);
}

/* The exact int32 lane sums of w (unsigned codes) times a (int8) over 4 bytes, as VNNI's
 * dot product gives them. Unsigned codes below 64 (bits 4; 5- and 6-bit codes pass 4 too):
 * maddubs' 16-bit pair sums cannot saturate (2 * 63 * 127). 8-bit codes u: (u - 128) * a
 * through sign tricks (pairs at most 2 * 128 * 127), and 128 * (the row's code sum) added
 * back per block by the caller. */
AVX2 INLINE __m256i dot4_avx2(__m256i w, __m256i a, int64_t bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q)), ones);
}

/* 8 table entries from `at` as floats. */
AVX2 INLINE __m256 table8(const void *table, int half, int64_t at) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)table + at)));
    return _mm256_loadu_ps((const float *)table + at);
}

/* times16's 8 lanes. */
AVX2 INLINE __m256 times8(__m256 table, const int8_t *factors) {
    return _mm256_mul_ps(table, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64((const __m128i *)factors))));
}

/* `value` in byte i of 32 where bit i of `set` is 1, else 0: a bit plane of 5- or 6-bit
 * codes (blockq.h) as the bytes it adds. */
AVX2 INLINE __m256i plane_bytes(uint32_t set, int value) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)set), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit),
                            _mm256_set1_epi8((char)value));
}

/* AVX2: rows m0 .. m0+R-1 of one tile, as two halves of 8 columns. */
AVX2 INLINE void tile_rows_avx2(const BlockqRows *x, const BlockqWeight *wt, float *y,
                                int64_t t, int64_t m0, const int R, const Ahead *ahead) {
    const int64_t N = wt->N, bits = wt->bits, nb = x->K / 32;
    const int64_t block_bytes = GROUPS * 4 * LANES * bits / 8;
    const int parts = parts_of(wt->sub), part_pairs = GROUPS / 2 / parts;
    const uint8_t *codes = wt->codes;
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* a book's codes take all 8 bits: they are multiplied as 8-bit codes are; 5- and 6-bit
     * ones as 4-bit ones (dot4_avx2) */
    const int64_t code_bits = wt->book || bits == 8 ? 8 : 4;
    const int planes = planes_of(bits);
    const __m256i values = wt->book ? _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)wt->book)) : _mm256_setzero_si256();
    __m256 acc[2][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = codes + (t * nb + b) * block_bytes;
        prefetch_block(wt, ahead, nb, b);
        for (int p = 0; p < parts; ++p) {
            __m256i dot[2][2];
            for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
            for (int h = p * part_pairs; h < (p + 1) * part_pairs; ++h) {
                for (int half = 0; half < 2; ++half) {
                    __m256i w[2];
                    if (bits != 8) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(block + h * 64 + half * 32));
                        w[0] = _mm256_and_si256(v, low);
                        w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                        if (wt->book) {
                            w[0] = _mm256_shuffle_epi8(values, w[0]);
                            w[1] = _mm256_shuffle_epi8(values, w[1]);
                        }
                        for (int p = 0; p < planes; ++p)
                            for (int g = 0; g < 2; ++g) {
                                uint32_t set;
                                memcpy(&set, block + PLANES_AT + (p * GROUPS + 2 * h + g) * 8 +
                                       half * 4, 4);
                                w[g] = _mm256_or_si256(w[g], plane_bytes(set, 16 << p));
                            }
                    } else {
                        w[0] = _mm256_loadu_si256((const __m256i *)(block + 2 * h * 64 + half * 32));
                        w[1] = _mm256_loadu_si256((const __m256i *)(block + (2 * h + 1) * 64 + half * 32));
                    }
                    for (int g = 0; g < 2; ++g)
                        for (int r = 0; r < R; ++r)
                            dot[r][half] = _mm256_add_epi32(dot[r][half], dot4_avx2(
                                w[g], _mm256_set1_epi32(four_codes(x, m0 + r, b, 2 * h + g)),
                                code_bits));
                }
            }
            for (int half = 0; half < 2; ++half) {
                const int64_t at = table_index(nb, t, b, wt->sub) + half * 8;
                __m256 s = table8(wt->scales, wt->half, at), o = table8(wt->offsets, wt->half, at);
                if (wt->sub) {
                    const int64_t sub_at = sub_index(nb, t, b, p, wt->sub) + half * 8;
                    s = times8(s, wt->sub_scales + sub_at);
                    o = times8(o, wt->sub_offsets + sub_at);
                }
                for (int r = 0; r < R; ++r) {
                    const int64_t row = b * x->M + m0 + r;
                    __m256i exact = dot[r][half];
                    if (code_bits == 8) /* the part's code sum times 128 (dot4_avx2) */
                        exact = _mm256_add_epi32(exact, _mm256_set1_epi32(
                            128 * (parts == 2 ? x->isum16[2 * row + p] : x->isum[row])));
                    const __m256 d = _mm256_mul_ps(s, _mm256_set1_ps(x->d[row]));
                    acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), d, acc[r][half]);
                    acc[r][half] = _mm256_fmadd_ps(o, _mm256_set1_ps(row_sum(x, row, p, wt->sub)),
                                                   acc[r][half]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int half = 0; half < 2; ++half)
            _mm256_storeu_ps(y + (m0 + r) * N + t * LANES + half * 8, acc[r][half]);
}

#define VNNI_CASE(T, n, B, H, L, S) \
    case n: tile_rows_vnni(x, w, y, t, m0, T, n, &ahead, B, H, L, S); break;
#define VNNI_SWITCH(T, rows, B, H, L, S)                                                      \
    switch (rows) {                                                                           \
        VNNI_CASE(T, 1, B, H, L, S) VNNI_CASE(T, 2, B, H, L, S) VNNI_CASE(T, 3, B, H, L, S)   \
        VNNI_CASE(T, 4, B, H, L, S) VNNI_CASE(T, 5, B, H, L, S) VNNI_CASE(T, 6, B, H, L, S)   \
    }

/* columns_vnni for one code width, table type, book (or none) and sub-block size (0: per
 * block tables), constants in its inner loops. */
#define COLUMNS_VNNI(BITS, HALF, BOOK, SUB)                                                   \
    VNNI static void columns_vnni_##BITS##_##HALF##_##BOOK##_##SUB(                           \
        const BlockqRows *x, const BlockqWeight *w, float *y, int64_t t0, int64_t t1) {       \
        /* rows in near-equal chunks of at most MAX_ROWS (17 -> 5, 6, 6) */                  \
        const int64_t M = x->M, chunks = (M + MAX_ROWS - 1) / MAX_ROWS;                      \
        for (int64_t t = t0; t < t1; t += 2) {                                                \
            for (int64_t c = 0, m0 = 0; c < chunks; ++c) {                                    \
                const int64_t rows = (M - m0) / (chunks - c), left = w->N / LANES - t - 2;    \
                const Ahead ahead = {t + 2, left < 0 ? 0 : (left < 2 ? left : 2), (int)c,     \
                                     (int)chunks};                                            \
                if (t + 1 < t1) {                                                             \
                    VNNI_SWITCH(2, rows, BITS, HALF, BOOK, SUB)                               \
                } else {                                                                      \
                    VNNI_SWITCH(1, rows, BITS, HALF, BOOK, SUB)                               \
                }                                                                             \
                m0 += rows;                                                                   \
            }                                                                                 \
        }                                                                                     \
    }

COLUMNS_VNNI(4, 0, 0, 0)
COLUMNS_VNNI(4, 1, 0, 0)
COLUMNS_VNNI(4, 0, 1, 0)
COLUMNS_VNNI(4, 1, 1, 0)
COLUMNS_VNNI(8, 0, 0, 0)
COLUMNS_VNNI(8, 1, 0, 0)
/* K-quant tables: float16 super-block tables (BlockQMatMulK) */
COLUMNS_VNNI(4, 1, 0, 32)
COLUMNS_VNNI(4, 1, 1, 32)
COLUMNS_VNNI(8, 1, 0, 32)
COLUMNS_VNNI(4, 1, 0, 16)
COLUMNS_VNNI(8, 1, 0, 16)
/* 5- and 6-bit codes: GGUF's Q5_0, Q5_1 (per-block tables), Q5_K (sub 32), Q6_K (sub 16) */
COLUMNS_VNNI(5, 0, 0, 0)
COLUMNS_VNNI(5, 1, 0, 0)
COLUMNS_VNNI(5, 1, 0, 32)
COLUMNS_VNNI(5, 1, 0, 16)
COLUMNS_VNNI(6, 0, 0, 0)
COLUMNS_VNNI(6, 1, 0, 0)
COLUMNS_VNNI(6, 1, 0, 32)
COLUMNS_VNNI(6, 1, 0, 16)

VNNI static void columns_vnni(const BlockqRows *x, const BlockqWeight *w, float *y, int64_t t0,
                              int64_t t1) {
/* the instantiation for 5- or 6-bit codes (B) and w's tables */
#define WIDE_VNNI(B)                                                                          \
    (w->sub == 16 ? columns_vnni_##B##_1_0_16                                                 \
     : w->sub     ? columns_vnni_##B##_1_0_32                                                 \
     : w->half    ? columns_vnni_##B##_1_0_0                                                  \
                  : columns_vnni_##B##_0_0_0)
    if (w->bits == 5 || w->bits == 6)
        (w->bits == 5 ? WIDE_VNNI(5) : WIDE_VNNI(6))(x, w, y, t0, t1);
    else if (w->sub == 16)
        (w->bits == 4 ? columns_vnni_4_1_0_16 : columns_vnni_8_1_0_16)(x, w, y, t0, t1);
    else if (w->sub)
        (w->bits == 8 ? columns_vnni_8_1_0_32
                      : w->book ? columns_vnni_4_1_1_32 : columns_vnni_4_1_0_32)(x, w, y, t0, t1);
    else if (w->bits == 4 && w->book)
        (w->half ? columns_vnni_4_1_1_0 : columns_vnni_4_0_1_0)(x, w, y, t0, t1);
    else if (w->bits == 4)
        (w->half ? columns_vnni_4_1_0_0 : columns_vnni_4_0_0_0)(x, w, y, t0, t1);
    else
        (w->half ? columns_vnni_8_1_0_0 : columns_vnni_8_0_0_0)(x, w, y, t0, t1);
}

/* AVX2, row-wise: rows m0 .. m0+R-1 of one tile, each sum over all of K (dot4_avx2 gives
 * (u - 128) * a exactly), then one float step an output. */
AVX2 INLINE void tile_rows_avx2_row(const BlockqRows *x, const BlockqWeight *wt, float *y,
                                    int64_t t, int64_t m0, const int R, const Ahead *ahead) {
    const int64_t N = wt->N, nb = x->K / 32;
    __m256i dot[2][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = wt->codes + (t * nb + b) * GROUPS * 4 * LANES;
        prefetch_block(wt, ahead, nb, b);
        for (int g = 0; g < GROUPS; ++g)
            for (int half = 0; half < 2; ++half) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(block + g * 64 + half * 32));
                for (int r = 0; r < R; ++r)
                    dot[r][half] = _mm256_add_epi32(dot[r][half], dot4_avx2(
                        w, _mm256_set1_epi32(four_codes(x, m0 + r, b, g)), 8));
            }
    }
    for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(x->d[m0 + r]);
        for (int half = 0; half < 2; ++half) {
            const __m256 s = _mm256_loadu_ps((const float *)wt->scales + t * LANES + half * 8);
            _mm256_storeu_ps(y + (m0 + r) * N + t * LANES + half * 8, _mm256_mul_ps(
                _mm256_cvtepi32_ps(dot[r][half]), _mm256_mul_ps(s, d)));
        }
    }
}

AVX2 static void columns_avx2_row(const BlockqRows *x, const BlockqWeight *w, float *y,
                                  int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
        for (int64_t m0 = 0; m0 < x->M; m0 += 2) {
            const Ahead ahead = {t + 1, t + 1 < w->N / LANES, 0, 1};
            if (m0 + 2 <= x->M)
                tile_rows_avx2_row(x, w, y, t, m0, 2, &ahead);
            else
                tile_rows_avx2_row(x, w, y, t, m0, 1, &ahead);
        }
}

/* Row m's 16 outputs in tile t from its integer sums of u * a over all of K: less `zero`
 * (128 times the row's code sum), then row_output's float step. */
VNNI INLINE void row_outputs_512(const BlockqRows *x, const BlockqWeight *w, float *y,
                                 __m512i sums, __m512i zero, int64_t t, int64_t m) {
    const __m512 s = _mm512_loadu_ps((const float *)w->scales + t * LANES);
    _mm512_storeu_ps(y + m * w->N + t * LANES, _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, zero)), _mm512_mul_ps(s, _mm512_set1_ps(x->d[m]))));
}

/* AVX-512 VNNI, row-wise: rows m0 .. m0+R-1 of T adjacent tiles, vpdpbusd's sums of u * a
 * over all of K, then row_outputs_512. */
VNNI INLINE void tile_rows_vnni_row(const BlockqRows *x, const BlockqWeight *wt, float *y,
                                    int64_t t, int64_t m0, const int T, const int R,
                                    const Ahead *ahead) {
    const int64_t nb = x->K / 32, block_bytes = GROUPS * 4 * LANES;
    __m512i dot[2][MAX_ROWS];
    for (int i = 0; i < T; ++i)
        for (int r = 0; r < R; ++r) dot[i][r] = _mm512_setzero_si512();
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_block(wt, ahead, nb, b);
        for (int g = 0; g < GROUPS; ++g) {
            __m512i w[2];
            for (int i = 0; i < T; ++i)
                w[i] = _mm512_loadu_si512((const void *)(wt->codes + ((t + i) * nb + b) * block_bytes
                                                         + g * 64));
            for (int r = 0; r < R; ++r) {
                int32_t four;
                memcpy(&four, x->q + codes_at(x, m0 + r, b) + g * 4, 4);
                const __m512i a = _mm512_set1_epi32(four);
                for (int i = 0; i < T; ++i) dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], w[i], a);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const __m512i zero = _mm512_set1_epi32(128 * x->isum[m0 + r]);
        for (int i = 0; i < T; ++i) row_outputs_512(x, wt, y, dot[i][r], zero, t + i, m0 + r);
    }
}

#define VNNI_ROW_CASE(T, n) \
    case n: tile_rows_vnni_row(x, w, y, t, m0, T, n, &ahead); break;
#define VNNI_ROW_SWITCH(T, rows)                                                              \
    switch (rows) {                                                                           \
        VNNI_ROW_CASE(T, 1) VNNI_ROW_CASE(T, 2) VNNI_ROW_CASE(T, 3)                           \
        VNNI_ROW_CASE(T, 4) VNNI_ROW_CASE(T, 5) VNNI_ROW_CASE(T, 6)                           \
    }

VNNI static void columns_vnni_row(const BlockqRows *x, const BlockqWeight *w, float *y,
                                  int64_t t0, int64_t t1) {
    const int64_t M = x->M, chunks = (M + MAX_ROWS - 1) / MAX_ROWS;
    for (int64_t t = t0; t < t1; t += 2)
        for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
            const int64_t rows = (M - m0) / (chunks - c), left = w->N / LANES - t - 2;
            const Ahead ahead = {t + 2, left < 0 ? 0 : (left < 2 ? left : 2), (int)c, (int)chunks};
            if (t + 1 < t1) {
                VNNI_ROW_SWITCH(2, rows)
            } else {
                VNNI_ROW_SWITCH(1, rows)
            }
            m0 += rows;
        }
}

#ifdef EDGESPEC_AMX
/* AMX: tile configurations by the inputs a tile product takes (32: a block, or 64: a pair
 * of blocks where rows keep them together) and the rows of a pass's two row groups, R0
 * (1..16) and R1 (0..16): C tiles 0, 1 (group 0) and 2, 3 (group 1), the activations' A
 * tiles 4, 5 of R0 and R1 rows, the weights' B tiles 6 and 7 of 8 or 16 rows (a block's 8
 * groups of 4 inputs, 64 bytes each: blockq.h's layout is AMX's, and a tile's blocks follow
 * each other). Kept in static storage: GCC drops stores to a local one that only ldtilecfg
 * reads. */
typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
static TileConfig amx_configs[2][17][17];

static void amx_configure(void) {
    for (int pair = 0; pair < 2; ++pair)
        for (int r0 = 1; r0 <= 16; ++r0)
            for (int r1 = 0; r1 <= 16; ++r1) {
                TileConfig *c = &amx_configs[pair][r0][r1];
                memset(c, 0, sizeof *c);
                c->palette = 1;
                const int b_rows = GROUPS << pair;
                const int rows[8] = {r0, r0, r1, r1, r0, r1, b_rows, b_rows};
                for (int i = 0; i < 8; ++i) {
                    c->rows[i] = (uint8_t)rows[i];
                    c->colsb[i] = rows[i] == 0 ? 0 : i == 4 || i == 5 ? 32 << pair : 64;
                }
            }
}

/* The outputs of a C tile's sums (R rows of 16 lanes) stored at `sums`. */
VNNI INLINE void amx_outputs(const BlockqRows *x, const BlockqWeight *w, float *y,
                             const int32_t *sums, int64_t t, int64_t m0, int R) {
    for (int r = 0; r < R; ++r)
        row_outputs_512(x, w, y, _mm512_load_si512((const void *)(sums + r * LANES)),
                        _mm512_set1_epi32(128 * x->isum[m0 + r]), t, m0 + r);
}

/* AMX, row-wise: each block of a tile pair is one tile product (tdpbsud: int8 activations
 * times unsigned codes) for each of two row groups of up to 16 rows, the four accumulated
 * in their C tiles over all of K; the sums are then what vpdpbusd's are, and so is every
 * output. */
AMX static void columns_amx_row(const BlockqRows *x, const BlockqWeight *w, float *y,
                                int64_t t0, int64_t t1) {
    const int64_t M = x->M, N = w->N, nb = x->K / 32, block_bytes = GROUPS * 4 * LANES;
    const int pair = paired(x), step = 1 + pair; /* blocks a tile product takes */
    int32_t sums[4][16 * LANES] __attribute__((aligned(64)));
    const TileConfig *configured = NULL;
    for (int64_t t = t0; t < t1; t += 2) {
        const int T = t + 1 < t1 ? 2 : 1;
        /* the tile pair after next: a pair's tile products take less time than its
         * weights take to arrive (2 threads, weights from memory, 17 rows: 0.75x the time
         * of prefetching the next pair) */
        const int64_t left = N / LANES - t - 4;
        const Ahead ahead = {t + 4, left < 0 ? 0 : (left < 2 ? left : 2), 0, 1};
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int64_t left_rows = M - m0 < 32 ? M - m0 : 32;
            const int R0 = left_rows <= 16 ? (int)left_rows : (int)(left_rows + 1) / 2;
            const int R1 = (int)left_rows - R0;
            if (configured != &amx_configs[pair][R0][R1]) {
                configured = &amx_configs[pair][R0][R1];
                _tile_loadconfig(configured);
            }
            _tile_zero(0);
            _tile_zero(1);
            if (R1) { /* group 1's tiles have no rows otherwise: touching them faults */
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t b = 0; b < nb; b += step) {
                if (m0 == 0)
                    for (int i = 0; i < step; ++i) prefetch_block(w, &ahead, nb, b + i);
                const int8_t *qb = x->q + codes_at(x, m0, b);
                _tile_loadd(4, qb, 32 * step);
                _tile_loadd(6, w->codes + (t * nb + b) * block_bytes, 64);
                if (T == 2) _tile_loadd(7, w->codes + ((t + 1) * nb + b) * block_bytes, 64);
                _tile_dpbsud(0, 4, 6);
                if (T == 2) _tile_dpbsud(1, 4, 7);
                if (R1) {
                    _tile_loadd(5, qb + R0 * 32 * step, 32 * step);
                    _tile_dpbsud(2, 5, 6);
                    if (T == 2) _tile_dpbsud(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], LANES * 4);
            if (T == 2) _tile_stored(1, sums[1], LANES * 4);
            if (R1) {
                _tile_stored(2, sums[2], LANES * 4);
                if (T == 2) _tile_stored(3, sums[3], LANES * 4);
            }
            for (int i = 0; i < T; ++i) {
                amx_outputs(x, w, y, sums[i], t + i, m0, R0);
                if (R1) amx_outputs(x, w, y, sums[2 + i], t + i, m0 + R0, R1);
            }
        }
    }
    _tile_release();
}
#endif

AVX2 static void columns_avx2(const BlockqRows *x, const BlockqWeight *w, float *y, int64_t t0,
                              int64_t t1) {
    const int parts = (int)((x->M + 1) / 2);
    for (int64_t t = t0; t < t1; ++t) {
        int64_t m0 = 0;
        for (; m0 + 2 <= x->M; m0 += 2) {
            const Ahead ahead = {t + 1, t + 1 < w->N / LANES, (int)(m0 / 2), parts};
            tile_rows_avx2(x, w, y, t, m0, 2, &ahead);
        }
        if (m0 < x->M) {
            const Ahead ahead = {t + 1, t + 1 < w->N / LANES, parts - 1, parts};
            tile_rows_avx2(x, w, y, t, m0, 1, &ahead);
        }
    }
}

/* peak_portable's value on 16 lanes (n % 32 == 0). */
VNNI static float peak_512(const float *x, int64_t n) {
    __m512 peak = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) peak = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), peak);
    return _mm512_reduce_max_ps(peak);
}

/* The portable quantizer's results with vector instructions: max, multiply, clamp and
 * round to nearest even are exact, so every path gives the same codes. */
VNNI static void quantize_vnni(const float *x, BlockqRows *rows, int64_t m0, int64_t m1) {
    const int64_t K = rows->K, nb = K / 32;
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t m = m0; m < m1; ++m) {
        float row_d = 0.0f;
        const float row_inv = rows->rowwise ? to_codes(peak_512(x + m * K, K), &row_d) : 0.0f;
        __m512i row_codes = _mm512_setzero_si512(); /* row-wise: lane sums, added up once */
        for (int64_t b = 0; b < nb; ++b) {
            const float *v = x + m * K + b * 32;
            const __m512 a[2] = {_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)};
            float d = row_d;
            const __m512 inv = _mm512_set1_ps(rows->rowwise ? row_inv : to_codes(peak_512(v, 32), &d));
            __m512i c[2];
            for (int i = 0; i < 2; ++i) {
                const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a[i], inv), lo), hi);
                c[i] = _mm512_cvtps_epi32(
                    _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                _mm_storeu_si128((__m128i *)(rows->q + codes_at(rows, m, b) + i * 16),
                                 _mm512_cvtepi32_epi8(c[i]));
            }
            const __m512i both = _mm512_add_epi32(c[0], c[1]);
            if (rows->rowwise) {
                row_codes = _mm512_add_epi32(row_codes, both);
                continue;
            }
            const int32_t first = rows->isum16 != NULL ? _mm512_reduce_add_epi32(c[0]) : 0;
            store_block(rows, b * rows->M + m, d, _mm512_reduce_add_epi32(both), first);
        }
        if (rows->rowwise) store_row(rows, m, row_d, _mm512_reduce_add_epi32(row_codes));
    }
}

/* The sum of 8 int32 lanes. */
AVX2 INLINE int32_t hsum_avx2(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* peak_portable's value on 8 lanes (n % 32 == 0). */
AVX2 static float peak_256(const float *x, int64_t n) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 peak = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        peak = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), peak);
    __m128 p = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    p = _mm_max_ps(p, _mm_movehl_ps(p, p));
    p = _mm_max_ss(p, _mm_shuffle_ps(p, p, 1));
    return _mm_cvtss_f32(p);
}

AVX2 static void quantize_avx2(const float *x, BlockqRows *rows, int64_t m0, int64_t m1) {
    const int64_t K = rows->K, nb = K / 32;
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = m0; m < m1; ++m) {
        float row_d = 0.0f;
        int32_t total = 0;
        const float row_inv = rows->rowwise ? to_codes(peak_256(x + m * K, K), &row_d) : 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const float *v = x + m * K + b * 32;
            __m256 a[4];
            for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(v + 8 * i);
            float d = row_d;
            const __m256 inv = _mm256_set1_ps(rows->rowwise ? row_inv : to_codes(peak_256(v, 32), &d));
            __m256i c[4];
            for (int i = 0; i < 4; ++i) {
                const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(a[i], inv), lo), hi);
                c[i] = _mm256_cvtps_epi32(
                    _mm256_round_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                                     _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256((__m256i *)(rows->q + codes_at(rows, m, b)),
                                _mm256_permutevar8x32_epi32(bytes, order));
            const int32_t first = hsum_avx2(_mm256_add_epi32(c[0], c[1]));
            store_sums(rows, m, b, d, first + hsum_avx2(_mm256_add_epi32(c[2], c[3])), first,
                       &total);
        }
        store_row(rows, m, row_d, total);
    }
}

/* silu_mul_portable on W-bit vectors (512: 16 lanes, 256: 8; K % 32 == 0),
 * one source for both widths so that they stay the very same operations. */
#define SILU_MUL_SIMD(W, ATTR)                                                                   \
    ATTR static void silu_mul_##W(const float *x, int64_t M, int64_t K, float *out) {            \
        const __m##W one = _mm##W##_set1_ps(1.0f);                                               \
        for (int64_t m = 0; m < M; ++m)                                                          \
            for (int64_t k = 0; k < K; k += W / 32) {                                            \
                const __m##W g = _mm##W##_loadu_ps(x + m * 2 * K + k);                           \
                const __m##W e = exp_##W(_mm##W##_sub_ps(_mm##W##_setzero_ps(), g));             \
                _mm##W##_storeu_ps(out + m * K + k,                                              \
                                   _mm##W##_mul_ps(_mm##W##_div_ps(g, _mm##W##_add_ps(one, e)),  \
                                                   _mm##W##_loadu_ps(x + m * 2 * K + K + k)));   \
            }                                                                                    \
    }

EXP_SIMD(512, VNNI)
EXP_SIMD(256, AVX2)
SILU_MUL_SIMD(512, VNNI)
SILU_MUL_SIMD(256, AVX2)

/* hadamard_portable's butterflies on 16 lanes: the stages within a vector (h < 16) first,
 * as a permute (lane l's partner l ^ h) and a masked subtract (lanes whose bit h is set
 * take partner - own, that is a - b), then the stages across vectors, a whole vector a
 * side; each stage's butterflies are independent, so this is the portable order's result. */
VNNI static void hadamard_512(float *x, int64_t M, int64_t K, int64_t B) {
    static const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    __m512i partner[4];
    for (int s = 0; s < 4; ++s)
        partner[s] = _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                         12, 13, 14, 15),
                                      _mm512_set1_epi32(1 << s));
    for (int64_t m = 0; m < M; ++m) {
        float *row = x + m * K;
        for (int64_t i = 0; i < K; i += LANES) {
            __m512 v = _mm512_loadu_ps(row + i);
            for (int s = 0; (1 << s) < B && s < 4; ++s) {
                const __m512 p = _mm512_permutexvar_ps(partner[s], v);
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper[s], p, v);
            }
            _mm512_storeu_ps(row + i, v);
        }
        for (int64_t h = LANES; h < B; h *= 2)
            for (int64_t c = 0; c < K; c += 2 * h)
                for (int64_t i = c; i < c + h; i += LANES) {
                    const __m512 a = _mm512_loadu_ps(row + i), b = _mm512_loadu_ps(row + i + h);
                    _mm512_storeu_ps(row + i, _mm512_add_ps(a, b));
                    _mm512_storeu_ps(row + i + h, _mm512_sub_ps(a, b));
                }
    }
}

#ifdef EDGESPEC_AMX
/* AMX's int8 tiles, where the CPU has them (CPUID leaf 7: AMX-TILE, AMX-INT8) and Linux
 * grants this process their state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
        return 0;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
    amx_configure();
    return 1;
}
#endif

static int best_path(void) {
    __builtin_cpu_init();
    prefetch_nta = __builtin_cpu_is("amd");
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
#ifdef EDGESPEC_AMX
        if (amx_usable()) return 3;
#endif
        return 2;
    }
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c") ? 1 : 0;
}
#else
static int best_path(void) { return 0; }
#endif

int blockq_layout(void) { return BLOCKQ_LAYOUT; }

static int path_limit = -1;

int blockq_path(void) {
    static int best = -1;
    if (best < 0) best = best_path();
    return path_limit >= 0 && path_limit < best ? path_limit : best;
}

void blockq_limit_path(int path) { path_limit = path; }

int blockq_simd(void) { return blockq_path() > 2 ? 2 : blockq_path(); }

void blockq_quantize_range(const float *x, BlockqRows *rows, int64_t m0, int64_t m1) {
    switch (blockq_path()) {
#ifdef EDGESPEC_X86
    case 3:
    case 2: quantize_vnni(x, rows, m0, m1); return;
    case 1: quantize_avx2(x, rows, m0, m1); return;
#endif
    default: quantize_portable(x, rows, m0, m1);
    }
}

void blockq_quantize_rows(const float *x, BlockqRows *rows) {
    blockq_quantize_range(x, rows, 0, rows->M);
}

void blockq_hadamard(float *x, int64_t M, int64_t K, int64_t B) {
#ifdef EDGESPEC_X86
    if (blockq_path() >= 2) {
        hadamard_512(x, M, K, B);
        return;
    }
#endif
    hadamard_portable(x, M, K, B);
}

void blockq_silu_mul(const float *x, int64_t M, int64_t K, float *out) {
    switch (blockq_path()) {
#ifdef EDGESPEC_X86
    case 3:
    case 2: silu_mul_512(x, M, K, out); return;
    case 1: silu_mul_256(x, M, K, out); return;
#endif
    default: silu_mul_portable(x, M, K, out);
    }
}

void blockq_columns(const BlockqRows *rows, const BlockqWeight *weight, float *y,
                    int64_t tile_begin, int64_t tile_end) {
    if (weight->rowwise) {
        switch (blockq_path()) {
#ifdef EDGESPEC_X86
#ifdef EDGESPEC_AMX
        case 3:
            if (rows->M >= BLOCKQ_AMX_ROWS) {
                columns_amx_row(rows, weight, y, tile_begin, tile_end);
                return;
            }
            /* fall through: fewer rows read their weights faster on VNNI */
#endif
        case 2: columns_vnni_row(rows, weight, y, tile_begin, tile_end); return;
        case 1: columns_avx2_row(rows, weight, y, tile_begin, tile_end); return;
#endif
        default: columns_portable_row(rows, weight, y, tile_begin, tile_end); return;
        }
    }
    switch (blockq_path()) {
#ifdef EDGESPEC_X86
    case 3:
    case 2: columns_vnni(rows, weight, y, tile_begin, tile_end); return;
    case 1: columns_avx2(rows, weight, y, tile_begin, tile_end); return;
#endif
    default: columns_portable(rows, weight, y, tile_begin, tile_end);
    }
}
