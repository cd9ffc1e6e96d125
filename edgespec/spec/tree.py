"""Token trees: draft many continuations, verify all of them in one target pass.

Tree (EAGLE-2 style, deterministic): from the root (the last committed token) take the
draft's top-k tokens; at each depth expand the k frontier nodes with the highest
cumulative draft log-probability, each by its own top-k; finally keep the `budget`
nodes with the highest cumulative log-probability. A child never scores above its
parent, so the kept set is closed under ancestors.

Verification (sample-and-match, exact for any tree built without looking at the
target): at the root, draw x from the target's (warped) distribution — argmax when
greedy — and descend into the child whose token is x; repeat from there; the first x
that has no matching child is emitted and ends the pass. Every emitted token is drawn
from the target at its true context, so greedy output equals AR's and sampled output has
the target's distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from edgespec.spec.sampling import SamplingParams, sample

NEG_INF = np.finfo(np.float32).min

# A draft pass's proposals per fed token: log-probabilities [S, k], best first, and ids.
Ranked = tuple[np.ndarray, np.ndarray]


def top_logprobs(logits: np.ndarray, k: int, temperature: float = 1.0) -> Ranked:
    """Each row's k most likely tokens and their log-probabilities under
    softmax(logits / temperature), best first: what a tree scores nodes by. A draft
    graph computes the same in ONNX Runtime (runtimes.decoder.with_ranked_outputs); this
    is the reference and the path for models without it."""
    with np.errstate(over="ignore"):  # a trimmed head's NEG_INF / T < 1: -inf, as meant
        z = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    k = min(k, z.shape[1])
    best = np.argpartition(z, -k, axis=1)[:, -k:]
    top = np.take_along_axis(z, best, axis=1)
    order = np.argsort(-top, axis=1, kind="stable")
    best, top = np.take_along_axis(best, order, axis=1), np.take_along_axis(top, order, axis=1)
    norm = top[:, :1] + np.log(np.exp(z - top[:, :1]).sum(axis=1, keepdims=True))
    return top - norm, best


@dataclass
class DraftTree:
    """Nodes in the order they will be fed (every parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: child of the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    lineage: list[tuple[int, ...]] = field(default_factory=list)  # see ancestors()

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.lineage.append((len(self.tokens) - 1, *(self.lineage[parent] if parent >= 0
                                                     else ())))
        return len(self.tokens) - 1

    def ancestors(self, node: int) -> tuple[int, ...]:
        """The node and its ancestors (root excluded), nearest first."""
        return self.lineage[node] if node >= 0 else ()

    def graft(self, chain: list[int]) -> None:
        """Add a chain of tokens below the root, sharing nodes where they already exist
        (prompt-lookup proposals as an extra branch of a model's tree)."""
        parent = -1
        for token in chain:
            child = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents,
                                                          strict=True))
                          if t == token and p == parent), None)
            parent = child if child is not None else self.add(token, parent, float("-inf"))

    def prune(self, budget: int) -> DraftTree:
        """The `budget` best nodes, re-indexed so parents still come first."""
        keep = sorted(sorted(range(len(self)), key=lambda i: (-self.scores[i],
                                                             self.depths[i]))[:budget])
        index = {old: new for new, old in enumerate(keep)}
        parents = [self.parents[old] for old in keep]
        assert all(p < 0 or p in index for p in parents), "pruning must keep ancestors"
        return DraftTree([self.tokens[old] for old in keep], [index.get(p, -1) for p in parents],
                         [self.depths[old] for old in keep], [self.scores[old] for old in keep],
                         [tuple(index[a] for a in self.lineage[old]) for old in keep])

    def ancestor_bias(self, rows: Iterable[int], slot: Callable[[int], int], visible: int,
                      total: int) -> np.ndarray:
        """Bias [1, 1, len(rows), total]: each row sees keys [0, visible) and the cache
        slots of its node's ancestors (the node itself included), nothing else."""
        rows = list(rows)
        bias = np.full((1, 1, len(rows), total), NEG_INF, dtype=np.float32)
        bias[0, 0, :, :visible] = 0.0
        seen = [(row, slot(a)) for row, node in enumerate(rows) for a in self.ancestors(node)]
        if seen:  # one scatter for all rows: this runs for every draft pass of a tree
            rr, cc = zip(*seen, strict=True)
            bias[0, 0, list(rr), list(cc)] = 0.0
        return bias

    def verify_inputs(self, root: int, past: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """ids, positions and bias for one pass over [root, *nodes] after `past` tokens."""
        s = len(self) + 1
        # row 0 is the root (no ancestors); the prefix and the root are seen by all
        bias = self.ancestor_bias(range(-1, len(self)), lambda a: past + 1 + a, past + 1,
                                  past + s)
        positions = past + np.array([0, *self.depths], dtype=np.int64)
        return [root, *self.tokens], positions, bias


def expand(root: Ranked, step: Callable[[list[int], DraftTree], Ranked], top_k: int,
           depth: int, budget: int) -> DraftTree:
    """Grow a tree from the draft's ranked proposals at the root (one row).

    `step(nodes, tree)` runs the draft on `nodes` (already in `tree`) and returns their
    ranked proposals, one row each. Scores are cumulative log-probabilities of the warped
    draft distribution, so sampling with a temperature grows the tree the target is
    likely to follow at that temperature.
    """
    tree = DraftTree()
    if budget <= 0 or depth <= 0:
        return tree
    frontier = _children(tree, [-1], root)
    for _ in range(depth - 1):
        candidates = _children(tree, frontier, step(frontier, tree))
        frontier = sorted(candidates, key=lambda i: -tree.scores[i])[:top_k]
    return tree.prune(budget)


def expand_best_first(root: Ranked, step: Callable[[list[int], DraftTree], Ranked],
                      batch: int, budget: int, max_depth: int,
                      max_fed: int | None = None) -> DraftTree:
    """SpecExec-style growth for large budgets (hundreds of nodes, when a target pass is
    expensive): repeatedly expand the `batch` best not-yet-expanded nodes, wherever they
    are, until the tree holds `budget` nodes worth keeping (or the draft has been fed
    `max_fed` nodes, all its cache can hold)."""
    tree = DraftTree()
    if budget <= 0 or max_depth <= 0:
        return tree
    open_nodes = _children(tree, [-1], root)
    fed = 0
    while open_nodes:
        if max_fed is not None:
            batch = min(batch, max_fed - fed)
            if batch <= 0:
                break
        best = sorted(open_nodes, key=lambda i: -tree.scores[i])[:batch]
        cutoff = sorted(tree.scores, reverse=True)[min(budget, len(tree)) - 1]
        best = [n for n in best if tree.scores[n] >= cutoff and tree.depths[n] < max_depth]
        if not best:
            break
        open_nodes = [n for n in open_nodes if n not in best]
        fed += len(best)
        open_nodes += _children(tree, best, step(best, tree))
    return tree.prune(budget)


def _children(tree: DraftTree, parents: list[int], ranked: Ranked) -> list[int]:
    """Add each parent's proposals (row i belongs to parents[i]) as its children,
    scored by the parent's score plus their log-probability."""
    logprobs, ids = ranked
    base = [tree.scores[p] if p >= 0 else 0.0 for p in parents]
    return [tree.add(t, parent, score + lp)
            for parent, score, tokens, lps in zip(parents, base, ids.tolist(),
                                                  logprobs.tolist(), strict=True)
            for t, lp in zip(tokens, lps, strict=True)]


def verify_tree(target_logits: np.ndarray, tree: DraftTree, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], int]:
    """Return (accepted node indices, root to leaf; the token emitted after them).

    target_logits: [1 + len(tree), V], row 0 for the root, row i + 1 for node i.
    """
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(tree.parents):
        children.setdefault(parent, {})[tree.tokens[node]] = node
    path: list[int] = []
    node = -1
    while True:
        x = sample(target_logits[node + 1], params, rng)
        child = children.get(node, {}).get(x)
        if child is None:
            return path, x
        path.append(child)
        node = child
