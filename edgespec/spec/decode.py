"""Decoding loops: AR (the reference) and speculative chains from any drafter.

A *model* is anything with `forward(ids) -> logits [S, V]` that appends `ids` after its
cached prefix, a `cache` with `length` and `trim(n)`, and `max_len` (drafters.Model).
The ONNX sessions are one such model; the tests' toy Markov models are another, which is
how these loops are checked statistically without ONNX Runtime.

Each loop is a generator yielding the tokens one target pass committed. With `on_logits`,
it first hands over the target's logit rows that decided them ([len(tokens), V], one row
per token, read before the next pass reuses the buffer): what OpenAI's `logprobs` report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from edgespec.spec.adaptive import GammaController
from edgespec.spec.chain import verify_chain
from edgespec.spec.drafters import Drafter, Model, TreeDrafter
from edgespec.spec.sampling import SamplingParams, sample, warp
from edgespec.spec.stats import GenerationStats
from edgespec.spec.tree import verify_tree

LogitsSink = Callable[[np.ndarray], None]


def prefill(target: Model, ids: list[int], params: SamplingParams, rng: np.random.Generator,
            stats: GenerationStats, on_logits: LogitsSink | None = None) -> int:
    """Feed the prompt and draw the first token. The caller decides how much of `ids`
    the target's cache already holds (a previous chat turn): only the rest is fed."""
    t0 = time.perf_counter()
    held = target.cache.length
    assert held < len(ids), "the cache must leave at least the prompt's last token to feed"
    logits = target.forward(ids[held:], last=True)
    stats.target_passes += 1
    stats.prefill_s = time.perf_counter() - t0
    if on_logits:
        on_logits(logits[-1:])
    return sample(logits[-1], params, rng)


def ar_decode(target: Model, ids: list[int], params: SamplingParams, rng: np.random.Generator,
              stats: GenerationStats, on_logits: LogitsSink | None = None
              ) -> Iterator[list[int]]:
    """The reference: one target pass per token."""
    tok = prefill(target, ids, params, rng, stats, on_logits)
    while True:
        yield [tok]
        t0 = time.perf_counter()
        logits = target.forward([tok])
        stats.verify_s += time.perf_counter() - t0
        stats.target_passes += 1
        if on_logits:
            on_logits(logits[-1:])
        tok = sample(logits[-1], params, rng)


def chain_decode(target: Model, drafter: Drafter, ids: list[int], params: SamplingParams,
                 gamma: int, rng: np.random.Generator, stats: GenerationStats,
                 controller: GammaController | None = None,
                 on_logits: LogitsSink | None = None,
                 limit: int | None = None) -> Iterator[list[int]]:
    """Draft up to γ tokens, verify them in one target pass, keep the accepted prefix + 1.

    Invariant between steps: `tokens` is everything committed; every cache holds a
    prefix of it and the last committed token is always still to be fed. After a pass
    the caches are trimmed back to that invariant, which is the whole rollback. With a
    `controller`, γ is chosen per pass (up to `gamma`) from measured acceptance and costs.
    `limit`: the tokens wanted in all; no pass verifies drafts past them.
    """
    drafter.reset()
    tokens = [*ids, prefill(target, ids, params, rng, stats, on_logits)]
    yield tokens[-1:]
    while True:
        room = _room(target, ids, tokens, limit)
        g = min(controller.gamma() if controller else gamma, room)
        t0 = time.perf_counter()
        proposals, q = drafter.propose(tokens, g, params, rng, stats)
        if len(proposals) > room:  # copies may run past γ (HybridDrafter), not past this
            proposals, q = proposals[:room], None if q is None else q[:room]
        t1 = time.perf_counter()
        logits = target.forward(tokens[target.cache.length:] + proposals)
        stats.target_passes += 1
        rows = logits[-(len(proposals) + 1):]
        n, nxt = verify_chain(rows, proposals, q, params, rng)
        if on_logits:
            on_logits(rows[:n + 1])
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.drafted += len(proposals)
        stats.accepted += n
        if controller:
            controller.update(len(proposals), n, t1 - t0, t2 - t1)
        new = proposals[:n] + [nxt]
        tokens += new
        target.cache.trim(target.cache.length - (len(tokens) - 1))
        drafter.rollback(len(tokens))
        yield new


def _room(target: Model, ids: list[int], tokens: list[int], limit: int | None) -> int:
    """How many drafts the next pass may verify: it feeds them after the last token and
    commits one more, within the context and the tokens still wanted."""
    wanted = len(ids) + limit - len(tokens) - 1 if limit is not None else target.max_len
    return max(0, min(target.max_len - len(tokens), wanted))


def tree_decode(target: Model, drafter: TreeDrafter, ids: list[int], params: SamplingParams,
                budget: int, rng: np.random.Generator, stats: GenerationStats,
                on_logits: LogitsSink | None = None,
                limit: int | None = None) -> Iterator[list[int]]:
    """Grow a draft tree, pass it through the target and keep the path it picks.

    Sample-and-match on the tree pass's rows (verify_tree) draws every token from the
    target's own row for its prefix: a path and the token after it. Where a tree row is
    bitwise the chain row of the same prefix (`target.exact_trees`: edgespec's own
    attention, which sums only the keys a row sees, in order) those tokens are decided
    then and there and the path's cache entries are moved together (`cache.compact`): one
    pass per step. Elsewhere (ONNX Runtime's attention sums a row's keys in SIMD lanes,
    and masked siblings move the keys to other lanes; with int8 activations the logits
    moved by up to 0.7 on SmolLM2) the tree pass only proposes: its cache entries are
    dropped and one chain pass over [root, *path, next] verifies them with the tree rows
    as the proposal q (verify_chain), writing exact cache entries. Either way every
    emitted token is decided by rows bitwise equal to AR steps: greedy output equals AR's,
    and sampled output has the target's distribution.
    """
    exact = getattr(target, "exact_trees", False)
    drafter.reset()
    tokens = [*ids, prefill(target, ids, params, rng, stats, on_logits)]
    yield tokens[-1:]
    while True:
        room = _room(target, ids, tokens, limit)
        t0 = time.perf_counter()
        tree = drafter.propose_tree(tokens, min(budget, room), params, stats)
        t1 = time.perf_counter()
        past = target.cache.length
        logits = target.forward(*tree.verify_inputs(tokens[-1], past))
        stats.target_passes += 1
        path, nxt = verify_tree(logits, tree, params, rng)
        # row 0 drew the first proposal, row 1 + node the one after node
        proposals = [tree.tokens[node] for node in path] + [nxt]
        drawn_by = [0, *(1 + node for node in path)]
        if exact:
            target.cache.compact(past + 1, [past + 1 + node for node in path])
            n, rows = len(path), logits[drawn_by]
        else:
            target.cache.trim(target.cache.length - past)
            # the chain pass verifies the token after the path too: within the room
            proposals, drawn_by = proposals[:room], drawn_by[:room]
            q = None if params.greedy else warp(logits[drawn_by], params)
            rows = target.forward([tokens[-1], *proposals])
            stats.target_passes += 1
            n, nxt = verify_chain(rows, proposals, q, params, rng)
        if on_logits:
            on_logits(rows[:n + 1])
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.drafted += len(tree)
        stats.accepted += min(n, len(path))
        new = proposals[:n] + [nxt]
        tokens += new
        target.cache.trim(target.cache.length - (len(tokens) - 1))
        drafter.rollback()
        yield new
