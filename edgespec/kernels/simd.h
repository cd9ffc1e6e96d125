/* What blockq.c and attend.c share: the x86-64 target attributes their SIMD paths are
 * compiled with (the library is built without global ISA flags, each path chosen at run
 * time) and edgespec's own exp, the same operations on every path.
 */
#ifndef EDGESPEC_SIMD_H
#define EDGESPEC_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define EDGESPEC_X86 1
#include <immintrin.h>
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#endif

#define ROUNDER 12582912.0f /* 1.5 * 2^23 */

/* IEEE half -> float, exactly (every half is a float), as F16C's conversion. */
static inline float from_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0) {
        v = ldexpf((float)man, -24); /* zero and subnormals */
    } else if (exp == 31) {
        v = man ? NAN : INFINITY;
    } else {
        v = ldexpf((float)(man | 0x400), (int)exp - 25);
    }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits |= sign;
    memcpy(&v, &bits, 4);
    return v;
}

/* float -> IEEE half, rounded to nearest even, saturated at +-65504 (a KV cache holds no
 * infinity: one would turn a whole softmax into NaN). */
static inline uint16_t to_half(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    const float a = fabsf(x);
    if (a != a) return (uint16_t)(sign | 0x7E00);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7BFF); /* what would round to inf */
    if (a < 6.103515625e-05f) /* subnormal halves: multiples of 2^-24, rounded by the FPU */
        return (uint16_t)(sign | (uint16_t)nearbyintf(a * 16777216.0f));
    memcpy(&bits, &a, 4);
    const uint32_t exp = (bits >> 23) - 112, man = bits & 0x7FFFFF; /* rebias 127 -> 15 */
    uint32_t h = (exp << 10) | (man >> 13);
    const uint32_t rest = man & 0x1FFF; /* the 13 bits dropped: round half to even */
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h; /* a carry steps the exponent */
    return (uint16_t)(sign | h);
}

/* r clamped to [-127, 127] and rounded half to even by the 1.5 * 2^23 trick (exact for
 * |r| <= 2^22): what the SIMD paths' rounding instructions do, with no libm call. */
static inline int8_t int8_code(float r) {
    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
    return (int8_t)((r + ROUNDER) - ROUNDER);
}

/* exp(x) for x clamped to [-87, 88] (never inf, never subnormal): n = round(x / ln 2),
 * r = x - n ln 2 in two parts, Cephes' degree-6 polynomial for e^r, times 2^n from the
 * exponent bits. Each path runs these very operations (fma for fma), so all agree. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_portable(float x) {
    x = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
    const float n = (x * LOG2E + ROUNDER) - ROUNDER;
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; ++i) p = fmaf(p, r, EXP_POLY[i]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) * (1 << 23);
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* exp_portable on W-bit vectors (512: 16 lanes, 256: 8): exp_512 / exp_256. */
#define EXP_SIMD(W, ATTR)                                                                        \
    ATTR INLINE __m##W exp_##W(__m##W x) {                                                       \
        x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(EXP_LO)), _mm##W##_set1_ps(EXP_HI)); \
        const __m##W rounder = _mm##W##_set1_ps(ROUNDER);                                        \
        const __m##W n = _mm##W##_sub_ps(                                                        \
            _mm##W##_add_ps(_mm##W##_mul_ps(x, _mm##W##_set1_ps(LOG2E)), rounder), rounder);     \
        __m##W r = _mm##W##_fmadd_ps(n, _mm##W##_set1_ps(-LN2_HI), x);                           \
        r = _mm##W##_fmadd_ps(n, _mm##W##_set1_ps(-LN2_LO), r);                                  \
        __m##W p = _mm##W##_set1_ps(EXP_POLY[0]);                                                \
        for (int i = 1; i < 6; ++i) p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(EXP_POLY[i])); \
        const __m##W y = _mm##W##_add_ps(_mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r, r), r),        \
                                         _mm##W##_set1_ps(1.0f));                                \
        const __m##W##i e = _mm##W##_slli_epi32(                                                 \
            _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23);          \
        return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                  \
    }

#endif
