/* Batch-invariant attention (see attend.h): a portable path and an AVX2 one, bitwise equal.
 * Built with -ffp-contract=off like blockq.c: the compiler fuses nothing the other does not.
 */
#include "attend.h"

#include "blockq.h"
#include "simd.h"

#define MASKED -1e30f /* bias values at or below this close a key (-inf, float32's min) */

/* Does row s see slot j? Open in its bias row, and at or before its own slot. */
static inline int sees(const AttendShape *a, const float *bias, int64_t s, int64_t j) {
    return j <= a->past + s && bias[s * (a->past + a->S) + j] > MASKED;
}

/* ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): what AVX2's horizontal adds give. */
static float fold8(const float *l) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* A raw dot product taken to a score: scaled, soft-capped, biased. */
static float score(const AttendShape *a, float dot, float bias) {
    const float x = dot * a->scale;
    return (a->softcap > 0.0f ? a->softcap * tanhf(x / a->softcap) : x) + bias;
}

/* What a cache holds: floats, int8 codes (their scales applied elsewhere) or IEEE halves
 * (in this order the instance tables SCORES and VALUES are indexed by). */
enum { FLOATS, CODES, HALVES };

static inline int kind_of(const AttendShape *a) {
    return a->kscale != NULL ? CODES : a->halves ? HALVES : FLOATS;
}

static inline int64_t bytes_of(int kind) { return kind == CODES ? 1 : kind == HALVES ? 2 : 4; }

/* Element i of a cache row, as a float (exactly: codes and halves are all floats). */
static inline float cached(const void *row, int64_t i, int kind) {
    return kind == CODES    ? (float)((const int8_t *)row)[i]
           : kind == HALVES ? from_half(((const uint16_t *)row)[i])
                            : ((const float *)row)[i];
}

static inline const void *slot(const void *cache, int64_t j, int64_t D, int kind) {
    return (const char *)cache + j * D * bytes_of(kind);
}

/* The queries a block holds for KV head g: rows r0..r1-1, the group's heads. */
#define FOR_GROUP_QUERIES(b, g, s, h)                                                 \
    for (int64_t s = (b)->r0; s < (b)->r1; ++s)                                     \
        for (int64_t h = (g) * ((b)->a->H / (b)->a->Hk);                            \
             h < ((g) + 1) * ((b)->a->H / (b)->a->Hk); ++h)

static inline float *w_row(const AttendBlock *b, int64_t s, int64_t h) {
    return b->w + ((s - b->r0) * b->a->H + h) * (b->U + 8);
}

static void scores_portable(const AttendBlock *b, int64_t g, int64_t u0, int64_t u1, int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D;
    const void *K = slot(b->kcache, g * a->max, D, kind);
    for (int64_t u = u0; u < u1; ++u) {
        const void *k = slot(K, b->keys[u], D, kind);
        FOR_GROUP_QUERIES(b, g, s, h) {
            const float *q = b->qrot + (s * a->H + h) * D;
            float lanes[8] = {0};
            for (int64_t d = 0; d < D; d += 8)
                for (int l = 0; l < 8; ++l)
                    lanes[l] = fmaf(q[d + l], cached(k, d + l, kind), lanes[l]);
            w_row(b, s, h)[u] = fold8(lanes);
        }
    }
}

/* e = exp(e - top) in place; returns their sum, in 8 lanes by index, folded. */
static float exps_portable(float *e, int64_t n, float top) {
    float lanes[8] = {0};
    for (int64_t i = 0; i < n; ++i) {
        e[i] = exp_portable(e[i] - top);
        lanes[i % 8] += e[i];
    }
    return fold8(lanes);
}

/* Dimensions [d0, d1) of the block's outputs for KV head g: sum_u w_u v_keys[u] key after
 * key, in slices of KEY_SLICE keys (their values stay in L1 while every query of the
 * group takes them; the partial sums wait in `out`, which changes no bit). */
#define KEY_SLICE 64
static void values_portable(const AttendBlock *b, int64_t g, int64_t d0, int64_t d1, int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D;
    const void *V = slot(b->vcache, g * a->max, D, kind);
    for (int64_t u0 = 0; u0 < b->U; u0 += KEY_SLICE) {
        const int64_t u1 = u0 + KEY_SLICE < b->U ? u0 + KEY_SLICE : b->U;
        FOR_GROUP_QUERIES(b, g, s, h) {
            const float *w = w_row(b, s, h);
            float *o = b->out + (s * a->H + h) * D;
            if (u0 == 0)
                for (int64_t d = d0; d < d1; ++d) o[d] = 0.0f;
            for (int64_t u = u0; u < u1; ++u) {
                const void *v = slot(V, b->keys[u], D, kind);
                for (int64_t d = d0; d < d1; ++d) o[d] = fmaf(w[u], cached(v, d, kind), o[d]);
            }
        }
    }
}

