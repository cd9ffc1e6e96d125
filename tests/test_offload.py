"""Offload: segment graphs, streamed weights, the memory planner and `edgespec plan`.

The oracle for segments is the whole graph in one session (itself parity-tested against
PyTorch in test_export); the oracle for plans is arithmetic done by hand in the tests.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgespec
from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.runtimes.decoder import NEG_INF, DecoderSession
from edgespec.runtimes.planner import Costs, ModelSizes, make_plan, parse_bytes
from edgespec.runtimes.segments import Placement, SegmentedDecoder
from tests.test_cli import assert_user_error, run

CPU = ["CPUExecutionProvider"]
MiB = 1 << 20
PROMPTS = ["def parse(", "class Stack:\n    def", "import os\n\ndef walk(", "# sum a list\n"]


def splits(layers: int) -> dict[str, list[Placement]]:
    """The units (embedding 0, layer i as i + 1, head layers + 1) cut in different ways."""
    units = layers + 2
    return {
        "two": [Placement(0, 3), Placement(3, units)],
        "after the embedding": [Placement(0, 1), Placement(1, units)],
        "every unit": [Placement(u, u + 1) for u in range(units)],
        "streamed middle": [Placement(0, 2), Placement(2, 4, streamed=True),
                            Placement(4, layers + 1), Placement(layers + 1, units)],
        "all streamed": [Placement(0, 1), Placement(1, layers + 1, streamed=True),
                         Placement(layers + 1, units)],
    }


def tree_pass(model, prefix: list[int]) -> np.ndarray:
    """Prefill, two steps, a 3-node tree (a; b and c children of a), then a rollback to
    a and one more step."""
    out = [model.forward(prefix), model.forward([11]), model.forward([12])]
    past = model.cache.length
    bias = np.zeros((1, 1, 3, past + 3), np.float32)
    bias[0, 0, 2, past + 1] = NEG_INF
    out.append(model.forward([77, 123, 555], positions=np.array([past, past + 1, past + 1]),
                             bias=bias))
    model.cache.trim(2)  # keep a
    out.append(model.forward([31]))
    return np.concatenate(out)


@pytest.mark.parametrize("split", ["two", "after the embedding", "every unit",
                                   "streamed middle", "all streamed"])
def test_segments_give_the_whole_graphs_logits(demo_bundle, split):
    m = read_manifest(demo_bundle)
    path = demo_bundle / m.target.graph
    whole = DecoderSession(path, m.target, CPU, "cpu", max_len=128)
    seg = SegmentedDecoder(path, m.target, splits(m.target.num_layers)[split], max_len=128)
    prefix = list(range(3, 40, 2))
    want, got = tree_pass(whole, prefix), tree_pass(seg, prefix)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert seg.cache.length == whole.cache.length
    assert seg.device == "cpu"


@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory, demo_target):
    """Quantized weights with fp32 activations (accuracy_level 0), the arithmetic the
    streamed path's kernel uses when weights arrive as inputs."""
    from edgespec.export import export

    out = tmp_path_factory.mktemp("int4") / "bundle"
    export(demo_target, out, precision="int4", accuracy_level=0)
    return out


def test_streamed_quantized_weights_match_resident_ones(int4_bundle):
    m = read_manifest(int4_bundle)
    path = int4_bundle / m.target.graph
    layers = m.target.num_layers
    whole = DecoderSession(path, m.target, CPU, "cpu", max_len=128)
    seg = SegmentedDecoder(path, m.target, splits(layers)["all streamed"], max_len=128)
    assert sum(s.weight_bytes for s in seg.segments) > 0.5 * sum(
        ModelSizes.of(path, m.target).layers)  # the layer weights really are inputs
    prefix = list(range(5, 30))
    want, got = tree_pass(whole, prefix), tree_pass(seg, prefix)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def offloaded(demo_bundle):
    m = read_manifest(demo_bundle)
    layers = m.target.num_layers
    return edgespec.load(demo_bundle, device="cpu", context=512,
                         placements=splits(layers)["streamed middle"])


