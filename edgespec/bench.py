"""`edgespec bench`: every decoding mode the bundle has, side by side on a prompt set.

Each prompt runs in every mode and at every temperature in turn (interleaved, in one
process, the modes' order rotating from prompt to prompt), so the ratios compare like with
like on the same machine state. Speed is decode tokens per second (prefill excluded).
Greedy outputs are compared with AR's, and a mode whose output differs is flagged, since
that would be a losslessness bug. The modes come from the bundle: the model-draft modes
run with whatever draft it carries (a separate draft, a nested BitNest one, a draft head),
"default" is what `edgespec generate` does with no flags, and lookup needs no draft.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from edgespec.bench_sets import prompt_ids
from edgespec.engine import Engine, GenerationConfig
from edgespec.errors import EdgespecError
from edgespec.spec import GenerationStats

# id -> (label, GenerationConfig fields); "default" is GenerationConfig()'s own choice
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "ar": ("ar", dict(mode="ar")),
    "chain": ("chain γ=4", dict(mode="spec", draft_tokens=4, lookup_tokens=0)),
    "adaptive": ("chain adaptive", dict(mode="spec", draft_tokens=6, adaptive=True)),
    "tree": ("tree 16", dict(mode="spec", tree_budget=16, tree_depth=5, tree_top_k=3)),
    "lookup": ("lookup", dict(mode="lookup", draft_tokens=4)),
    "default": ("default", dict()),  # last: a named mode it equals keeps its name
}
DEFAULT_TEMPERATURES = (0.0, 0.7)


def draft_description(engine: Engine) -> str:
    """What the spec modes draft with, from the manifest."""
    d = engine.manifest.draft
    if engine.draft is None or d is None:
        return "none"
    if d.nested:
        return f"nested (BitNest, {d.precision})"
    kind = f"{d.kind} head, " if d.kind else ""
    return f"{kind}{d.architecture} {d.precision}, {d.params / 1e6:.1f}M parameters"


def bench_modes(engine: Engine, wanted: tuple[str, ...] = (),
                gammas: tuple[int, ...] = ()) -> tuple[dict[str, GenerationConfig], str]:
    """label -> config for the modes this bundle can run (all, or the ids in `wanted`; AR
    always, the ratios need it) plus a chain of each length in `gammas`, and the label of
    the one `edgespec generate` runs with no flags ("default" only when it equals none of
    the others)."""
    default = engine.resolve(GenerationConfig())
    entries = [(key, label, fields, key in wanted) for key, (label, fields) in MODES.items()]
    entries[-1:-1] = [("chain", f"chain γ={g}", dict(mode="spec", draft_tokens=g,
                                                     lookup_tokens=0), True)
                      for g in gammas]  # before "default", which keeps a named twin's name
    configs: dict[str, GenerationConfig] = {}
    for key, label, fields, asked in entries:
        config = engine.resolve(GenerationConfig(**fields)) if fields else default
        if (wanted and not asked and key != "ar") or \
                (config.mode == "spec" and engine.draft is None and not asked):
            continue  # asked for, it runs into the engine's own refusal at warm-up
        if config not in configs.values():
            configs[label] = config
    return configs, next(name for name, c in configs.items() if c == default) \
        if default in configs.values() else ""


def _row(group: list[GenerationStats]) -> dict[str, Any]:
    decode_s = sum(s.wall_s - s.prefill_s for s in group)
    tokens = sum(s.new_tokens - 1 for s in group)
    drafted = sum(s.drafted for s in group)
    return {"tokens_per_s": tokens / decode_s if decode_s else 0.0,
            "tokens_per_target_pass": sum(s.committed - 1 for s in group)
            / max(1, sum(s.target_passes - 1 for s in group)),
            "acceptance": sum(s.accepted for s in group) / drafted if drafted else None,
            "new_tokens": sum(s.new_tokens for s in group),
            "prompt_tokens": sum(s.prompt_tokens for s in group) / len(group),
            "overhead_share": 1 - sum(s.runtime_s for s in group)
            / max(1e-9, sum(s.wall_s for s in group))}


def run_bench(engine: Engine, prompts: list[dict[str, Any]], max_new_tokens: int = 64,
              temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES, rounds: int = 1,
              modes: tuple[str, ...] = (), seed: int = 0,
              progress: Callable[[int, int], None] | None = None,
              gammas: tuple[int, ...] = ()) -> dict[str, Any]:
    """Per category, temperature and mode: tokens/s, speedup vs AR (with its range over
    rounds), tokens per target pass, acceptance. Sampled runs are seeded per prompt and
    not compared with AR's output. `gammas`: chains of these lengths as extra modes."""
    # a model with a short context (the demo's 512) keeps the prompt's end, and says so
    keep = engine.context_length - max_new_tokens - 1
    if keep < 1:
        raise EdgespecError(f"{max_new_tokens} new tokens leave no room for a prompt in the "
                            f"model's context of {engine.context_length}; give at most "
                            f"{engine.context_length - 2}.")
    temperatures = tuple(dict.fromkeys(temperatures))  # a repeated one would count twice
    configs, default = bench_modes(engine, modes, gammas)
    skipped = {}
    for name, config in list(configs.items()):  # warm-up: each mode's first pass allocates
        engine.reset()
        try:
            engine.generate("x", replace(config, max_new_tokens=4))
        except EdgespecError as e:  # a mode this bundle's drafter does not support
            skipped[name] = (str(e) if config.mode != "spec" or engine.draft is not None else
                             "this model has no draft (export it with --draft), so only ar "
                             "and lookup run.")  # the engine's sentence speaks of --mode spec
            del configs[name]
    if set(modes) - {"ar"} and list(configs) == ["ar"]:  # what was asked for ran nowhere
        raise EdgespecError(f"no mode asked for can run here: {' '.join(skipped.values())}")
    names = list(configs)
    ids = [prompt_ids(engine.tokenizer, p) for p in prompts]
    cut = sum(len(x) > keep for x in ids)
    ids = [x[-keep:] for x in ids]
    stats: dict[tuple[int, str, float, str], list[GenerationStats]] = defaultdict(list)
    differs: dict[tuple[str, float, str], int] = defaultdict(int)
    done, total = 0, rounds * len(prompts) * len(temperatures)
    for r in range(rounds):
        for i, (item, prompt) in enumerate(zip(prompts, ids, strict=True)):
            for t in temperatures:
                shift = (i + r) % len(names)
                outputs = {}
                for name in names[shift:] + names[:shift]:
                    engine.reset()  # every mode prefills from scratch
                    result = engine.generate(prompt, replace(
                        configs[name], max_new_tokens=max_new_tokens, temperature=t,
                        seed=seed + i))
                    outputs[name] = result.token_ids
                    for category in (item["category"], "all"):
                        stats[r, category, t, name].append(result.stats)
                if t == 0:
                    for name in names:
                        differs[item["category"], t, name] += outputs[name] != outputs["ar"]
                        differs["all", t, name] += outputs[name] != outputs["ar"]
                done += 1
                if progress:
                    progress(done, total)
    order = [*dict.fromkeys(p["category"] for p in prompts), "all"]
    rows = []
    for category in order:
        for t in temperatures:
            merged = {n: [s for r in range(rounds) for s in stats[r, category, t, n]]
                      for n in names}
            ar = _row(merged["ar"])["tokens_per_s"]
            for name in names:
                row = {"category": category, "temperature": t, "mode": name,
                       "is_default": name == default,
                       **_row(merged[name]),
                       "greedy_differs_from_ar": differs[category, t, name] if t == 0 else None}
                row["speedup_vs_ar"] = row["tokens_per_s"] / ar if ar else 0.0
                per_round = [_row(stats[r, category, t, name])["tokens_per_s"]
                             / max(1e-9, _row(stats[r, category, t, "ar"])["tokens_per_s"])
                             for r in range(rounds)]
                row["speedup_range"] = [min(per_round), max(per_round)]
                rows.append(row)
    return {"prompts": len(prompts), "cut_prompts": cut, "kept_tokens": keep,
            "categories": order[:-1], "rounds": rounds,
            "max_new_tokens": max_new_tokens, "temperatures": list(temperatures),
            "device": engine.devices, "draft": draft_description(engine),
            "default_mode": default, "skipped_modes": skipped,
            "prompt_format": "chat template" if engine.tokenizer.chat_template
            else "plain text (no chat template)", "rows": rows}


