"""Offload on the CPU: the cost model's decisions, and what segmenting and streaming cost.

1. Decisions: the planner run on BUNDLE's real sizes and CPU layer times measured here,
   for GPU budgets of 1/4, 1/2 and 3/4 of the target and simulated host->GPU bandwidths
   (the GPU's own layer times are the planner's assumed defaults: no GPU here).
2. Overhead: greedy decoding speed of the target as one session, as segments with
   resident weights, and as segments whose weights are streamed (graph inputs rather than
   constants), side by side in one run. On the CPU "streaming" copies nothing, so the
   third row isolates the cost of weights-as-inputs: ONNX Runtime cannot prepack them.

    python tools/bench_offload.py edgespec/assets/demo
    python tools/bench_offload.py /tmp/qwen05b-int4 --steps 24
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgespec.bundle import read_manifest
from edgespec.runtimes.decoder import DecoderSession
from edgespec.runtimes.planner import ModelSizes, expected_tokens, make_plan, measure_costs
from edgespec.runtimes.segments import Placement, SegmentedDecoder

BANDWIDTHS = (2e9, 8e9, 16e9, 32e9, 64e9)


def decisions(bundle: Path, context: int) -> list[dict]:
    m = read_manifest(bundle, verify=False)
    path = bundle / m.target.graph
    sizes = ModelSizes.of(path, m.target)
    measured, _ = measure_costs(path, m.target, gpu=False)
    rows = []
    for share in (0.25, 0.5, 0.75):
        budget = int(share * (sizes.total + sizes.kv_per_token * context))
        for bandwidth in BANDWIDTHS:
            costs = replace(measured, bandwidth=bandwidth)
            try:
                plan = make_plan(sizes, budget, context, costs)
            except Exception as e:  # a budget below the LM head: reported, not fatal
                rows.append({"budget_share": share, "bandwidth_GBps": bandwidth / 1e9,
                             "error": str(e)})
                continue
            t = max(plan.tree_budget, 1)
            rows.append({"budget_share": share, "bandwidth_GBps": bandwidth / 1e9,
                         "offload": plan.offload, "resident_layers": plan.resident_layers,
                         "tree_budget": plan.tree_budget,
                         "pass_ms_1": round(plan.pass_s[1] * 1e3, 2),
                         "pass_ms_tree": round(plan.pass_s[t] * 1e3, 2),
                         "ar_tok_s": round(1 / plan.pass_s[1], 1),
                         "tree_tok_s_at_0.8": round(expected_tokens(t, 0.8)
                                                    / plan.pass_s[t], 1)})
    return rows


def decode(model, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Greedy decoding speed (tokens/s after the prefill) and the tokens."""
    model.cache.reset()
    logits = model.forward(prompt)
    out = [int(logits[-1].argmax())]
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        out.append(int(model.forward([out[-1]])[-1].argmax()))
    return (steps - 1) / (time.perf_counter() - t0), out


def overhead(bundle: Path, steps: int, threads: int) -> dict:
    m = read_manifest(bundle, verify=False)
    path, layers = bundle / m.target.graph, m.target.num_layers
    third = max(1, layers // 3)
    groups = [Placement(a + 1, min(a + third, layers) + 1) for a in range(0, layers, third)]
    embed, head = Placement(0, 1), Placement(layers + 1, layers + 2)
    n = len(groups) + 2
    models = {
        "one session": DecoderSession(path, m.target, ["CPUExecutionProvider"], "cpu",
                                      max_len=512, threads=threads),
        f"{n} segments, resident": SegmentedDecoder(
            path, m.target, [embed, *groups, head], 512, threads),
        f"{n} segments, streamed": SegmentedDecoder(
            path, m.target, [embed, *(Placement(g.start, g.stop, streamed=True)
                                      for g in groups), head], 512, threads),
    }
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 4000, 32)]
    rows, reference = {}, None
    for name, model in models.items():
        speed, tokens = decode(model, prompt, steps)
        reference = reference or (speed, tokens)
        rows[name] = {"tok_s": round(speed, 1), "ratio": round(speed / reference[0], 3),
                      "same_tokens_as_one_session": tokens == reference[1]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps({"bundle": str(a.bundle),
                      "decisions": decisions(a.bundle, a.context),
                      "overhead": overhead(a.bundle, a.steps, a.threads)}, indent=1))


if __name__ == "__main__":
    main()