#ifdef EDGESPEC_X86
EXP_SIMD(256, AVX2)
EXP_SIMD(512, VNNI)

/* fold8 on a vector. */
AVX2 INLINE float fold_256(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 q = _mm256_hadd_ps(h, h); /* lane 0: (l0+l1)+(l2+l3), lane 4: (l4+l5)+(l6+l7) */
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

/* The cache is read key after key, usually from memory (a long context's caches outgrow
 * the CPU's): rows AHEAD keys on are asked for early, which shortened a pass of 2-17
 * tokens over 3,000 keys by a fifth. */
#define AHEAD 16
INLINE void prefetch(const void *row, int64_t from, int64_t bytes) {
    for (int64_t c = from; c < from + bytes; c += 64)
        _mm_prefetch((const char *)row + c, _MM_HINT_T0);
}

/* 8 cache elements from `at` as floats (codes and halves converted, exactly). */
AVX2 INLINE __m256 load_256(const void *row, int64_t at, int kind) {
    if (kind == CODES)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)row + at))));
    if (kind == HALVES)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + at)));
    return _mm256_loadu_ps((const float *)row + at);
}

/* fold8 of four vectors at once, as the four lanes of one. */
AVX2 INLINE __m128 fold4_256(const __m256 *a) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* Dot products of Q queries (from m0, numbered as in values_tile) with four keys: each
 * key chunk is loaded once for the Q queries, whose 4 * Q sums advance side by side. */
AVX2 INLINE void scores_tile(const AttendBlock *b, int64_t g, const void *const *k, int64_t u,
                             int64_t m0, int Q, int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D, group = a->H / a->Hk;
    const float *q[3];
    float *w[3];
    for (int m = 0; m < Q; ++m) {
        const int64_t s = b->r0 + (m0 + m) / group, h = g * group + (m0 + m) % group;
        q[m] = b->qrot + (s * a->H + h) * D;
        w[m] = w_row(b, s, h) + u;
    }
    __m256 acc[3][4];
    for (int m = 0; m < Q; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x[3];
        for (int m = 0; m < Q; ++m) x[m] = _mm256_loadu_ps(q[m] + d);
        for (int j = 0; j < 4; ++j) {
            const __m256 key = load_256(k[j], d, kind);
            for (int m = 0; m < Q; ++m) acc[m][j] = _mm256_fmadd_ps(x[m], key, acc[m][j]);
        }
    }
    for (int m = 0; m < Q; ++m) _mm_storeu_ps(w[m], fold4_256(acc[m]));
}

/* Four keys at a time (the last ones repeated, their extra lanes landing in the rows'
 * padding), each read once for every query of the group. */
AVX2 INLINE void scores_avx2(const AttendBlock *b, int64_t g, int64_t u0, int64_t u1,
                             int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D, M = (b->r1 - b->r0) * (a->H / a->Hk);
    const void *K = slot(b->kcache, g * a->max, D, kind);
    for (int64_t u = u0; u < u1; u += 4) {
        const void *k[4];
        for (int j = 0; j < 4; ++j)
            k[j] = slot(K, b->keys[u + j < b->U ? u + j : b->U - 1], D, kind);
        for (int j = AHEAD; j < AHEAD + 4 && u + j < b->U; ++j)
            prefetch(slot(K, b->keys[u + j], D, kind), 0, D * bytes_of(kind));
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) scores_tile(b, g, k, u, m, 3, kind);
        if (M - m == 2) scores_tile(b, g, k, u, m, 2, kind);
        if (M - m == 1) scores_tile(b, g, k, u, m, 1, kind);
    }
}

