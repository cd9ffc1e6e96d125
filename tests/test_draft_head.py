"""EAGLE draft heads: the drafter's algorithm on toy models (exact distributions), the
exported head graph against its PyTorch definition, and heads in real bundles."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgespec.spec import (
    GenerationStats,
    HeadDrafter,
    HeadTreeDrafter,
    HybridDrafter,
    SamplingParams,
    ar_decode,
    chain_decode,
    tree_decode,
)
from edgespec.spec.adaptive import HybridController
from tests.test_spec import (
    PARAMS,
    MarkovModel,
    ToyCache,
    V,
    accept_all_chain,
    accept_all_tree,
    assert_matches,
    exact_distribution,
    greedy_ar,
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

    def __init__(self, table: np.ndarray, kept: np.ndarray, max_len: int = 1 << 20):
        self.table, self.kept = table, kept
        self.cache = ToyCache()
        self.max_len = max_len  # as an exported head's, its target's context
        self.tokens: list[int] = []  # t_{j+1} at head position j

    def forward_head(self, ids, hidden):
        past = self.cache.length
        self.tokens = self.tokens[:past] + list(ids)
        for row, state in enumerate(hidden):
            j = past + row
            if j > 0:
                assert int(np.argmax(state)) == self.tokens[j - 1]
        self.cache.length += len(ids)
        assert self.cache.length <= self.max_len
        return self.table[np.asarray(ids)][:, self.kept], np.eye(V, dtype=np.float32)[ids]


KEPT = np.array([0, 1, 3, 4])  # token 2 cannot be drafted (VocabTrim)


def head_run(target_table, draft_table, params, gamma, rng, kept=KEPT, stop=("none", 0.4),
             stats=None, window=256, proposal_scale=1.0):
    target = FeatureMarkov(target_table, 200)
    drafter = HeadDrafter(ToyHead(draft_table, kept), target, kept, V, *stop, window=window,
                          proposal_scale=proposal_scale)
    return chain_decode(target, drafter, [2, 0], params, gamma, rng,
                        stats or GenerationStats("spec"))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_head_chain_equals_greedy_ar(seed, gamma):
    target_table, draft_table = tables(seed)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(0.0)
    ar = greedy_ar(target_table, [2, 0], 30)
    assert take(head_run(target_table, draft_table, greedy, gamma, rng), 30) == ar


@pytest.mark.parametrize("stop", [("confidence", 0.5), ("entropy", 0.0)])
def test_a_head_chain_ends_where_its_stop_rule_says_and_stays_lossless(stop):
    """A stop rule ends a head's chain on the head's own numbers: greedy output is still
    AR's, sampled output still the target's distribution; a threshold no probability
    reaches leaves one token per chain, one none crosses the whole chain."""
    target_table, draft_table = tables(2)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(0.0)
    ar = greedy_ar(target_table, [2, 0], 30)
    assert take(head_run(target_table, draft_table, greedy, 6, rng, stop=stop), 30) == ar
    samples = [tuple(take(head_run(target_table, draft_table, SamplingParams(1.0), 3, rng,
                                   stop=stop), 3)) for _ in range(6000)]
    assert_matches(samples, exact_distribution(target_table, 0, 3, SamplingParams(1.0)))
    for threshold, per_chain in ((1.01, 1), (0.0, 6)):
        stats = GenerationStats("spec")
        take(head_run(target_table, draft_table, greedy, 6, rng, stop=("confidence", threshold),
                      stats=stats), 30)
        assert stats.drafted == per_chain * (stats.target_passes - 1)


@pytest.mark.parametrize("seed", range(3))
def test_a_head_reads_the_last_window_of_a_long_prompt(seed):
    """Its first pass over a 40-token prompt reads the last 5 pairs only, each state with
    the token that followed it (ToyHead checks the alignment), and later passes go on
    from there; greedy output is still AR's."""
    target_table, draft_table = tables(seed)
    greedy = SamplingParams(0.0)
    prompt = [2, 0, *take(ar_decode(MarkovModel(target_table), [2, 0], SamplingParams(1.0),
                                    np.random.default_rng(7), GenerationStats("ar")), 38)]
    want = take(ar_decode(MarkovModel(target_table, 200), prompt, greedy, np.random.default_rng(0),
                          GenerationStats("ar")), 30)
    target = FeatureMarkov(target_table, 200)
    head = ToyHead(draft_table, KEPT)
    drafter = HeadDrafter(head, target, KEPT, V, window=5)
    got = take(chain_decode(target, drafter, prompt, greedy, 2, np.random.default_rng(0),
                            GenerationStats("spec")), 30)
    assert got == want
    assert drafter.skipped == len(prompt) - 5
    assert head.tokens[:5] == [*prompt[-4:], want[0]]


class MovingCache(ToyCache):
    """A cache whose compaction moves the model's tokens, and so its states, with it."""

    def __init__(self, model: MarkovModel):
        super().__init__()
        self.model = model

    def compact(self, start: int, slots: list[int]) -> None:
        seen = self.model.seen
        seen[start:start + len(slots)] = [seen[s] for s in slots]
        self.length = start + len(slots)


class ExactFeatureMarkov(FeatureMarkov):
    """Tree rows are chain rows (edgespec's own attention): tree decoding decides from the
    tree pass and compacts the cache, the target's states with it."""

    exact_trees = True

    def __init__(self, table: np.ndarray, max_len: int):
        super().__init__(table, max_len)
        self.cache = MovingCache(self)


def head_tree_run(target_table, draft_table, params, rng, exact, stats=None, top_k=2, depth=3,
                  kept=KEPT):
    target = (ExactFeatureMarkov if exact else FeatureMarkov)(target_table, 200)
    drafter = HeadTreeDrafter(HeadDrafter(ToyHead(draft_table, kept), target, kept, V), top_k,
                              depth)
    return tree_decode(target, drafter, [2, 0], params, top_k * depth, rng,
                       stats or GenerationStats("spec"))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("exact", [False, True])
def test_greedy_head_tree_equals_greedy_ar(seed, exact):
    """The head's chain and its runners-up, verified in one tree pass (exact: decided
    there, the target's states compacted with its cache, which ToyHead checks) or
    re-verified by a chain pass: greedy output is AR's."""
    target_table, draft_table = tables(seed)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(0.0)
    ar = greedy_ar(target_table, [2, 0], 30)
    assert take(head_tree_run(target_table, draft_table, greedy, rng, exact), 30) == ar


@pytest.mark.parametrize("exact", [False, True])
def test_a_head_tree_takes_the_heads_runner_up(exact):
    """A head whose first choice is always the target's second and whose second is the
    target's first: its chains are never accepted, its trees once every pass (the
    runner-up at depth 1), one target pass a step where the target's trees are exact."""
    target_table, _ = tables(3)
    order = np.argsort(-target_table, axis=1)
    swapped = target_table.copy()
    rows = np.arange(V)
    swapped[rows, order[:, 0]], swapped[rows, order[:, 1]] = (target_table[rows, order[:, 1]],
                                                              target_table[rows, order[:, 0]])
    rng, greedy, kept = np.random.default_rng(0), SamplingParams(0.0), np.arange(V)
    ar = greedy_ar(target_table, [2, 0], 30)
    chain, tree = GenerationStats("spec"), GenerationStats("spec")
    assert take(head_run(target_table, swapped, greedy, 1, rng, kept=kept, stats=chain), 30) == ar
    assert chain.accepted == 0
    assert take(head_tree_run(target_table, swapped, greedy, rng, exact, tree, kept=kept),
                30) == ar
    steps = tree.draft_passes // 3  # three head passes (depths) a step
    assert tree.accepted == steps and tree.target_passes == (1 if exact else 2) * steps + 1


@pytest.mark.parametrize("exact", [False, True])
def test_head_tree_sampling_preserves_sequence_distribution(exact):
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(7)
    samples = [tuple(take(head_tree_run(target_table, draft_table, SamplingParams(0.8), rng,
                                        exact), 3)) for _ in range(6000)]
    assert_matches(samples, exact_distribution(target_table, 0, 3, SamplingParams(0.8)))


def test_a_wrong_verifier_fails_the_head_tree_distribution_test(monkeypatch):
    import edgespec.spec.decode as decode

    monkeypatch.setattr(decode, "verify_tree", accept_all_tree)
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(7)
    samples = [tuple(take(head_tree_run(target_table, draft_table, SamplingParams(0.8), rng,
                                        True), 3)) for _ in range(6000)]
    with pytest.raises(AssertionError):
        assert_matches(samples, exact_distribution(target_table, 0, 3, SamplingParams(0.8)))


