"""Decoding loops over any model with a trimmable cache: AR and draft-model chains.

A *model* here is anything with `forward(ids) -> logits [S, V]` that appends `ids` after
its cached prefix, a `cache` with `length` and `trim(n)`, and `max_len`. The ONNX
sessions are one such model; the tests' toy Markov models are another, which is how the
loops below are checked statistically without ONNX Runtime.

Each loop is a generator yielding the tokens one target pass committed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from edgespec.spec.chain import verify_chain
from edgespec.spec.sampling import SamplingParams, sample, sample_probs, warp
from edgespec.spec.stats import GenerationStats


class Cache(Protocol):
    length: int

    def trim(self, n: int) -> None: ...

    def reset(self) -> None: ...


class Model(Protocol):
    cache: Cache
    max_len: int

    def forward(self, ids: list[int]) -> np.ndarray: ...


def prefill(target: Model, ids: list[int], params: SamplingParams, rng: np.random.Generator,
            stats: GenerationStats) -> int:
    t0 = time.perf_counter()
    target.cache.reset()
    logits = target.forward(ids)
    stats.target_passes += 1
    stats.prefill_s = time.perf_counter() - t0
    return sample(logits[-1], params, rng)


def ar_decode(target: Model, ids: list[int], params: SamplingParams, rng: np.random.Generator,
              stats: GenerationStats) -> Iterator[list[int]]:
    """The reference: one target pass per token."""
    tok = prefill(target, ids, params, rng, stats)
    while True:
        yield [tok]
        t0 = time.perf_counter()
        logits = target.forward([tok])
        stats.verify_s += time.perf_counter() - t0
        stats.target_passes += 1
        tok = sample(logits[-1], params, rng)


def chain_decode(target: Model, draft: Model, ids: list[int], params: SamplingParams,
                 gamma: int, rng: np.random.Generator,
                 stats: GenerationStats) -> Iterator[list[int]]:
    """Draft γ tokens, verify them in one target pass, keep the accepted prefix + one.

    Invariant between steps: `tokens` is everything committed; each cache holds a prefix
    of it and the last committed token is always still to be fed. After a pass both
    caches are trimmed back to that invariant, which is the whole rollback.
    """
    draft.cache.reset()
    tokens = [*ids, prefill(target, ids, params, rng, stats)]
    yield tokens[-1:]
    while True:
        g = min(gamma, target.max_len - len(tokens))  # the verify pass must fit
        t0 = time.perf_counter()
        proposals: list[int] = []
        q_rows: list[np.ndarray] = []
        feed = tokens[draft.cache.length:]
        for _ in range(g):
            logits = draft.forward(feed)[-1]
            stats.draft_passes += 1
            if params.greedy:
                proposals.append(int(np.argmax(logits)))
            else:
                q_rows.append(warp(logits, params))
                proposals.append(sample_probs(q_rows[-1], rng))
            feed = proposals[-1:]
        t1 = time.perf_counter()
        logits = target.forward(tokens[target.cache.length:] + proposals)
        stats.target_passes += 1
        n, nxt = verify_chain(logits[-(g + 1):], proposals,
                              np.stack(q_rows) if q_rows else None, params, rng)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.drafted += g
        stats.accepted += n
        new = proposals[:n] + [nxt]
        tokens += new
        target.cache.trim(target.cache.length - (len(tokens) - 1))
        draft.cache.trim(max(0, draft.cache.length - (len(tokens) - 1)))
        yield new