/* exps from element i on, into the 8 lane sums so far (exps_avx2 starts at 0). */
AVX2 INLINE float exps_from_256(float *e, int64_t n, float top, __m256 lanes, int64_t i) {
    const __m256 vtop = _mm256_set1_ps(top);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = exp_256(_mm256_sub_ps(_mm256_loadu_ps(e + i), vtop));
        _mm256_storeu_ps(e + i, x);
        lanes = _mm256_add_ps(lanes, x);
    }
    float tail[8] = {0}; /* the last n % 8, the other lanes adding exact zeros */
    for (int64_t j = 0; i + j < n; ++j) tail[j] = e[i + j] = exp_portable(e[i + j] - top);
    return fold_256(_mm256_add_ps(lanes, _mm256_loadu_ps(tail)));
}

AVX2 static float exps_avx2(float *e, int64_t n, float top) {
    return exps_from_256(e, n, top, _mm256_setzero_ps(), 0);
}

/* exps_avx2 sixteen at a time: the high 8 lanes of each vector are added after the low 8,
 * so lane l still sums e[l], e[l + 8], e[l + 16], ... in that order, bit for bit. */
VNNI static float exps_512(float *e, int64_t n, float top) {
    const __m512 vtop = _mm512_set1_ps(top);
    __m256 lanes = _mm256_setzero_ps();
    int64_t i;
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 x = exp_512(_mm512_sub_ps(_mm512_loadu_ps(e + i), vtop));
        _mm512_storeu_ps(e + i, x);
        lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(x));
        lanes = _mm256_add_ps(lanes, _mm256_castpd_ps(
                                         _mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    }
    return exps_from_256(e, n, top, lanes, i);
}

/* to_half of n floats with F16C, which rounds to nearest even as to_half does once a
 * value is clamped to +-65504 (to_half's saturation); a vector holding a NaN goes
 * through to_half, whose NaN has no payload. */
AVX2 static void to_halves_avx2(const float *x, uint16_t *out, int64_t n) {
    const __m256 hi = _mm256_set1_ps(65504.0f), lo = _mm256_set1_ps(-65504.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;
        const __m256 c = _mm256_max_ps(_mm256_min_ps(v, hi), lo);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) out[i] = to_half(x[i]);
}

/* values_portable for R registers of 8 dimensions from d0, the group's queries m0 .. m0+Q-1
 * (numbered row after row, head after head) and the keys [u0, u1): each value vector is
 * loaded once for all Q, whose R * Q sums (at most 8 registers) advance side by side. */
AVX2 INLINE void values_tile(const AttendBlock *b, int64_t g, int64_t d0, int R, int64_t m0,
                             int Q, int64_t u0, int64_t u1, int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D, group = a->H / a->Hk;
    const void *V = slot(b->vcache, g * a->max, D, kind);
    const float *w[4];
    float *o[4];
    __m256 acc[4][8];
    for (int m = 0; m < Q; ++m) {
        const int64_t s = b->r0 + (m0 + m) / group, h = g * group + (m0 + m) % group;
        w[m] = w_row(b, s, h);
        o[m] = b->out + (s * a->H + h) * D + d0;
        for (int r = 0; r < R; ++r)
            acc[m][r] = u0 ? _mm256_loadu_ps(o[m] + 8 * r) : _mm256_setzero_ps();
    }
    for (int64_t u = u0; u < u1; ++u) {
        const void *v = slot(V, b->keys[u], D, kind);
        if (m0 == 0 && u + AHEAD < b->U) /* the first tile brings the slice in */
            prefetch(slot(V, b->keys[u + AHEAD], D, kind), d0 * bytes_of(kind),
                     R * 8 * bytes_of(kind));
        __m256 x[8];
        for (int r = 0; r < R; ++r) x[r] = load_256(v, d0 + 8 * r, kind);
        for (int m = 0; m < Q; ++m) {
            const __m256 p = _mm256_set1_ps(w[m][u]);
            for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(p, x[r], acc[m][r]);
        }
    }
    for (int m = 0; m < Q; ++m)
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(o[m] + 8 * r, acc[m][r]);
}

/* values_tile for the R and Q given, each pair its own instance (constant bounds, no
 * spills). */
AVX2 INLINE void values_rq(const AttendBlock *b, int64_t g, int64_t d, int R, int64_t m, int Q,
                           int64_t u0, int64_t u1, int kind) {
#define VALUES_CASE(r, q) \
    case r * 8 + q: values_tile(b, g, d, r, m, q, u0, u1, kind); break;
    switch (R * 8 + Q) {
        VALUES_CASE(8, 1)
        VALUES_CASE(4, 2) VALUES_CASE(4, 1)
        VALUES_CASE(2, 4) VALUES_CASE(2, 3) VALUES_CASE(2, 2) VALUES_CASE(2, 1)
        VALUES_CASE(1, 4) VALUES_CASE(1, 3) VALUES_CASE(1, 2) VALUES_CASE(1, 1)
    }
#undef VALUES_CASE
}

