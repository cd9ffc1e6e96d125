"""What a pass costs by the number of tokens it feeds, for bundles' targets and drafts.

The bound on speculation: a chain pass costs γ draft steps plus one target pass over
γ + 1 tokens and commits E tokens, so its speedup over AR is at most
E · t(1) / (γ · d(1) + t(γ + 1)). Median over repeats, after 50 tokens of context (or
`--context`: at the 2,000-5,000 tokens of RAG and summary prompts attention reads more
than the weights, and its cost grows with S). Several
bundles (or .gguf files: their default export) are measured in interleaved rounds (this
machine drifts), on the one thread pool every session shares, as the command line runs
them (a one-token step gains most from its spinning workers); each figure is the
median over rounds, with the range, and every S is also given as a ratio to S=1: the
median of the ratios taken within each round (`x_one`) and the ratio of the medians
(`x_medians`); where the two disagree the machine drifted during the run: rerun it.

    python tools/bench_verify_cost.py                        # the shipped demo bundle
    python tools/bench_verify_cost.py --model A B --tokens 1 5 17 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import edgespec
from edgespec.model_cache import resolve_model
from edgespec.runtimes import pool


def pass_ms(model, s: int, repeats: int, context: int) -> float:
    """A draft head is fed the target's hidden states too (zeros: the cost is the same)."""
    def forward(ids: list[int]) -> None:
        if model.is_head:
            model.forward_head(ids, np.zeros((len(ids), model.entry.hidden_size), np.float32))
        else:
            model.forward(ids)

    model.cache.reset()
    forward([10 + i % 1000 for i in range(context)])
    times = []
    for _ in range(repeats):
        model.cache.trim(model.cache.length - context)
        t0 = time.perf_counter()
        forward(list(range(1, s + 1)))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="*", default=[None], help="bundles or .gguf files")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--context", type=int, default=50, help="tokens cached before each pass")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.context < 1:
        raise SystemExit("--context must be at least 1.")
    sizes = sorted(set([1, *a.tokens]))
    pool.share_threads()
    engines = {str(m or "demo"): edgespec.load(resolve_model(m), device="cpu",
                                               threads=a.threads) for m in a.model}
    models = {(name, role): model for name, e in engines.items()
              for role, model in (("target", e.target), ("draft", e.draft)) if model}
    ms: dict[tuple[str, str], dict[int, list[float]]] = {k: {s: [] for s in sizes}
                                                         for k in models}
    for _ in range(a.rounds):
        for key, model in models.items():
            for s in sizes:
                ms[key][s].append(pass_ms(model, s, a.repeats, a.context))
    report = []
    for (name, role), by_s in ms.items():
        base = np.array(by_s[1])
        report.append({"bundle": name, "model": role, "by_tokens": {
            s: {"ms": round(float(np.median(v)), 3),
                "range": [round(min(v), 3), round(max(v), 3)],
                "x_one": round(float(np.median(np.array(v) / base)), 2),
                "x_medians": round(float(np.median(v) / np.median(base)), 2)}
            for s, v in by_s.items() if s in a.tokens}})
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
