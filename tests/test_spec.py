"""The decoding algorithms on toy models, against exact probabilities.

Toy models are Markov chains: the logits for the next token depend on the previous
token only, through a table. With V tokens and L generated tokens we can enumerate the
exact probability of every sequence under the target and compare speculative sampling's
empirical distribution with it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgespec.spec import (
    DraftTree,
    GenerationStats,
    LookupDrafter,
    ModelDrafter,
    SamplingParams,
    TreeDrafter,
    ar_decode,
    chain_decode,
    sample,
    tree_decode,
    verify_tree,
    warp,
)
from edgespec.spec.chain import verify_chain
from edgespec.spec.drafters import lookup
from edgespec.spec.tree import top_logprobs

V = 5


class ToyCache:
    def __init__(self):
        self.length = 0

    def trim(self, n: int) -> None:
        self.length -= n

    def reset(self) -> None:
        self.length = 0

    def compact(self, start: int, slots: list[int]) -> None:
        self.moves = (start, slots)
        self.length = start + len(slots)


class MarkovModel:
    """logits(next | previous token) = table[previous]; the cache is the token list."""

    def __init__(self, table: np.ndarray, max_len: int = 64):
        self.table = table
        self.cache = ToyCache()
        self.max_len = max_len
        self.seen: list[int] = []

    def forward(self, ids: list[int], positions=None, bias=None, last=False) -> np.ndarray:
        self.seen = self.seen[:self.cache.length] + list(ids)
        self.cache.length = len(self.seen)
        assert self.cache.length <= self.max_len
        rows = self.table[np.asarray(ids)]
        return rows[-1:] if last else rows  # as little as the contract allows


def tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    target = rng.normal(scale=1.5, size=(V, V))
    draft = target + rng.normal(scale=1.0, size=(V, V))  # similar, not equal
    return target, draft


def take(gen, n: int) -> list[int]:
    out: list[int] = []
    for toks in gen:
        out += toks
        if len(out) >= n:
            return out[:n]
    return out


def exact_distribution(table: np.ndarray, start: int, length: int,
                       params: SamplingParams) -> dict[tuple, float]:
    probs = warp(table, params)
    dist = {}
    for seq in itertools.product(range(V), repeat=length):
        p, prev = 1.0, start
        for t in seq:
            p *= probs[prev, t]
            prev = t
        dist[seq] = p
    return dist


def assert_matches(samples: list[tuple], dist: dict[tuple, float]) -> None:
    """Chi-square goodness of fit on outcomes with an expected count >= 5 (the rest
    pooled). A correct sampler fails it with probability 1e-3 (the false-alarm rate)."""
    from scipy.stats import chisquare

    n = len(samples)
    total = sum(float(v) for v in dist.values())  # 1 up to float32 rounding (warp's)
    dist = {k: float(v) / total for k, v in dist.items()}
    counts = {k: 0 for k in dist}
    for s in samples:
        counts[s] += 1
    keys = [k for k in dist if dist[k] * n >= 5]
    observed = np.array([counts[k] for k in keys] + [n - sum(counts[k] for k in keys)])
    expected = np.array([dist[k] * n for k in keys] + [n - sum(dist[k] * n for k in keys)])
    keep = expected > 0
    assert chisquare(observed[keep], expected[keep]).pvalue > 1e-3


PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8)]


@pytest.mark.parametrize("params", PARAMS)
def test_verify_chain_first_token_is_target_distributed(params):
    """One step in isolation: the emitted token after a γ=1 chain follows p exactly."""
    rng = np.random.default_rng(0)
    p_logits = np.array([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0] * 5])
    q = warp(np.array([[0.0, 2.0, 0.5, 1.0, -1.0]]), params)
    out = []
    for _ in range(20000):
        d = int(rng.choice(V, p=q[0]))
        n, nxt = verify_chain(p_logits, [d], q, params, rng)
        out.append((d if n == 1 else nxt,))
    p = warp(p_logits[0], params)
    assert_matches(out, {(i,): p[i] for i in range(V)})


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("gamma", [1, 3])
def test_chain_sampling_preserves_sequence_distribution(params, gamma):
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(gamma)
    samples = []
    for _ in range(6000):
        drafter = ModelDrafter(MarkovModel(draft_table))
        gen = chain_decode(MarkovModel(target_table), drafter, [2], params, gamma, rng,
                           GenerationStats("spec"))
        samples.append(tuple(take(gen, 3)))
    assert_matches(samples, exact_distribution(target_table, 2, 3, params))


def ar_samples(table: np.ndarray, start: int, params: SamplingParams) -> list[tuple]:
    rng = np.random.default_rng(0)
    return [tuple(take(ar_decode(MarkovModel(table), [start], params, rng,
                                 GenerationStats("ar")), 3)) for _ in range(6000)]


def test_ar_sampling_matches_exact_distribution():
    """The baseline itself, with the same oracle (so the oracle is checked too)."""
    target_table, _ = tables(2)
    params = SamplingParams(1.0)
    assert_matches(ar_samples(target_table, 0, params),
                   exact_distribution(target_table, 0, 3, params))


def test_oracle_detects_a_wrong_distribution():
    """Sampling from the *draft* must fail the same test: the check has teeth."""
    target_table, draft_table = tables(1)
    params = SamplingParams(1.0)
    with pytest.raises(AssertionError):
        assert_matches(ar_samples(draft_table, 2, params),
                       exact_distribution(target_table, 2, 3, params))


def greedy_ar(table: np.ndarray, prompt: list[int], n: int = 40) -> list[int]:
    return take(ar_decode(MarkovModel(table, 200), prompt, SamplingParams(0.0),
                          np.random.default_rng(0), GenerationStats("ar")), n)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_greedy_chain_equals_greedy_ar(seed, gamma):
    target_table, draft_table = tables(seed)
    params = SamplingParams(0.0)
    rng = np.random.default_rng(0)
    ar = greedy_ar(target_table, [1])
    stats = GenerationStats("spec")
    drafter = ModelDrafter(MarkovModel(draft_table, 200))
    spec = take(chain_decode(MarkovModel(target_table, 200), drafter, [1], params, gamma, rng,
                             stats), 40)
    assert spec == ar
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted


def test_identical_draft_accepts_everything():
    table, _ = tables(3)
    stats = GenerationStats("spec")
    take(chain_decode(MarkovModel(table, 200), ModelDrafter(MarkovModel(table, 200)), [0],
                      SamplingParams(0.9), 4, np.random.default_rng(0), stats), 50)
    assert stats.accepted == stats.drafted
    assert stats.target_passes <= 1 + 50 / 5 + 1


def test_chain_respects_context_limit():
    table, draft_table = tables(4)
    target = MarkovModel(table, max_len=12)
    drafter = ModelDrafter(MarkovModel(draft_table, 12))
    out = take(chain_decode(target, drafter, [0, 1, 2], SamplingParams(), 4,
                            np.random.default_rng(0), GenerationStats("spec")), 9)
    assert len(out) == 9  # 3 prompt + 9 = 12 positions, never more (forward asserts)


@pytest.mark.parametrize("kind", ["chain", "tree", "exact tree"])
@pytest.mark.parametrize("limit", [1, 2, 5, 9])
def test_no_pass_verifies_drafts_past_the_tokens_wanted(kind, limit):
    """With `limit` tokens wanted, the target's cache never holds more than the prompt and
    limit - 1 of them (the last is never fed), though the draft (the target's own table
    here) would have every draft accepted, and exactly `limit` tokens come out."""
    table, _ = tables(13)
    target = {"chain": MarkovModel, "tree": lambda t: TreeRowsDiffer(t, t),
              "exact tree": ExactTrees}[kind](table)
    high = []
    forward = target.forward

    def watched(*args, **kwargs):
        rows = forward(*args, **kwargs)
        high.append(target.cache.length)
        return rows

    target.forward = watched
    prompt, rng, stats = [1, 2], np.random.default_rng(0), GenerationStats("spec")
    if kind == "chain":
        steps = chain_decode(target, ModelDrafter(MarkovModel(table)), prompt,
                             SamplingParams(0.0), 6, rng, stats, limit=limit)
    else:
        steps = tree_decode(target, TreeDrafter(MarkovModel(table), top_k=2, depth=4),
                            prompt, SamplingParams(0.0), 8, rng, stats, limit=limit)
    assert len(take(steps, limit)) == limit
    assert max(high) <= len(prompt) + limit - 1


def spec_samples(kind: str, target_table: np.ndarray, draft_table: np.ndarray,
                 params: SamplingParams, rng: np.random.Generator,
                 limit: int | None = None) -> list[tuple]:
    """6,000 runs of 3 tokens after [2]: chains of 3, or trees of 2 x 3 (budget 6), their
    tree rows the chain rows ("exact-tree") or not."""
    samples = []
    for _ in range(6000):
        stats, draft = GenerationStats("spec"), MarkovModel(draft_table, 200)
        if kind == "chain":
            steps = chain_decode(MarkovModel(target_table, 200), ModelDrafter(draft), [2],
                                 params, 3, rng, stats, limit=limit)
        else:
            target = (ExactTrees if kind == "exact-tree" else MarkovModel)(target_table, 200)
            steps = tree_decode(target, TreeDrafter(draft, top_k=2, depth=3), [2], params, 6,
                                rng, stats, limit=limit)
        samples.append(tuple(take(steps, 3)))
    return samples


@pytest.mark.parametrize("kind", ["chain", "tree", "exact-tree"])
def test_sampling_with_a_limit_preserves_sequence_distribution(kind):
    """Drafts cut to the tokens wanted (`limit`: chains of 3 and trees of depth 3 cut to
    the 2 drafts that 3 wanted tokens leave room for) still sample the target's sequences."""
    target_table, draft_table = tables(8)
    params = SamplingParams(1.0)
    samples = spec_samples(kind, target_table, draft_table, params, np.random.default_rng(9),
                           limit=3)
    assert_matches(samples, exact_distribution(target_table, 2, 3, params))


