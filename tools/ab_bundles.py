"""Bundles side by side: the same prompts decoded by each, in one process, interleaved.

This host drifts ±30% between runs, so two exports (a head in int8 or int4, two drafts,
two recipes) are compared by decoding moments apart in one process: each bundle is opened
once, and every round generates every prompt with every bundle in turn, the order
alternating. Per bundle: the median decode speed over rounds (prefill excluded) and the
median per-round ratio to the first bundle; tokens per target pass and acceptance from the
first round (greedy runs repeat them exactly); and whether every output equals the first
bundle's, which greedy decoding of the same target promises whatever the draft.

    python tools/ab_bundles.py BUNDLE_A BUNDLE_B --category chat --prompts 8 --rounds 6
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import edgespec
from edgespec.bench_sets import REAL_CATEGORIES, load_set, select
from edgespec.engine import MODES, GenerationConfig
from edgespec.errors import EdgespecError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", type=Path, nargs="+", help="two or more bundle directories")
    ap.add_argument("--category", choices=REAL_CATEGORIES, default="chat")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--mode", choices=("default", *MODES), default="default",
                    help="a decoding mode, or each bundle's default")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if len(a.bundles) < 2:
        raise SystemExit("name at least two bundles to compare.")
    if min(a.prompts, a.rounds, a.new) < 1:
        raise SystemExit("--prompts, --rounds and --new must each be at least 1.")
    try:
        compare(a)
    except EdgespecError as e:
        raise SystemExit(str(e)) from None


def compare(a: argparse.Namespace) -> None:
    engines = [edgespec.load(b, device="cpu", threads=a.threads) for b in a.bundles]
    prompts = [engines[0].tokenizer.encode_chat(p["messages"])
               for p in select(load_set("real"), (a.category,), a.prompts)]
    speed: list[list[float]] = [[] for _ in engines]
    counts = [dict(tokens=0, passes=0, accepted=0, drafted=0) for _ in engines]
    outputs: list[list[list[int]]] = [[] for _ in engines]
    for r in range(a.rounds):
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            engine, seconds, tokens = engines[i], 0.0, 0
            mode = engine.default_mode if a.mode == "default" else a.mode
            for ids in prompts:
                out = engine.generate(ids, GenerationConfig(
                    max_new_tokens=a.new, temperature=a.temperature, mode=mode, seed=r))
                s = out.stats
                seconds += s.wall_s - s.prefill_s
                tokens += s.new_tokens - 1  # the prefill draws the first
                if r == 0:
                    for key, value in (("tokens", s.new_tokens), ("passes", s.target_passes),
                                       ("accepted", s.accepted), ("drafted", s.drafted)):
                        counts[i][key] += value
                    outputs[i].append(out.token_ids)
            speed[i].append(tokens / seconds)
    base = np.array(speed[0])
    print(f"{a.category}, {len(prompts)} prompts x {a.new} tokens, {a.rounds} rounds, "
          f"T={a.temperature}; ratio: median per round to the first bundle")
    for i, bundle in enumerate(a.bundles):
        c = counts[i]
        equal = sum(o == f for o, f in zip(outputs[i], outputs[0], strict=True))
        same = "" if a.temperature else f", outputs = first's {equal}/{len(prompts)}"
        print(f"{bundle}: {np.median(speed[i]):.1f} tok/s "
              f"({np.median(np.array(speed[i]) / base):.3f}x), "
              f"{c['tokens'] / c['passes']:.3f} tokens/pass, "
              f"acceptance {c['accepted'] / max(c['drafted'], 1):.1%}{same}")


if __name__ == "__main__":
    main()
