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


class PassCosts:
    """What a target pass of S tokens costs: the median of the last `window` measured.

    Medians, not moving averages: on a busy machine one pass in a few is delayed
    several-fold, and an average would carry such a spike for many passes (and keep a
    plain step from ever being chosen, so re-measured, again)."""

    def __init__(self, window: int):
        self.window = window
        self._seconds: dict[int, deque[float]] = {}

    def add(self, s: int, seconds: float) -> None:
        self._seconds.setdefault(s, deque(maxlen=self.window)).append(seconds)

    def measured(self, s: int) -> bool:
        return s in self._seconds

    def __bool__(self) -> bool:
        return bool(self._seconds)

    def __call__(self, s: int) -> float:
        """An S not measured yet costs as much as the nearest measured one."""
        nearest = min(self._seconds, key=lambda k: (abs(k - s), k))
        return median(self._seconds[nearest])


class GammaController:
    """Picks the chain length that maximizes expected tokens per second, from the medians
    of the recent draft and verify costs (PassCosts)."""

    def __init__(self, max_gamma: int, alpha: float = 0.7, decay: float = 0.8,
                 probe_every: int = 32, window: int = 9):
        self.max_gamma = max_gamma
        self.alpha = alpha
        self.decay = decay
        self.probe_every = probe_every
        self.plain_steps = 0  # consecutive passes that drafted nothing
        self.updates = 0
        self._draft: deque[float] = deque(maxlen=window)  # seconds per draft pass
        self._verify = PassCosts(window)

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
        self._verify.add(drafted + 1, verify_s)

    def gamma(self) -> int:
        if not self._draft or not self._verify:
            return self.max_gamma
        if not self._verify.measured(1):
            return 0  # what a plain step costs is measured once, on the second pass
        a, draft = self.alpha, median(self._draft)

        def rate(g: int) -> float:
            return (1 - a ** (g + 1)) / (1 - a) / (g * draft + self._verify(g + 1))

        best = max(range(self.max_gamma + 1), key=rate)
        if best == 0 and self.plain_steps >= self.probe_every:
            # the probe: the chain that would be chosen, since acceptance is correlated
            # along a chain (one-token probes made longer chains look worse than they are)
            return max(range(1, self.max_gamma + 1), key=rate)
        return best


class HybridController:
    """Per pass, which draft pays for a head with prompt lookup (HybridDrafter): copying
    up to `max_copy` tokens that followed the text's last n-gram before, `head_gamma`
    head tokens, or no draft at all (a plain step).

    Each option's expected tokens per second is its expected committed tokens over its
    measured cost: a copy of L tokens costs a verify pass of L + 1 (looking up is free), a
    head chain of γ costs γ head steps and a pass of γ + 1, a plain step a pass of 1.
    Copies are right to the end or wrong at the first token more often than independent
    trials would be (a quoted span either is quoted or is not), so acceptance is kept per
    source and position: a[i] = P(proposal i accepted | those before it were), a moving
    average of what passes measured, and E(L) = 1 + sum over i <= L of a[1]...a[i]. When
    the long-context passes of RAG and summaries cost far more per extra token than
    sampled copies commit, this drafts less or steps plainly; it reads only past outcomes
    and timings, never the tokens being verified, so decoding stays lossless. A source
    passed over `probe_every` times where it could have drafted drafts its best option
    once anyway, to keep the acceptance it is judged by measured. A plain step must beat
    the best draft by `plain_margin`: head passes amid copies catch up on the copied runs
    and find their weights evicted, so they measure dearer than a steady chain's, and on
    SmolLM2's short-context greedy chat a head breaking even by these measurements still
    gained (plain steps instead: 0.94-0.97x the fixed chains).
    """

    plain_margin = 1.1

    def __init__(self, max_copy: int, head_gamma: int = 1, decay: float = 0.9,
                 probe_every: int = 16, window: int = 9):
        # priors: what SmolLM2's greedy chat and code measured (README "Draft heads")
        self.accept = {"copy": [0.7] * max_copy, "head": [0.45] * head_gamma}
        self.head_gamma, self.decay, self.probe_every = head_gamma, decay, probe_every
        self.source: str | None = None  # what the pass being verified drafted from
        self.passed_over = {"copy": 0, "head": 0}  # since each last drafted where it could
        self.drafted_last = self.head_started = False
        self._head: deque[float] = deque(maxlen=window)  # seconds per head token
        self._verify = PassCosts(window)

    def gamma(self) -> int:
        """The most head tokens a pass drafts (chain_decode's controller interface)."""
        return self.head_gamma

    def expected(self, source: str, n: int) -> float:
        """Tokens a pass commits when it drafts `n` tokens from `source`."""
        tokens, reach = 1.0, 1.0
        for a in self.accept[source][:n]:
            reach *= a
            tokens += reach
        return tokens

    def plan(self, found: int) -> tuple[str, int]:
        """(source, how many to draft): ("copy", L), ("head", γ) or ("plain", 0), given
        `found` copied tokens on offer."""
        found = min(found, len(self.accept["copy"]))
        if not self._head and not found:
            choice = ("head", self.head_gamma)  # what a head step costs, measured first
        elif not self._verify:
            choice = ("copy", found) if found else ("head", self.head_gamma)
        elif not self._verify.measured(1):
            choice = ("plain", 0)  # what a plain step costs, measured once
        else:
            choice = self._best(found)
        self.source = choice[0] if choice[1] else None
        for source in ("copy", "head") if found else ("head",):
            self.passed_over[source] = 0 if source == self.source else \
                self.passed_over[source] + 1
        return choice

    def _best(self, found: int) -> tuple[str, int]:
        head = median(self._head) if self._head else 0.0
        options = [("copy", n) for n in range(1, found + 1)]
        options += [("head", g) for g in range(1, self.head_gamma + 1)]

        def rate(option: tuple[str, int]) -> float:
            source, n = option
            cost = self._verify(n + 1) + (n * head if source == "head" else 0.0)
            return self.expected(source, n) / cost

        best = max(options, key=rate)
        for probed in ("copy", "head") if found else ("head",):
            if self.passed_over[probed] + 1 >= self.probe_every:
                return max((o for o in options if o[0] == probed), key=rate)
        return best if rate(best) * self.plain_margin > 1 / self._verify(1) else ("plain", 0)

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted and self.source is not None:
            rates = self.accept[self.source]
            for i in range(min(accepted + 1, drafted)):  # up to the first rejection
                rates[i] = self.decay * rates[i] + (1 - self.decay) * (i < accepted)
            # a head pass right after a drafting pass catches up on that pass's tokens;
            # its first (the prompt) and one after plain steps on many, which is no
            # head step's cost (counting it would make plain steps look cheaper still)
            if self.source == "head":
                if self.head_started and self.drafted_last:
                    self._head.append(draft_s / drafted)
                self.head_started = True
        self.drafted_last = drafted > 0
        self._verify.add(drafted + 1, verify_s)
