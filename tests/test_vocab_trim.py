"""VocabTrim: the draft proposes among K tokens, the target still decides among all."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import edgespec
from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.export import export
from edgespec.export.vocab_trim import retrim_bundle
from edgespec.quant.vocab_trim import count_tokens, kept_tokens
from edgespec.runtimes import DecoderSession
from edgespec.spec import GenerationStats, ModelDrafter, SamplingParams, chain_decode
from edgespec.spec.drafters import TrimmedModel
from edgespec.spec.tree import top_logprobs
from tests.test_spec import MarkovModel, V, assert_matches, exact_distribution, tables, take


def test_kept_tokens_keeps_specials_then_the_most_frequent():
    counts = count_tokens([[5, 5, 5, 3, 3, 7], [3, 9]], vocab_size=12)
    assert counts[3] == 3 and counts[5] == 3 and counts[9] == 1
    assert kept_tokens(counts, 4, always=[0, 11]).tolist() == [0, 3, 5, 11]  # tie: lower id
    assert kept_tokens(counts, 5, always=[0]).tolist() == [0, 3, 5, 7, 9]
    with pytest.raises(ValueError, match="smaller than the 3 special tokens"):
        kept_tokens(counts, 2, always=[0, 1, 2])


@pytest.fixture(scope="module")
def trimmed_bundle(tmp_path_factory, demo_target, demo_draft):
    out = tmp_path_factory.mktemp("trim") / "bundle"
    export(demo_target, out, draft=demo_draft, precision="fp32", vocab_trim=1024)
    return out


def test_trimmed_head_is_a_row_subset_of_the_full_head(trimmed_bundle, fp32_bundle):
    m = read_manifest(trimmed_bundle)
    kept = np.load(trimmed_bundle / m.vocab_map)
    assert m.draft.vocab_size == len(kept) == 1024 and m.target.vocab_size == 4096
    assert set(m.eos_token_ids) <= set(kept.tolist())
    full_m = read_manifest(fp32_bundle)
    ids = np.random.default_rng(0).integers(0, 4096, 20)
    small = DecoderSession(trimmed_bundle / "draft.onnx", m.draft,
                           ["CPUExecutionProvider"]).forward(ids)
    full = DecoderSession(fp32_bundle / "draft.onnx", full_m.draft,
                          ["CPUExecutionProvider"]).forward(ids)
    assert small.shape == (20, 1024)
    assert np.abs(small - full[:, kept]).max() < 1e-5


def test_target_source_keeps_what_the_target_says(trimmed_bundle, engine):
    """The kept quarter of the vocabulary, counted on the target's own generations from
    generic prompts, covers most tokens of its greedy code continuations: far more than
    a random quarter does."""
    kept = set(np.load(trimmed_bundle / "draft_vocab.npy").tolist())
    random_kept = set(np.random.default_rng(0).choice(4096, len(kept), replace=False).tolist())
    out = engine.generate("def main(argv):\n", max_new_tokens=64, mode="ar").token_ids
    coverage = np.mean([t in kept for t in out])
    assert coverage > 0.6 and coverage > 2 * np.mean([t in random_kept for t in out])


@pytest.mark.parametrize("kwargs", [dict(mode="spec"), dict(mode="spec", tree_budget=8),
                                    dict(mode="spec", tree_budget=8, tree_lookup=4)])
def test_greedy_trimmed_spec_equals_ar(trimmed_bundle, kwargs):
    """Chains, trees, and trees with prompt-lookup branches (which may hold tokens the
    trimmed head cannot propose)."""
    engine = edgespec.load(trimmed_bundle)
    for prompt in ("def quicksort(items):", "import os\n", "class Stack:\n"):
        ar = engine.generate(prompt, max_new_tokens=40, mode="ar")
        spec = engine.generate(prompt, max_new_tokens=40, **kwargs)
        assert spec.token_ids == ar.token_ids
        assert spec.stats.accepted > 0


def test_a_trimmed_draft_ranks_in_full_vocabulary_ids():
    target_table, draft_table = tables(4)
    kept = np.array([0, 2, 4])
    draft = TrimmedModel(MarkovModel(draft_table[:, kept]), kept, V)
    logprobs, ids = draft.forward_ranked([1, 3], 2, 0.8)
    reference = top_logprobs(TrimmedModel(MarkovModel(draft_table[:, kept]), kept, V)
                             .forward([1, 3]), 2, 0.8)
    assert ids.tolist() == reference[1].tolist() and set(ids.ravel()) <= set(kept)
    np.testing.assert_allclose(logprobs, reference[0], atol=1e-6)


def test_sampling_with_a_trimmed_draft_is_lossless():
    """Draft keeps 3 of 5 tokens; the target's distribution is still matched exactly, so
    the 2 tokens the draft can never propose still appear, through the residual."""
    target_table, draft_table = tables(10)
    kept = np.array([0, 2, 4])
    params = SamplingParams(1.0)
    rng = np.random.default_rng(2)
    samples = []
    for _ in range(6000):
        draft = TrimmedModel(MarkovModel(draft_table[:, kept]), kept, V)  # a 3-column head
        gen = chain_decode(MarkovModel(target_table), ModelDrafter(draft), [0], params, 3,
                           rng, GenerationStats("spec"))
        samples.append(tuple(take(gen, 3)))
    assert any(t in (1, 3) for s in samples for t in s)
    assert_matches(samples, exact_distribution(target_table, 0, 3, params))


def test_trim_errors(tmp_path, demo_target, demo_draft):
    with pytest.raises(EdgespecError, match="choose a larger K"):
        export(demo_target, tmp_path / "b", draft=demo_draft, vocab_trim=2)
    vocab = json.loads((demo_target / "config.json").read_text())["vocab_size"]
    with pytest.raises(EdgespecError, match=f"keeps every one of the target's {vocab} tokens"):
        export(demo_target, tmp_path / "b", draft=demo_draft, vocab_trim=vocab)
    with pytest.raises(EdgespecError, match="neither 'target' nor 'corpus:PATH'"):
        export(demo_target, tmp_path / "b", draft=demo_draft, vocab_trim=100,
               trim_source="wiki")
    with pytest.raises(EdgespecError, match="does not exist"):
        export(demo_target, tmp_path / "b", draft=demo_draft, vocab_trim=100,
               trim_source=f"corpus:{tmp_path / 'none'}")
    assert not (tmp_path / "b").exists()


def test_corpus_source(tmp_path, demo_target, demo_draft):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("lambda lambda lambda yield yield\n" * 50)
    export(demo_target, tmp_path / "b", draft=demo_draft, vocab_trim=64,
           trim_source=f"corpus:{corpus}")
    kept = set(np.load(tmp_path / "b" / "draft_vocab.npy").tolist())
    tok = edgespec.load(tmp_path / "b").tokenizer
    assert set(tok.encode("lambda yield", add_special_tokens=False)) <= kept


@pytest.mark.parametrize("precision,quant,kernels", [
    ("fp32", "auto", "edgespec"), ("int8", "auto", "edgespec"), ("int8", "k", "edgespec"),
    ("int8", "rot", "onnxruntime")])
def test_retrim_an_exported_bundle(tmp_path, demo_target, demo_draft, precision, quant,
                                   kernels, monkeypatch):
    """Every head layout: a float MatMul, int8 blocks (k), int8 rows on edgespec's
    RowQMatMul (auto: rot where the kernel library is built) and on ONNX Runtime's
    MatMulIntegerToFloat."""
    import subprocess
    import sys

    monkeypatch.setenv("EDGESPEC_KERNELS", kernels)
    export(demo_target, tmp_path / "b", draft=demo_draft, precision=precision, quant=quant)
    ops = {n.op_type for n in onnx.load(tmp_path / "b" / "draft.onnx",
                                        load_external_data=False).graph.node}
    assert (quant == "rot" and kernels == "onnxruntime") == ("MatMulIntegerToFloat" in ops)
    with pytest.raises(EdgespecError, match="--k 100000 is at or past the vocabulary's 4096"):
        retrim_bundle(tmp_path / "b", 100000)  # it spoke of re-exporting to keep 100000
    full = edgespec.load(tmp_path / "b")
    ids = [0, 17, 300, 41]
    full_logits = full.draft.forward(ids)
    out = subprocess.run([sys.executable, "-m", "edgespec.cli", "vocab-trim",
                          str(tmp_path / "b"), "--k", "500"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    trimmed = edgespec.load(tmp_path / "b")  # verifies every file's sha256 too
    kept = np.load(tmp_path / "b" / "draft_vocab.npy")
    assert trimmed.manifest.draft.vocab_size == 500 == len(kept)  # int8: not whole tiles
    got = trimmed.draft.forward(ids)  # full-vocabulary view: -inf outside the kept ids
    assert np.abs(got[:, kept] - full_logits[:, kept]).max() < 1e-5
    assert (np.delete(got, kept, axis=1) < -1e30).all()
    ar = trimmed.generate("def f(x):", max_new_tokens=24, mode="ar")
    assert trimmed.generate("def f(x):", max_new_tokens=24).token_ids == ar.token_ids
    again = subprocess.run([sys.executable, "-m", "edgespec.cli", "vocab-trim",
                            str(tmp_path / "b"), "--k", "1024"], capture_output=True, text=True)
    assert again.returncode == 1 and "already keeps 500" in again.stderr


@pytest.fixture(scope="module")
def nested_trimmed(tmp_path_factory, demo_target):
    out = tmp_path_factory.mktemp("nested_trim") / "b"
    export(demo_target, out, draft="nested", vocab_trim=1024, accuracy_level=0)
    return out


def test_a_nested_draft_takes_a_trimmed_head(nested_trimmed, nested_bundle):
    """BitNest + VocabTrim: the draft view of the one graph gives exactly the untrimmed
    nested draft's logits on the kept rows; the target view still gives every row."""
    m, full = read_manifest(nested_trimmed), read_manifest(nested_bundle)
    kept = np.load(nested_trimmed / m.vocab_map)
    assert m.draft.graph == m.target.graph and m.draft.vocab_size == len(kept) == 1024
    ids = np.random.default_rng(1).integers(0, 4096, 16)

    def logits(bundle, entry):
        return DecoderSession(bundle / entry.graph, entry, ["CPUExecutionProvider"]).forward(ids)

    small, wide = logits(nested_trimmed, m.draft), logits(nested_bundle, full.draft)
    assert small.shape == (16, 1024)
    assert np.abs(small - wide[:, kept]).max() < 1e-4
    target = logits(nested_trimmed, m.target)
    assert np.abs(target - logits(nested_bundle, full.target)).max() < 1e-4
    engine = edgespec.load(nested_trimmed)
    assert engine.draft.model.session is engine.target.session  # still one session
    for prompt in ("def quicksort(items):", "class Stack:\n"):
        ar = engine.generate(prompt, max_new_tokens=32, mode="ar")
        for kwargs in (dict(mode="spec"), dict(mode="spec", tree_budget=8)):
            assert engine.generate(prompt, max_new_tokens=32, **kwargs).token_ids == ar.token_ids
    with pytest.raises(EdgespecError, match="nested in the target"):
        retrim_bundle(nested_trimmed, 512)
