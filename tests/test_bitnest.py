"""BitNest nested precision: codes, the W8 target, and the draft inside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgespec
from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.quant.bitnest import nest
from edgespec.quant.blockwise import dequantize
from edgespec.runtimes import DecoderSession
from tests.conftest import torch_logits, torch_model


@pytest.mark.parametrize("k", [64, 96])
def test_codes_reconstruct_exactly(k):
    w = np.random.default_rng(k).normal(size=(16, k)).astype(np.float32)
    nw = nest(w, block_size=32)
    codes = nw.int8_codes().astype(np.float32)
    s = np.repeat(nw.base.scales.reshape(16, -1), 32, axis=1)[:, :k]
    np.testing.assert_allclose(nw.w8(), codes * s / 16, rtol=0, atol=1e-6)
    assert codes.min() >= -128 and codes.max() <= 127
    # the draft's weight is the high nibble alone: c = 16·q4 + qr, qr in [-8, 7]
    hi = np.floor_divide(nw.int8_codes().astype(np.int16) + 8, 16)
    np.testing.assert_allclose(dequantize(nw.base), hi * s, atol=1e-6)
    # the same W8 as one 8-bit plane (the LM head both models read whole)
    w8 = nw.as_8bit()
    assert w8.bits == 8 and w8.packed.shape == (16, k // 32, 32)
    np.testing.assert_allclose(dequantize(w8), nw.w8(), rtol=0, atol=1e-6)


def test_w8_is_much_closer_than_the_base_and_clipping_helps():
    w = np.random.default_rng(0).standard_t(df=3, size=(64, 256)).astype(np.float32)
    nw, plain = nest(w), nest(w, clip_search=False)
    base_err = np.abs(dequantize(nw.base) - w).mean()
    assert np.abs(nw.w8() - w).mean() < base_err / 8
    assert base_err < np.abs(dequantize(plain.base) - w).mean()


def nested_reference(path, part: str):
    """The PyTorch model computing with exactly the nested W8 weights, or with their
    4-bit base alone (the LM head W8 in both: the draft reads its whole nest too)."""
    def weight(w: np.ndarray, part: str = part) -> torch.Tensor:
        nw = nest(w)
        return torch.from_numpy(nw.w8() if part == "w8" else dequantize(nw.base))

    model = torch_model(path)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                module.weight.copy_(weight(module.weight.numpy()))
        model.lm_head.weight = torch.nn.Parameter(weight(model.lm_head.weight.numpy(), "w8"))
    return model


@pytest.mark.parametrize("role,part", [("target", "w8"), ("draft", "base")])
def test_one_graph_holds_both_models(nested_bundle, demo_target, role, part):
    """The target view computes with W8 = base + residual, the draft view with the base;
    both are the same graph file and weights."""
    m = read_manifest(nested_bundle)
    assert (m.target.precision, m.draft.precision) == ("int8", "int4")
    assert m.draft.graph == m.target.graph and m.draft.data_files == m.target.data_files
    entry = m.target if role == "target" else m.draft
    ids = np.random.default_rng(1).integers(0, 4096, 32)
    ref = torch_logits(nested_reference(demo_target, part), ids)
    sess = DecoderSession(nested_bundle / entry.graph, entry, ["CPUExecutionProvider"])
    assert np.abs(np.concatenate([sess.forward(ids[:20]), sess.forward(ids[20:])]) - ref
                  ).max() < 2e-3


def test_a_nested_draft_cannot_be_placed_apart(nested_bundle):
    with pytest.raises(EdgespecError, match="--draft-device does not apply"):
        edgespec.load(nested_bundle, device="cpu", draft_device="cpu")


def test_engine_shares_one_session_and_one_kv_store(nested_bundle):
    """The draft holds no KV buffers: it reads the target's entries for the committed
    prefix and writes only past the target's length."""
    engine = edgespec.load(nested_bundle)
    assert engine.draft.session is engine.target.session
    assert all(dk is tk for dk, tk in zip(engine.draft.cache.buffers,
                                          engine.target.cache.buffers, strict=True))
    engine.generate("def quicksort(items):", max_new_tokens=24, mode="spec")
    held = engine.target.cache.length
    engine.target.forward([5])  # the target's own next step...
    before = [k[:, :, :held + 1].copy() for k, _ in engine.target.cache.arrays]
    engine.draft.forward([6, 7])  # ...then a draft step writes only beyond it
    after = [k[:, :, :held + 1] for k, _ in engine.target.cache.arrays]
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    assert engine.draft.cache.length == held + 3


@pytest.mark.parametrize("kwargs", [dict(), dict(tree_budget=8, tree_top_k=2),
                                    dict(adaptive=True)])
def test_greedy_nested_spec_equals_w8_ar(nested_bundle, kwargs):
    engine = edgespec.load(nested_bundle)
    for prompt in ("def quicksort(items):", "import os\n", "class Stack:\n"):
        ar = engine.generate(prompt, max_new_tokens=40, mode="ar")
        spec = engine.generate(prompt, max_new_tokens=40, mode="spec", **kwargs)
        assert spec.token_ids == ar.token_ids
        assert spec.stats.accepted > 0


def test_nested_sampling_matches_ar_distribution(nested_bundle):
    from scipy.stats import chi2_contingency

    engine = edgespec.load(nested_bundle)
    counts = {"ar": {}, "spec": {}}
    for mode in counts:
        for seed in range(400):
            key = tuple(engine.generate("def main(", max_new_tokens=2, mode=mode,
                                        temperature=1.0, top_k=3, seed=seed).token_ids)
            counts[mode][key] = counts[mode].get(key, 0) + 1
    keys = sorted(set(counts["ar"]) | set(counts["spec"]))
    table = np.array([[counts[m].get(k, 0) for k in keys] for m in counts])
    table = table[:, table.sum(0) >= 10]
    assert table.shape[1] >= 2 and chi2_contingency(table).pvalue > 1e-3
