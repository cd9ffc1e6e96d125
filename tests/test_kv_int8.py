"""int8 KV cache: GroupQueryAttention writes int8 codes with calibrated per-channel scales.

Oracles: the float-KV graph of the same weights (what the codes must encode), numpy
rounding (what a code must be), and the runtime's own AR decoding (losslessness).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import edgespec
from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.export import export
from edgespec.runtimes import DecoderSession
from edgespec.runtimes.planner import ModelSizes
from edgespec.runtimes.segments import Placement, SegmentedDecoder

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def kv8_bundle(tmp_path_factory, demo_target, demo_draft):
    out = tmp_path_factory.mktemp("kv8") / "b"
    export(demo_target, out, draft=demo_draft, precision="fp16", draft_precision="int8",
           kv_cache="int8")
    return out


def sessions(bundle_a, bundle_b):
    return [DecoderSession(b / read_manifest(b).target.graph, read_manifest(b).target, CPU,
                           "cpu", max_len=256) for b in (bundle_a, bundle_b)]


def test_the_cache_holds_int8_codes_of_the_float_keys(kv8_bundle, demo_bundle):
    """Layer 0's keys do not depend on the cache, so its codes must be exactly the float
    graph's rotated keys divided by the calibrated scale and rounded (±1 for rounding
    ties between the two computations)."""
    m = read_manifest(kv8_bundle)
    assert (m.target.kv_dtype, m.target.compute_dtype, m.draft.kv_dtype) == (
        "int8", "float32", "int8")
    kv8, fp = sessions(kv8_bundle, demo_bundle)
    ids = np.random.default_rng(0).integers(0, 4096, 40)
    kv8.forward(ids)
    fp.forward(ids)
    graph = onnx.load(str(kv8_bundle / m.target.graph))
    scale = next(numpy_helper.to_array(t) for t in graph.graph.initializer
                 if t.name == "layers.0.k_scale")  # [kv_heads, 1, head_dim]
    codes = kv8.cache.arrays[0][0][0, :, :40]
    assert codes.dtype == np.int8
    want = np.clip(np.rint(fp.cache.arrays[0][0][0, :, :40] / scale), -128, 127)
    assert np.abs(codes.astype(np.int32) - want).max() <= 1
    assert np.abs(codes).max() > 64  # the scales use the range, not a sliver of it


def test_int8_kv_logits_stay_close_to_float_kv(kv8_bundle, demo_bundle):
    kv8, fp = sessions(kv8_bundle, demo_bundle)
    ids = np.random.default_rng(1).integers(0, 4096, 96)
    a, b = kv8.forward(ids), fp.forward(ids)
    assert np.abs(a - b).max() < 0.5  # observed 0.15 with logits up to ~16
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.95


@pytest.mark.parametrize("kwargs", [dict(mode="spec"), dict(mode="spec", tree_budget=12),
                                    dict(mode="lookup")])
def test_greedy_spec_with_int8_kv_equals_ar(kv8_bundle, kwargs):
    engine = edgespec.load(kv8_bundle)
    for prompt in ("def quicksort(items):", "class Stack:\n", "import os\n"):
        ar = engine.generate(prompt, max_new_tokens=40, mode="ar")
        assert engine.generate(prompt, max_new_tokens=40, **kwargs).token_ids == ar.token_ids


def test_int8_kv_takes_a_quarter_of_the_memory_and_segments_still_cut(kv8_bundle,
                                                                      demo_bundle):
    m, f = read_manifest(kv8_bundle), read_manifest(demo_bundle)
    small = ModelSizes.of(kv8_bundle / m.target.graph, m.target).kv_per_token
    assert small * 4 == ModelSizes.of(demo_bundle / f.target.graph, f.target).kv_per_token
    path, layers = kv8_bundle / m.target.graph, m.target.num_layers
    whole = DecoderSession(path, m.target, CPU, "cpu", max_len=128)
    seg = SegmentedDecoder(path, m.target, [Placement(0, 3), Placement(3, layers + 2)], 128)
    ids = list(range(7, 50))
    assert np.abs(seg.forward(ids) - whole.forward(ids)).max() < 1e-3


def test_kv_cache_errors(tmp_path, demo_target):
    with pytest.raises(EdgespecError, match="not one of auto, float, float16, int8"):
        export(demo_target, tmp_path / "b", kv_cache="int4")
    with pytest.raises(EdgespecError, match="GroupQueryAttention"):
        export(demo_target, tmp_path / "b", kv_cache="int8", ep_profile="dml",
               precision="int4")
    assert not (tmp_path / "b").exists()


def test_nested_trimmed_draft_with_int8_kv(tmp_path, demo_target):
    """Every export feature at once: BitNest draft, trimmed head, int8 KV for both views."""
    export(demo_target, tmp_path / "b", draft="nested", vocab_trim=1024, kv_cache="int8")
    engine = edgespec.load(tmp_path / "b")
    m = engine.manifest
    assert (m.target.kv_dtype, m.draft.kv_dtype, m.draft.vocab_size) == ("int8", "int8", 1024)
    for prompt in ("def quicksort(items):", "class Stack:\n"):
        ar = engine.generate(prompt, max_new_tokens=32, mode="ar")
        spec = engine.generate(prompt, max_new_tokens=32, mode="spec")
        assert spec.token_ids == ar.token_ids and spec.stats.accepted > 0


def test_a_rebuilt_graph_does_not_keep_its_first_weights(kv8_bundle, demo_bundle):
    """Calibration builds the graph twice; the bundle holds one copy of the weights."""
    size = (kv8_bundle / "target.onnx.data").stat().st_size
    assert size < 1.05 * (demo_bundle / "target.onnx.data").stat().st_size