/* Dimensions [d0, d1) for every query of the group: tiles of up to 64 dimensions by up to
 * 8 / R queries, over slices of KEY_SLICE keys (which stay in L1 while every tile takes
 * them). */
AVX2 INLINE void values_avx2(const AttendBlock *b, int64_t g, int64_t d0, int64_t d1,
                             int kind) {
    const int64_t M = (b->r1 - b->r0) * (b->a->H / b->a->Hk);
    for (int64_t d = d0, R; d < d1; d += 8 * R) {
        R = d1 - d >= 64 ? 8 : d1 - d >= 32 ? 4 : d1 - d >= 16 ? 2 : 1;
        const int64_t most = R >= 2 ? 8 / R : 4;
        for (int64_t u0 = 0; u0 < b->U; u0 += KEY_SLICE) {
            const int64_t u1 = u0 + KEY_SLICE < b->U ? u0 + KEY_SLICE : b->U;
            for (int64_t m = 0; m < M; m += most)
                values_rq(b, g, d, (int)R, m, (int)(M - m < most ? M - m : most), u0, u1, kind);
        }
    }
}

/* 8 elements from `at` of rows a and b, as floats in the halves of one vector. */
VNNI INLINE __m512 load_pair_512(const void *a, const void *b, int64_t at, int kind) {
    if (kind == CODES)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)((const int8_t *)a + at)),
                               _mm_loadl_epi64((const __m128i *)((const int8_t *)b + at)))));
    if (kind == HALVES)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + at))),
            _mm_loadu_si128((const __m128i *)((const uint16_t *)b + at)), 1));
    return _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps((const float *)a + at))),
        _mm256_castps_pd(_mm256_loadu_ps((const float *)b + at)), 1));
}

/* _mm256_hadd_ps in each 256-bit half: [a0+a1, a2+a3, b0+b1, b2+b3] per 128-bit lane. */
VNNI INLINE __m512 hadd_512(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* scores_tile with AVX-512: Q queries and eight keys, two keys to a vector (8 dimensions
 * each, the AVX2 path's lanes), folded as fold4_256 folds: the same dot products, bit for
 * bit, at half the instructions. */
VNNI INLINE void scores_tile_512(const AttendBlock *b, int64_t g, const void *const *k,
                                 int64_t u, int64_t m0, int Q, int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D, group = a->H / a->Hk;
    const float *q[5];
    float *w[5];
    for (int m = 0; m < Q; ++m) {
        const int64_t s = b->r0 + (m0 + m) / group, h = g * group + (m0 + m) % group;
        q[m] = b->qrot + (s * a->H + h) * D;
        w[m] = w_row(b, s, h) + u;
    }
    __m512 acc[5][4];
    for (int m = 0; m < Q; ++m)
        for (int p = 0; p < 4; ++p) acc[m][p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m512 x[5];
        for (int m = 0; m < Q; ++m)
            x[m] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
                _mm256_loadu_ps(q[m] + d))));
        for (int p = 0; p < 4; ++p) {
            const __m512 keys = load_pair_512(k[2 * p], k[2 * p + 1], d, kind);
            for (int m = 0; m < Q; ++m) acc[m][p] = _mm512_fmadd_ps(x[m], keys, acc[m][p]);
        }
    }
    for (int m = 0; m < Q; ++m) { /* 128-bit lanes: keys 0 2 4 6 by halves, then 1 3 5 7 */
        const __m512 u4 = hadd_512(hadd_512(acc[m][0], acc[m][1]),
                                   hadd_512(acc[m][2], acc[m][3]));
        const __m128 even = _mm_add_ps(_mm512_extractf32x4_ps(u4, 0),
                                       _mm512_extractf32x4_ps(u4, 1));
        const __m128 odd = _mm_add_ps(_mm512_extractf32x4_ps(u4, 2),
                                      _mm512_extractf32x4_ps(u4, 3));
        _mm_storeu_ps(w[m], _mm_unpacklo_ps(even, odd));
        _mm_storeu_ps(w[m] + 4, _mm_unpackhi_ps(even, odd));
    }
}

