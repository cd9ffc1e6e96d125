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

static float fold8(float *lanes) {
    for (int l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
    return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
}

/* A raw dot product taken to a score: scaled, soft-capped, biased. */
static float score(const AttendShape *a, float dot, float bias) {
    const float x = dot * a->scale;
    return (a->softcap > 0.0f ? a->softcap * tanhf(x / a->softcap) : x) + bias;
}

static void row_portable(const AttendShape *a, const float *q, const float *K, const float *V,
                         const float *bias, const int32_t *idx, int64_t n, float *e, float *out) {
    const int64_t D = a->D;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
        const float *k = K + idx[i] * D;
        float lanes[8] = {0};
        for (int64_t d = 0; d < D; d += 8)
            for (int l = 0; l < 8; ++l) lanes[l] = fmaf(q[d + l], k[d + l], lanes[l]);
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
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) out[d] = fmaf(e[i], V[idx[i] * D + d], out[d]);
    for (int64_t d = 0; d < D; ++d) out[d] = out[d] / sum;
}

#ifdef EDGESPEC_X86
EXP_SIMD(256, AVX2)

/* fold8 on a vector: (l + l+4), then (l + l+2), then (l + l+1). */
AVX2 INLINE float fold_256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* out[0:8R] = sum_i e_i v_i[0:8R] / sum, key after key (R registers of 8 dimensions). */
AVX2 INLINE void weighted_256(const float *V, int64_t D, const int32_t *idx, int64_t n,
                              const float *e, float sum, float *out, int R) {
    __m256 acc[8];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
        const __m256 p = _mm256_set1_ps(e[i]);
        const float *v = V + idx[i] * D;
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * r), acc[r]);
    }
    for (int r = 0; r < R; ++r)
        _mm256_storeu_ps(out + 8 * r, _mm256_div_ps(acc[r], _mm256_set1_ps(sum)));
}

AVX2 static void row_avx2(const AttendShape *a, const float *q, const float *K, const float *V,
                          const float *bias, const int32_t *idx, int64_t n, float *e,
                          float *out) {
    const int64_t D = a->D;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) { /* four keys at once: four independent chains */
        const float *k0 = K + idx[i] * D, *k1 = K + idx[i + 1] * D, *k2 = K + idx[i + 2] * D,
                    *k3 = K + idx[i + 3] * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 x = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + d), a3);
        }
        e[i] = fold_256(a0);
        e[i + 1] = fold_256(a1);
        e[i + 2] = fold_256(a2);
        e[i + 3] = fold_256(a3);
    }
    for (; i < n; ++i) {
        const float *k = K + idx[i] * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
        e[i] = fold_256(acc);
    }
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
            weighted_256(V + d, D, idx, n, e, sum, out + d, 8);
        else
            weighted_256(V + d, D, idx, n, e, sum, out + d, (int)((D - d) / 8));
    }
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
                    const float *cos, const float *sin, float *qrot, float *kcache,
                    float *vcache) {
    const int64_t D = a->D;
    for (int64_t s = 0; s < a->S; ++s) {
        const float *c = cos + pos[s] * a->half, *sn = sin + pos[s] * a->half;
        for (int64_t h = 0; h < a->H; ++h)
            rotate(q + s * q_stride + h * D, qrot + (s * a->H + h) * D, D, a->half, c, sn);
        for (int64_t g = 0; g < a->Hk; ++g) {
            const int64_t slot = (g * a->max + a->past + s) * D;
            rotate(k + s * k_stride + g * D, kcache + slot, D, a->half, c, sn);
            memcpy(vcache + slot, v + s * v_stride + g * D, (size_t)D * sizeof(float));
        }
    }
}

void attend_rows(const AttendShape *a, const float *qrot, const float *kcache,
                 const float *vcache, const float *bias, float *out, int64_t begin,
                 int64_t end, int32_t *idx, float *e) {
    const int64_t D = a->D, T = a->past + a->S, group = a->H / a->Hk;
    const int path = blockq_path();
    int64_t row = -1, n = 0;
    for (int64_t t = begin; t < end; ++t) {
        const int64_t s = t / a->H, g = (t % a->H) / group;
        if (s != row) { /* heads of a row see the same keys */
            n = open_keys(a, bias + s * T, s, idx);
            row = s;
        }
        const float *K = kcache + g * a->max * D, *V = vcache + g * a->max * D;
        float *o = out + t * D;
        if (n == 0) {
            memset(o, 0, (size_t)D * sizeof(float));
            continue;
        }
#ifdef EDGESPEC_X86
        if (path >= 1) {
            row_avx2(a, qrot + t * D, K, V, bias + s * T, idx, n, e, o);
            continue;
        }
#endif
        row_portable(a, qrot + t * D, K, V, bias + s * T, idx, n, e, o);
    }
    (void)path;
}