def hybrid_run(target_table, draft_table, params, rng, stats, prompt=(0, 1, 2, 0, 1, 2, 0),
               controlled=False, max_len=200, head_gamma=1):
    """With `controlled`, a HybridController picks each pass's source from timings that
    are noise here: whatever it picks, the output must be the target's."""
    target = FeatureMarkov(target_table, max_len)
    controller = HybridController(4, head_gamma) if controlled else None
    drafter = HybridDrafter(HeadDrafter(ToyHead(draft_table, KEPT, max_len), target, KEPT, V),
                            4, controller=controller)
    return chain_decode(target, drafter, list(prompt), params, 1, rng, stats, controller)


@pytest.mark.parametrize("controlled", [False, True])
def test_hybrid_copies_repeats_and_the_head_drafts_the_rest_losslessly(controlled):
    """Head chains of one token, lookup runs of up to four where the last 2 tokens
    occurred before: greedy output is AR's, and (fixed chains) both drafters were used
    (the toy head checks that the states it reads stay aligned after copied runs); with
    a controller choosing copies, head tokens or plain steps, greedy output is AR's too."""
    for seed in range(4):
        target_table, draft_table = tables(seed)
        rng = np.random.default_rng(0)
        prompt = [0, 1, 2, 0, 1, 2, 0]
        greedy = SamplingParams(0.0)
        ar = take(ar_decode(MarkovModel(target_table), prompt, greedy, rng,
                            GenerationStats("ar")), 40)
        stats = GenerationStats("spec")
        assert take(hybrid_run(target_table, draft_table, greedy, rng, stats, prompt,
                               controlled), 40) == ar
        # lookup drafted some passes (no head pass: draft_passes counts the head's), the
        # head the others
        assert controlled or 0 < stats.draft_passes < stats.target_passes - 1


@pytest.mark.parametrize("controlled", [False, True])
def test_hybrid_fills_the_context_without_a_pass_past_it(controlled):
    """A copied run is as long as lookup found, longer than the head's γ of one, and a
    controller picks its own γ: near the end of the context both are cut to what the
    verify pass can hold (the toy target and head assert that their caches stay within
    max_len), and the output up to the last position is AR's."""
    prompt = [0, 1, 2, 0, 1, 2, 0]
    for seed in range(4):
        target_table, draft_table = tables(seed)
        for max_len in range(len(prompt) + 1, len(prompt) + 12):
            rng = np.random.default_rng(seed)
            greedy = SamplingParams(0.0)
            ar = take(ar_decode(MarkovModel(target_table, max_len), prompt, greedy, rng,
                                GenerationStats("ar")), max_len - len(prompt))
            spec = take(hybrid_run(target_table, draft_table, greedy, rng,
                                   GenerationStats("spec"), prompt, controlled, max_len,
                                   head_gamma=4),  # the engine's adaptive default
                        max_len - len(prompt))
            assert spec == ar


@pytest.mark.parametrize("controlled", [False, True])
@pytest.mark.parametrize("params", PARAMS)
def test_hybrid_sampling_preserves_sequence_distribution(params, controlled):
    target_table, draft_table = tables(5)
    rng = np.random.default_rng(3)
    stats = GenerationStats("spec")
    samples = [tuple(take(hybrid_run(target_table, draft_table, params, rng, stats,
                                     controlled=controlled), 3)) for _ in range(6000)]
    # fixed chains copy somewhere; a controller may choose the head or plain steps instead
    assert (stats.drafted >= stats.draft_passes if controlled
            else stats.drafted > stats.draft_passes) and stats.draft_passes > 0
    assert_matches(samples, exact_distribution(target_table, 0, 3, params))


@pytest.mark.parametrize("controlled", [False, True])
def test_a_wrong_verifier_fails_the_hybrid_distribution_test(monkeypatch, controlled):
    import edgespec.spec.decode as decode

    monkeypatch.setattr(decode, "verify_chain", accept_all_chain)
    target_table, draft_table = tables(5)
    rng = np.random.default_rng(3)
    stats = GenerationStats("spec")
    samples = [tuple(take(hybrid_run(target_table, draft_table, SamplingParams(1.0), rng,
                                     stats, controlled=controlled), 3)) for _ in range(6000)]
    with pytest.raises(AssertionError):
        assert_matches(samples, exact_distribution(target_table, 0, 3, SamplingParams(1.0)))


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
@pytest.mark.parametrize(("window", "scale"), [(256, 1.0), (1, 1.0), (256, 0.6)])
def test_head_sampling_preserves_sequence_distribution(params, window, scale):
    """window 1: the head's first pass skips the prompt; scale 0.6: it proposes from a
    sharper softmax than the target's temperature (a trained head's proposal_scale)."""
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(7)
    samples = [tuple(take(head_run(target_table, draft_table, params, 3, rng,
                                   window=window, proposal_scale=scale), 3))
               for _ in range(6000)]
    assert_matches(samples, exact_distribution(target_table, 0, 3, params))


@pytest.mark.parametrize("scale", [1.0, 0.6, 2.0])
def test_a_head_proposes_from_its_softmax_at_its_scaled_temperature(scale):
    """The proposal q handed to verification is the head's row through warp at
    proposal_scale times the target's temperature (top-k and top-p as the target's),
    zero outside the kept tokens: checked against a numpy softmax of the toy head's row."""
    target_table, draft_table = tables(4)
    target = FeatureMarkov(target_table, 200)
    target.forward([2, 0])
    drafter = HeadDrafter(ToyHead(draft_table, KEPT), target, KEPT, V, proposal_scale=scale)
    _, q = drafter.propose([2, 0, 1], 1, SamplingParams(0.7), np.random.default_rng(0),
                           GenerationStats("spec"))
    z = draft_table[1][KEPT] / (0.7 * scale)
    want = np.zeros(V)
    want[KEPT] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(q[0], want, rtol=1e-5, atol=1e-7)


def test_a_wrong_verifier_fails_the_head_distribution_test(monkeypatch):
    import edgespec.spec.decode as decode

    monkeypatch.setattr(decode, "verify_chain", accept_all_chain)
    target_table, draft_table = tables(1)
    rng = np.random.default_rng(7)
    samples = [tuple(take(head_run(target_table, draft_table, SamplingParams(1.0), 3, rng), 3))
               for _ in range(6000)]
    with pytest.raises(AssertionError):
        assert_matches(samples, exact_distribution(target_table, 0, 3, SamplingParams(1.0)))


# --- the exported head against its PyTorch definition, on a random-init Llama ----------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_target):
    """A small random Llama with the demo tokenizer (a base model: plain prompts)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_target / f, path / f)
    return path, model


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A head trained for a few steps through the CLI (greedy answers, 3-step unroll)."""
    from tests.test_cli import run

    path, _ = tiny
    work = tmp_path_factory.mktemp("head")
    prompts = work / "prompts.txt"
    prompts.write_text("def parse(text):\nimport os\nclass Stack:\nfor i in range(10):\n")
    out = run("train-draft", str(path), "--out", str(work / "tiny.npz"), "--steps", "4",
              "--kept", "256", "--max-new-tokens", "24", "--prompts", str(prompts),
              "--greedy-only", env={"EDGESPEC_CACHE": str(work / "cache")}, timeout=600)
    assert out.returncode == 0, out.stderr
    return work / "tiny.npz"


def torch_head(head, model):
    import torch

    from edgespec.train.model import EagleHead

    embed = model.get_input_embeddings().weight.detach()
    lm = model.get_output_embeddings().weight.detach()[torch.from_numpy(head.kept)]
    module = EagleHead(head.config, embed, lm)
    module.load_weights(head.weights)
    return module.eval()


