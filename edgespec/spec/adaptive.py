"""Adaptive drafting: when to stop a chain, and how long the next chain should be.

Both decisions look only at the draft's own numbers and at measured timings, never at
the target's verdict on the tokens being proposed, so verification stays lossless.

Stop rules (within one chain):
- confidence: stop once the draft's top probability falls below a threshold (Hugging
  Face's assistant_confidence_threshold, 0.4);
- entropy (SVIP): stop once sqrt(0.15 · H) > 0.3, H the draft entropy in nats.

Length controller (across chains): with per-token acceptance α, a γ-chain commits
E(γ) = (1 - α^(γ+1)) / (1 - α) tokens per target pass and costs γ·c_draft + c_verify(γ+1).
α is an exponential moving average of what each pass measured, c_draft and c_verify(S)
medians of the recent passes, and the next γ maximizes E(γ) / cost(γ). γ = 0 is a plain
AR step (E = 1, cost c_verify(1)): when no chain is expected to beat it (a draft that
agrees too rarely, or costs too much next to the target), the controller decodes plainly
and, every `probe_every` such steps, drafts its best chain anyway to keep α measured.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

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
    """Picks the chain length that maximizes expected tokens per second.

    Costs are medians of the last `window` measurements (per verified length S): on a
    busy machine one pass in a few is delayed several-fold, and a moving average would
    carry such a spike for many passes (and keep γ = 0 from ever being re-measured)."""

    def __init__(self, max_gamma: int, alpha: float = 0.7, decay: float = 0.8,
                 probe_every: int = 32, window: int = 9):
        self.max_gamma = max_gamma
        self.alpha = alpha
        self.decay = decay
        self.probe_every = probe_every
        self.window = window
        self.plain_steps = 0  # consecutive passes that drafted nothing
        self.updates = 0
        self._draft: deque[float] = deque(maxlen=window)  # seconds per draft pass
        self._verify: dict[int, deque[float]] = {}  # seconds per verify pass of S tokens

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        # a draft pass right after another drafting pass catches up on one pass's tokens;
        # the first one (the prompt) and one after plain steps catch up on many, which a
        # steady chain never pays, so they do not count as the draft's cost
        steady = self.updates > 0 and self.plain_steps == 0
        self.updates += 1
        self.plain_steps = 0 if drafted else self.plain_steps + 1
        if drafted:
            # each proposal is a Bernoulli trial until the first rejection
            trials = accepted + (accepted < drafted)
            rate = accepted / trials
            self.alpha = min(0.99, max(0.01, self.decay * self.alpha + (1 - self.decay) * rate))
            if steady:
                self._draft.append(draft_s / drafted)
        self._verify.setdefault(drafted + 1, deque(maxlen=self.window)).append(verify_s)

    def gamma(self) -> int:
        if not self._draft or not self._verify:
            return self.max_gamma
        if 1 not in self._verify:
            return 0  # what a plain step costs is measured once, on the second pass
        a, draft = self.alpha, median(self._draft)
        verify = {s: median(v) for s, v in self._verify.items()}

        def rate(g: int) -> float:
            # an S not measured yet costs as much as the nearest measured one
            s = min(verify, key=lambda k: (abs(k - g - 1), k))
            return (1 - a ** (g + 1)) / (1 - a) / (g * draft + verify[s])

        best = max(range(self.max_gamma + 1), key=rate)
        if best == 0 and self.plain_steps >= self.probe_every:
            # the probe: the chain that would be chosen, since acceptance is correlated
            # along a chain (one-token probes made longer chains look worse than they are)
            return max(range(1, self.max_gamma + 1), key=rate)
        return best
