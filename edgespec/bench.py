"""`edgespec bench`: every decoding mode on a Spec-Bench-style prompt set, side by side.

Each prompt runs in every mode in turn (interleaved, in one process), so the speedups
compare like with like on the same machine state. Speed is decode tokens per second
(prefill excluded); greedy outputs are also compared with AR's, and a mode whose output
differs is flagged, since that would be a losslessness bug.
"""

from __future__ import annotations

import json
from collections import defaultdict
from importlib.resources import files
from typing import Any

from rich.console import Console
from rich.table import Table

from edgespec.engine import Engine
from edgespec.spec import GenerationStats

MODES: dict[str, dict[str, Any]] = {
    "ar": dict(mode="ar"),
    "chain γ=4": dict(mode="spec", draft_tokens=4),
    "chain adaptive": dict(mode="spec", draft_tokens=6, adaptive=True),
    "tree 16": dict(mode="spec", tree_budget=16, tree_depth=5, tree_top_k=3),
    "lookup": dict(mode="lookup", draft_tokens=4),
}


def load_prompts() -> list[dict[str, Any]]:
    return json.loads((files("edgespec") / "assets" / "bench_prompts.json").read_text())[
        "prompts"]


def run_bench(engine: Engine, max_new_tokens: int = 64, limit: int | None = None,
              progress=None, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Per category and mode: tokens/s, speedup vs AR, tokens per target pass, acceptance.
    With a temperature, outputs are sampled (seeded) and not compared with AR's."""
    prompts = load_prompts()[:limit]
    modes = {name: kw for name, kw in MODES.items()
             if kw["mode"] != "spec" or engine.draft is not None}
    stats: dict[tuple[str, str], list[GenerationStats]] = defaultdict(list)
    differs: dict[str, int] = defaultdict(int)
    engine.generate("x", max_new_tokens=4, mode="ar")  # warm-up
    for i, item in enumerate(prompts):
        ids = (engine.tokenizer.encode_chat(item["messages"]) if "messages" in item
               else engine.tokenizer.encode(item["prompt"]))
        # a model with a short context (the demo's 512) keeps the prompt's end
        ids = ids[-max(1, engine.context_length - max_new_tokens - 1):]
        reference = None
        for name, kwargs in modes.items():
            engine.reset()  # every mode prefills from scratch
            result = engine.generate(ids, max_new_tokens=max_new_tokens,
                                     temperature=temperature, seed=seed + i, **kwargs)
            reference = reference or result.token_ids
            differs[name] += temperature == 0 and result.token_ids != reference
            stats[item["category"], name].append(result.stats)
            stats["all", name].append(result.stats)
        if progress:
            progress(i + 1, len(prompts))
    rows = []
    for (category, name), group in stats.items():
        decode_s = sum(s.wall_s - s.prefill_s for s in group)
        tokens = sum(s.new_tokens - 1 for s in group)
        drafted = sum(s.drafted for s in group)
        rows.append({"category": category, "mode": name,
                     "tokens_per_s": tokens / decode_s if decode_s else 0.0,
                     "tokens_per_target_pass": tokens / max(1, sum(s.target_passes - 1
                                                                   for s in group)),
                     "acceptance": sum(s.accepted for s in group) / drafted if drafted
                     else None, "greedy_differs_from_ar": differs[name],
                     "overhead_share": 1 - sum(s.runtime_s for s in group)
                     / sum(s.wall_s for s in group)})
    order = [*dict.fromkeys(p["category"] for p in prompts), "all"]
    rows.sort(key=lambda r: (order.index(r["category"]), list(modes).index(r["mode"])))
    ar_speed = {r["category"]: r["tokens_per_s"] for r in rows if r["mode"] == "ar"}
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar_speed[r["category"]]
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "temperature": temperature, "device": engine.devices, "rows": rows}


def print_table(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"edgespec bench: {report['prompts']} prompts, "
                        f"{report['max_new_tokens']} new tokens, temperature "
                        f"{report['temperature']}, {report['device']}")
    for col in ("category", "mode", "tok/s", "vs AR", "tokens/pass", "acceptance",
                "overhead"):
        table.add_column(col, justify="left" if col in ("category", "mode") else "right")
    for r in report["rows"]:
        flag = " [red]≠AR[/red]" if r["greedy_differs_from_ar"] else ""
        table.add_row(r["category"], r["mode"] + flag, f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup_vs_ar']:.2f}×", f"{r['tokens_per_target_pass']:.2f}",
                      "" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                      f"{r['overhead_share']:.0%}")
    console.print(table)