@pytest.mark.parametrize("quant", ["sym", "rot"])
def test_exported_head_computes_what_pytorch_trains(tiny, trained, tmp_path, quant):
    """The head graph (fed in chunks, as drafting does) equals the PyTorch head, and the
    target's `hidden` output equals transformers' last_hidden_state (a rotated target's
    too: it turns its states back into the model's basis); the second unrolled step
    equals drafting one more token from the head's own state."""
    import torch

    from edgespec.bundle import read_manifest
    from edgespec.export import export
    from edgespec.export.draft_head import load_head
    from edgespec.runtimes import DecoderSession

    path, model = tiny
    export(path, tmp_path / "b", draft=trained, precision="fp32", quant=quant)
    m = read_manifest(tmp_path / "b")
    assert m.draft.kind == "eagle"
    target = DecoderSession(tmp_path / "b" / m.target.graph, m.target, ["CPUExecutionProvider"])
    head_session = DecoderSession(tmp_path / "b" / m.draft.graph, m.draft,
                                  ["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 4096, 20)
    target.forward(ids[:7])
    target.forward(ids[7:])
    with torch.no_grad():
        states = model.model(torch.from_numpy(ids)[None]).last_hidden_state[0].numpy()
    assert np.abs(target.features[:20] - states).max() < 1e-4

    head = load_head(trained)
    module = torch_head(head, model)
    pair_ids, pair_states = ids[1:], states[:-1]
    with torch.no_grad():
        steps = module.unrolled(torch.from_numpy(np.stack([ids[1:-1], ids[2:]]))[None],
                                torch.from_numpy(states[:-2])[None])
        ref_logits = module.logits(steps[0][0]).numpy()
    got = [head_session.forward_head(pair_ids[:5], pair_states[:5]),
           head_session.forward_head(pair_ids[5:18], pair_states[5:18])]
    # the graph scores each pass's last row only: the one a drafter reads
    logits = np.concatenate([g[0] for g in got])
    predicted = np.concatenate([g[1] for g in got])
    assert np.abs(predicted - steps[0][0].numpy()).max() < 1e-4
    assert np.abs(logits - ref_logits[[4, 17]]).max() < 1e-4
    for j in (0, 6, 17):  # draft one more token at chain j, from the head's own state
        head_session.cache.reset()
        head_session.forward_head(pair_ids[:j + 1], pair_states[:j + 1])
        _, second = head_session.forward_head(ids[j + 2:j + 3], predicted[j:j + 1])
        assert np.abs(second[0] - steps[1][0, j].numpy()).max() < 1e-4


def test_train_data_reads_the_states_a_head_is_trained_on(tiny, tmp_path):
    """train-draft adds a `hidden` output to the exported target: the model's final-norm
    states (transformers' last_hidden_state)."""
    import torch

    from edgespec.bundle import read_manifest
    from edgespec.export import export
    from edgespec.runtimes import DecoderSession
    from edgespec.train.data import with_hidden_output

    path, model = tiny
    export(path, tmp_path / "b", draft="none", precision="fp32")
    m = read_manifest(tmp_path / "b")
    (tmp_path / "b" / "hidden.onnx").write_bytes(with_hidden_output(tmp_path / "b" /
                                                                    m.target.graph))
    target = DecoderSession(tmp_path / "b" / "hidden.onnx", m.target, ["CPUExecutionProvider"])
    ids = np.random.default_rng(1).integers(0, 4096, 12)
    target.forward(ids)
    with torch.no_grad():
        states = model.model(torch.from_numpy(ids)[None]).last_hidden_state[0].numpy()
    assert np.abs(target.features[:12] - states).max() < 1e-4


def test_a_training_batch_pairs_each_state_with_the_tokens_and_states_after_it():
    """batch_of, element by element: chain j of window i at unroll step k reads token
    t[j + 1 + k] and is trained towards state s[j + 1 + k], where those exist; all else is
    zero and marked invalid, and the input states are the window's but its last."""
    import torch

    from edgespec.train.trainer import batch_of

    rng = np.random.default_rng(3)
    items = [(rng.integers(0, 100, n), rng.standard_normal((n, 4)).astype(np.float16))
             for n in (2, 9, 5)]
    ids, states, targets, valid, mask = batch_of(items, 3)
    assert ids.shape == (3, 3, 8) and targets.shape == (3, 3, 8, 4) and states.shape == (3, 8, 4)
    for i, (t, s) in enumerate(items):
        for j in range(8):
            assert bool(mask[i, j]) == (j < len(t) - 1)
            want = s[j].astype(np.float32) if j < len(t) - 1 else np.zeros(4, np.float32)
            assert np.array_equal(states[i, j].numpy(), want)
            for k in range(3):
                there = j + 1 + k < len(t)
                assert bool(valid[i, k, j]) == there
                assert int(ids[i, k, j]) == (t[j + 1 + k] if there else 0)
                assert np.array_equal(targets[i, k, j].numpy(), s[j + 1 + k].astype(np.float32)
                                      if there else np.zeros(4, np.float32))
    assert all(x.device == torch.device("cpu") for x in (ids, states, targets, valid, mask))


def test_float_states_in_padded_batches_are_the_exported_targets(tiny, tmp_path):
    """On a GPU the head learns the float model's states, read in padded batches
    (data.float_states): each sequence's are the exported fp32 target's reading it alone,
    whatever its batch-mates' lengths."""
    from edgespec.export import export
    from edgespec.train.data import float_states, read_sequences

    path, model = tiny
    export(path, tmp_path / "b", draft="none", precision="fp32")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 4096, n).tolist() for n in (5, 17, 9, 30, 2)]
    batched = list(float_states(model, seqs, 3))
    alone = read_sequences(tmp_path / "b", seqs, 1, lambda n: None)
    assert [len(s) for s in batched] == [len(s) for s in seqs]
    for got, want in zip(batched, alone, strict=True):
        assert got.dtype == np.float16
        assert np.abs(got.astype(np.float32) - want.states.astype(np.float32)).max() < 1e-2


@pytest.mark.filterwarnings("error::UserWarning")  # torch's, on a read-only table
def test_train_draft_on_a_gpu_learns_the_float_models_answers_and_states(
        tiny, tmp_path, monkeypatch):
    """What --device cuda runs (reader "float"), here on the CPU: the float model answers
    the prompts in batches, greedy and sampled, and reads the text, and no bundle is
    exported; the greedy answers are transformers' own greedy continuation of each prompt
    alone, the states its last_hidden_state along them."""
    import torch

    from edgespec.export.source import open_source
    from edgespec.tokenizer import Tokenizer
    from edgespec.train.data import prompt_ids
    from edgespec.train.trainer import TrainOptions, _load_joined, train_draft

    path, model = tiny
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    prompts = ["def parse(text):", "import os\nimport sys", "x = [1, 2, 3]\nfor"]
    opts = TrainOptions(steps=3, kept=256, max_new_tokens=8, reader="float", gen_batch=2,
                        text_tokens=40)
    head = train_draft(open_source(path, tmp_path / "src"), tmp_path / "h.npz",
                       tmp_path / "work", prompts, opts,
                       texts=["for i in range(10):\n    print(i)\n" * 6])
    assert not (tmp_path / "cache").exists() and len(head.kept) == 256
    tokens, states = _load_joined(tmp_path / "work" / "conversations.npz", "tokens", "states")
    assert len(tokens) == 2 * len(prompts)  # greedy answers, then sampled ones
    tokenizer = Tokenizer.from_dir(path)
    for prompt, ids in zip(prompts, tokens[:3], strict=True):
        alone = torch.tensor([prompt_ids(tokenizer, prompt)])  # as the CPU path reads it
        with torch.no_grad():
            want = model.generate(alone, attention_mask=torch.ones_like(alone),
                                  do_sample=False, max_new_tokens=8, pad_token_id=0)[0]
        assert ids.tolist() == want.tolist()
    for ids, got in zip(tokens, states, strict=True):
        with torch.no_grad():
            want = model.model(torch.from_numpy(ids)[None]).last_hidden_state[0].numpy()
        assert np.abs(got.astype(np.float32) - want).max() < 1e-2
    text_tokens, _ = _load_joined(tmp_path / "work" / "text.npz", "tokens", "states")
    assert sum(map(len, text_tokens)) == 40


