/* Batch-invariant attention (see attend.h): a portable path and an AVX2 one, bitwise equal.
 * Built with -ffp-contract=off like blockq.c: the compiler fuses nothing the other does not.
 */
#include "attend.h"

#include "blockq.h"
#include "simd.h"

#define MASKED -1e30f /* bias values at or below this close a key (-inf, float32's min) */

/* The slots row s sees, in order: open in its bias row, and at or before its own slot. */
static int64_t open_keys(const AttendShape *a, const float *bias_row, int64_t s, int32_t *idx) {
    int64_t n = 0;
    for (int64_t j = 0; j <= a->past + s; ++j)
        if (bias_row[j] > MASKED) idx[n++] = (int32_t)j;
    return n;
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

/* Element i of a cache row: float, or an int8 code (its scale applied elsewhere). */
static inline float cached(const void *row, int64_t i, int int8) {
    return int8 ? (float)((const int8_t *)row)[i] : ((const float *)row)[i];
}

static inline const void *slot(const void *cache, int64_t j, int64_t D, int int8) {
    return int8 ? (const void *)((const int8_t *)cache + j * D)
                : (const void *)((const float *)cache + j * D);
}

/* The output of one query row q over the n open keys idx of one KV head. With int8 caches
 * q comes scaled by the key scales, and `vscale` scales the weighted sum of value codes. */
static void row_portable(const AttendShape *a, const float *q, const void *K, const void *V,
                         const float *vscale, int int8, const float *bias, const int32_t *idx,
                         int64_t n, float *e, float *out) {
    const int64_t D = a->D;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
        const void *k = slot(K, idx[i], D, int8);
        float lanes[8] = {0};
        for (int64_t d = 0; d < D; d += 8)
            for (int l = 0; l < 8; ++l) lanes[l] = fmaf(q[d + l], cached(k, d + l, int8), lanes[l]);
        e[i] = score(a, fold8(lanes), bias[idx[i]]);
        top = e[i] > top ? e[i] : top;
    }
    float lanes[8] = {0};
    for (int64_t i = 0; i < n; ++i) {
        e[i] = exp_portable(e[i] - top);
        lanes[i % 8] += e[i];
    }
    const float sum = fold8(lanes);
    for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        const void *v = slot(V, idx[i], D, int8);
        for (int64_t d = 0; d < D; ++d) out[d] = fmaf(e[i], cached(v, d, int8), out[d]);
    }
    for (int64_t d = 0; d < D; ++d) out[d] = (int8 ? out[d] * vscale[d] : out[d]) / sum;
}

#ifdef EDGESPEC_X86
EXP_SIMD(256, AVX2)

/* fold8 on a vector. */
AVX2 INLINE float fold_256(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 q = _mm256_hadd_ps(h, h); /* lane 0: (l0+l1)+(l2+l3), lane 4: (l4+l5)+(l6+l7) */
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

/* fold8 of eight vectors at once, as the eight lanes of one (a transposing reduction). */
AVX2 INLINE __m256 fold8_256(const __m256 *a) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* u0 = [a0 a1 a2 a3 of l0..l3 | a0 a1 a2 a3 of l4..l7], u1 the same for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 cache elements from `at` as floats (int8 codes converted). */
AVX2 INLINE __m256 load_256(const void *row, int64_t at, int int8) {
    if (int8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)row + at))));
    return _mm256_loadu_ps((const float *)row + at);
}

/* out[0:8R] = sum_i e_i v_i[0:8R] (times vscale with int8 codes) / sum, key after key
 * (R registers of 8 dimensions). */
AVX2 INLINE void weighted_256(const void *V, int64_t d0, int64_t D, const float *vscale,
                              int int8, const int32_t *idx, int64_t n, const float *e,
                              float sum, float *out, int R) {
    __m256 acc[8];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
        const __m256 p = _mm256_set1_ps(e[i]);
        const void *v = slot(V, idx[i], D, int8);
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(p, load_256(v, d0 + 8 * r, int8), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
        __m256 x = acc[r];
        if (int8) x = _mm256_mul_ps(x, _mm256_loadu_ps(vscale + d0 + 8 * r));
        _mm256_storeu_ps(out + d0 + 8 * r, _mm256_div_ps(x, _mm256_set1_ps(sum)));
    }
}

