"""Decoding configurations of one bundle side by side: chains of several lengths, adaptive
chains and head trees, each against AR, interleaved per prompt in one process (this
machine drifts ±30% between runs, so only ratios measured together count).

Per configuration: tokens committed per target pass, head steps per pass, decode tokens/s,
its ratio to AR over the same prompts, and on how many prompts its greedy output equals
AR's. `edgespec bench` covers the named modes; this covers the knobs behind them.

    python tools/ab_configs.py MODEL --category chat --category code --limit 8 [--new 128]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from edgespec.bench_sets import load_set, prompt_ids, select
from edgespec.engine import Engine, GenerationConfig
from edgespec.model_cache import resolve_model
from edgespec.runtimes import pool

CONFIGS = {
    "ar": GenerationConfig(mode="ar"),
    "default (chain of 1 + copies)": GenerationConfig(),
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
    args = ap.parse_args()
    pool.share_threads()
    engine = Engine(resolve_model(args.model), threads=args.threads)
    prompts = select(load_set("real"), tuple(args.category), args.limit)
    totals = {name: [0, 0, 0, 0.0, 0] for name in CONFIGS}  # tokens, passes, head, s, equal
    for item in prompts:
        ids = prompt_ids(engine.tokenizer, item)
        outputs = {}
        for name, config in CONFIGS.items():
            engine.reset()
            result = engine.generate(ids, replace(config, max_new_tokens=args.new,
                                                  temperature=0.0))
            s, t = result.stats, totals[name]
            outputs[name] = result.token_ids
            t[0] += s.new_tokens - 1  # the first token comes from the prefill
            t[1] += s.target_passes - 1
            t[2] += s.draft_passes
            t[3] += s.wall_s - s.prefill_s
            t[4] += outputs[name] == outputs["ar"]
    ar = totals["ar"][0] / totals["ar"][3]
    print(f"{len(prompts)} prompts x {args.new} tokens, greedy, interleaved per prompt")
    for name, (tokens, passes, head, seconds, equal) in totals.items():
        print(f"{name:32s} tokens/pass {tokens / passes:.3f}  head steps/pass "
              f"{head / passes:.3f}  {tokens / seconds:6.1f} tok/s  {tokens / seconds / ar:.2f}x AR"
              f"  equal to AR {equal}/{len(prompts)}")


if __name__ == "__main__":
    main()