def test_train_draft_answers_task_requests_and_learns_their_tails(tmp_path, demo_target,
                                                                  monkeypatch):
    """--tasks: the target answers task requests (train.tasks) after the prompts, each
    conversation the request as the target reads it and then its answer, and the head
    learns a task conversation's last --task-tail tokens only. A work directory holding
    the answers to another set of prompts is refused, before any training."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from edgespec.errors import EdgespecError
    from edgespec.export.source import open_source
    from edgespec.tokenizer import Tokenizer
    from edgespec.train.data import prompt_ids
    from edgespec.train.tasks import task_requests
    from edgespec.train.trainer import TrainOptions, _load_joined, train_draft

    torch.manual_seed(0)  # room for a task's documents: 2,048 positions
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    path = tmp_path / "model"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_target / f, path / f)
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    opts = TrainOptions(steps=2, kept=256, max_new_tokens=8, reader="float", gen_batch=4,
                        sampled=False, tasks=3, task_chars=1500, task_tail=40)
    source = open_source(path, tmp_path / "src")
    head = train_draft(source, tmp_path / "h.npz", tmp_path / "work", ["def parse(text):"],
                       opts)
    tokens, _ = _load_joined(tmp_path / "work" / "conversations.npz", "tokens", "states")
    tokenizer = Tokenizer.from_dir(path)
    asked = task_requests(0, 3, max_chars=1500)
    assert len(asked) == 3 and all(len(a) <= 1500 for a in asked)
    assert len(tokens) == 4
    for ids, request in zip(tokens[1:], asked, strict=True):
        prompt = prompt_ids(tokenizer, request)
        assert ids[:len(prompt)].tolist() == prompt and len(ids) > 40
    assert head.card["tasks"] == 3  # the prompt's answer whole, the tasks' last 40 tokens
    assert head.card["tokens"] == len(tokens[0]) + 3 * 40
    with pytest.raises(EdgespecError, match=r"keeps answers made for another target, data "
                                            r"or options \(prompts\)"):
        train_draft(source, tmp_path / "h2.npz", tmp_path / "work", ["def parse(text):"],
                    TrainOptions(**{**vars(opts), "tasks": 2}))


def test_read_along_gives_the_states_of_reading_each_window_alone(tiny, tmp_path):
    """--text: the target reads random windows of the texts until the token budget is
    spent; each window's states are transformers' last_hidden_state over that window."""
    import torch

    from edgespec.export import export
    from edgespec.tokenizer import Tokenizer
    from edgespec.train.data import read_along

    path, model = tiny
    export(path, tmp_path / "b", draft="none", precision="fp32")
    texts = ["def parse(text):\n    return [w for w in text.split() if w]\n" * 3,
             "The quick brown fox jumps over the lazy dog. " * 4]
    windows = read_along(tmp_path / "b", texts, 9, 40, 0, 1, lambda n: None)
    assert sum(len(w.tokens) for w in windows) == 40
    pieces = {tuple(ids[i:i + 9]) for ids in map(Tokenizer.from_dir(tmp_path / "b").encode, texts)
              for i in range(0, len(ids), 9)}
    for w in windows:
        assert any(tuple(w.tokens) == p[:len(w.tokens)] for p in pieces)
        with torch.no_grad():
            states = model.model(torch.from_numpy(w.tokens)[None]).last_hidden_state[0]
        assert np.abs(w.states.astype(np.float32) - states.numpy()).max() < 2e-3  # float16


def test_the_target_writes_requests_and_answers_them_greedily(tmp_path):
    """--synthesize (Magpie): SmolLM2 in float writes distinct requests after its template's
    open user turn and answers each in a left-padded batch; every answer token is the
    float model's greedy choice given the prefix alone (unpadded), and a conversation is
    the request through the chat template, then the answer with its end-of-turn token."""
    import torch

    from edgespec.export.source import open_source
    from edgespec.tokenizer import Tokenizer
    from edgespec.train import data
    from tests.real_models import smollm2_gguf

    source = open_source(str(smollm2_gguf()), tmp_path)
    tokenizer = Tokenizer.from_dir(source.tokenizer_dir)
    model = data.float_model(source.name, source.kind)
    written = []
    asked = data.self_requests(model, tokenizer, source.eos_ids, 6, 0, 4, written.append)
    assert len(asked) == 6 and sum(written) == 6
    batches = list(data.answered(model, tokenizer, source.eos_ids, asked, 24, 4))
    assert [len(b) for b in batches] == [4, 2]
    convs = batches[0] + batches[1]
    opening = tokenizer.encode_chat([{"role": "user", "content": "\u2063"}])
    cut = opening.index(tokenizer.encode("\u2063", add_special_tokens=False)[0])
    requests, start = set(), len(tokenizer.decode(opening[:cut]))
    for conv in convs:
        assert conv[:cut] == opening[:cut]
        text = tokenizer.decode(conv)
        request = text[start:text.index("<|im_end|>", start)]
        requests.add(request)
        prompt = tokenizer.encode_chat([{"role": "user", "content": request.strip()}])
        assert conv[:len(prompt)] == prompt
        answer = conv[len(prompt):]
        assert answer[-1] in source.eos_ids or len(answer) == 24
        with torch.no_grad():
            logits = model(torch.tensor([conv])).logits[0, len(prompt) - 1:-1]
        best = logits.max(-1).values
        chosen = logits[torch.arange(len(answer)), torch.tensor(answer)]
        assert (best - chosen).max() < 1e-3  # the greedy token, or a float tie with it
    assert len(requests) == 6
    # bounded by positions (the KV cache a batch needs), batches hold what fits, in order
    prompts = [data.prompt_ids(tokenizer, a) for a in asked]
    budget = 2 * (max(map(len, prompts)) + 24) + 10
    bounded = list(data.answered(model, tokenizer, source.eos_ids, asked, 24, 4,
                                 max_tokens=budget))
    flat = [c for b in bounded for c in b]
    assert [c[:len(p)] for c, p in zip(flat, prompts, strict=True)] == prompts
    start = 0
    for b in bounded:
        rows = prompts[start:start + len(b)]
        assert len(rows) == 1 or len(rows) * (max(map(len, rows)) + 24) <= budget
        if start + len(b) < len(prompts):  # the next request did not fit
            longest = max(map(len, prompts[start:start + len(b) + 1]))
            assert len(b) == 4 or (len(b) + 1) * (longest + 24) > budget
        start += len(b)
    assert 1 < len(bounded) <= 6


def test_an_interrupted_synthesis_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Killed after its first batch of answers, a --synthesize run keeps the requests and
    that batch; run again, it answers only the rest, and ends with the conversations an
    uninterrupted run writes. Another count in the same work directory is refused."""
    from rich.console import Console

    from edgespec.export.source import open_source
    from edgespec.train import data, trainer
    from tests.real_models import smollm2_gguf

    source = open_source(str(smollm2_gguf()), tmp_path / "src")
    opts = trainer.TrainOptions(synthesize=5, gen_batch=2, max_new_tokens=8)
    target = trainer.FloatTarget(source, "cpu", opts.gen_batch)  # the writer, loaded once
    quiet = Console(quiet=True)
    whole = trainer.self_written(source, target, opts, tmp_path / "whole", quiet)
    assert len(whole) == 5

    answered, answers = data.answered, []

    def killed_after_one(model, tok, eos, requests, limit, batch):
        """The first run is killed once it has answered one batch."""
        answers.append(len(requests))
        for i, convs in enumerate(answered(model, tok, eos, requests, limit, batch)):
            if i == 1 and len(answers) == 1:
                raise RuntimeError("killed")
            yield convs

    monkeypatch.setattr(data, "answered", killed_after_one)
    work = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="killed"):
        trainer.self_written(source, target, opts, work, quiet)
    assert trainer.self_written(source, target, opts, work, quiet) == whole
    assert answers == [5, 3]  # the second run answered the three left
    with pytest.raises(data.EdgespecError, match="holds 5 self-written requests"):
        trainer.self_written(source, target, trainer.TrainOptions(synthesize=6), work,
                             quiet)


def test_synthesize_refuses_a_model_without_a_chat_template(tiny, tmp_path):
    from edgespec.export import export
    from edgespec.tokenizer import Tokenizer
    from edgespec.train import data

    path, model = tiny
    export(path, tmp_path / "b", draft="none", precision="fp32")
    base = Tokenizer.from_dir(tmp_path / "b")
    base.chat_template = None  # as a base model's GGUF file or checkpoint has it
    with pytest.raises(data.EdgespecError, match="a base model writes no requests"):
        data.self_requests(model, base, [0], 2, 0, 2, lambda n: None)



