"""What a prefill costs when the LM head scores every prompt row against the last two only.

A prefill needs the last row's logits alone (it draws the first token), but a graph
without `logits_from` (exported before it existed) scores every row over the whole
vocabulary: a fifth of SmolLM2-135M's weights, most of Gemma-3-270M's. Both ways run on
the same session, interleaved per round (this machine drifts), on N tokens of the real
bench set's longest prompts; median over rounds, with the range and the ratio taken
within each round.

    python tools/bench_prefill.py --model BUNDLE [BUNDLE ...] --tokens 512 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import edgespec
from edgespec.bench_sets import load_set


def prompt_ids(engine, n: int) -> list[int]:
    """n tokens of the bench set's prompts, longest first (the RAG ones), joined."""
    texts = sorted((m["content"] for p in load_set("real") for m in p["messages"]), key=len,
                   reverse=True)
    ids: list[int] = []
    for text in texts:
        ids += engine.tokenizer.encode(text)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the bench set holds fewer than {n} tokens")


def prefill_ms(model, ids: list[int], last: bool) -> float:
    model.cache.reset()
    t0 = time.perf_counter()
    model.forward(ids, last=last)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, nargs="+", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    engines = {str(m): edgespec.load(m, device="cpu", threads=a.threads) for m in a.model}
    for name, engine in engines.items():
        if not getattr(engine.target, "scores_from", False):
            raise SystemExit(f"{name}: its graph scores every row (exported before "
                             "logits_from); export it again.")
    ms = {(name, n, way): [] for name in engines for n in a.tokens for way in ("all", "last")}
    for _ in range(a.rounds):
        for name, engine in engines.items():
            for n in a.tokens:
                ids = prompt_ids(engine, n)
                for way in ("all", "last"):
                    ms[name, n, way].append(prefill_ms(engine.target, ids, way == "last"))
    report = []
    for name in engines:
        for n in a.tokens:
            every, last = (np.array(ms[name, n, w]) for w in ("all", "last"))
            report.append({
                "bundle": name, "tokens": n,
                "every_row_ms": round(float(np.median(every)), 1),
                "last_rows_ms": round(float(np.median(last)), 1),
                "last_rows_tokens_per_s": round(n / float(np.median(last)) * 1e3, 1),
                "speedup": round(float(np.median(every / last)), 2),
                "speedup_range": [round(float(x), 2) for x in ((every / last).min(),
                                                              (every / last).max())]})
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
