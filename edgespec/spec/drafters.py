"""Drafters: where proposals come from. The verifier does not care.

A drafter proposes up to n tokens after the committed sequence and says how it drew
them: `q` rows are the (warped) distributions the proposals were sampled from, needed by
lossless sampling verification. A deterministic drafter (prompt lookup) has one-hot q,
for which min(1, p/q) = p(d) and the residual is p with d removed: the standard rule,
still exact.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgespec.spec.sampling import SamplingParams, sample_probs, warp
from edgespec.spec.stats import GenerationStats


class Cache(Protocol):
    length: int

    def trim(self, n: int) -> None: ...

    def reset(self) -> None: ...


class Model(Protocol):
    """A decoder that appends `ids` after its cached prefix and returns their logits."""

    cache: Cache
    max_len: int

    def forward(self, ids: list[int]) -> np.ndarray: ...


class Drafter(Protocol):
    def reset(self) -> None: ...

    def propose(self, tokens: list[int], n: int, params: SamplingParams,
                rng: np.random.Generator, stats: GenerationStats
                ) -> tuple[list[int], np.ndarray | None]: ...

    def rollback(self, committed: int) -> None:
        """Forget anything beyond the first `committed - 1` tokens (the last is unfed)."""


class ModelDrafter:
    """A small autoregressive model with its own KV cache."""

    def __init__(self, model: Model):
        self.model = model

    def reset(self) -> None:
        self.model.cache.reset()

    def propose(self, tokens, n, params, rng, stats):
        proposals: list[int] = []
        q_rows: list[np.ndarray] = []
        feed = tokens[self.model.cache.length:]
        for _ in range(n):
            logits = self.model.forward(feed)[-1]
            stats.draft_passes += 1
            if params.greedy:
                proposals.append(int(np.argmax(logits)))
            else:
                q_rows.append(warp(logits, params))
                proposals.append(sample_probs(q_rows[-1], rng))
            feed = proposals[-1:]
        return proposals, (np.stack(q_rows) if q_rows else None)

    def rollback(self, committed: int) -> None:
        cache = self.model.cache
        cache.trim(max(0, cache.length - (committed - 1)))


class LookupDrafter:
    """Prompt lookup (PLD): copy what followed the latest earlier occurrence of the
    sequence's last n-gram (n from `max_ngram` down to 1). Free drafts for code edits,
    RAG and summaries, where the output repeats the input."""

    def __init__(self, vocab_size: int, max_ngram: int = 3):
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram

    def reset(self) -> None:
        pass

    def rollback(self, committed: int) -> None:
        pass

    def propose(self, tokens, n, params, rng, stats):
        proposals = lookup(np.asarray(tokens), n, self.max_ngram)
        if params.greedy or not proposals:
            return proposals, None
        q = np.zeros((len(proposals), self.vocab_size))
        q[np.arange(len(proposals)), proposals] = 1.0
        return proposals, q


def lookup(seq: np.ndarray, n: int, max_ngram: int) -> list[int]:
    """Up to n tokens following the most recent earlier match of seq's last k-gram."""
    if n <= 0:
        return []
    for k in range(min(max_ngram, len(seq) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], k)
        hits = np.flatnonzero((windows == seq[-k:]).all(axis=1))
        if len(hits):
            start = hits[-1] + k
            return seq[start:start + n].tolist()
    return []