AVX2 INLINE void row_avx2(const AttendShape *a, const float *q, const void *K, const void *V,
                          const float *vscale, int int8, const float *bias,
                          const int32_t *idx, int64_t n, float *e, float *out) {
    const int64_t D = a->D;
    for (int64_t i = 0; i < n; i += 8) { /* eight keys at once (the last block's repeated) */
        const void *k[8];
        for (int j = 0; j < 8; ++j) k[j] = slot(K, idx[i + j < n ? i + j : n - 1], D, int8);
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 x = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(x, load_256(k[j], d, int8), acc[j]);
        }
        _mm256_storeu_ps(e + i, fold8_256(acc)); /* e has room for n rounded up to 8 */
    }
    int64_t i;
    float top = -INFINITY;
    for (i = 0; i < n; ++i) {
        e[i] = score(a, e[i], bias[idx[i]]);
        top = e[i] > top ? e[i] : top;
    }
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 lanes = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 x = exp_256(_mm256_sub_ps(_mm256_loadu_ps(e + i), vtop));
        _mm256_storeu_ps(e + i, x);
        lanes = _mm256_add_ps(lanes, x);
    }
    float tail[8] = {0}; /* the last n % 8, the other lanes adding exact zeros */
    for (int64_t j = 0; i + j < n; ++j) tail[j] = e[i + j] = exp_portable(e[i + j] - top);
    const float sum = fold_256(_mm256_add_ps(lanes, _mm256_loadu_ps(tail)));
    for (int64_t d = 0; d < D; d += 64) {
        if (D - d >= 64)
            weighted_256(V, d, D, vscale, int8, idx, n, e, sum, out, 8);
        else
            weighted_256(V, d, D, vscale, int8, idx, n, e, sum, out, (int)((D - d) / 8));
    }
}

/* One instance per cache type, so that neither tests its type in the inner loops. */
AVX2 static void row_avx2_float(const AttendShape *a, const float *q, const void *K,
                                const void *V, const float *vscale, const float *bias,
                                const int32_t *idx, int64_t n, float *e, float *out) {
    row_avx2(a, q, K, V, vscale, 0, bias, idx, n, e, out);
}

AVX2 static void row_avx2_int8(const AttendShape *a, const float *q, const void *K,
                               const void *V, const float *vscale, const float *bias,
                               const int32_t *idx, int64_t n, float *e, float *out) {
    row_avx2(a, q, K, V, vscale, 1, bias, idx, n, e, out);
}
#endif

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
    const int int8 = a->kscale != NULL;
    for (int64_t s = 0; s < a->S; ++s) {
        const float *c = cos + pos[s] * a->half, *sn = sin + pos[s] * a->half;
        for (int64_t h = 0; h < a->H; ++h)
            rotate(q + s * q_stride + h * D, qrot + (s * a->H + h) * D, D, a->half, c, sn);
        for (int64_t g = 0; g < a->Hk; ++g) {
            const int64_t at = (g * a->max + a->past + s) * D;
            const float *vs = v + s * v_stride + g * D;
            if (!int8) {
                rotate(k + s * k_stride + g * D, (float *)kcache + at, D, a->half, c, sn);
                memcpy((float *)vcache + at, vs, (size_t)D * sizeof(float));
                continue;
            }
            rotate(k + s * k_stride + g * D, scratch, D, a->half, c, sn);
            for (int64_t d = 0; d < D; ++d) {
                ((int8_t *)kcache)[at + d] = int8_code(scratch[d] / a->kscale[g * D + d]);
                ((int8_t *)vcache)[at + d] = int8_code(vs[d] / a->vscale[g * D + d]);
            }
        }
    }
}

void attend_rows(const AttendShape *a, const float *qrot, const void *kcache,
                 const void *vcache, const float *bias, float *out, int64_t begin,
                 int64_t end, int32_t *idx, float *e) {
    const int64_t D = a->D, T = a->past + a->S, group = a->H / a->Hk;
    const int int8 = a->kscale != NULL, path = blockq_path();
    float *scaled = e + T + 8; /* the query times the key scales (int8 caches) */
    int64_t row = -1, n = 0;
    for (int64_t t = begin; t < end; ++t) {
        const int64_t s = t / a->H, g = (t % a->H) / group;
        if (s != row) { /* heads of a row see the same keys */
            n = open_keys(a, bias + s * T, s, idx);
            row = s;
        }
        const void *K = slot(kcache, g * a->max, D, int8), *V = slot(vcache, g * a->max, D, int8);
        const float *q = qrot + t * D, *vscale = int8 ? a->vscale + g * D : NULL;
        float *o = out + t * D;
        if (n == 0) {
            memset(o, 0, (size_t)D * sizeof(float));
            continue;
        }
        if (int8) {
            for (int64_t d = 0; d < D; ++d) scaled[d] = q[d] * a->kscale[g * D + d];
            q = scaled;
        }
#ifdef EDGESPEC_X86
        if (path >= 1) {
            (int8 ? row_avx2_int8 : row_avx2_float)(a, q, K, V, vscale, bias + s * T, idx, n,
                                                   e, o);
            continue;
        }
#endif
        row_portable(a, q, K, V, vscale, int8, bias + s * T, idx, n, e, o);
    }
    (void)path;
}
