"""EAGLE draft heads: the drafter's algorithm on toy models (exact distributions), the
exported head graph against its PyTorch definition, and heads in real bundles."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.spec import GenerationStats, HeadDrafter, SamplingParams, ar_decode, chain_decode
from tests.test_spec import (
    PARAMS,
    V,
    MarkovModel,
    ToyCache,
    accept_all_chain,
    assert_matches,
    exact_distribution,
    tables,
    take,
)


class FeatureMarkov(MarkovModel):
    """A Markov target whose state after token j is one-hot(t_j)."""

    @property
    def features(self) -> np.ndarray:
        return np.eye(V, dtype=np.float32)[self.seen]


class ToyHead:
    """Reads (state after t_j, t_{j+1}), scores t_{j+2} by a draft table over `kept`,
    and returns one-hot(t_{j+1}) as its guess at the next state. It checks that every
    state it is handed belongs to the token before the one it comes with: the drafter's
    alignment of target states, its own states and tokens."""

    def __init__(self, table: np.ndarray, kept: np.ndarray):
        self.table, self.kept = table, kept
        self.cache = ToyCache()
        self.tokens: list[int] = []  # t_{j+1} at head position j

    def forward_head(self, ids, hidden):
        past = self.cache.length
        self.tokens = self.tokens[:past] + list(ids)
        for row, state in enumerate(hidden):
            j = past + row
            if j > 0:
                assert int(np.argmax(state)) == self.tokens[j - 1]
        self.cache.length += len(ids)
        return self.table[np.asarray(ids)][:, self.kept], np.eye(V, dtype=np.float32)[ids]


KEPT = np.array([0, 1, 3, 4])  # token 2 cannot be drafted (VocabTrim)


def head_run(target_table, draft_table, params, gamma, rng, kept=KEPT):
    target = FeatureMarkov(target_table, 200)
    drafter = HeadDrafter(ToyHead(draft_table, kept), target, kept, V)
    return chain_decode(target, drafter, [2, 0], params, gamma, rng, GenerationStats("spec"))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_head_chain_equals_greedy_ar(seed, gamma):
    target_table, draft_table = tables(seed)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(0.0)
    ar = take(ar_decode(MarkovModel(target_table), [2, 0], greedy, rng, GenerationStats("ar")),
              30)
    assert take(head_run(target_table, draft_table, greedy, gamma, rng), 30) == ar


def test_a_perfect_head_is_always_accepted():
    target_table, _ = tables(3)
    stats = GenerationStats("spec")
    target = FeatureMarkov(target_table, 200)
    kept = np.arange(V)
    drafter = HeadDrafter(ToyHead(target_table, kept), target, kept, V)
    take(chain_decode(target, drafter, [2, 0], SamplingParams(0.0), 4,
                      np.random.default_rng(0), stats), 20)
    assert stats.accepted == stats.drafted > 0


@pytest.mark.parametrize("params", PARAMS)
def test_head_sampling_preserves_sequence_distribution(params):
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(7)
    samples = [tuple(take(head_run(target_table, draft_table, params, 3, rng), 3))
               for _ in range(6000)]
    assert_matches(samples, exact_distribution(target_table, 0, 3, params))


def test_a_wrong_verifier_fails_the_head_distribution_test(monkeypatch):
    import edgespec.spec.decode as decode

    monkeypatch.setattr(decode, "verify_chain", accept_all_chain)
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(7)
    samples = [tuple(take(head_run(target_table, draft_table, SamplingParams(1.0), 3, rng), 3))
               for _ in range(6000)]
    with pytest.raises(AssertionError):
        assert_matches(samples, exact_distribution(target_table, 0, 3, SamplingParams(1.0)))