def test_warp_top_k_and_top_p():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_k=2)),
                               [2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_p=0.7)),
                               [2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_p=0.1)), [1, 0, 0, 0],
                               rtol=1e-6)
    hot = warp(logits, SamplingParams(0.5))  # float32: rtol 1e-6
    np.testing.assert_allclose(hot, np.array([0.25, 0.0625, 0.0225, 0.01]) / 0.345, rtol=1e-6)


def test_lookup_finds_latest_longest_match():
    seq = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(seq, 3, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert lookup(np.array([4, 1, 2, 4]), 5, 3) == [1, 2, 4]
    assert lookup(np.array([1, 2, 3]), 4, 3) == []
    assert lookup(np.array([5, 6, 5, 6]), 0, 3) == []


@pytest.mark.parametrize("params", PARAMS)
def test_lookup_sampling_preserves_sequence_distribution(params):
    """A deterministic drafter (one-hot q) verified with the standard rule stays exact;
    a repetitive prompt makes lookup propose often."""
    target_table, _ = tables(5)
    rng = np.random.default_rng(11)
    samples = []
    drafted = 0
    for _ in range(6000):
        stats = GenerationStats("lookup")
        gen = chain_decode(MarkovModel(target_table), LookupDrafter(V), [0, 1, 2, 0, 1, 2, 0],
                           params, 3, rng, stats)
        samples.append(tuple(take(gen, 3)))
        drafted += stats.drafted
    assert drafted > 6000
    assert_matches(samples, exact_distribution(target_table, 0, 3, params))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_lookup_equals_greedy_ar(seed):
    target_table, _ = tables(seed)
    params = SamplingParams(0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    rng = np.random.default_rng(0)
    ar = greedy_ar(target_table, prompt)
    stats = GenerationStats("lookup")
    spec = take(chain_decode(MarkovModel(target_table, 200), LookupDrafter(V), prompt, params,
                             4, rng, stats), 40)
    assert spec == ar
    assert stats.accepted > 0  # greedy Markov chains cycle, so lookup hits


def test_lookup_takes_the_latest_longest_match():
    """Against a brute-force reading of the rule, on random short sequences."""

    def reference(seq: list[int], n: int, max_ngram: int) -> list[int]:
        for k in range(min(max_ngram, len(seq) - 1), 0, -1):
            starts = [i for i in range(len(seq) - k) if seq[i:i + k] == seq[-k:]]
            if starts:
                return seq[starts[-1] + k:starts[-1] + k + n]
        return []

    rng = np.random.default_rng(1)
    for _ in range(3000):
        seq = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 30))).tolist()
        for max_ngram, n in [(1, 3), (3, 4), (4, 1)]:
            assert lookup(np.array(seq), n, max_ngram) == reference(seq, n, max_ngram)
        # a floor on the match: nothing unless the last 2 tokens occurred before
        seen = any(seq[i:i + 2] == seq[-2:] for i in range(len(seq) - 2))
        assert lookup(np.array(seq), 4, 3, 2) == (reference(seq, 4, 3) if seen else [])


