"""Decoding configurations of one bundle side by side: chains of several lengths, with and
without copies, adaptive chains and head trees, each against AR, interleaved per prompt in
one process (this machine drifts ±30% between runs, so only ratios measured together
count).

Per configuration: tokens committed per target pass, head steps per pass, decode tokens/s,
its ratio to AR over the same prompts (the median of the rounds' ratios, and their range),
and, greedy, on how many prompts its output equals AR's. Sampled runs (`--temperature`)
are seeded per prompt. `edgespec bench` covers the named modes; this covers the knobs
behind them.

    python tools/ab_configs.py MODEL --category chat --category code --limit 8 [--new 128]
    python tools/ab_configs.py MODEL --category rag --temperature 0.7 --rounds 2
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from edgespec.bench_sets import load_set, prompt_ids, select
from edgespec.engine import Engine, GenerationConfig
from edgespec.model_cache import resolve_model
from edgespec.runtimes import pool

CONFIGS = {
    "ar": GenerationConfig(mode="ar"),
    "default (chain of 1 + copies)": GenerationConfig(),
    "chain of 1, no copies": GenerationConfig(lookup_tokens=0),
    "chain of 2 + copies": GenerationConfig(draft_tokens=2),
    "chain of 3 + copies": GenerationConfig(draft_tokens=3),
    "adaptive": GenerationConfig(adaptive=True, draft_tokens=2),
    "tree 2 x 2 + 4 copied": GenerationConfig(tree_budget=4, tree_top_k=2, tree_depth=2,
                                              tree_lookup=4),
    "tree 2 x 3 + 4 copied": GenerationConfig(tree_budget=6, tree_top_k=2, tree_depth=3,
                                              tree_lookup=4),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a bundle or a .gguf file (its default export)")
    ap.add_argument("--category", action="append", default=[])
    ap.add_argument("--limit", type=int, default=8, help="prompts per category")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    pool.share_threads()
    engine = Engine(resolve_model(args.model), threads=args.threads)
    prompts = select(load_set("real"), tuple(args.category), args.limit)
    greedy = args.temperature == 0
    # per round and configuration: tokens, passes, head steps, seconds, outputs equal to AR's
    totals = [{name: [0, 0, 0, 0.0, 0] for name in CONFIGS} for _ in range(args.rounds)]
    for r in range(args.rounds):
        for i, item in enumerate(prompts):
            ids = prompt_ids(engine.tokenizer, item)
            names = list(CONFIGS)
            names = names[(i + r) % len(names):] + names[:(i + r) % len(names)]
            outputs = {}
            for name in names:
                engine.reset()
                result = engine.generate(ids, replace(CONFIGS[name], max_new_tokens=args.new,
                                                      temperature=args.temperature, seed=i))
                s, t = result.stats, totals[r][name]
                outputs[name] = result.token_ids
                t[0] += s.new_tokens - 1  # the first token comes from the prefill
                t[1] += s.target_passes - 1
                t[2] += s.draft_passes
                t[3] += s.wall_s - s.prefill_s
            for name in CONFIGS:
                totals[r][name][4] += outputs[name] == outputs["ar"]
    print(f"{len(prompts)} prompts x {args.new} tokens, T={args.temperature:g}, "
          f"{args.rounds} round(s), interleaved per prompt")
    for name in CONFIGS:
        tokens, passes, head, seconds, equal = (sum(t[name][k] for t in totals)
                                                for k in range(5))
        ratios = [(t[name][0] / t[name][3]) / (t["ar"][0] / t["ar"][3]) for t in totals]
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if args.rounds > 1 else ""
        same = f"  equal to AR {equal}/{len(prompts) * args.rounds}" if greedy else ""
        print(f"{name:32s} tokens/pass {tokens / passes:.3f}  head steps/pass "
              f"{head / passes:.3f}  {tokens / seconds:6.1f} tok/s  "
              f"{np.median(ratios):.2f}x AR{spread}{same}")


if __name__ == "__main__":
    main()