/* scores_avx2 eight keys at a time, five queries a tile. */
VNNI INLINE void scores_avx512(const AttendBlock *b, int64_t g, int64_t u0, int64_t u1,
                               int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D, M = (b->r1 - b->r0) * (a->H / a->Hk);
    const void *K = slot(b->kcache, g * a->max, D, kind);
    for (int64_t u = u0; u < u1; u += 8) {
        const void *k[8];
        for (int j = 0; j < 8; ++j)
            k[j] = slot(K, b->keys[u + j < b->U ? u + j : b->U - 1], D, kind);
        for (int j = AHEAD; j < AHEAD + 8 && u + j < b->U; ++j)
            prefetch(slot(K, b->keys[u + j], D, kind), 0, D * bytes_of(kind));
        for (int64_t m = 0; m < M; m += 5) {
            switch (M - m < 5 ? M - m : 5) {
            case 5: scores_tile_512(b, g, k, u, m, 5, kind); break;
            case 4: scores_tile_512(b, g, k, u, m, 4, kind); break;
            case 3: scores_tile_512(b, g, k, u, m, 3, kind); break;
            case 2: scores_tile_512(b, g, k, u, m, 2, kind); break;
            default: scores_tile_512(b, g, k, u, m, 1, kind);
            }
        }
    }
}

/* 16 cache elements from `at` as floats (codes and halves converted, exactly); `keep`
 * masks the lanes read (a slice's last 8 dimensions read 8). */
VNNI INLINE __m512 load_512(const void *row, int64_t at, int kind, __mmask16 keep) {
    if (kind == CODES)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(keep, (const int8_t *)row + at)));
    if (kind == HALVES)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, (const uint16_t *)row + at));
    return _mm512_maskz_loadu_ps(keep, (const float *)row + at);
}

/* values_tile with AVX-512: R registers of 16 dimensions from d0 (the last one's lanes
 * `tail`) for Q queries. A dimension's sum is the same chain of fmas whatever the vector
 * width, so the results are values_tile's, bit for bit; 32 registers let up to 6 queries
 * share each value row read (and each code or half converted) once. */
VNNI INLINE void values_tile_512(const AttendBlock *b, int64_t g, int64_t d0, int R,
                                 __mmask16 tail, int64_t m0, int Q, int64_t u0, int64_t u1,
                                 int kind) {
    const AttendShape *a = b->a;
    const int64_t D = a->D, group = a->H / a->Hk;
    const void *V = slot(b->vcache, g * a->max, D, kind);
    const float *w[6];
    float *o[6];
    __m512 acc[6][4];
    for (int m = 0; m < Q; ++m) {
        const int64_t s = b->r0 + (m0 + m) / group, h = g * group + (m0 + m) % group;
        w[m] = w_row(b, s, h);
        o[m] = b->out + (s * a->H + h) * D + d0;
        for (int r = 0; r < R; ++r)
            acc[m][r] = u0 ? _mm512_maskz_loadu_ps(r == R - 1 ? tail : 0xFFFF, o[m] + 16 * r)
                           : _mm512_setzero_ps();
    }
    for (int64_t u = u0; u < u1; ++u) {
        const void *v = slot(V, b->keys[u], D, kind);
        if (m0 == 0 && u + AHEAD < b->U) /* the first tile brings the slice in */
            prefetch(slot(V, b->keys[u + AHEAD], D, kind), d0 * bytes_of(kind),
                     16 * R * bytes_of(kind));
        __m512 x[4];
        for (int r = 0; r < R; ++r)
            x[r] = load_512(v, d0 + 16 * r, kind, r == R - 1 ? tail : 0xFFFF);
        for (int m = 0; m < Q; ++m) {
            const __m512 p = _mm512_set1_ps(w[m][u]);
            for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(p, x[r], acc[m][r]);
        }
    }
    for (int m = 0; m < Q; ++m)
        for (int r = 0; r < R; ++r)
            _mm512_mask_storeu_ps(o[m] + 16 * r, r == R - 1 ? tail : 0xFFFF, acc[m][r]);
}