@pytest.mark.parametrize("options", [
    dict(mode="spec"),
    dict(mode="spec", tree_budget=64, tree_best_first=True),
    dict(mode="spec", tree_budget=12, tree_depth=3),
    dict(mode="lookup"),
])
def test_greedy_output_with_a_segmented_target_equals_ar(engine, offloaded, options):
    for prompt in PROMPTS:
        want = engine.generate(prompt, max_new_tokens=40, mode="ar").token_ids
        got = offloaded.generate(prompt, max_new_tokens=40, **options)
        assert got.token_ids == want
        assert got.stats.device == "cpu"
        assert 0 <= got.stats.transfer_s <= got.stats.runtime_s


def test_bad_segment_plans_are_refused(demo_bundle):
    m = read_manifest(demo_bundle)
    path, units = demo_bundle / m.target.graph, m.target.num_layers + 2
    for bad in ([Placement(0, 3)], [Placement(0, 2), Placement(3, units)],
                [Placement(1, units)], []):
        with pytest.raises(EdgespecError, match="cover units"):
            SegmentedDecoder(path, m.target, bad)


# the planner, on sizes whose plans are worked out by hand in each test
SIZES = ModelSizes(embed=50 * MiB, head=60 * MiB, layers=[100 * MiB] * 10, shared=0,
                   kv_per_token=10 * 1024)  # 1 KiB per layer per token: 1 MiB at 1024
DRAFT = ModelSizes(embed=10 * MiB, head=10 * MiB, layers=[5 * MiB] * 2, shared=0,
                   kv_per_token=1024)  # 30 MiB + 1 MiB of KV
GPU = (5e-5, 2e-7)


def plan(budget_mib: int, costs: Costs, draft: ModelSizes | None = DRAFT):
    return make_plan(SIZES, budget_mib * MiB, 1024, costs, draft, group_bytes=200 * MiB)


def spans(p) -> list[tuple]:
    return [(x.start, x.stop, x.device, x.streamed) for x in p.placements]


def test_a_model_that_fits_is_not_offloaded():
    p = plan(2048, Costs(10e9, (0.05, 0.0), GPU))  # 60 + 31 + 10 + 50 + 1000 MiB
    assert p.offload == "none" and spans(p) == [(0, 12, "cuda", False)]
    assert p.gpu_bytes == (60 + 31 + 10 + 1050) * MiB
    assert p.tree_budget == 0


def test_the_whole_target_stays_on_the_gpu_before_the_draft_does():
    """1130 MiB hold the target (60 + 10 + 50 + 1000) but not the draft beside it: the
    draft runs on the CPU rather than 2 target layers being offloaded to make room."""
    p = plan(1130, Costs(10e9, (0.05, 0.0), GPU))
    assert p.offload == "none" and p.draft_device == "cpu"
    assert spans(p) == [(0, 12, "cuda", False)] and p.gpu_bytes == 1120 * MiB
    assert "the draft on the CPU" in p.summary()
    more = plan(1151, Costs(10e9, (0.05, 0.0), GPU))
    assert more.offload == "none" and more.draft_device == "cuda"


def test_slow_cpu_and_fast_pcie_stream_the_offloaded_layers():
    """1000 MiB: head 60 + draft 31 leave 909; streaming reserves KV 10 and two 2-layer
    buffers 400, so 499 MiB hold 4 layers; the embedding stays in host memory and 6
    layers are streamed in groups of two. A streamed layer costs 100 MiB / 10 GB/s =
    10.5 ms whatever the tokens, so the whole 1024-node tree fits within the 25% slack.
    Computing them on the CPU instead (9 resident, one 200 ms CPU layer) would be slower."""
    p = plan(1000, Costs(10e9, (0.2, 0.0), GPU))
    assert p.offload == "streamed" and p.resident_layers == 4
    assert spans(p) == [(0, 1, "cpu", False), (1, 5, "cuda", False), (5, 7, "cuda", True),
                        (7, 9, "cuda", True), (9, 11, "cuda", True), (11, 12, "cuda", False)]
    copy = 100 * MiB / 10e9
    assert p.pass_s[1] == pytest.approx(4 * (5e-5 + 2e-7) + 6 * copy)
    assert p.tree_budget == 1024
    assert p.gpu_bytes == (60 + 31 + 10 + 400 + 400) * MiB
    assert p.draft_device == "cuda"


