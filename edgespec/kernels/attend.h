/* Attention whose output for a query is bitwise the same whatever else shares the pass.
 *
 * A query attends to the keys its bias row leaves open (bias > -1e30) at or before its own
 * slot, taken in slot order, and only to those: masked keys never enter a sum. Its scores
 * are dot products of fixed order (8 lanes over the head's dimensions, folded l + l+4,
 * l + l+2, l + l+1), e = exp(score - max) with edgespec's own exp, the sum of e in 8 lanes
 * by index (folded the same way) and the output sum_i e_i v_i / sum, each dimension
 * accumulated key after key. So a token's output depends only on its own query and the keys
 * it sees, in their order: alone, in a chain, or on a branch of a token tree, where masked
 * siblings sit between its ancestors, it is the same. Every path runs these operations
 * (fma for fma), so the AVX2 and portable results are bitwise equal too.
 *
 * Layouts: q rows of S tokens, each H heads of D floats (row stride q_stride floats); k and
 * v rows of Hk heads (strides k_stride, v_stride); the caches [Hk, max, D]; bias [S, T]
 * with T = past + S; cos/sin [positions, half] (the rotary half; dimensions past 2 * half
 * are not rotated).
 */
#ifndef EDGESPEC_ATTEND_H
#define EDGESPEC_ATTEND_H

#include <stdint.h>

typedef struct {
    int64_t S, H, Hk, D, half; /* tokens, query heads, KV heads, head size, rotary half */
    int64_t past, max;         /* cached slots before this pass; the caches' length */
    float scale, softcap;      /* scores = softcap * tanh(q.k * scale / softcap) if softcap */
    const float *kscale, *vscale; /* [Hk, D]: the caches hold int8 codes (NULL: floats) */
} AttendShape;

/* Rotates the pass's queries into qrot [S, H, D] and its keys into the key cache at slots
 * past..past+S-1 (the half-split layout, rotated at position pos[s]); copies its values into
 * the value cache. With int8 caches both are stored as codes round(x / scale) (half to even,
 * within +-127) per KV head and channel; scratch holds D floats. */
void attend_prepare(const AttendShape *shape, const float *q, int64_t q_stride, const float *k,
                    int64_t k_stride, const float *v, int64_t v_stride, const int64_t *pos,
                    const float *cos, const float *sin, float *qrot, void *kcache,
                    void *vcache, float *scratch);

/* out[s, h] for the (s, h) pairs numbered s * H + h in [begin, end); idx is scratch of
 * past + S + 8 elements, e of past + S + 8 + D. With int8 caches a query is multiplied by
 * the key scales before its dot products with the codes, and the weighted sum of value
 * codes by the value scales before the division by the sum. */
void attend_rows(const AttendShape *shape, const float *qrot, const void *kcache,
                 const void *vcache, const float *bias, float *out, int64_t begin,
                 int64_t end, int32_t *idx, float *e);

#endif
