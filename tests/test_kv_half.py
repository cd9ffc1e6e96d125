"""float16 KV cache: edgespec's attention op stores keys and values as IEEE halves.

Oracles: the float-KV export of the same weights (layer 0's keys and values do not depend
on the cache, so the halves must be numpy's float16 of its float cache, exactly), the
runtime's own single-token passes (chains and trees bitwise) and its own AR decoding
(losslessness).
"""

from __future__ import annotations

import numpy as np
import pytest

import edgespec
from edgespec import kernels
from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.export import export
from edgespec.runtimes import DecoderSession
from edgespec.runtimes.exactness import measure
from edgespec.runtimes.planner import ModelSizes

pytestmark = pytest.mark.skipif(not kernels.for_export(), reason="kernel library not built")

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, demo_target, demo_draft):
    """The demo pair at the default precision, with float16 and with float caches."""
    root = tmp_path_factory.mktemp("kvhalf")
    for kv in ("float16", "float"):
        export(demo_target, root / kv, draft=demo_draft, kv_cache=kv)
    return root / "float16", root / "float"


def sessions(*paths):
    return [DecoderSession(p / read_manifest(p).target.graph, read_manifest(p).target, CPU,
                           "cpu", max_len=256) for p in paths]


def test_the_caches_hold_the_float_caches_rounded_to_half(bundles):
    m = read_manifest(bundles[0])
    assert (m.target.kv_dtype, m.target.compute_dtype, m.draft.kv_dtype) == (
        "float16", "float32", "float16")
    half, full = sessions(*bundles)
    ids = np.random.default_rng(0).integers(0, 4096, 40)
    half.forward(ids)
    full.forward(ids)
    for kind in (0, 1):  # layer 0's rotated keys, and its values
        held = half.cache.arrays[0][kind][0, :, :40]
        assert held.dtype == np.float16
        assert np.array_equal(held, full.cache.arrays[0][kind][0, :, :40].astype(np.float16))


def test_half_kv_logits_stay_close_to_float_kv(bundles):
    half, full = sessions(*bundles)
    ids = np.random.default_rng(1).integers(0, 4096, 96)
    a, b = half.forward(ids), full.forward(ids)
    assert np.abs(a - b).max() < 0.5
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.95


def test_half_kv_chains_and_trees_are_bitwise(bundles):
    engine = edgespec.load(bundles[0], device="cpu")
    rng = np.random.default_rng(2)
    got = measure(engine.target, rng.integers(3, 4096, 40).tolist(),
                  rng.integers(3, 4096, 17).tolist(), trees=(5, 17))
    assert got.chain == got.tree == got.prefill == {5: 0.0, 17: 0.0}


@pytest.mark.parametrize("kwargs", [dict(mode="spec"), dict(mode="spec", tree_budget=12),
                                    dict(mode="lookup")])
def test_greedy_spec_with_half_kv_equals_ar(bundles, kwargs):
    engine = edgespec.load(bundles[0])
    for prompt in ("def quicksort(items):", "class Stack:\n", "import os\n"):
        ar = engine.generate(prompt, max_new_tokens=40, mode="ar")
        assert engine.generate(prompt, max_new_tokens=40, **kwargs).token_ids == ar.token_ids


def test_half_kv_takes_half_the_memory(bundles):
    half, full = (ModelSizes.of(p / read_manifest(p).target.graph, read_manifest(p).target)
                  for p in bundles)
    assert half.kv_per_token * 2 == full.kv_per_token


def test_half_kv_needs_the_kernel_library(tmp_path, demo_target, monkeypatch):
    monkeypatch.setenv("EDGESPEC_KERNELS", "onnxruntime")
    with pytest.raises(EdgespecError, match="needs edgespec's kernel library"):
        export(demo_target, tmp_path / "b", kv_cache="float16")
    assert not (tmp_path / "b").exists()


def test_auto_halves_the_caches_where_activations_are_int8(tmp_path, demo_target,
                                                          monkeypatch):
    """The default: float16 where edgespec's kernels run the graph (int8 activations);
    fp32 exports and fp32 activations (accuracy_level 0) stay float references, and
    bundles for any ONNX Runtime keep float."""
    for name, kwargs, want in (("int4", dict(precision="int4"), "float16"),
                               ("fp32", dict(precision="fp32"), "float32"),
                               ("acc0", dict(precision="int4", accuracy_level=0), "float32")):
        export(demo_target, tmp_path / name, **kwargs)
        assert read_manifest(tmp_path / name).target.kv_dtype == want
    monkeypatch.setenv("EDGESPEC_KERNELS", "onnxruntime")
    export(demo_target, tmp_path / "portable", precision="int4")
    assert read_manifest(tmp_path / "portable").target.kv_dtype == "float32"