def test_tree_inputs_show_each_node_only_its_ancestors():
    tree = DraftTree()
    a = tree.add(10, -1, -0.1)
    b = tree.add(11, a, -0.5)
    tree.add(12, a, -0.7)
    tree.add(13, b, -0.9)
    ids, positions, bias = tree.verify_inputs(root=9, past=3)
    assert ids == [9, 10, 11, 12, 13]
    assert positions.tolist() == [3, 4, 5, 5, 6]
    visible = (bias[0, 0] == 0).astype(int)
    assert visible.tolist() == [[1, 1, 1, 1, 0, 0, 0, 0],   # root
                                [1, 1, 1, 1, 1, 0, 0, 0],   # a
                                [1, 1, 1, 1, 1, 1, 0, 0],   # b
                                [1, 1, 1, 1, 1, 0, 1, 0],   # c: not b
                                [1, 1, 1, 1, 1, 1, 0, 1]]   # d: a, b
    assert tree.prune(2).tokens == [10, 11]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_logprobs_are_the_best_log_softmax_entries(temperature):
    logits = np.random.default_rng(3).normal(0, 4, (4, 50)).astype(np.float32)
    z = logits.astype(np.float64) / temperature
    reference = z - z.max(1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(1, keepdims=True))
    logprobs, ids = top_logprobs(logits, 6, temperature)
    assert ids.tolist() == np.argsort(-reference, axis=1)[:, :6].tolist()
    np.testing.assert_allclose(logprobs, np.take_along_axis(reference, ids, 1), atol=1e-5)
    assert top_logprobs(logits, 99)[1].shape == (4, 50)  # k beyond the vocabulary: all


