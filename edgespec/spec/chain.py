"""Verifying a drafted chain against one target pass (Leviathan et al.; Chen et al.).

The draft proposed d_1..d_γ, drawing d_i from q_i. The target pass gives p_1..p_{γ+1}.
Walk the chain: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection emit one token from the residual norm(max(0, p_i - q_i)) and stop; if all γ
are accepted, emit a bonus token from p_{γ+1}. Every emitted token is then distributed
exactly as the target would have sampled it, so the output distribution is the target's.

Greedy (temperature 0) is the limit where p and q are one-hot at their argmax: accept
d_i iff it equals argmax p_i, and the replacement/bonus is argmax p — the same tokens
the target alone would have produced.
"""

from __future__ import annotations

import numpy as np

from edgespec.spec.sampling import SamplingParams, sample_probs, warp


def verify_chain(target_logits: np.ndarray, draft_tokens: list[int],
                 draft_probs: np.ndarray | None, params: SamplingParams,
                 rng: np.random.Generator) -> tuple[int, int]:
    """Return (number of draft tokens accepted, the token emitted after them).

    target_logits: [γ+1, V] raw logits; draft_probs: [γ, V] warped draft distributions
    (unused when greedy).
    """
    if params.greedy:
        best = np.argmax(target_logits, axis=-1)
        n = 0
        while n < len(draft_tokens) and draft_tokens[n] == best[n]:
            n += 1
        return n, int(best[n])
    p = warp(target_logits, params)
    for i, tok in enumerate(draft_tokens):
        q = draft_probs[i]
        if rng.random() * q[tok] < p[i, tok]:  # u < p/q without dividing by a tiny q
            continue
        residual = np.maximum(p[i] - q, 0.0)
        total = residual.sum()
        # total == 0 means p == q on the support: then rejection has probability 0, and
        # floating-point noise is the only way here; p itself is the right fallback.
        return i, sample_probs(residual / total if total > 0 else p[i], rng)
    return len(draft_tokens), sample_probs(p[len(draft_tokens)], rng)
