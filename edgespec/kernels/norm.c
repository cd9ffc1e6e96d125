/* norm.h's residual add and RMS norm: portable C, AVX2 and AVX-512, the path blockq_simd()
 * picks. Build with -ffp-contract=off (no path fuses a multiply and an add). */
#include "norm.h"

#include "blockq.h"
#include "simd.h"

#define NORM_LANES 16

/* The row's scale from its 16 lane sums: the folds, the mean, 1 / sqrt(mean + eps). */
static float row_scale(float *lane, int64_t K, float eps) {
    for (int w = NORM_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
    return 1.0f / sqrtf(lane[0] / (float)K + eps);
}

static void row_portable(const float *x, const float *skip, const float *gamma, int64_t K,
                         float eps, float *y, float *sum) {
    float lane[NORM_LANES] = {0};
    for (int64_t i = 0; i < K; ++i) {
        sum[i] = x[i] + skip[i];
        const float sq = sum[i] * sum[i];
        lane[i % NORM_LANES] = lane[i % NORM_LANES] + sq;
    }
    const float inv = row_scale(lane, K, eps);
    for (int64_t i = 0; i < K; ++i) y[i] = (sum[i] * inv) * gamma[i];
}

#ifdef EDGESPEC_X86
VNNI static void row_512(const float *x, const float *skip, const float *gamma, int64_t K,
                         float eps, float *y, float *sum) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += NORM_LANES) {
        const __m512 s = _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(skip + i));
        _mm512_storeu_ps(sum + i, s);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(s, s));
    }
    float lane[NORM_LANES];
    _mm512_storeu_ps(lane, acc);
    const __m512 inv = _mm512_set1_ps(row_scale(lane, K, eps));
    for (int64_t i = 0; i < K; i += NORM_LANES)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(sum + i), inv),
                                              _mm512_loadu_ps(gamma + i)));
}

/* Lanes 0-7 and 8-15 of the 16 in two registers. */
AVX2 static void row_256(const float *x, const float *skip, const float *gamma, int64_t K,
                         float eps, float *y, float *sum) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += NORM_LANES) {
        const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(skip + i));
        const __m256 b = _mm256_add_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(skip + i + 8));
        _mm256_storeu_ps(sum + i, a);
        _mm256_storeu_ps(sum + i + 8, b);
        lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
    }
    float lane[NORM_LANES];
    _mm256_storeu_ps(lane, lo);
    _mm256_storeu_ps(lane + 8, hi);
    const __m256 inv = _mm256_set1_ps(row_scale(lane, K, eps));
    for (int64_t i = 0; i < K; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sum + i), inv),
                                              _mm256_loadu_ps(gamma + i)));
}
#endif

void norm_skip_rms(const float *x, const float *skip, const float *gamma, int64_t M,
                   int64_t K, float eps, float *y, float *sum) {
    void (*row)(const float *, const float *, const float *, int64_t, float, float *,
                float *) = row_portable;
#ifdef EDGESPEC_X86
    if (blockq_simd() == 2) row = row_512;
    if (blockq_simd() == 1) row = row_256;
#endif
    for (int64_t m = 0; m < M; ++m)
        row(x + m * K, skip + m * K, gamma, K, eps, y + m * K, sum + m * K);
}
