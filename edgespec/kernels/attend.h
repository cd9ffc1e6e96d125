/* Attention whose output for a query is bitwise the same whatever else shares the pass.
 *
 * A query attends to the keys its bias row leaves open (bias > -1e30) at or before its own
 * slot, taken in slot order, and only to those: masked keys never change a sum (one another
 * row sees enters its weighted sum of values with weight 0, adding exact zeros). Its scores
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
    int halves;                   /* with no scales: the caches hold IEEE halves */
} AttendShape;

/* Rotates the pass's queries into qrot [S, H, D] and its keys into the key cache at slots
 * past..past+S-1 (the half-split layout, rotated at position pos[s]); copies its values into
 * the value cache. With int8 caches both are stored as codes round(x / scale) (half to even,
 * within +-127) per KV head and channel, and the queries are multiplied by the key scales;
 * with half caches as IEEE halves (to_half: nearest even, saturated). Scratch holds D
 * floats. */
void attend_prepare(const AttendShape *shape, const float *q, int64_t q_stride, const float *k,
                    int64_t k_stride, const float *v, int64_t v_stride, const int64_t *pos,
                    const float *cos, const float *sin, float *qrot, void *kcache,
                    void *vcache, float *scratch);

/* A pass's queries are attended in blocks of rows, each in three steps: every key any of
 * its rows sees is read once for all of the block's queries of its KV head (the scores,
 * then the values), so a pass of S tokens reads the caches about once, not S times. Each
 * query's arithmetic is unchanged: its dot products, its softmax over the keys its own row
 * sees (the others get weight 0, which adds exact zeros), its sums key after key. */
typedef struct {
    const AttendShape *a;
    const float *qrot, *bias;       /* attend_prepare's queries; [S, T] */
    const void *kcache, *vcache;
    float *out;                     /* [S, H, D] */
    int64_t r0, r1;                 /* the block's rows */
    const int32_t *keys;            /* the U slots any of its rows sees, in order */
    int64_t U;
    float *w;     /* [(r1 - r0) * H, U + 8]: dot products, then softmax weights */
    float *sums;  /* [(r1 - r0) * H]: each query's sum of weights (0: it sees no key) */
} AttendBlock;

/* Fills keys (room for past + r1) with the slots rows [r0, r1) see; returns their count. */
int64_t attend_keys(const AttendShape *shape, const float *bias, int64_t r0, int64_t r1,
                    int32_t *keys);

/* The block's dot products of KV head g's queries with keys[u0:u1] (u0 a multiple of 8, u1
 * too unless it is U). With int8 caches the queries come multiplied by the key scales. */
void attend_scores(const AttendBlock *block, int64_t g, int64_t u0, int64_t u1);

/* Softmax weights for the block's queries numbered (s - r0) * H + h in [t0, t1); e and pick
 * are scratch of U + 8 elements. */
void attend_weights(const AttendBlock *block, int64_t t0, int64_t t1, float *e, int32_t *pick);

/* Dimensions [d0, d1) (multiples of 8) of the outputs of KV head g's queries: the weighted
 * sum of values (times the value scales with int8 codes) over the sum of weights. */
void attend_values(const AttendBlock *block, int64_t g, int64_t d0, int64_t d1);

#endif