/* values_tile_512 for the R and Q given, each pair its own instance. */
VNNI INLINE void values_rq_512(const AttendBlock *b, int64_t g, int64_t d, int R,
                               __mmask16 tail, int64_t m, int Q, int64_t u0, int64_t u1,
                               int kind) {
#define VALUES_CASE(r, q) \
    case r * 8 + q: values_tile_512(b, g, d, r, tail, m, q, u0, u1, kind); break;
#define VALUES_QS(r) VALUES_CASE(r, 1) VALUES_CASE(r, 2) VALUES_CASE(r, 3) \
    VALUES_CASE(r, 4) VALUES_CASE(r, 5) VALUES_CASE(r, 6)
    switch (R * 8 + Q) { VALUES_QS(1) VALUES_QS(2) VALUES_QS(3) VALUES_QS(4) }
#undef VALUES_QS
#undef VALUES_CASE
}

/* values_avx2's order of work with AVX-512 tiles: dimensions [d0, d1) (at most 64) for
 * every query of the group, 6 queries a tile, over slices of KEY_SLICE keys. */
VNNI INLINE void values_avx512(const AttendBlock *b, int64_t g, int64_t d0, int64_t d1,
                               int kind) {
    const int64_t M = (b->r1 - b->r0) * (b->a->H / b->a->Hk);
    for (int64_t d = d0; d < d1; d += 64) {
        const int64_t n = d1 - d < 64 ? d1 - d : 64; /* a multiple of 8 */
        const int R = (int)((n + 15) / 16);
        const __mmask16 tail = n % 16 ? 0x00FF : 0xFFFF;
        for (int64_t u0 = 0; u0 < b->U; u0 += KEY_SLICE) {
            const int64_t u1 = u0 + KEY_SLICE < b->U ? u0 + KEY_SLICE : b->U;
            for (int64_t m = 0; m < M; m += 6)
                values_rq_512(b, g, d, R, tail, m, (int)(M - m < 6 ? M - m : 6), u0, u1, kind);
        }
    }
}

/* One instance per cache type, so that none tests its type in the inner loops. */
#define AVX2_INSTANCES(name, KIND)                                                          \
    AVX2 static void scores_avx2_##name(const AttendBlock *b, int64_t g, int64_t u0,         \
                                        int64_t u1) {                                       \
        scores_avx2(b, g, u0, u1, KIND);                                                    \
    }                                                                                       \
    AVX2 static void values_avx2_##name(const AttendBlock *b, int64_t g, int64_t d0,         \
                                        int64_t d1) {                                       \
        values_avx2(b, g, d0, d1, KIND);                                                    \
    }
AVX2_INSTANCES(floats, FLOATS)
AVX2_INSTANCES(codes, CODES)
AVX2_INSTANCES(halves, HALVES)
#undef AVX2_INSTANCES
#define AVX512_INSTANCE(name, KIND)                                                         \
    VNNI static void scores_avx512_##name(const AttendBlock *b, int64_t g, int64_t u0,       \
                                          int64_t u1) {                                     \
        scores_avx512(b, g, u0, u1, KIND);                                                  \
    }                                                                                       \
    VNNI static void values_avx512_##name(const AttendBlock *b, int64_t g, int64_t d0,       \
                                          int64_t d1) {                                     \
        values_avx512(b, g, d0, d1, KIND);                                                  \
    }
AVX512_INSTANCE(floats, FLOATS)
AVX512_INSTANCE(codes, CODES)
AVX512_INSTANCE(halves, HALVES)
#undef AVX512_INSTANCE

/* The instances by path (AVX2, AVX-512) and cache kind (FLOATS, CODES, HALVES). */
typedef void (*AttendStep)(const AttendBlock *, int64_t, int64_t, int64_t); /* g and a range */
static const AttendStep SCORES[2][3] = {
    {scores_avx2_floats, scores_avx2_codes, scores_avx2_halves},
    {scores_avx512_floats, scores_avx512_codes, scores_avx512_halves}};
static const AttendStep VALUES[2][3] = {
    {values_avx2_floats, values_avx2_codes, values_avx2_halves},
    {values_avx512_floats, values_avx512_codes, values_avx512_halves}};
#endif

int64_t attend_keys(const AttendShape *a, const float *bias, int64_t r0, int64_t r1,
                    int32_t *keys) {
    int64_t n = 0;
    for (int64_t j = 0; j < a->past + r1; ++j)
        for (int64_t s = r0; s < r1; ++s)
            if (sees(a, bias, s, j)) {
                keys[n++] = (int32_t)j;
                break;
            }
    return n;
}