def test_interrupted_training_resumes_from_its_checkpoint_to_the_same_head(
        tiny, tmp_path, monkeypatch):
    """A checkpoint every 30 s (here: every step, the clock jumping a minute a call); a run
    stopped at step 3 resumes at step 2 and ends with the uninterrupted run's head."""
    from rich.console import Console

    from edgespec.export.source import open_source
    from edgespec.train import trainer

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    clock = iter(range(0, 10**6, 60))
    monkeypatch.setattr(trainer.time, "monotonic", lambda: next(clock))
    opts = trainer.TrainOptions(steps=5, kept=256, max_new_tokens=8, reader="float",
                                sampled=False)
    source = open_source(tiny[0], tmp_path / "src")
    whole = trainer.train_draft(source, tmp_path / "a.npz", tmp_path / "a", ["def f(x):"], opts)
    loss, calls = trainer.head_loss, []

    def stops_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return loss(*args, **kwargs)

    monkeypatch.setattr(trainer, "head_loss", stops_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_draft(source, tmp_path / "b.npz", tmp_path / "b", ["def f(x):"], opts)
    monkeypatch.setattr(trainer, "head_loss", loss)
    console = Console(record=True, width=200)
    resumed = trainer.train_draft(source, tmp_path / "b.npz", tmp_path / "b", ["def f(x):"],
                                  opts, console=console)
    assert "resuming the head's training at step 2 of 5" in console.export_text()
    for name, value in whole.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], value, err_msg=name)
    from dataclasses import replace


    # more steps, another rate: the answers kept serve, the checkpoint goes (it was
    # refused, and the answers had to be made again to train longer)
    console = Console(record=True, width=200)
    longer = trainer.train_draft(source, tmp_path / "c.npz", tmp_path / "b", ["def f(x):"],
                                 replace(opts, steps=6, lr=2e-3), console=console)
    said = console.export_text()
    assert "made with other options (steps, lr), so the head trains from the start" in said
    assert "resuming" not in said and "reusing 1 conversations" in said
    afresh = trainer.train_draft(source, tmp_path / "d.npz", tmp_path / "d", ["def f(x):"],
                                 replace(opts, steps=6, lr=2e-3))
    for name, value in afresh.weights.items():
        np.testing.assert_array_equal(longer.weights[name], value, err_msg=name)


def test_a_work_directory_serves_only_the_run_it_was_made_for(tiny, tmp_path, monkeypatch):
    """What --work keeps (answers, text states, the checkpoint) depends on the target, the
    data and the options: another model or text is refused by name before anything kept is
    reused (a second model trained to the same --out once got the first one's head)."""
    import shutil
    from dataclasses import replace

    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from edgespec.errors import EdgespecError
    from edgespec.export.source import open_source
    from edgespec.train import trainer

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    path, model = tiny
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(model.config).save_pretrained(tmp_path / "other")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, tmp_path / "other" / f)
    # 20 steps: the learning-rate schedule once divided by zero there
    opts = trainer.TrainOptions(steps=20, kept=256, max_new_tokens=8, reader="float",
                                sampled=False)
    text = ["for i in range(3):\n    print(i)\n" * 40]
    work = tmp_path / "w"
    trainer.train_draft(open_source(path, tmp_path / "s"), tmp_path / "a.npz", work,
                        ["def f(x):"], opts, texts=text)
    for target, texts, differs in ((tmp_path / "other", text, "target"),
                                   (path, ["while True:\n    pass\n" * 40], "text")):
        with pytest.raises(EdgespecError, match=rf"made for another target, data or options "
                                                rf"\({differs}\)"):
            trainer.train_draft(open_source(target, tmp_path / "s2"), tmp_path / "b.npz",
                                work, ["def f(x):"], opts, texts=texts)
    # what does not touch the answers kept: text the first run could not read, more steps
    fresh = tmp_path / "fresh"
    with pytest.raises(EdgespecError, match="too little text"):
        trainer.train_draft(open_source(path, tmp_path / "s3"), tmp_path / "c.npz", fresh,
                            ["def f(x):"], opts, texts=["x"])
    console = Console(record=True, width=200)
    trainer.train_draft(open_source(path, tmp_path / "s4"), tmp_path / "c.npz", fresh,
                        ["def f(x):"], replace(opts, steps=21), console=console)
    assert "reusing 1 conversations" in console.export_text()
    (tmp_path / "plain").write_text("mine")
    with pytest.raises(EdgespecError, match="has no work.json"):
        trainer.train_draft(open_source(path, tmp_path / "s5"), tmp_path / "d.npz",
                            tmp_path / "plain", ["def f(x):"], opts)
    assert (tmp_path / "plain").read_text() == "mine" and not (tmp_path / "b.npz").exists()
    for damaged, part in ((fresh / "conversations.npz", "conversations.npz"),
                          (fresh / "head.pt", "head.pt")):
        damaged.write_bytes(damaged.read_bytes()[:50])  # truncated
        with pytest.raises(EdgespecError, match=f"{part} .*damaged|{part} cannot be read"):
            trainer.train_draft(open_source(path, tmp_path / "s6"), tmp_path / "c.npz",
                                fresh, ["def f(x):"], replace(opts, steps=21))
        damaged.unlink()  # as the sentence says: made again
    # the head a run starts from counts by its content, not by its path
    first = replace(opts, init=str(tmp_path / "a.npz"))
    trainer.train_draft(open_source(path, tmp_path / "s7"), tmp_path / "e.npz",
                        tmp_path / "wi", ["def f(x):"], first)
    shutil.copy(tmp_path / "a.npz", tmp_path / "moved.npz")
    moved = replace(opts, init=str(tmp_path / "moved.npz"))
    trainer.train_draft(open_source(path, tmp_path / "s8"), tmp_path / "e.npz",
                        tmp_path / "wi", ["def f(x):"], moved)
    shutil.copy(tmp_path / "c.npz", tmp_path / "moved.npz")  # another head, the same path
    with pytest.raises(EdgespecError, match=r"checkpoint made for .* \(init\)"):
        trainer.train_draft(open_source(path, tmp_path / "s9"), tmp_path / "e.npz",
                            tmp_path / "wi", ["def f(x):"], moved)


def test_answers_are_kept_a_block_at_a_time(tiny, tmp_path, monkeypatch):
    """An interrupted run loses the block of answers being made, not those before it."""
    from rich.console import Console

    from edgespec.export.source import open_source
    from edgespec.train import trainer

    opts = trainer.TrainOptions(max_new_tokens=8)  # greedy answers, then sampled ones
    target = trainer.FloatTarget(open_source(tiny[0], tmp_path / "s"), "cpu", 1)
    prompts, quiet = ["def f(x):", "import os", "class A:"], Console(quiet=True)
    (tmp_path / "whole").mkdir()
    whole = trainer.conversations(target, prompts, opts, tmp_path / "whole", quiet)
    answer, calls = target.answer, []

    def killed_at_the_second(block, *args, **kwargs):
        calls.append(block)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return answer(block, *args, **kwargs)

    monkeypatch.setattr(target, "answer", killed_at_the_second)
    (tmp_path / "w").mkdir()
    with pytest.raises(KeyboardInterrupt):
        trainer.conversations(target, prompts, opts, tmp_path / "w", quiet)
    resumed = trainer.conversations(target, prompts, opts, tmp_path / "w", quiet)
    assert [c.tokens.tolist() for c in resumed] == [c.tokens.tolist() for c in whole]
    assert calls == [[p] for p in prompts[:2] + prompts[1:] + prompts]
    assert not (tmp_path / "w" / "answers").exists()


def test_train_draft_learns_from_text_and_refuses_what_it_cannot_read(tiny, tmp_path):
    from tests.test_cli import run

    path, _ = tiny
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.py").write_text("import os\nfor name in os.listdir('.'):\n    print(name)\n" * 5)
    (corpus / "sub" / "b.md").write_text("# Notes\n\nA stack is last in, first out. " * 5)
    (corpus / "blob.bin").write_bytes(bytes(range(256)))
    (tmp_path / "prompts.txt").write_text("def parse(text):\n")
    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    common = ["--steps", "2", "--kept", "256", "--max-new-tokens", "8", "--greedy-only",
              "--prompts", str(tmp_path / "prompts.txt")]
    out = run("train-draft", str(path), "--out", str(tmp_path / "h.npz"), *common,
              "--text", str(corpus), "--text-tokens", "100", env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    card = json.loads((tmp_path / "h.json").read_text())
    assert card["text"]["files"] == 2  # the binary file is not text
    assert card["text"]["tokens"] == 100 and card["text"]["windows"] >= 1
    for bad, message in ((tmp_path / "missing", "does not exist"),
                         (corpus / "blob.bin", "cannot read")):
        out = run("train-draft", str(path), "--out", str(tmp_path / "x.npz"), *common,
                  "--text", str(bad), env=env)
        assert out.returncode != 0 and message in out.stderr
        assert "Traceback" not in out.stderr and not (tmp_path / "x.npz").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="the refusal is for a machine without a GPU")
def test_train_draft_on_cuda_without_a_gpu_is_refused(tiny, tmp_path):
    from tests.test_cli import run

    path, _ = tiny
    out = run("train-draft", str(path), "--out", str(tmp_path / "h.npz"), "--device", "cuda",
              env={"EDGESPEC_CACHE": str(tmp_path / "cache")})
    assert out.returncode != 0 and "needs PyTorch with CUDA" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "h.npz").exists()