def test_fast_cpu_and_slow_pcie_compute_offloaded_layers_on_the_cpu():
    """Same budget; a CPU layer costs 2 ms + 1 ms/token, a streamed one 105 ms. CPU
    layers keep their KV in host memory, so 909 MiB hold 9 layers with their 1 MiB of KV
    each. pass(1) = 9 gpu(1) + 3 ms; pass(2) adds 1 ms, more than 25% of it: the tree
    budget stays 1."""
    p = plan(1000, Costs(1e9, (2e-3, 1e-3), GPU))
    assert p.offload == "cpu" and p.resident_layers == 9
    assert spans(p) == [(0, 1, "cpu", False), (1, 10, "cuda", False), (10, 11, "cpu", False),
                        (11, 12, "cuda", False)]
    assert p.pass_s[1] == pytest.approx(9 * (5e-5 + 2e-7) + 3e-3)
    assert p.tree_budget == 1
    assert p.gpu_bytes == (60 + 31 + 9 + 900) * MiB


def test_tiny_budgets():
    with pytest.raises(EdgespecError, match="LM head"):
        plan(50, Costs(10e9, (0.05, 0.0), GPU))
    # 80 MiB: the head fits, the draft (31) does not and runs on the CPU; no layer fits,
    # so the embedding and every layer run on the CPU, as one segment
    p = plan(80, Costs(10e9, (0.05, 0.0), GPU))
    assert p.draft_device == "cpu" and p.offload == "cpu" and p.resident_layers == 0
    assert spans(p) == [(0, 11, "cpu", False), (11, 12, "cuda", False)]
    assert [i.where for i in p.items] == ["gpu", "cpu", "cpu"] + ["cpu"] * 5


def test_parse_bytes():
    assert parse_bytes("6GiB") == 6 << 30
    assert parse_bytes("1TiB") == 1 << 40 and parse_bytes("2TB") == 2 * 10**12
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5 gib") == 3 << 29
    with pytest.raises(EdgespecError, match="memory size"):
        parse_bytes("six gigs")


def test_plan_sizes_add_up_to_the_bundles_weights(demo_bundle):
    m = read_manifest(demo_bundle)
    sizes = ModelSizes.of(demo_bundle / m.target.graph, m.target)
    data = (demo_bundle / m.target.data_files[0]).stat().st_size
    # constants under ONNX's 1 KiB external-data threshold are stored in the graph itself
    assert abs(sizes.total - data) < 64 * 1024
    assert len(set(sizes.layers)) == 1  # identical layers weigh the same
    assert sizes.kv_per_token == 2 * 6 * 2 * 64 * 4  # K and V, 6 layers, 2 heads, fp32


def test_a_tied_float_head_counts_the_table_it_copies_at_load(fp32_bundle):
    """An fp32 export stores a tied table once; ONNX Runtime folds the head's transpose of
    it into a copy, so a plan must count it in the head as well as in the embedding."""
    m = read_manifest(fp32_bundle)
    sizes = ModelSizes.of(fp32_bundle / m.target.graph, m.target)
    table = m.target.vocab_size * m.target.hidden_size * 4
    assert sizes.embed >= table and sizes.head >= table
    data = (fp32_bundle / m.target.data_files[0]).stat().st_size
    assert abs(sizes.total - table - data) < 64 * 1024  # on disk once


def test_an_offload_plans_tree_is_what_settings_are_checked_against():
    """Offloaded, spec mode verifies the planner's best-first tree (Engine.resolve): chain
    settings then do nothing, and are refused as they are with a tree asked for."""
    from types import SimpleNamespace

    engine = edgespec.load()
    engine.plan = SimpleNamespace(tree_budget=16)  # what _plan_offload sets on CUDA
    with pytest.raises(EdgespecError, match="draft_tokens does nothing in mode spec with a "
                                            "tree"):
        engine.generate("def f(", mode="spec", draft_tokens=6)
    tree = engine.generate("def f(", max_new_tokens=24, mode="spec")
    assert tree.token_ids == engine.generate("def f(", max_new_tokens=24, mode="ar").token_ids
    engine.plan = SimpleNamespace(tree_budget=0)  # nothing offloaded: the draft's chains
    chain = engine.generate("def f(", max_new_tokens=24, draft_tokens=3)
    assert chain.token_ids == tree.token_ids and chain.stats.drafted > 0