void attend_scores(const AttendBlock *b, int64_t g, int64_t u0, int64_t u1) {
    const int kind = kind_of(b->a);
#ifdef EDGESPEC_X86
    if (blockq_simd() >= 1) {
        SCORES[blockq_simd() - 1][kind](b, g, u0, u1);
        return;
    }
#endif
    scores_portable(b, g, u0, u1, kind);
}

/* How many keys row s sees when they are a run of the block's keys, consecutive slots all
 * open, from *lo on (a row of a chain, fed alone, or under a sliding window); -1 when they
 * are not (a tree's masked siblings). */
static int64_t seen_run(const AttendBlock *b, int64_t s, int64_t *lo) {
    const AttendShape *a = b->a;
    const float *bias = b->bias + s * (a->past + a->S);
    int64_t hi = b->U, u = 0, low = 0;
    while (low < hi) { /* hi: the first key past the row's own slot (keys ascend) */
        const int64_t mid = low + (hi - low) / 2;
        if (b->keys[mid] <= a->past + s) low = mid + 1;
        else hi = mid;
    }
    while (u < hi && !(bias[b->keys[u]] > MASKED)) ++u;
    if (u == hi || b->keys[hi - 1] - b->keys[u] != hi - 1 - u) return -1;
    int open = 1;
    for (int64_t i = b->keys[u]; i <= b->keys[hi - 1]; ++i) open &= bias[i] > MASKED;
    *lo = u;
    return open ? hi - u : -1;
}

/* Scores of a row that sees a run of n keys, in place; returns their maximum. */
static float run_scores_portable(float *w, const float *bias, int64_t n, float scale) {
    float top = -INFINITY;
    for (int64_t u = 0; u < n; ++u) {
        w[u] = w[u] * scale + bias[u];
        top = w[u] > top ? w[u] : top;
    }
    return top;
}

#ifdef EDGESPEC_X86
AVX2 static float run_scores_avx2(float *w, const float *bias, int64_t n, float scale) {
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vtop = _mm256_set1_ps(-INFINITY);
    int64_t u = 0;
    for (; u + 8 <= n; u += 8) {
        const __m256 x = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(w + u), vs),
                                       _mm256_loadu_ps(bias + u));
        _mm256_storeu_ps(w + u, x);
        vtop = _mm256_max_ps(vtop, x);
    }
    float lanes[8], top = run_scores_portable(w + u, bias + u, n - u, scale);
    _mm256_storeu_ps(lanes, vtop);
    for (int l = 0; l < 8; ++l) top = lanes[l] > top ? lanes[l] : top;
    return top;
}
#endif

static float run_scores(float *w, const float *bias, int64_t n, float scale) {
#ifdef EDGESPEC_X86
    if (blockq_simd() >= 1) return run_scores_avx2(w, bias, n, scale);
#endif
    return run_scores_portable(w, bias, n, scale);
}