def test_verify_tree_follows_matching_children():
    tree = DraftTree()
    a = tree.add(1, -1, 0.0)
    tree.add(2, -1, 0.0)
    c = tree.add(3, a, 0.0)
    logits = np.full((4, V), -5.0)
    logits[0, 1] = logits[1, 3] = logits[3, 4] = 5.0  # root->1, a->3, c->4 (no child)
    path, nxt = verify_tree(logits, tree, SamplingParams(), np.random.default_rng(0))
    assert path == [a, c] and nxt == 4


def tree_run(table, draft_table, prompt, params, rng, n, budget=6, stats=None):
    target = MarkovModel(table, 200)
    drafter = TreeDrafter(MarkovModel(draft_table, 200), top_k=2, depth=3)
    return take(tree_decode(target, drafter, prompt, params, budget, rng,
                            stats or GenerationStats("spec")), n)


@pytest.mark.parametrize("seed", range(5))
def test_greedy_tree_equals_greedy_ar(seed):
    target_table, draft_table = tables(seed)
    params = SamplingParams(0.0)
    rng = np.random.default_rng(0)
    ar = greedy_ar(target_table, [1])
    stats = GenerationStats("spec")
    assert tree_run(target_table, draft_table, [1], params, rng, 40, stats=stats) == ar
    assert stats.accepted > 0 and stats.target_passes < 40


