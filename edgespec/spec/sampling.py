"""Turning logits into the distribution we sample from.

Losslessness is defined against the *warped* target distribution: temperature, top-k
and top-p are applied identically to target logits p and draft logits q, and
verification then compares the two warped distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p, along the last axis.

    In float32, as the logits come: this runs for every drafted and verified token, and
    float64 doubled its cost; probabilities are only summed into a CDF in float64."""
    with np.errstate(over="ignore"):  # a trimmed head's NEG_INF / T < 1: -inf, as meant
        z = np.asarray(logits, dtype=np.float32) / np.float32(max(params.temperature, 1e-6))
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        # keep a token if the mass strictly before it is < top_p; the most likely token
        # always survives, also when top_p rounds to 0 in float32 (below ~1.4e-45)
        keep_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) < params.top_p
        keep_sorted[..., 0] = True
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one row of logits; greedy is the argmax."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample_probs(warp(logits, params), rng)


def sample_probs(probs: np.ndarray, rng: np.random.Generator) -> int:
    # float64: a float32 running sum over a large vocabulary would round small
    # probabilities by a visible fraction of themselves
    return sample_cdf(np.cumsum(probs, dtype=np.float64), rng)


def sample_cdf(cdf: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from the distribution whose running sum (any scale) is `cdf`."""
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))
