"""How far a target's logits for a token depend on the pass that computes them.

Greedy speculative decoding is token-for-token equal to autoregressive decoding only if
the target's logits for a token are the same whether the token is fed alone (an AR step),
inside a chain of S tokens (a verify pass), or last in a prefill that scores its last
rows only (`forward(..., last=True)`, which draws the first token). Tree passes are
with edgespec's own attention op and not with ONNX Runtime's CPU attention, which is why
tree decoding verifies the path a tree pass picks by a chain pass on such targets
(spec.decode.tree_decode, `DecoderSession.exact_trees`). This module feeds the same tokens every
way (alone, in chains, last in a prefill, along one path of a tree) after the same prefix
and reports the largest difference per way; 0.0 is bitwise batch invariance. Tests and
tools/probe_batch_invariance.py use it on real bundles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.runtimes.decoder import DecoderSession
from edgespec.spec.tree import DraftTree


@dataclass
class Invariance:
    """max |logits(alone) - logits(in the pass)| per way of feeding, over all tokens."""

    chain: dict[int, float]  # by tokens per pass
    tree: dict[int, float]  # by nodes per pass
    prefill: dict[int, float]  # the last token of prefix + S tokens, by S

    @property
    def exact(self) -> bool:
        return all(v == 0.0 for v in (*self.chain.values(), *self.tree.values(),
                                      *self.prefill.values()))


def _after_prefix(model: DecoderSession, prefix: list[int], ids: list[int],
                  positions: np.ndarray | None = None,
                  bias: np.ndarray | None = None) -> np.ndarray:
    model.cache.reset()
    model.forward(prefix)
    return model.forward(ids, positions, bias)


def alone(model: DecoderSession, prefix: list[int], tokens: list[int]) -> np.ndarray:
    """The logits of each token fed on its own after the prefix and its predecessors."""
    model.cache.reset()
    model.forward(prefix)
    return np.concatenate([model.forward([t]) for t in tokens])


def decoy_tree(tokens: list[int], vocab: int) -> tuple[DraftTree, list[int]]:
    """A tree whose path root -> tokens[1] -> ... carries `tokens`, with a decoy sibling
    fed before every path node, so the path sits at scattered cache slots behind keys it
    must not see, as a verified branch does. Returns the tree and its path's node ids."""
    tree, parent, path = DraftTree(), -1, []
    for t in tokens[1:]:
        tree.add((t + 1) % vocab, parent, 0.0)
        parent = tree.add(t, parent, 0.0)
        path.append(parent)
    return tree, path


def measure(model: DecoderSession, prefix: list[int], tokens: list[int],
            chains: tuple[int, ...] = (5, 17), trees: tuple[int, ...] = (5, 17)) -> Invariance:
    """Feed `tokens` (at least max(chains) of them, and (max(trees)+1)/2) after `prefix`
    alone, in chain passes of each size, last in one prefill pass of the prefix and S of
    them (for each chain size S) and along one path of decoy trees of each size (root + 2
    nodes per depth), and compare with the tokens fed alone."""
    ref = alone(model, prefix, tokens)
    chain, prefill = {}, {}
    for s in chains:
        got = _after_prefix(model, prefix, tokens[:s])
        chain[s] = float(np.abs(got - ref[:s]).max())
        model.cache.reset()
        last = model.forward(prefix + tokens[:s], last=True)[-1]
        prefill[s] = float(np.abs(last - ref[s - 1]).max())
    tree = {}
    for s in trees:
        depth = (s - 1) // 2
        t, path = decoy_tree(tokens[:depth + 1], model.vocab)
        model.cache.reset()
        model.forward(prefix)
        ids, positions, bias = t.verify_inputs(tokens[0], model.cache.length)
        got = model.forward(ids, positions, bias)
        rows = [0, *(1 + n for n in path)]
        tree[len(ids)] = float(np.abs(got[rows] - ref[:depth + 1]).max())
    model.cache.reset()
    return Invariance(chain, tree, prefill)