class TreeRowsDiffer(MarkovModel):
    """A target whose tree passes (fed with an attention bias) return other logits than
    its chain passes: ONNX Runtime's tree rows are not bitwise its chain rows, here the
    difference is made large enough to change tokens."""

    def __init__(self, table: np.ndarray, tree_table: np.ndarray, max_len: int = 200):
        super().__init__(table, max_len)
        self.tree_table = tree_table

    def forward(self, ids: list[int], positions=None, bias=None, last=False) -> np.ndarray:
        rows = super().forward(ids, positions, bias, last)
        return rows if bias is None else self.tree_table[np.asarray(ids)]


class ExactTrees(MarkovModel):
    """A target whose tree rows are its chain rows (edgespec's own attention): tree
    decoding decides from the tree pass and compacts the cache."""

    exact_trees = True


@pytest.mark.parametrize("seed", range(3))
def test_exact_trees_take_one_pass_a_step_and_equal_greedy_ar(seed):
    target_table, draft_table = tables(seed)
    stats = GenerationStats("spec")
    target = ExactTrees(target_table, 200)
    drafter = TreeDrafter(MarkovModel(draft_table, 200), top_k=2, depth=3)
    out, steps = [], 0
    for new in tree_decode(target, drafter, [1], SamplingParams(0.0), 6,
                           np.random.default_rng(0), stats):
        out += new
        steps += 1
        # the committed tokens but the last are cached, the path moved after the root
        assert target.cache.length == len(out)
        if len(out) >= 40:
            break
    assert out[:40] == greedy_ar(target_table, [1])
    assert stats.target_passes == steps  # the prefill, then one tree pass a step
    assert stats.accepted > 0 and steps < 40
    start, slots = target.cache.moves
    assert slots == sorted(slots) and all(s >= start for s in slots)


def test_exact_tree_sampling_preserves_sequence_distribution():
    target_table, draft_table = tables(7)
    params = SamplingParams(0.9)
    rng = np.random.default_rng(4)
    samples = []
    for _ in range(6000):
        drafter = TreeDrafter(MarkovModel(draft_table, 200), top_k=2, depth=3)
        samples.append(tuple(take(tree_decode(ExactTrees(target_table, 200), drafter, [2],
                                              params, 6, rng, GenerationStats("spec")), 3)))
    assert_matches(samples, exact_distribution(target_table, 2, 3, params))


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)])
def test_tree_rows_never_decide_a_token(params):
    """Only chain rows decide: greedy trees equal AR of the chain rows and sampled trees
    have their distribution, however wrong the tree pass's rows are."""
    target_table, draft_table = tables(11)
    liar = np.random.default_rng(12).normal(scale=1.5, size=(V, V))
    assert (liar.argmax(1) != target_table.argmax(1)).any()
    rng = np.random.default_rng(5)

    def run(prompt, n):
        drafter = TreeDrafter(MarkovModel(draft_table, 200), top_k=2, depth=3)
        return take(tree_decode(TreeRowsDiffer(target_table, liar), drafter, prompt, params,
                                6, rng, GenerationStats("spec")), n)
    if params.greedy:
        assert run([1], 40) == greedy_ar(target_table, [1])
    else:
        samples = [tuple(run([2], 3)) for _ in range(6000)]
        assert_matches(samples, exact_distribution(target_table, 2, 3, params))