def print_table(report: dict[str, Any], console: Console) -> None:
    count = report["prompts"]
    table = Table(title=f"edgespec bench: {count} prompt{'s' * (count != 1)} × {report['rounds']} "
                        f"round(s), {report['max_new_tokens']} new tokens, "
                        f"{report['device']}, draft: {report['draft']}")
    for col in ("category", "T", "mode", "tok/s", "vs AR", "tokens/pass", "acceptance",
                "overhead"):
        table.add_column(col, justify="left" if col in ("category", "mode") else "right")
    rows = report["rows"]
    for n, r in enumerate(rows):
        flag = (" *" if r["is_default"] else "") + \
            (" [red]≠AR[/red]" if r["greedy_differs_from_ar"] else "")
        low, high = r["speedup_range"]
        spread = f" ({low:.2f}–{high:.2f})" if report["rounds"] > 1 else ""
        last = n + 1 == len(rows) or rows[n + 1]["temperature"] != r["temperature"]
        table.add_row(r["category"], f"{r['temperature']:g}", r["mode"] + flag,
                      f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_ar']:.2f}×{spread}",
                      f"{r['tokens_per_target_pass']:.2f}",
                      "" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                      f"{r['overhead_share']:.0%}", end_section=last)
    console.print(table)
    starred = (f"* what `edgespec generate` runs with no flags ({report['default_mode']}); "
               if report["default_mode"] else "")
    console.print(f"{starred}vs AR: decode tok/s over AR's in the same run"
                  + (", (range over rounds)" if report["rounds"] > 1 else "") + ".")
    if report["cut_prompts"]:
        console.print(f"{report['cut_prompts']} prompt(s) were cut to their last "
                      f"{report['kept_tokens']} tokens to fit the model's context with "
                      f"{report['max_new_tokens']} new tokens.")
    for name, why in report["skipped_modes"].items():
        console.print(f"{name}: not run, {why}")
    if any(r["greedy_differs_from_ar"] for r in rows):
        console.print("[red]≠AR[/red]: a greedy output differed from AR's on this many "
                      "prompts (see greedy_differs_from_ar in --json).")
