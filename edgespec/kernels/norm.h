/* A residual add and the RMS norm of its sum, a row at a time, whose result for a row is
 * bitwise the same whatever rows share the pass and on every path.
 *
 * sum = x + skip; y = sum * (1 / sqrt(ss / K + eps)) * gamma, with ss the row's sum of
 * squares in a fixed order: lane l of 16 adds sum[i]^2 (a multiply, then an add: no fma)
 * for i = l, l + 16, ... in turn, then lanes fold l + 8, l + 4, l + 2, l + 1. Every path
 * runs these operations, so the AVX-512, AVX2 and portable results are equal. What ONNX
 * Runtime's SkipSimplifiedLayerNormalization computes (within float rounding), at a few
 * microseconds less a node for a pass of several tokens (it took 10-13 us a node for 17
 * rows of SmolLM2's 576, on one thread or two).
 */
#ifndef EDGESPEC_NORM_H
#define EDGESPEC_NORM_H

#include <stdint.h>

/* Rows [0, M) of x, skip [M, K] (K % 16 == 0) into sum and y [M, K]; gamma [K]. */
void norm_skip_rms(const float *x, const float *skip, const float *gamma, int64_t M,
                   int64_t K, float eps, float *y, float *sum);

#endif