@pytest.mark.parametrize("params", PARAMS)
def test_tree_sampling_preserves_sequence_distribution(params):
    target_table, draft_table = tables(6)
    rng = np.random.default_rng(3)
    samples = [tuple(tree_run(target_table, draft_table, [2], params, rng, 3))
               for _ in range(6000)]
    assert_matches(samples, exact_distribution(target_table, 2, 3, params))


def test_stop_rules():
    from edgespec.spec.adaptive import should_stop

    sure, unsure = np.array([0.9, 0.05, 0.05]), np.array([0.35, 0.33, 0.32])
    assert not should_stop(sure, "confidence") and should_stop(unsure, "confidence")
    assert not should_stop(sure, "entropy") and should_stop(unsure, "entropy")  # H=1.1 nats
    assert not should_stop(unsure, "none")


def test_gamma_controller_follows_acceptance_and_costs():
    from edgespec.spec.adaptive import GammaController

    good = GammaController(max_gamma=8)
    bad = GammaController(max_gamma=8)
    for _ in range(20):
        # verify costs 10 ms whatever S; a draft pass 1 ms
        good.update(drafted=4, accepted=4, draft_s=0.004, verify_s=0.010)
        bad.update(drafted=4, accepted=0, draft_s=0.004, verify_s=0.010)
    assert good.alpha > 0.9 and bad.alpha < 0.1
    assert good.gamma() == bad.gamma() == 0  # a plain step's cost is not known yet
    for c in (good, bad):
        c.update(drafted=0, accepted=0, draft_s=0.0, verify_s=0.009)
    # good: 8 tokens for 18 ms beats 1 for 9 ms; bad: ~1 token for 11 ms does not
    assert good.gamma() == 8
    chosen = []
    for _ in range(2 * bad.probe_every + 2):
        chosen.append(bad.gamma())
        bad.update(chosen[-1], 0, 0.001 * chosen[-1], 0.009 + 0.001 * chosen[-1])
    probes = [i for i, g in enumerate(chosen) if g]
    assert probes == [bad.probe_every - 1, 2 * bad.probe_every] and chosen[probes[0]] == 1


def test_hybrid_controller_drafts_what_pays():
    """Copies where they are accepted and passes cost little more per row; plain steps
    where a sampled copy is rejected at once and each extra row costs 40% of a step
    (long context); the head where it is accepted; and a probe of a source passed over
    `probe_every` times."""
    from edgespec.spec.adaptive import HybridController

    def run(c: HybridController, found: int, accepted: int, per_row: float,
            head_s: float = 0.001) -> tuple[str, int]:
        source, n = c.plan(found)
        c.update(n, min(n, accepted), head_s * n if source == "head" else 0.0,
                 0.010 * (1 + per_row * n))
        return source, n

    cheap, long, head = HybridController(4), HybridController(4), HybridController(4)
    for _ in range(20):
        run(cheap, 4, 4, 0.02)
        run(long, 4, 0, 0.4)
        run(head, 0, 1, 0.02)
    assert cheap.plan(4) == ("copy", 4) and head.plan(0) == ("head", 1)
    assert cheap.expected("copy", 4) > 4.5 and long.accept["copy"][0] < 0.5
    chosen = [run(long, 4, 0, 0.4) for _ in range(2 * long.probe_every)]
    for source in ("copy", "head"):  # each probed once per probe_every passes over it
        probes = [i for i, (s, _) in enumerate(chosen) if s == source]
        assert len(probes) == 2 and probes[1] - probes[0] == long.probe_every
    assert sum(s == "plain" for s, _ in chosen) == len(chosen) - 4


@pytest.mark.parametrize("kwargs", [{"stop_rule": "confidence"}, {"stop_rule": "entropy"},
                                    {"adaptive": True}])