def test_train_draft_starts_from_a_trained_head_and_refuses_another_models(
        tiny, trained, tmp_path, demo_target):
    """--init: the head's own tokens and shape (whatever --kept says) and its weights as
    the start; a learning rate too small to move a float16 weight gives them back as
    they were, a real one moves them. A head for another model, or a file that is no
    head, is refused in one sentence with nothing written."""
    from edgespec.export.draft_head import load_head
    from tests.test_cli import run

    path, _ = tiny
    (tmp_path / "prompts.txt").write_text("import os\nclass Queue:\n")
    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    common = ["--steps", "2", "--kept", "64", "--max-new-tokens", "8", "--greedy-only",
              "--prompts", str(tmp_path / "prompts.txt"), "--init", str(trained)]
    start = load_head(trained)
    for lr, moved in (("1e-12", False), ("1e-2", True)):
        out = run("train-draft", str(path), "--out", str(tmp_path / f"{lr}.npz"), *common,
                  "--lr", lr, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        head = load_head(tmp_path / f"{lr}.npz")
        assert np.array_equal(head.kept, start.kept) and len(head.kept) == 256
        assert vars(head.config) == vars(start.config)
        same = [np.array_equal(head.weights[k], w) for k, w in start.weights.items()]
        assert all(same) if not moved else not any(same)
        assert head.card["init"] == {"file": trained.name, "card": start.card}
        assert head.card["options"]["kept"] == 256
    bogus = tmp_path / "bogus.npz"
    np.savez(bogus, x=np.zeros(3))
    for target, init, message in ((demo_target, trained, "another model|of width"),
                                  (path, bogus, "not an edgespec draft head"),
                                  (path, tmp_path / "missing.npz", "cannot read")):
        out = run("train-draft", str(target), "--out", str(tmp_path / "x.npz"), *common[:-1],
                  str(init), env=env, timeout=600)
        assert out.returncode != 0 and re.search(message, out.stderr), out.stderr
        assert "Traceback" not in out.stderr and not (tmp_path / "x.npz").exists()
        assert not (tmp_path / "x.work").exists()  # refused before any work is kept


@pytest.mark.parametrize("quant", ["k", "auto"])
def test_head_bundle_speculates_and_matches_ar(tiny, trained, tmp_path, quant):
    """int8 at accuracy level 4, the default precision, as llama.cpp's Q8_0 recipe (k) and
    as the default picks it (auto: rotated where the kernel library is built)."""
    import edgespec
    from edgespec import kernels
    from edgespec.bundle import read_manifest
    from edgespec.export import export

    path, _ = tiny
    export(path, tmp_path / "b", draft=trained, quant=quant)
    manifest = read_manifest(tmp_path / "b")
    rotated = quant == "auto" and kernels.for_export()
    assert manifest.provenance["quant"] == ("rot" if rotated else "k")
    # the head gathers the target's own (requantized; rotated: then turned back) embedding
    # codes: one copy on disk
    assert "target.onnx.data" in manifest.draft.data_files
    assert (tmp_path / "b" / "draft.onnx.data").stat().st_size < 4096 * 64  # < the table
    with edgespec.load(tmp_path / "b") as engine:
        assert engine.default_mode == "spec"
        for prompt in ("def parse(text):", "x = [1, 2, 3]\nfor"):
            spec = engine.generate(prompt, max_new_tokens=40, temperature=0)
            ar = engine.generate(prompt, max_new_tokens=40, temperature=0, mode="ar")
            assert spec.token_ids == ar.token_ids
            assert spec.stats.draft_passes > 0
            # a head's chains default to one draft token per verify pass (the prefill
            # drafts nothing) where nothing is copied; asked for, it drafts four
            alone = engine.generate(prompt, max_new_tokens=40, temperature=0,
                                    lookup_tokens=0)
            assert alone.token_ids == ar.token_ids
            assert alone.stats.drafted <= alone.stats.target_passes - 1
            four = engine.generate(prompt, max_new_tokens=40, temperature=0, draft_tokens=4,
                                   lookup_tokens=0)
            assert four.token_ids == ar.token_ids
            assert four.stats.drafted > 2 * (four.stats.target_passes - 1)



def test_vocab_trim_refuses_a_head_bundle_and_leaves_it_whole(tiny, trained, tmp_path):
    """A head shares the target's data file; re-trimming it once deleted that file."""
    from edgespec.bundle import sha256
    from edgespec.export import export
    from tests.test_cli import assert_user_error, run

    export(tiny[0], tmp_path / "b", draft=trained)
    before = {p.name: sha256(p) for p in (tmp_path / "b").iterdir()}
    assert_user_error(run("vocab-trim", str(tmp_path / "b"), "--k", "100"),
                      "is a head", "train-draft --kept K")
    assert {p.name: sha256(p) for p in (tmp_path / "b").iterdir()} == before
    drafts_and_equals_ar(tmp_path / "b")


def test_plan_refuses_to_offload_a_head_bundle(tiny, trained, tmp_path):
    """The engine cannot run a head beside an offloaded target, so no plan offers one."""
    from edgespec.bundle import read_manifest
    from edgespec.errors import EdgespecError
    from edgespec.export import export
    from edgespec.plan import plan_bundle
    from edgespec.runtimes.planner import ModelSizes, fmt_bytes

    export(tiny[0], tmp_path / "b", draft=trained)
    m = read_manifest(tmp_path / "b")
    sizes = ModelSizes.of(tmp_path / "b" / m.target.graph, m.target)
    fits, _ = plan_bundle(tmp_path / "b", gpu_memory=1 << 40, context=256, bandwidth=16e9)
    assert fits.offload == "none"  # the whole target on the GPU: a head's plan
    with pytest.raises(EdgespecError, match="draft head reads the target's final states") as e:
        plan_bundle(tmp_path / "b", gpu_memory=sizes.total, context=256, bandwidth=16e9)
    assert f"the whole target ({fmt_bytes(fits.gpu_bytes)} at a context of 256 tokens)" in \
        str(e.value)  # how much it needs, as the plan that fits counts it

def drafts_and_equals_ar(bundle: Path) -> None:
    """The bundle's default mode drafts, and its greedy output is greedy AR's."""
    import edgespec

    with edgespec.load(bundle) as engine:
        for prompt in ("def parse(text):", "x = [1, 2, 3]\nfor"):
            spec = engine.generate(prompt, max_new_tokens=40, temperature=0)
            assert spec.stats.draft_passes > 0
            assert spec.token_ids == engine.generate(prompt, max_new_tokens=40,
                                                     temperature=0, mode="ar").token_ids


def test_a_heads_proposal_scale_goes_from_its_card_to_its_drafter(tiny, trained, tmp_path):
    """The card's proposal_scale is the bundle's and the engine's drafter's; none: 1."""
    import edgespec
    from edgespec.engine import GenerationConfig
    from edgespec.export import export
    from edgespec.export.draft_head import load_head

    path, _ = tiny
    head = load_head(trained)
    head.card["proposal_scale"] = 0.5
    head.save(tmp_path / "sharp.npz")
    for draft, want in ((trained, 1.0), (tmp_path / "sharp.npz", 0.5)):
        out = tmp_path / draft.stem
        export(path, out, draft=draft, precision="fp32")
        engine = edgespec.load(out)
        assert engine.manifest.draft.proposal_scale == want
        assert engine._head_drafter(engine.resolve(GenerationConfig())).proposal_scale == want


def test_draft_precision_sets_the_heads_own_weights(tiny, trained, tmp_path):
    """--draft-precision int4: the head's fusion and layer in 4-bit codes beside an int8
    target (its kept LM head rows stay 8-bit like every LM head), still lossless."""
    import onnx

    from edgespec import kernels
    from edgespec.bundle import read_manifest
    from edgespec.export import export

    path, _ = tiny
    export(path, tmp_path / "b", draft=trained, draft_precision="int4")
    manifest = read_manifest(tmp_path / "b")
    assert (manifest.target.precision, manifest.draft.precision) == ("int8", "int4")
    graph = onnx.load(str(tmp_path / "b" / manifest.draft.graph), load_external_data=False)
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in graph.graph.node
            if n.domain == kernels.DOMAIN and n.op_type.startswith("BlockQ")}
    assert bits.pop("lm_head") == 8 and bits and set(bits.values()) == {4}
    drafts_and_equals_ar(tmp_path / "b")


