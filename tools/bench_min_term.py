"""What the block minimums of a GGUF file's Q4_1 / Q4_K codes cost a target pass.

MatMulNBits takes integer zero points only, so an imported w = d·q + m adds the minimum
as four small ops per linear (export.graph's `_nbits`: Reshape, ReduceSum, MatMul, Add).
This times the bundle's target as it is against a copy of its graph with those ops cut
out (timing only: the copy computes other numbers), interleaved per round; median over
rounds, with the ratio taken within each round.

    python tools/bench_min_term.py --model BUNDLE --tokens 1 2 5 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from bench_verify_cost import pass_ms  # tools/ is this script's directory

import edgespec

MIN_OPS = (".xb", ".xsum", ".min", ".addmin")  # the node names _nbits gives them


def without_minimums(bundle: Path, out: Path) -> int:
    """`bundle` copied to `out` with the minimum ops cut out of its target; how many."""
    shutil.copytree(bundle, out, ignore=shutil.ignore_patterns("target.onnx*"))
    model = onnx.load(str(bundle / "target.onnx"))
    cut = [n for n in model.graph.node if n.name.endswith(MIN_OPS)]
    for add in (n for n in cut if n.op_type == "Add"):  # its consumers read the product
        for node in model.graph.node:
            node.input[:] = [add.input[0] if x == add.output[0] else x for x in node.input]
    for node in cut:
        model.graph.node.remove(node)
    onnx.save(model, str(out / "target.onnx"), save_as_external_data=True,
              location="target.onnx.data")
    return len(cut)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cut = without_minimums(a.model, Path(tmp) / "cut")
        if not cut:
            raise SystemExit(f"{a.model}'s target has no block minimums (no Q4_1/Q4_K codes).")
        paths = {"as exported": a.model, "minimums cut": Path(tmp) / "cut"}
        targets = {name: edgespec.load(path, device="cpu", verify=False).target
                   for name, path in paths.items()}
        ms = {name: {s: [] for s in a.tokens} for name in targets}
        for _ in range(a.rounds):
            for name, target in targets.items():
                for s in a.tokens:
                    ms[name][s].append(pass_ms(target, s, a.repeats))
    report = {"model": str(a.model), "ops_cut": cut, "ms": {
        name: {s: round(float(np.median(v)), 2) for s, v in by.items()} for name, by in ms.items()},
        "share_of_pass": {s: round(float(np.median(1 - np.array(ms["minimums cut"][s])
                                                   / np.array(ms["as exported"][s]))), 3)
                          for s in a.tokens}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
