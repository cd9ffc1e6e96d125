"""Log-probabilities of emitted tokens under the target (OpenAI's `logprobs`).

They come from the target rows that verification computed anyway (decode's `on_logits`),
taken at temperature 1 with no top-k/top-p: the model's own distribution, as OpenAI
reports it, whatever the sampling settings were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best first


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (a copy: the input may be a reused buffer)."""
    z = np.asarray(rows, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`row` is one log-softmax row; `top` alternatives are listed best first."""
    best: list[tuple[int, float]] = []
    if top:
        idx = np.argpartition(-row, top - 1)[:top] if top < row.shape[0] else np.arange(
            row.shape[0])
        idx = idx[np.argsort(-row[idx], kind="stable")]
        best = [(int(i), float(row[i])) for i in idx]
    return TokenLogprob(int(token), float(row[token]), best)
