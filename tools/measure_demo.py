"""Measure a bundle the way the README reports it: acceptance and AR vs spec speed.

Prompts are cut from the demo pair's held-aside stdlib files (never seen in training):
for each file, a few random 64-token windows. Each prompt runs greedy in AR mode and in
spec mode for each γ in the same process, interleaved, so the ratios compare like with
like. Greedy outputs are also compared with AR's (losslessness, again): the report
counts prompts whose outputs differ anywhere.

    python tools/measure_demo.py [--model DIR] [--prompts 24] [--new 96] [--gammas 2 3 4 6]

Each run prints one JSON object: per mode, decode tokens/s, speedup over AR measured in
the same process, acceptance, tokens per target pass, the draft's share of the time,
and how many prompts' greedy output differed from AR's (it must be 0).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
from pathlib import Path

import edgespec

CARD = Path(__file__).parent / "demo_pair" / "model_card.json"


def held_out_prompts(engine: edgespec.Engine, n: int, card: Path,
                     length: int = 64) -> list[list[int]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = json.loads(card.read_text())["held_aside_files"]
    rng = random.Random(0)
    prompts = []
    while len(prompts) < n:
        ids = engine.tokenizer.encode((stdlib / rng.choice(files)).read_text(errors="replace"),
                                      add_special_tokens=False)
        if len(ids) > length + 1:
            s = rng.randrange(0, len(ids) - length)
            prompts.append([engine.manifest.bos_token_id or 0] + ids[s:s + length])
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 6])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--card", type=Path, default=CARD, help="model card naming held-out files")
    args = ap.parse_args()
    engine = edgespec.Engine(args.model, threads=args.threads)
    prompts = held_out_prompts(engine, args.prompts, args.card)
    engine.generate(prompts[0], max_new_tokens=8, mode="spec")  # warm-up
    runs = {"ar": dict(mode="ar")}
    runs |= {f"chain g={g}": dict(mode="spec", draft_tokens=g) for g in args.gammas}
    runs |= {
        "chain g<=6 adaptive": dict(mode="spec", draft_tokens=6, adaptive=True),
        "chain g<=6 confidence": dict(mode="spec", draft_tokens=6, stop_rule="confidence"),
        "chain g<=6 entropy": dict(mode="spec", draft_tokens=6, stop_rule="entropy"),
        "tree 8 (d4,k2)": dict(mode="spec", tree_budget=8, tree_depth=4, tree_top_k=2),
        "tree 16 (d5,k3)": dict(mode="spec", tree_budget=16, tree_depth=5, tree_top_k=3),
        "tree 32 (d6,k4)": dict(mode="spec", tree_budget=32, tree_depth=6, tree_top_k=4),
        "lookup g=4": dict(mode="lookup", draft_tokens=4),
    }
    rows: dict[str, list] = {name: [] for name in runs}
    differ = dict.fromkeys(rows, 0)
    for ids in prompts:
        ar = None
        for name, kwargs in runs.items():
            r = engine.generate(ids, max_new_tokens=args.new, **kwargs)
            ar = ar or r
            differ[name] += r.token_ids != ar.token_ids
            rows[name].append(r.stats)

    def tps(stats):  # total decode tokens / total decode time
        return (sum(s.new_tokens - 1 for s in stats)
                / sum(s.wall_s - s.prefill_s for s in stats))

    ar_tps = tps(rows["ar"])
    report = {}
    for name, stats in rows.items():
        drafted = sum(s.drafted for s in stats)
        report[name] = {
            "tokens_per_s": round(tps(stats), 1),
            "speedup_vs_ar": round(tps(stats) / ar_tps, 2),
            "acceptance": round(sum(s.accepted for s in stats) / drafted, 3) if drafted else None,
            "tokens_per_target_pass": round(statistics.mean(s.tokens_per_target_pass
                                                            for s in stats), 2),
            "draft_share_of_time": round(sum(s.draft_s for s in stats)
                                         / sum(s.wall_s - s.prefill_s for s in stats), 2),
            "outputs_differing_from_ar": differ[name],
        }
    print(json.dumps({"prompts": len(prompts), "new_tokens": args.new,
                      "threads": args.threads or "ort default", "modes": report}, indent=2))


if __name__ == "__main__":
    main()