def test_adaptive_chains_stay_lossless(kwargs):
    from edgespec.spec.adaptive import GammaController

    target_table, draft_table = tables(7)
    params = SamplingParams(1.0)
    rng = np.random.default_rng(5)
    samples = []
    for _ in range(6000):
        drafter = ModelDrafter(MarkovModel(draft_table), kwargs.get("stop_rule", "none"))
        controller = GammaController(4) if kwargs.get("adaptive") else None
        gen = chain_decode(MarkovModel(target_table), drafter, [3], params, 4, rng,
                           GenerationStats("spec"), controller)
        samples.append(tuple(take(gen, 3)))
    assert_matches(samples, exact_distribution(target_table, 3, 3, params))


def test_graft_shares_existing_nodes():
    tree = DraftTree()
    a = tree.add(1, -1, -0.1)
    tree.add(2, a, -0.2)
    tree.graft([1, 2, 3])
    tree.graft([4])
    assert tree.tokens == [1, 2, 3, 4] and tree.parents == [-1, 0, 1, -1]


@pytest.mark.parametrize("best_first,lookup_tokens", [(True, 0), (False, 3)])
def test_tree_variants_stay_lossless(best_first, lookup_tokens):
    target_table, draft_table = tables(8)
    params = SamplingParams(0.8)
    rng = np.random.default_rng(9)
    samples = []
    for _ in range(6000):
        drafter = TreeDrafter(MarkovModel(draft_table, 200), top_k=2, depth=3,
                              best_first=best_first, lookup_tokens=lookup_tokens)
        gen = tree_decode(MarkovModel(target_table, 200), drafter, [1, 2, 1], params, 8, rng,
                          GenerationStats("spec"))
        samples.append(tuple(take(gen, 3)))
    assert_matches(samples, exact_distribution(target_table, 1, 3, params))


def accept_all_chain(target_logits, draft_tokens, draft_probs, params, rng):
    """A broken verifier: keeps every drafted token and samples the bonus from p."""
    return len(draft_tokens), sample(target_logits[len(draft_tokens)], params, rng)


def accept_all_tree(target_logits, tree, params, rng):
    """A broken tree verifier: follows the first child at every node."""
    path, node = [], -1
    while (children := [i for i, p in enumerate(tree.parents) if p == node]):
        node = children[0]
        path.append(node)
    return path, sample(target_logits[node + 1], params, rng)


@pytest.mark.parametrize("kind", ["chain", "tree", "exact-tree", "greedy"])
def test_a_wrong_verifier_fails_the_losslessness_tests(monkeypatch, kind):
    """The statistical and greedy checks above must be able to fail: with a verifier
    that accepts everything, they do."""
    import edgespec.spec.decode as decode

    monkeypatch.setattr(decode, "verify_chain", accept_all_chain)
    monkeypatch.setattr(decode, "verify_tree", accept_all_tree)
    target_table, draft_table = tables(1)
    if kind == "greedy":
        with pytest.raises(AssertionError):
            test_greedy_chain_equals_greedy_ar(1, 4)
        return
    params = SamplingParams(1.0)
    samples = spec_samples(kind, target_table, draft_table, params, np.random.default_rng(4))
    with pytest.raises(AssertionError):
        assert_matches(samples, exact_distribution(target_table, 2, 3, params))


@pytest.mark.parametrize("best_first", [False, True])
def test_trees_fit_the_drafts_cache_near_the_context_end(best_first):
    """The draft's cache takes k nodes per level: near the end of the context the tree
    must shrink instead of overflowing it (MarkovModel.forward asserts the bound)."""
    target_table, draft_table = tables(3)
    for prompt_len in range(20, 31):
        drafter = TreeDrafter(MarkovModel(draft_table, 32), top_k=4, depth=6,
                              best_first=best_first)
        out = take(tree_decode(MarkovModel(target_table, 32), drafter, [1] * prompt_len,
                               SamplingParams(), 24, np.random.default_rng(0),
                               GenerationStats("spec")), 32 - prompt_len)
        assert len(out) == 32 - prompt_len