static void to_halves(const float *x, uint16_t *out, int64_t n) {
#ifdef EDGESPEC_X86
    if (blockq_simd() >= 1) {
        to_halves_avx2(x, out, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = to_half(x[i]);
}

static float exps(float *e, int64_t n, float top) {
#ifdef EDGESPEC_X86
    if (blockq_simd() == 2) return exps_512(e, n, top);
    if (blockq_simd() == 1) return exps_avx2(e, n, top);
#endif
    return exps_portable(e, n, top);
}

void attend_weights(const AttendBlock *b, int64_t t0, int64_t t1, float *e, int32_t *pick) {
    const AttendShape *a = b->a;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t s = b->r0 + t / a->H, h = t % a->H;
        const float *bias = b->bias + s * (a->past + a->S);
        float *w = w_row(b, s, h), top = -INFINITY, sum = 0.0f; /* no key seen: zeros */
        int64_t lo = 0, n = a->softcap > 0.0f ? -1 : seen_run(b, s, &lo);
        if (n > 0) { /* the scores, exps and weights in place (the same operations) */
            top = run_scores(w + lo, bias + b->keys[lo], n, a->scale);
            sum = exps(w + lo, n, top);
            memset(w, 0, (size_t)lo * sizeof(float));
            memset(w + lo + n, 0, (size_t)(b->U - lo - n) * sizeof(float));
            b->sums[t] = sum;
            continue;
        }
        n = 0;
        for (int64_t u = 0; u < b->U; ++u)
            if (sees(a, b->bias, s, b->keys[u])) {
                pick[n] = (int32_t)u;
                e[n] = score(a, w[u], bias[b->keys[u]]);
                top = e[n] > top ? e[n] : top;
                ++n;
            }
        if (n > 0) sum = exps(e, n, top);
        memset(w, 0, (size_t)b->U * sizeof(float));
        for (int64_t i = 0; i < n; ++i) w[pick[i]] = e[i];
        b->sums[t] = sum;
    }
}

/* An output's n dimensions divided by its sum of weights (after the value scales vs of
 * int8 caches); 0 where it saw no key. Loops the compiler vectorizes: a division is the
 * same correctly rounded one in any lane, and scalar divisions took a tenth of a 17-token
 * pass's attention. */
static inline __attribute__((always_inline)) void normalize_body(float *o, const float *vs,
                                                                 float sum, int64_t n) {
    if (sum == 0.0f) {
        memset(o, 0, (size_t)n * sizeof(float));
    } else if (vs != NULL) {
        for (int64_t d = 0; d < n; ++d) o[d] = o[d] * vs[d] / sum;
    } else {
        for (int64_t d = 0; d < n; ++d) o[d] = o[d] / sum;
    }
}

static void normalize_portable(float *o, const float *vs, float sum, int64_t n) {
    normalize_body(o, vs, sum, n);
}

#ifdef EDGESPEC_X86
VNNI static void normalize_512(float *o, const float *vs, float sum, int64_t n) {
    normalize_body(o, vs, sum, n);
}
#endif

void attend_values(const AttendBlock *b, int64_t g, int64_t d0, int64_t d1) {
    const AttendShape *a = b->a;
    const int kind = kind_of(a);
    void (*normalize)(float *, const float *, float, int64_t) = normalize_portable;
#ifdef EDGESPEC_X86
    if (blockq_simd() == 2) normalize = normalize_512;
    if (blockq_simd() >= 1)
        VALUES[blockq_simd() - 1][kind](b, g, d0, d1);
    else
#endif
        values_portable(b, g, d0, d1, kind);
    FOR_GROUP_QUERIES(b, g, s, h)
        normalize(b->out + (s * a->H + h) * a->D + d0,
                  kind == CODES ? a->vscale + g * a->D + d0 : NULL,
                  b->sums[(s - b->r0) * a->H + h], d1 - d0);
}

static void rotate(const float *x, float *y, int64_t D, int64_t half, const float *c,
                   const float *s) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
    }
    for (int64_t i = 2 * half; i < D; ++i) y[i] = x[i];
}

void attend_prepare(const AttendShape *a, const float *q, int64_t q_stride, const float *k,
                    int64_t k_stride, const float *v, int64_t v_stride, const int64_t *pos,
                    const float *cos, const float *sin, float *qrot, void *kcache,
                    void *vcache, float *scratch) {
    const int64_t D = a->D;
    const int kind = kind_of(a);
    for (int64_t s = 0; s < a->S; ++s) {
        const float *c = cos + pos[s] * a->half, *sn = sin + pos[s] * a->half;
        for (int64_t h = 0; h < a->H; ++h) {
            float *qr = qrot + (s * a->H + h) * D;
            rotate(q + s * q_stride + h * D, qr, D, a->half, c, sn);
            if (kind == CODES) { /* the dot products are taken with the key codes */
                const float *ks = a->kscale + h / (a->H / a->Hk) * D;
                for (int64_t d = 0; d < D; ++d) qr[d] *= ks[d];
            }
        }
        for (int64_t g = 0; g < a->Hk; ++g) {
            const int64_t at = (g * a->max + a->past + s) * D;
            const float *vs = v + s * v_stride + g * D;
            if (kind == FLOATS) {
                rotate(k + s * k_stride + g * D, (float *)kcache + at, D, a->half, c, sn);
                memcpy((float *)vcache + at, vs, (size_t)D * sizeof(float));
                continue;
            }
            rotate(k + s * k_stride + g * D, scratch, D, a->half, c, sn);
            if (kind == HALVES) {
                to_halves(scratch, (uint16_t *)kcache + at, D);
                to_halves(vs, (uint16_t *)vcache + at, D);
                continue;
            }
            for (int64_t d = 0; d < D; ++d) {
                ((int8_t *)kcache)[at + d] = int8_code(scratch[d] / a->kscale[g * D + d]);
                ((int8_t *)vcache)[at + d] = int8_code(vs[d] / a->vscale[g * D + d]);
            }
        }
    }
}