def test_head_beside_an_int8_kv_target_matches_ar(tiny, trained, tmp_path):
    """--kv-cache int8 quantizes the target's cache; the head's one-layer cache stays
    float (its graph takes the target's states, so it is not calibrated alone)."""
    from edgespec.bundle import read_manifest
    from edgespec.export import export

    path, _ = tiny
    export(path, tmp_path / "b", draft=trained, kv_cache="int8")
    manifest = read_manifest(tmp_path / "b")
    assert manifest.target.kv_dtype == "int8" and manifest.draft.kv_dtype == "float32"
    drafts_and_equals_ar(tmp_path / "b")


def test_a_head_for_another_model_is_refused(tiny, trained, tmp_path, demo_target):
    from edgespec.errors import EdgespecError
    from edgespec.export import export

    with pytest.raises(EdgespecError, match="trained for a model of width|another model"):
        export(demo_target, tmp_path / "b", draft=trained)
    assert not (tmp_path / "b").exists()
    path, _ = tiny
    with np.load(trained) as z:  # the same width, but tokens the target does not have
        fields = {k: z[k] for k in z.files}
    fields["kept"] = fields["kept"].copy()
    fields["kept"][-1] = 4096
    np.savez(tmp_path / "wide.npz", **fields)
    with pytest.raises(EdgespecError, match="keeps token 4096, past this target's vocabulary"):
        export(path, tmp_path / "b", draft=tmp_path / "wide.npz")
    with pytest.raises(EdgespecError, match="leave out --vocab-trim"):
        export(path, tmp_path / "b", draft=trained, vocab_trim=100)
    bogus = tmp_path / "bogus.npz"
    np.savez(bogus, x=np.zeros(3))
    with pytest.raises(EdgespecError, match="not an edgespec draft head"):
        export(path, tmp_path / "b", draft=bogus)
    for junk in (b"", b"text, not a head", trained.read_bytes()[:1000]):  # empty, cut short
        bogus.write_bytes(junk)
        with pytest.raises(EdgespecError, match="cannot read the draft head") as refused:
            export(path, tmp_path / "b", draft=bogus)
        assert "allow_pickle" not in str(refused.value)
    # a weight of another shape made a bundle ONNX Runtime could not load; a non-finite
    # one (a training that diverged) a draft that proposes nothing
    for name, change, told in (("w.fusion", lambda w: w[:, :-1], r"its fusion do not have"),
                               ("w.layer.down_proj", lambda w: w * np.inf, "not finite")):
        broken = dict(fields)
        broken[name] = change(fields[name])
        np.savez(bogus, **broken)
        with pytest.raises(EdgespecError, match=told):
            export(path, tmp_path / "b", draft=bogus)
    assert not (tmp_path / "b").exists()


def test_default_export_takes_the_shipped_head_trained_on_its_target(tiny, trained, tmp_path,
                                                                   demo_target, monkeypatch):
    """With no --draft, a head in the shipped folder whose fingerprint matches the target
    is used; 'none' leaves it out; another target does not match it."""
    import shutil

    import edgespec.export.draft_head as draft_head
    from edgespec.bundle import read_manifest
    from edgespec.export import export

    shipped = tmp_path / "drafts"
    shipped.mkdir()
    shutil.copy(trained, shipped / "tiny.npz")
    monkeypatch.setattr(draft_head, "SHIPPED", shipped)
    path, _ = tiny
    export(path, tmp_path / "b")
    assert read_manifest(tmp_path / "b").draft.kind == "eagle"
    export(path, tmp_path / "none", draft="none")
    assert read_manifest(tmp_path / "none").draft is None
    export(demo_target, tmp_path / "demo", precision="fp32")
    assert read_manifest(tmp_path / "demo").draft is None


# --- the heads shipped for the real models (edgespec/assets/drafts) -----------------------

SHIPPED = Path(__file__).resolve().parent.parent / "edgespec" / "assets" / "drafts"
REPO_HEAD = SHIPPED / "smollm2-135m-instruct.npz"
GEMMA_HEAD = SHIPPED / "gemma-3-270m.npz"
# measured on 8 held-out chat prompts x 128 tokens at the default gamma=1: 1.28 (a
# random head gives 1.0)
HEAD_TOKENS_PER_PASS = 1.1


def test_fingerprints_recognise_a_model_in_any_precision(demo_target):
    """The file's own codes, a 4-bit requantization of them and their float values give
    the same fingerprint as the head trained on them; another model's weights do not."""
    from edgespec.export.architectures import adapter_for
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.draft_head import fingerprint, load_head, matches
    from edgespec.export.gguf_reader import load_gguf
    from edgespec.quant.blockwise import dequantize, quantize_blockwise
    from tests.real_models import smollm2_gguf

    trained_on = load_head(REPO_HEAD).fingerprint
    codes = adapter_for(load_gguf(smollm2_gguf())).embeddings()
    floats = dequantize(codes)
    for weights in (codes, floats, dequantize(quantize_blockwise(floats, 4, 32, True))):
        assert matches(fingerprint(weights), trained_on)
    other = adapter_for(load_checkpoint(demo_target)).embeddings()
    assert not matches(fingerprint(other), trained_on)


def test_the_repos_gemma_head_was_trained_on_the_registrys_gemma():
    """The shipped Gemma-3-270M head drafts for that very file (and not for SmolLM2),
    and fits its width and vocabulary."""
    from edgespec.export.architectures import adapter_for
    from edgespec.export.draft_head import fingerprint, load_head, matches
    from edgespec.export.gguf_reader import load_gguf
    from tests.real_models import gemma_gguf, smollm2_gguf

    head = load_head(GEMMA_HEAD)
    gemma = adapter_for(load_gguf(gemma_gguf()))
    assert matches(fingerprint(gemma.embeddings()), head.fingerprint)
    assert not matches(fingerprint(adapter_for(load_gguf(smollm2_gguf())).embeddings()),
                       head.fingerprint)
    assert head.config.hidden_size == gemma.spec.hidden_size
    assert head.kept.max() < gemma.spec.vocab_size and len(head.kept) == 8192


@pytest.fixture(scope="module", params=["k", "rot"])
def smollm2(request, tmp_path_factory):
    """The registry's SmolLM2 GGUF exported with no --draft, which gives it the head
    shipped for it: the default export (the file's codes) and the rotated int8 one (the
    head reads the target's states in the model's own basis either way)."""
    from edgespec.bundle import read_manifest
    from edgespec.export import export
    from tests.real_models import smollm2_gguf

    out = tmp_path_factory.mktemp("smollm2") / "b"
    export(smollm2_gguf(), out, quant=request.param)
    shipped = Path(read_manifest(out).draft.source)  # the installed package's copy
    assert shipped.name == REPO_HEAD.name and shipped.read_bytes() == REPO_HEAD.read_bytes()
    return out


def held_out_chat(n: int) -> list[list[dict]]:
    from edgespec.bench_sets import load_set

    return [p["messages"] for p in load_set("real") if p["category"] == "chat"][:n]


def test_smollm2_head_greedy_equals_ar_and_is_accepted(smollm2):
    import edgespec

    with edgespec.load(smollm2) as engine:
        assert engine.default_mode == "spec"
        passes = tokens = 0
        for messages in held_out_chat(4):
            ids = engine.tokenizer.encode_chat(messages)
            spec = engine.generate(ids, max_new_tokens=64, temperature=0)
            ar = engine.generate(ids, max_new_tokens=64, temperature=0, mode="ar")
            assert spec.token_ids == ar.token_ids
            passes += spec.stats.target_passes - 1  # the prefill drafts nothing
            tokens += spec.stats.new_tokens - 1
        assert tokens / passes > HEAD_TOKENS_PER_PASS


def test_smollm2_head_trees_equal_ar_and_take_runners_up(smollm2):
    """--tree-budget with the head: its chain and runners-up in one exact tree pass, the
    target's states compacted with its cache for the head's next read (after a tree
    generation they are bitwise those of reading its tokens in one pass). Greedy output
    is AR's, and four candidates a step commit more per pass than the head's one."""
    import edgespec

    with edgespec.load(smollm2) as engine:
        assert engine.target.exact_trees
        per_pass = {"chain": [0, 0], "tree": [0, 0]}
        for messages in held_out_chat(4):
            ids = engine.tokenizer.encode_chat(messages)
            ar = engine.generate(ids, max_new_tokens=48, temperature=0, mode="ar")
            for kind, extra in (("chain", {"draft_tokens": 1}),
                                ("tree", {"tree_budget": 4, "tree_top_k": 4, "tree_depth": 1})):
                out = engine.generate(ids, max_new_tokens=48, temperature=0, mode="spec",
                                      lookup_tokens=0, **extra)
                assert out.token_ids == ar.token_ids
                per_pass[kind][0] += out.stats.new_tokens - 1
                per_pass[kind][1] += out.stats.target_passes - 1
        fed = ids + out.token_ids[:-1]  # the last tree generation's, its last token unfed
        kept = engine.target.features[:len(fed)].copy()
        engine.target.cache.reset()
        engine.target.forward(fed)
        assert np.array_equal(kept, engine.target.features[:len(fed)])
    chain, tree = (n / passes for n, passes in per_pass.values())
    assert tree > chain + 0.1