def test_plan_command(demo_bundle, nested_bundle):
    # a budget the demo target does not fit (16.8 MiB of it would need to be resident)
    r = run("plan", str(demo_bundle), "--gpu-memory", "14MiB", "--context", "1024", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["offload"] in ("streamed", "cpu") and got["gpu_bytes"] <= 14 * MiB
    assert got["segments"][-1]["start"] == 7 and got["segments"][0] == {
        "start": 0, "stop": 1, "device": "cpu", "streamed": False}
    assert "GPU layer times (no GPU here)" in got["assumed"]
    table = run("plan", str(demo_bundle), "--gpu-memory", "16MiB")
    assert table.returncode == 0 and "target LM head" in table.stdout
    limit = read_manifest(demo_bundle).target.max_positions
    wide = run("plan", str(demo_bundle), "--gpu-memory", "1GiB", "--context", "100000")
    assert f"KV cache for {limit} tokens (the model's limit)" in " ".join(wide.stdout.split())
    assert_user_error(run("plan", str(demo_bundle)), "--gpu-memory")
    assert_user_error(run("plan", str(nested_bundle), "--gpu-memory", "8MiB"),
                      "cannot split a BitNest")
    fits = run("plan", str(nested_bundle), "--gpu-memory", "1GiB")  # nothing to split
    assert fits.returncode == 0 and "draft on" not in fits.stdout, fits.stderr  # one graph
    fits = json.loads(run("plan", str(nested_bundle), "--gpu-memory", "1GiB", "--json").stdout)
    assert fits["offload"] == "none" and fits["draft_device"] is None
    assert_user_error(run("generate", "x", "--device", "cpu", "--gpu-memory", "1GiB"),
                      "does not use CUDA")


def test_a_draftless_bundle_is_planned_without_a_tree(tmp_path, demo_target):
    """No drafter grows a tree there: the plan showed "tree budget 2" all the same."""
    from edgespec.export import export

    export(demo_target, tmp_path / "b", draft="none")
    r = run("plan", str(tmp_path / "b"), "--gpu-memory", "3MiB", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["offload"] != "none" and got["tree_budget"] == 0
    table = run("plan", str(tmp_path / "b"), "--gpu-memory", "3MiB")
    assert "resident" in table.stdout and "tree budget" not in table.stdout


def test_device_auto_reports_the_cpu_here():
    r = run("generate", "def f(", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["stats"]["device"] == "cpu"


def test_a_planned_offload_verifies_large_best_first_trees_losslessly(engine, demo_bundle):
    """With a plan (made here for a small GPU and a fast link, as CUDA start-up would),
    spec mode grows and verifies the planned best-first tree; greedy output stays AR's."""
    m = read_manifest(demo_bundle)
    sizes = ModelSizes.of(demo_bundle / m.target.graph, m.target)
    plan = make_plan(sizes, 12 * MiB, 512, Costs(16e9, (1e-4, 2e-5), GPU))
    assert plan.offload == "streamed" and plan.tree_budget >= 64
    offloaded = edgespec.load(demo_bundle, device="cpu", context=512, placements=[
        Placement(p.start, p.stop, "cpu", p.streamed) for p in plan.placements])
    offloaded.plan = plan
    new = 2 * plan.tree_budget  # room for full trees (none drafts past the tokens asked)
    for prompt in PROMPTS[:2]:
        want = engine.generate(prompt, max_new_tokens=new, mode="ar").token_ids
        got, first = [], None
        for record in offloaded.records(prompt, max_new_tokens=new, mode="spec"):
            got += record.tokens
            first = first or record.stats.drafted
        assert got == want
        # the first step's tree pass took a tree of about the planned size (and one chain
        # pass verified the path it picked)
        assert first > 0.5 * plan.tree_budget
        assert record.stats.tokens_per_target_pass > 1
