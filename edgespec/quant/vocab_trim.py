"""VocabTrim / FR-Spec: which rows of the draft's LM head to keep.

The draft proposes only among the K most frequent tokens (counted on text the target
generates, or on a corpus); the target still verifies over the whole vocabulary, so
output stays lossless, and a token outside the kept set can still be emitted (by the
target's correction). Special tokens and EOS are always kept: a draft that cannot
propose EOS would make every answer end one pass late.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def count_tokens(sequences: Iterable[list[int]], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in sequences:
        np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    return counts


def kept_tokens(counts: np.ndarray, k: int, always: Iterable[int]) -> np.ndarray:
    """The ids to keep, sorted: `always` first, then the most frequent (ties: lower id)."""
    always = sorted(set(int(i) for i in always))
    if k < len(always):
        raise ValueError(f"K={k} is smaller than the {len(always)} special tokens to keep")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id
    chosen = set(always)
    for i in order:
        if len(chosen) >= k:
            break
        chosen.add(int(i))
    return np.array(sorted(chosen), dtype=np.int64)
