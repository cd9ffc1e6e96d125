"""edgespec.bench picks its modes from the bundle: whatever draft it carries (a nested one
here), none without a draft, and a mode the engine refuses is reported, not run."""

from __future__ import annotations

import pytest

import edgespec
from edgespec.bench import bench_modes, draft_description, run_bench
from edgespec.bench_sets import load_set, select
from edgespec.errors import EdgespecError


@pytest.fixture(scope="module")
def target_only(tmp_path_factory, demo_target):
    from edgespec.export import export

    out = tmp_path_factory.mktemp("alone") / "bundle"
    export(demo_target, out, precision="int8")
    return edgespec.load(out)


def test_a_nested_draft_runs_the_model_draft_modes_losslessly(nested_bundle):
    engine = edgespec.load(nested_bundle)
    assert draft_description(engine).startswith("nested")
    prompts = select(load_set("real"), ("chat", "code"), 1)
    report = run_bench(engine, prompts, max_new_tokens=12, temperatures=(0.0,),
                       modes=("chain", "lookup"))
    assert report["default_mode"] == "chain γ=4"
    rows = {(r["category"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(c, m) for c in ("chat", "code", "all")
                         for m in ("ar", "chain γ=4", "lookup")}
    assert all(r["greedy_differs_from_ar"] == 0 for r in rows.values())
    chain = rows["all", "chain γ=4"]
    assert chain["is_default"] and chain["tokens_per_target_pass"] > 1
    assert 0 < chain["acceptance"] <= 1
    assert rows["all", "ar"]["tokens_per_target_pass"] == 1.0


def test_extra_chain_lengths_run_as_modes_of_their_own(nested_bundle):
    """`gammas` adds a chain of each length; its passes draft at most that many tokens,
    and greedy output still equals AR's."""
    engine = edgespec.load(nested_bundle)
    configs, _ = bench_modes(engine, ("chain",), (1, 4))
    assert list(configs) == ["ar", "chain γ=4", "chain γ=1"]
    prompts = select(load_set("real"), ("chat",), 1)
    report = run_bench(engine, prompts, max_new_tokens=12, temperatures=(0.0,),
                       modes=("ar",), gammas=(1,))
    rows = {r["mode"]: r for r in report["rows"] if r["category"] == "all"}
    assert set(rows) == {"ar", "chain γ=1"}
    assert rows["chain γ=1"]["greedy_differs_from_ar"] == 0
    assert 1 < rows["chain γ=1"]["tokens_per_target_pass"] <= 2


def test_without_a_draft_only_ar_and_lookup_run(target_only):
    configs, default = bench_modes(target_only)
    assert list(configs) == ["ar", "lookup"] and default == "ar"
    assert draft_description(target_only) == "none"
    prompts = select(load_set("real"), ("chat",), 1)
    report = run_bench(target_only, prompts, max_new_tokens=4, temperatures=(0.0, 0.0),
                       modes=("ar",))  # a temperature given twice is one row, counted once
    rows = [r for r in report["rows"] if r["category"] == "chat"]
    assert len(rows) == 1 and rows[0]["new_tokens"] == 4


def test_a_mode_the_engine_refuses_is_reported_with_its_reason(target_only):
    """In bench's own words (the engine's spoke of --mode spec, a mode bench has not), and
    a run where nothing asked for can run is an error, not a table of AR alone."""
    prompts = select(load_set("real"), ("chat",), 1)
    report = run_bench(target_only, prompts, max_new_tokens=4, temperatures=(0.0,),
                       modes=("tree", "lookup"))
    assert {r["mode"] for r in report["rows"]} == {"ar", "lookup"}
    assert report["skipped_modes"]["tree 16"] == ("this model has no draft (export it with "
                                                  "--draft), so only ar and lookup run.")
    with pytest.raises(EdgespecError, match="no mode asked for can run here: this model has "
                                            "no draft"):
        run_bench(target_only, prompts, max_new_tokens=4, temperatures=(0.0,),
                  modes=("tree",))