def test_smollm2_copies_code_it_repeats_and_stays_ar(smollm2):
    """Held-out code completions repeat their prompt: the default chains copy runs of
    tokens there (more drafted than one per pass), and greedy output is still AR's."""
    import edgespec
    from edgespec.bench_sets import load_set

    with edgespec.load(smollm2) as engine:
        drafted = passes = 0
        for p in [p for p in load_set("real") if p["category"] == "code"][:2]:
            ids = engine.tokenizer.encode_chat(p["messages"])
            spec = engine.generate(ids, max_new_tokens=64, temperature=0)
            assert spec.token_ids == engine.generate(ids, max_new_tokens=64, temperature=0,
                                                     mode="ar").token_ids
            drafted += spec.stats.drafted
            passes += spec.stats.target_passes - 1
        assert drafted > 1.5 * passes


def test_smollm2_tokens_per_pass_count_the_end_token_a_pass_decided(smollm2):
    """AR decides one token a pass, its end-of-sequence token too: 1.00 tokens/pass, not
    (n-1)/n; speculation's rate counts the same tokens over its own passes."""
    import edgespec

    with edgespec.load(smollm2) as engine:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
        ar = engine.generate(ids, max_new_tokens=64, temperature=0, mode="ar")
        spec = engine.generate(ids, max_new_tokens=64, temperature=0)
        assert ar.finish_reason == spec.finish_reason == "stop"
        assert ar.stats.tokens_per_target_pass == 1.0
        assert spec.stats.committed == ar.stats.committed == len(ar.token_ids) + 1
        assert spec.stats.tokens_per_target_pass == len(ar.token_ids) / (
            spec.stats.target_passes - 1)


def test_smollm2_speculates_to_the_end_of_its_context(smollm2):
    """An answer that runs into the context's end stops there with "length", the tokens
    AR gives, in every mode: copies near the end are cut to the positions left."""
    import edgespec

    ids = None
    for room in (5, 17, 40):
        with edgespec.load(smollm2, context=160 + room) as engine:
            ids = ids or engine.tokenizer.encode("def add(a, b):\n    return a + b\n" * 20)[:160]
            ar = engine.generate(ids, max_new_tokens=1000, temperature=0, mode="ar")
            assert ar.finish_reason == "length" and len(ar.token_ids) == room
            for kwargs in ({}, {"draft_tokens": 3}, {"adaptive": True}, {"mode": "lookup"},
                           {"tree_budget": 4}):
                out = engine.generate(ids, max_new_tokens=1000, temperature=0, **kwargs)
                assert (out.finish_reason, out.token_ids) == ("length", ar.token_ids), kwargs


def test_smollm2_head_sampling_keeps_the_targets_distribution(smollm2):
    """Two-sample test at T=0.7: the first two tokens of an answer, drafted by the head
    and verified, against the target sampling alone (chi-square on the contingency)."""
    from scipy.stats import chi2_contingency

    import edgespec

    with edgespec.load(smollm2) as engine:
        ids = engine.tokenizer.encode_chat(held_out_chat(1)[0])
        runs = {mode: [tuple(engine.generate(ids, max_new_tokens=2, temperature=0.7,
                                              seed=seed, mode=mode).token_ids)
                       for seed in range(250)] for mode in ("spec", "ar")}
    outcomes = sorted(set(runs["spec"]) | set(runs["ar"]))
    common = [o for o in outcomes if runs["spec"].count(o) + runs["ar"].count(o) >= 10]
    table = np.array([[r.count(o) for o in common] + [sum(x not in common for x in r)]
                      for r in runs.values()])
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] >= 2  # the prompt has several likely openings at T=0.7
    assert chi2_contingency(table).pvalue > 1e-3


def test_train_draft_refuses_a_folder_as_out_and_leaves_no_work_when_refused(tiny, tmp_path):
    """A folder named as --out was found after the whole run (a traceback and a .part
    file); a run refused before it made anything (--synthesize on a base model) left its
    work folder with a work.json behind."""
    from tests.test_cli import assert_user_error, run

    path, _ = tiny
    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    (tmp_path / "dir.npz").mkdir()
    assert_user_error(run("train-draft", str(path), "--out", str(tmp_path / "dir.npz"),
                          "--steps", "2", env=env, timeout=600), "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.npz"]
    base = tmp_path / "base"
    shutil.copytree(path, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    assert_user_error(run("train-draft", str(base), "--out", str(tmp_path / "s.npz"),
                          "--steps", "2", "--synthesize", "2", env=env, timeout=600),
                      "--synthesize needs a chat model")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["base",
                                                                              "dir.npz"]
    prompts = tmp_path / "prompts.txt"  # the second too long for the tiny model's 256
    prompts.write_text("def f(x):\n" + "x = 1 " * 200 + "\n")
    assert_user_error(run("train-draft", str(path), "--out", str(tmp_path / "l.npz"),
                          "--steps", "2", "--max-new-tokens", "16", "--prompts", str(prompts),
                          env=env, timeout=600),
                      "prompt 2 ('x = 1 x = 1", "passes the 256 positions")
    assert not (tmp_path / "l.work").exists()


def test_a_training_that_diverges_writes_no_head(tiny, tmp_path, monkeypatch):
    from edgespec.errors import EdgespecError
    from edgespec.export.source import open_source
    from edgespec.train import trainer

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    opts = trainer.TrainOptions(steps=20, kept=256, max_new_tokens=8, reader="float",
                                sampled=False, lr=1e6)
    with pytest.raises(EdgespecError, match="the training diverged .* lower --lr than 1e"):
        trainer.train_draft(open_source(tiny[0], tmp_path / "src"), tmp_path / "h.npz",
                            tmp_path / "w", ["def f(x):"], opts)
    assert not (tmp_path / "h.npz").exists() and not (tmp_path / "h.npz.part").exists()


def test_text_files_are_read_or_refused_by_what_they_hold(tmp_path):
    """A blank file was told to be "UTF-8 files (.c .cpp ... .txt)", which it was."""
    from edgespec.errors import EdgespecError
    from edgespec.train.data import read_texts

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "d" / "latin.txt").write_bytes("café".encode("latin-1"))  # skipped in a folder
    assert read_texts([tmp_path / "d"]) == ["def f(x):\n    return x\n"]
    with pytest.raises(EdgespecError, match="cannot read .*latin.txt as text"):
        read_texts([tmp_path / "d" / "latin.txt"])  # refused when named
    (tmp_path / "blank.txt").write_text(" \n\n")
    with pytest.raises(EdgespecError, match="found only blank files in .*blank.txt; give it"):
        read_texts([tmp_path / "blank.txt"])
    (tmp_path / "e").mkdir()
    with pytest.raises(EdgespecError, match="--text found no text in .*; pass UTF-8 files"):
        read_texts([tmp_path / "e"])


def test_ctrl_c_in_train_draft_says_the_run_resumes(tiny, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    work = tmp_path / "h.work"
    # Ctrl-C as a terminal sends it: a suite started in the background by a shell without
    # job control inherits SIGINT ignored, and so would the command (Python keeps it so)
    as_in_a_terminal = ("import runpy, signal; signal.signal(signal.SIGINT, "
                        "signal.default_int_handler); runpy.run_module('edgespec.cli', "
                        "run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen(
        [sys.executable, "-c", as_in_a_terminal, "train-draft", str(tiny[0]), "--out",
         str(tmp_path / "h.npz"), "--steps", "100000", "--kept", "256", "--max-new-tokens", "8"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1",
                                                "EDGESPEC_CACHE": str(tmp_path / "cache")})
    deadline = time.time() + 300
    while not (work / "head.pt").exists() and time.time() < deadline:  # training, saved
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where it was, and leave nothing running
        proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        pytest.fail("train-draft went on after Ctrl-C:\n" + proc.communicate()[1][-8000:])
    assert proc.returncode == 130, err
    assert f"stopped; the same command resumes from what {work} keeps." in err
    assert "Traceback" not in err and not (tmp_path / "h.npz").exists()
