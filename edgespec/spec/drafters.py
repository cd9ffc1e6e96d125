"""Drafters: where proposals come from. The verifier does not care.

A drafter proposes up to n tokens after the committed sequence and says how it drew
them: `q` rows are the (warped) distributions the proposals were sampled from, needed by
lossless sampling verification. A deterministic drafter (prompt lookup) has one-hot q,
for which min(1, p/q) = p(d) and the residual is p with d removed: the standard rule,
still exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from edgespec.spec.adaptive import HybridController, should_stop
from edgespec.spec.sampling import SamplingParams, sample_cdf, sample_probs, warp
from edgespec.spec.stats import GenerationStats
from edgespec.spec.tree import NEG_INF, DraftTree, Ranked, expand, expand_best_first, top_logprobs


class Cache(Protocol):
    length: int

    def trim(self, n: int) -> None: ...

    def reset(self) -> None: ...


class Model(Protocol):
    """A decoder that appends `ids` after its cached prefix and returns their logits.

    `positions` and `bias` ([1, 1, S, past + S], 0 or -inf) let one call feed a token
    tree: nodes at their depths, each seeing only its ancestors. A model whose tree rows
    are bitwise its chain rows says so with `exact_trees = True` and its cache then has
    `compact(start, slots)` (see decode.tree_decode).
    """

    cache: Cache
    max_len: int

    def forward(self, ids: list[int], positions: np.ndarray | None = None,
                bias: np.ndarray | None = None, last: bool = False) -> np.ndarray:
        """`last`: only the last row is read; a model may then return fewer rows
        (the last still last)."""


class Drafter(Protocol):
    def reset(self) -> None: ...

    def propose(self, tokens: list[int], n: int, params: SamplingParams,
                rng: np.random.Generator, stats: GenerationStats
                ) -> tuple[list[int], np.ndarray | None]: ...

    def rollback(self, committed: int) -> None:
        """Forget anything beyond the first `committed - 1` tokens (the last is unfed)."""


class ModelDrafter:
    """A small autoregressive model with its own KV cache; `stop_rule` (see
    spec.adaptive) may end a chain early when the draft grows unsure."""

    def __init__(self, model: Model, stop_rule: str = "none", threshold: float = 0.4):
        self.model = model
        self.stop_rule = stop_rule
        self.threshold = threshold

    def reset(self) -> None:
        self.model.cache.reset()

    def propose(self, tokens, n, params, rng, stats):
        proposals: list[int] = []
        q_rows: list[np.ndarray] = []
        feed = tokens[self.model.cache.length:]
        need_q = not params.greedy or self.stop_rule != "none"  # a softmax over V costs
        # plain temperature sampling: the draft graph computes q and its CDF itself
        in_graph = (not params.greedy and not params.top_k and params.top_p >= 1.0
                    and getattr(self.model, "samples", False))
        for _ in range(n):
            stats.draft_passes += 1
            cdf = None
            if in_graph:
                q, cdf = self.model.forward_sample(feed, params.temperature)
            else:
                logits = self.model.forward(feed, last=True)[-1]
                q = warp(logits, params if not params.greedy else SamplingParams(1.0)) \
                    if need_q else None
            if proposals and q is not None and should_stop(q, self.stop_rule,
                                                           self.threshold):
                break  # keeps at least one proposal, so the draft pass is not wasted
            if params.greedy:
                proposals.append(int(np.argmax(logits)))
            else:
                q_rows.append(q)
                proposals.append(sample_cdf(cdf, rng) if cdf is not None
                                 else sample_probs(q, rng))
            feed = proposals[-1:]
        return proposals, (np.stack(q_rows) if q_rows else None)

    def rollback(self, committed: int) -> None:
        cache = self.model.cache
        cache.trim(max(0, cache.length - (committed - 1)))


class HeadDrafter:
    """An EAGLE head drafting from the target's own final states (export.draft_head).

    Head position j reads the pair (h_j, t_{j+1}): the target's state after token j and
    the token that followed it, and predicts the state after t_{j+1}, whose scores over
    the kept tokens pick t_{j+2}. Each round first feeds the pairs the last verify pass
    made known (the target has fed every committed token but the last), then drafts by
    feeding its own predicted state back with the token it drafted. The drafted pairs
    are forgotten after verification, accepted or not: the target's true states replace
    them in the next round. `kept` maps the head's rows to token ids; other tokens have
    q = 0, so verification over the full vocabulary stays exact. `stop_rule` (see
    spec.adaptive) ends a chain once the head grows unsure, as for ModelDrafter.

    A head reads at most the last `window` tokens of what it is first given: it learned
    from windows of 256 tokens (train-draft's seq_len), and its first pass over a whole
    long prompt costs up to a second of decoding time (SmolLM2's head, 2,957 tokens:
    1.15 s); what it then drafts from is the target's states, which saw everything.
    On SmolLM2's RAG and summary prompts (greedy, 96 tokens) its acceptance is the same
    with 256, 512 or all tokens read (36.6%, 36.1%, 36.1%), its drafting time a third.

    Sampling, a token drawn from q is accepted with probability sum_x min(p(x), q(x)), and
    any q keeps the output the target's, so a head proposes from its softmax at
    `proposal_scale` times the target's temperature: a property of the trained head (its
    card's "proposal_scale", measured by tools/eval_proposal_scale.py; 1 when it has none,
    as the shipped ones). Teacher-forced on greedy answers a sharper q looked better
    (SmolLM2's head: 36.6 -> 38.6% at T=0.7, scale 0.6; Gemma 3's: 27.1 -> 33.8%, 0.2), but
    decoding sampled text gained nothing (Gemma 3's head alone at T=1: 30.3% -> 25.3%).
    """

    def __init__(self, head, target, kept: np.ndarray, vocab_size: int,
                 stop_rule: str = "none", threshold: float = 0.4, window: int = 256,
                 proposal_scale: float = 1.0):
        """`head` has `forward_head(ids, hidden) -> (logits [S, K], states [S, d])` and a
        cache; `target.features[j]` is the target's state after token j."""
        self.head, self.target = head, target
        self.kept = np.asarray(kept, dtype=np.int64)
        self.vocab_size = vocab_size
        self.stop_rule, self.threshold = stop_rule, threshold
        self.window = window
        self.proposal_scale = proposal_scale
        self.known = 0  # head positions fed with the target's own states
        self.skipped = 0  # leading tokens the head never reads (`window`)

    def reset(self) -> None:
        self.head.cache.reset()
        self.known = self.skipped = 0

    def unread(self, tokens: list[int]) -> tuple[list[int], np.ndarray]:
        """The pairs the head has not read yet: the tokens after its cache (the last one,
        unfed to the target, included) and the target's states before each."""
        if self.head.cache.length == 0:
            self.skipped = max(0, len(tokens) - 1 - self.window)
        start = self.head.cache.length + self.skipped
        return tokens[start + 1:], self.target.features[start:len(tokens) - 1]

    def propose(self, tokens, n, params, rng, stats):
        ids, states = self.unread(tokens)
        proposals: list[int] = []
        q_rows: list[np.ndarray] = []
        for _ in range(n):
            stats.draft_passes += 1
            logits, predicted = self.head.forward_head(ids, states)
            if not proposals:
                self.known = self.head.cache.length
            row = logits[-1]
            need_q = not params.greedy or self.stop_rule != "none"
            q = warp(row, self._proposal(params)) if need_q else None
            if proposals and q is not None and should_stop(q, self.stop_rule,
                                                           self.threshold):
                break  # the head's own numbers only: verification stays lossless
            if params.greedy:
                proposals.append(int(self.kept[np.argmax(row)]))
            else:
                full = np.zeros(self.vocab_size)
                full[self.kept] = q
                q_rows.append(full)
                proposals.append(sample_probs(full, rng))
            ids, states = proposals[-1:], predicted[-1:]
        return proposals, (np.stack(q_rows) if q_rows else None)

    def _proposal(self, params: SamplingParams) -> SamplingParams:
        if params.greedy:  # q only for the stop rule: the head's own softmax
            return SamplingParams(1.0)
        return replace(params, temperature=params.temperature * self.proposal_scale)

    def rollback(self, committed: int) -> None:
        self.head.cache.trim(self.head.cache.length - self.known)


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
        return copied(lookup(np.asarray(tokens), n, self.max_ngram), params, self.vocab_size)


def copied(proposals: list[int], params: SamplingParams, vocab_size: int
           ) -> tuple[list[int], np.ndarray | None]:
    """Copied tokens as proposals: when sampling, each drawn from a one-hot q, so it is
    accepted with the target's own probability of it (min(1, p/1))."""
    if params.greedy or not proposals:
        return proposals, None
    q = np.zeros((len(proposals), vocab_size))
    q[np.arange(len(proposals)), proposals] = 1.0
    return proposals, q


def lookup(seq: np.ndarray, n: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to n tokens following the most recent earlier match of seq's last k-gram, k as
    large as any match allows (at most max_ngram, and none if below min_ngram). One pass
    over the sequence finds the earlier occurrences of the last token; the longer matches
    are checked among those."""
    if n <= 0 or len(seq) < 2:
        return []
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier match would end
    if not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int64)  # of the match ending there, so far
    for j in range(1, min(max_ngram, len(seq) - 1)):
        back = ends - j
        length += (length == j) & (back >= 0) & (seq[np.maximum(back, 0)] == seq[-1 - j])
    if length.max() < min_ngram:
        return []
    end = ends[np.flatnonzero(length == length.max())[-1]]
    return seq[end + 1:end + 1 + n].tolist()


class HybridDrafter:
    """A draft head, and prompt lookup where the text repeats itself.

    Where the last `min_ngram` tokens or more occurred before (in the prompt or the
    answer), what followed them is proposed, up to `lookup_tokens`; elsewhere the head
    drafts its own chain. Answers that quote their context (summaries, RAG, code edits and
    completions) are long runs of such copies, which a head drafting one token at a time
    cannot follow (SmolLM2, greedy: a 2-gram match precedes 80-90% of the steps of its
    code, summary and RAG answers, and 2.7-2.8 of the 4 tokens it proposes are right; the
    head's one token, 30-40%). The choice reads committed tokens only, so verification
    stays lossless; the head catches up on the states of a copied run at its next chain.

    With a `controller` (spec.adaptive.HybridController) each pass drafts what its
    measured acceptance and pass costs say pays most: part of the copy, the head's chain,
    or nothing.
    """

    def __init__(self, head: HeadDrafter, lookup_tokens: int = 4, min_ngram: int = 2,
                 controller: HybridController | None = None):
        self.head = head
        self.lookup_tokens, self.min_ngram = lookup_tokens, min_ngram
        self.controller = controller

    def reset(self) -> None:
        self.head.reset()

    def propose(self, tokens, n, params, rng, stats):
        # a copy is as long as it runs and the controller picks its own γ, so both keep
        # to the positions the verify pass (and the head's cache) have left
        room = self.head.target.max_len - len(tokens)
        found = lookup(np.asarray(tokens), min(room, self.lookup_tokens), 3, self.min_ngram)
        if self.controller is not None:
            source, n = self.controller.plan(len(found))
            n = min(n, room)
        elif found:
            source, n = "copy", len(found)
        else:
            source = "head"
        if source == "copy":
            return copied(found[:n], params, self.head.vocab_size)
        if source == "head":
            return self.head.propose(tokens, n, params, rng, stats)
        return [], None

    def rollback(self, committed: int) -> None:
        self.head.rollback(committed)


class TreeDrafter:
    """A draft model growing an EAGLE-2-style tree (see spec.tree.expand).

    Tree nodes are fed to the draft's own cache after the committed tokens, one depth
    per pass, with a bias that shows each node only its ancestors. After verification
    the draft forgets all of them and re-reads the accepted ones with the next round's
    first pass (one cheap multi-token pass, no cache surgery).
    """

    def __init__(self, model: Model, top_k: int = 3, depth: int = 4, best_first: bool = False,
                 lookup_tokens: int = 0):
        """`best_first` grows SpecExec-style (for budgets of hundreds of nodes);
        `lookup_tokens` > 0 grafts that many prompt-lookup tokens as an extra branch."""
        self.model = model
        self.top_k = top_k
        self.depth = depth
        self.best_first = best_first
        self.lookup_tokens = lookup_tokens
        self.committed = 0

    def reset(self) -> None:
        self.model.cache.reset()
        self.committed = 0

    def rollback(self) -> None:
        cache = self.model.cache
        cache.trim(max(0, cache.length - self.committed))

    def propose_tree(self, tokens: list[int], budget: int, params: SamplingParams,
                     stats: GenerationStats) -> DraftTree:
        m = self.model
        temperature = 1.0 if params.greedy else params.temperature

        def ranked(ids: list[int], positions: np.ndarray | None = None,
                   bias: np.ndarray | None = None) -> Ranked:
            stats.draft_passes += 1
            return ranked_forward(m, ids, self.top_k, temperature, positions, bias)

        logprobs, ids = ranked(tokens[m.cache.length:])
        base = self.committed = len(tokens)
        slot: dict[int, int] = {}

        def step(nodes: list[int], tree: DraftTree) -> Ranked:
            past = m.cache.length
            slot.update({node: past + row for row, node in enumerate(nodes)})
            bias = tree.ancestor_bias(nodes, slot.__getitem__, base, past + len(nodes))
            positions = base - 1 + np.array([tree.depths[n] for n in nodes])
            return ranked([tree.tokens[n] for n in nodes], positions, bias)

        room = m.max_len - base  # tree nodes the draft's cache can still take
        depth = min(self.depth, room, room // self.top_k + 1)  # k nodes fed per level
        chain = (lookup(np.asarray(tokens), min(self.lookup_tokens, budget, depth), 3)
                 if self.lookup_tokens else [])
        budget -= len(chain)  # the grafted branch must fit the budget too
        root = logprobs[-1:], ids[-1:]
        if self.best_first:
            # a large budget is grown in wide batches: ~16 draft passes whatever its size
            tree = expand_best_first(root, step, max(self.top_k, budget // 16), budget, depth,
                                     room)
        else:
            tree = expand(root, step, self.top_k, depth, budget)
        tree.graft(chain)
        return tree


class HeadTreeDrafter:
    """An EAGLE head's chain with its runners-up as a token tree.

    At each depth the head's `top_k` tokens become siblings and its best one is drafted
    on, the head feeding back its own predicted state as in HeadDrafter's chains: `depth`
    head passes of one token, no tree pass of the head. The target verifies every node in
    one tree pass (decode.tree_decode), so where the head's first choice is wrong its
    second or third can still be taken (SmolLM2's head, chat and code, greedy: the
    target's next token is its first choice 34% of the time, among its first four 60%).
    The chain is fed first and the runners-up after it, so that a path along the chain
    needs no cache compaction. `lookup_tokens` > 0 grafts that many prompt-lookup tokens
    as an extra branch.
    """

    def __init__(self, head: HeadDrafter, top_k: int = 3, depth: int = 4,
                 lookup_tokens: int = 0):
        self.head = head
        self.top_k, self.depth, self.lookup_tokens = top_k, depth, lookup_tokens

    def reset(self) -> None:
        self.head.reset()

    def rollback(self) -> None:
        self.head.rollback(0)

    def propose_tree(self, tokens: list[int], budget: int, params: SamplingParams,
                     stats: GenerationStats) -> DraftTree:
        head = self.head
        temperature = 1.0 if params.greedy else params.temperature
        chain = (lookup(np.asarray(tokens), min(self.lookup_tokens, budget, self.depth), 3)
                 if self.lookup_tokens else [])
        budget -= len(chain)  # the grafted branch must fit the budget too
        tree = DraftTree()
        ids, states = head.unread(tokens)
        parent, score = -1, 0.0
        runners_up: list[tuple[int, int, float]] = []  # fed after the chain
        for depth in range(self.depth):
            k = min(self.top_k, budget - len(tree) - len(runners_up))
            if k <= 0:
                break
            stats.draft_passes += 1
            logits, predicted = head.head.forward_head(ids, states)
            if depth == 0:
                head.known = head.head.cache.length
            logprobs, best = top_logprobs(logits[-1:], k, temperature)
            ranked = [(int(head.kept[b]), parent, score + float(lp))
                      for lp, b in zip(logprobs[0], best[0], strict=True)]
            runners_up += ranked[1:]
            parent = tree.add(*ranked[0])
            score = tree.scores[parent]
            ids, states = [tree.tokens[parent]], predicted[-1:]
        for node in runners_up:
            tree.add(*node)
        tree.graft(chain)
        return tree


def ranked_forward(model: Model, ids: list[int], k: int, temperature: float,
                   positions: np.ndarray | None = None, bias: np.ndarray | None = None
                   ) -> Ranked:
    """The top-k log-probabilities after each fed token: ranked inside the graph when the
    model can (`ranked`, see runtimes.decoder.with_ranked_outputs), else from its logits."""
    if getattr(model, "ranked", False):
        return model.forward_ranked(ids, k, temperature, positions, bias)
    return top_logprobs(model.forward(ids, positions, bias), k, temperature)


class TrimmedModel:
    """A draft whose LM head covers only `kept` token ids (VocabTrim), seen by every
    drafter as a full-vocabulary model: the other ids get -inf logits, hence q = 0, and
    verification against the full-vocabulary target stays exactly as lossless."""

    def __init__(self, model: Model, kept: np.ndarray, vocab_size: int):
        self.model = model
        self.kept = np.asarray(kept, dtype=np.int64)
        self.vocab_size = vocab_size

    @property
    def cache(self) -> Cache:
        return self.model.cache

    @property
    def max_len(self) -> int:
        return self.model.max_len

    def forward(self, ids: list[int], positions: np.ndarray | None = None,
                bias: np.ndarray | None = None, last: bool = False) -> np.ndarray:
        small = self.model.forward(ids, positions, bias, last)
        full = np.full((small.shape[0], self.vocab_size), NEG_INF, dtype=np.float32)
        full[:, self.kept] = small
        return full

    ranked = True  # ranks in the small head's ids, mapped back

    def forward_ranked(self, ids: list[int], k: int, temperature: float,
                       positions: np.ndarray | None = None,
                       bias: np.ndarray | None = None) -> Ranked:
        logprobs, small = ranked_forward(self.model, ids, k, temperature, positions, bias)
        return logprobs, self.kept[small]
