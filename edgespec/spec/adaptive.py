"""Adaptive drafting: when to stop a chain, and how long the next chain should be.

Both decisions look only at the draft's own numbers and at measured timings, never at
the target's verdict on the tokens being proposed, so verification stays lossless.

Stop rules (within one chain):
- confidence: stop once the draft's top probability falls below a threshold (Hugging
  Face's assistant_confidence_threshold, 0.4);
- entropy (SVIP): stop once sqrt(0.15 · H) > 0.3, H the draft entropy in nats.

Length controller (across chains): with per-token acceptance α, a γ-chain commits
E(γ) = (1 - α^(γ+1)) / (1 - α) tokens per target pass and costs γ·c_draft + c_verify(γ+1).
α, c_draft and c_verify(S) are tracked as exponential moving averages of what each pass
measured, and the next γ maximizes E(γ) / cost(γ).
"""

from __future__ import annotations

import math

import numpy as np

STOP_RULES = ("none", "confidence", "entropy")


def should_stop(probs: np.ndarray, rule: str, threshold: float = 0.4) -> bool:
    """Stop the chain before proposing from `probs`? (`threshold` for confidence.)"""
    if rule == "confidence":
        return float(probs.max()) < threshold
    if rule == "entropy":
        p = probs[probs > 0]
        entropy = float(-(p * np.log(p)).sum())
        return math.sqrt(0.15 * entropy) > 0.3
    return False


class GammaController:
    """Picks the chain length that maximizes expected tokens per second."""

    def __init__(self, max_gamma: int, alpha: float = 0.7, decay: float = 0.8):
        self.max_gamma = max_gamma
        self.alpha = alpha
        self.decay = decay
        self.draft_cost: float | None = None  # seconds per draft pass
        self.verify_cost: dict[int, float] = {}  # seconds per verify pass of S tokens

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted:
            # each proposal is a Bernoulli trial until the first rejection
            trials = accepted + (accepted < drafted)
            self.alpha = min(0.99, max(0.01, self._ema(self.alpha, accepted / trials)))
            self.draft_cost = self._ema(self.draft_cost, draft_s / drafted)
        s = drafted + 1
        self.verify_cost[s] = self._ema(self.verify_cost.get(s), verify_s)

    def _verify(self, s: int) -> float:
        if s in self.verify_cost:
            return self.verify_cost[s]
        # not measured yet: the nearest measured size (optimistic, so it gets tried)
        nearest = min(self.verify_cost, key=lambda k: (abs(k - s), k))
        return self.verify_cost[nearest]

    def gamma(self) -> int:
        if self.draft_cost is None or not self.verify_cost:
            return self.max_gamma
        a = self.alpha

        def rate(g: int) -> float:
            return (1 - a ** (g + 1)) / (1 - a) / (g * self.draft_cost + self._verify(g + 1))

        return max(range(1, self.max_gamma + 1), key=rate)
