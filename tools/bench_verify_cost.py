"""What a pass costs by the number of tokens it feeds, for a bundle's target and draft.

The bound on speculation: a chain pass costs γ draft steps plus one target pass over
γ + 1 tokens and commits E tokens, so its speedup over AR is at most
E · t(1) / (γ · d(1) + t(γ + 1)). Median over repeats, 50 tokens of context.

    python tools/bench_verify_cost.py            # the shipped demo bundle
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import edgespec


def pass_ms(model, s: int, repeats: int = 200) -> float:
    model.cache.reset()
    model.forward(list(range(10, 60)))
    times = []
    for _ in range(repeats):
        model.cache.trim(model.cache.length - 50)
        t0 = time.perf_counter()
        model.forward(list(range(1, s + 1)))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32])
    a = ap.parse_args()
    engine = edgespec.load(a.model, device="cpu")
    models = {"target_ms": engine.target, "draft_ms": engine.draft}
    print(json.dumps([{"tokens": s, **{name: round(pass_ms(model, s), 3)
                                       for name, model in models.items() if model}}
                      for s in a.tokens], indent=1))


if __name__ == "__main__":
    main()
