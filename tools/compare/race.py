"""The speed race on one model: edgespec, llama.cpp and onnxruntime-genai side by side.

Same GGUF file, same held-out prompts (edgespec's real-model bench set, chat unless
`--category` says otherwise, through the model's chat template, or as labelled plain text
for a base model without one, as `edgespec bench` gives them: token ids for edgespec and
genai, the rendered text for llama.cpp), greedy, the same number of new tokens and CPU
threads, interleaved: every round runs each prompt on every runtime in turn, the order
rotating. Speed is decode tokens/s (prefill
excluded) for everyone, totalled per round; the table gives the median round, the range
over rounds and the ratios to edgespec AR and to the fastest peer, also per round.

- edgespec: the default export of the file (`--model FILE`'s cached bundle), AR and
  whatever `edgespec generate` runs by default when that differs (a draft's speculation),
  its sessions on one shared thread pool as on the command line (runtimes.pool).
- llama.cpp: llama-completion on the file itself (and llama-bench's tg figure, which has
  no prompt, for reference).
- onnxruntime-genai 0.18: its builder's int4 model (`-p int4 -e cpu`) of the same weights
  (transformers dequantizes the GGUF into a checkpoint first), in its own environment.
- With `--draft DRAFT.gguf` (a smaller model of the same vocabulary): llama-speculative
  and genai's speculative mode with it, γ = 4 both.

    python tools/compare/race.py --model /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts 8 --new 128 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import (  # noqa: E402
    LLAMA_BIN,
    Edgespec,
    Genai,
    LlamaCompletion,
    LlamaSpeculative,
    Missing,
    Prompt,
    build_genai_model,
    genai_python,
    genai_with_draft,
    llama_bench,
    note,
)

import edgespec  # noqa: E402
from edgespec.bench_sets import (  # noqa: E402
    REAL_CATEGORIES,
    load_set,
    prompt_ids,
    prompt_text,
    select,
)
from edgespec.model_cache import cache_dir, resolve_model, source_hash  # noqa: E402
from edgespec.runtimes import pool  # noqa: E402


def peers(args: argparse.Namespace, engine: Any) -> tuple[dict[str, Any], list[Any]]:
    """name -> peer for everything that runs here; the skipped ones are said why."""
    found: dict[str, Any] = {"edgespec AR": Edgespec(engine, "ar")}
    if engine.default_mode != "ar":
        found[f"edgespec default ({engine.default_mode})"] = Edgespec(engine,
                                                                      engine.default_mode)
    to_close = []
    try:
        found["llama.cpp"] = LlamaCompletion(args.llama_bin, args.model, args.threads,
                                             args.llama_poll)
        if args.draft:
            found["llama.cpp speculative"] = LlamaSpeculative(args.llama_bin, args.model,
                                                              args.draft, args.threads,
                                                              args.llama_poll)
    except Missing as e:
        note(f"llama.cpp: skipped, {e}")
    try:
        python = genai_python(args.genai_python)
        work = cache_dir() / "compare" / f"{args.model.stem}-{source_hash(args.model)[:12]}"
        note(f"onnxruntime-genai: int4 model in {work} (built once)")
        target = build_genai_model(python, args.model, work, args.threads)
        genai = Genai(python, target, engine.tokenizer.decode)
        found[f"onnxruntime-genai {genai.version} int4"] = genai
        to_close.append(genai)
        if args.draft:
            draft_work = work.parent / f"{args.draft.stem}-{source_hash(args.draft)[:12]}"
            draft = build_genai_model(python, args.draft, draft_work, args.threads)
            spec = Genai(python, genai_with_draft(target, draft, work / "genai-spec"),
                         engine.tokenizer.decode)
            found[f"onnxruntime-genai {genai.version} int4 speculative"] = spec
            to_close.append(spec)
    except Missing as e:
        note(f"onnxruntime-genai: skipped, {e}")
    return found, to_close


def race(args: argparse.Namespace) -> dict[str, Any]:
    engine = edgespec.load(args.bundle or resolve_model(args.model), threads=args.threads)
    tok = engine.tokenizer
    prompts = [Prompt(p["messages"], prompt_text(tok, p), prompt_ids(tok, p))
               for p in select(load_set("real"), (args.category,), args.prompts)]
    runners, to_close = peers(args, engine)
    names = list(runners)
    speed: dict[str, list[float]] = {n: [] for n in names}
    texts: dict[str, list[str]] = {n: [] for n in names}
    prompt_mismatch: dict[str, int] = {n: 0 for n in names}
    bench_tg: list[float] = []
    try:
        for runner in runners.values():  # warm-up
            runner.generate(prompts[0], 8)
        for r in range(args.rounds):
            tokens = {n: 0 for n in names}
            seconds = {n: 0.0 for n in names}
            for i, prompt in enumerate(prompts):
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    s = runners[name].generate(prompt, args.new)
                    tokens[name] += s.new_tokens - 1
                    seconds[name] += (s.new_tokens - 1) / s.tokens_per_s if s.tokens_per_s \
                        else 0.0
                    prompt_mismatch[name] += s.prompt_tokens not in (None, len(prompt.ids))
                    if r == 0:
                        texts[name].append(s.text)
            for name in names:
                speed[name].append(tokens[name] / seconds[name] if seconds[name] else 0.0)
            if "llama.cpp" in runners:
                bench_tg.append(llama_bench(args.llama_bin, args.model, args.threads,
                                            args.new, args.llama_poll))
            note(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {speed[n][-1]:.1f}" for n in names) + " tok/s")
    finally:
        for peer in to_close:
            peer.close()
    others = [n for n in names if not n.startswith("edgespec")]
    rows = []
    for name in names:
        vs_ar = [a / b for a, b in zip(speed[name], speed["edgespec AR"], strict=True)]
        fastest = [max(speed[o][r] for o in others) for r in range(args.rounds)] \
            if others else None
        rows.append({
            "runtime": name, "tokens_per_s": statistics.median(speed[name]),
            "range": [min(speed[name]), max(speed[name])],
            "vs_edgespec_ar": [min(vs_ar), max(vs_ar)],
            "vs_fastest_peer": [min(a / b for a, b in zip(speed[name], fastest, strict=True)),
                                max(a / b for a, b in zip(speed[name], fastest, strict=True))]
            if fastest else None,
            "greedy_text_equals_edgespec_ar": sum(
                a.strip() == b.strip() for a, b in zip(texts[name], texts["edgespec AR"],
                                                        strict=True)),
            "common_prefix_chars": statistics.median(
                len(os.path.commonprefix([a.strip(), b.strip()]))
                for a, b in zip(texts[name], texts["edgespec AR"], strict=True)),
            "prompt_token_count_differs": prompt_mismatch[name],
            "acceptance": statistics.mean(runners[name].acceptance)
            if getattr(runners[name], "acceptance", None) else None})
    return {"model": str(args.model), "category": args.category, "prompts": len(prompts),
            "new_tokens": args.new,
            "threads": args.threads, "llama_poll": args.llama_poll, "rounds": args.rounds,
            "rows": rows, "llama_bench_tg": bench_tg}


def print_report(report: dict[str, Any]) -> None:
    table = Table(title=f"{Path(report['model']).name}: {report['prompts']} held-out "
                        f"{report['category']} prompts × {report['rounds']} rounds, "
                        f"{report['new_tokens']} new tokens, greedy, {report['threads']} "
                        "threads, interleaved")
    for col in ("runtime", "tok/s (median round)", "range", "vs edgespec AR",
                "vs fastest peer", "same text as edgespec AR", "same first chars"):
        table.add_column(col, justify="left" if col == "runtime" else "right")
    for r in report["rows"]:
        peer = r["vs_fastest_peer"]
        table.add_row(r["runtime"], f"{r['tokens_per_s']:.1f}",
                      f"{r['range'][0]:.1f}–{r['range'][1]:.1f}",
                      "{:.2f}–{:.2f}×".format(*r["vs_edgespec_ar"]),
                      "{:.2f}–{:.2f}×".format(*peer) if peer else "",
                      f"{r['greedy_text_equals_edgespec_ar']}/{report['prompts']}",
                      f"{r['common_prefix_chars']:.0f}")
    console = Console()
    console.print(table)
    if report["llama_bench_tg"]:
        tg = report["llama_bench_tg"]
        console.print(f"llama-bench tg{report['new_tokens']} (no prompt): "
                      f"{min(tg):.1f}–{max(tg):.1f} tok/s over the rounds.")
    for r in report["rows"]:
        if r["acceptance"] is not None:
            console.print(f"{r['runtime']}: acceptance {r['acceptance']:.0%}.")
        if r["prompt_token_count_differs"]:
            console.print(f"note: {r['runtime']} counted a different number of prompt "
                          f"tokens than edgespec on {r['prompt_token_count_differs']} runs.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a .gguf file")
    ap.add_argument("--bundle", type=Path, help="edgespec's side: a bundle exported from "
                    "MODEL (default: MODEL's default export), e.g. with --quant rot")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    ap.add_argument("--category", default="chat", choices=REAL_CATEGORIES,
                    help="which of the real bench set's categories")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft", type=Path, help="a .gguf draft for the peers' speculation")
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                    help="llama.cpp's bin directory (llama-completion, llama-bench)")
    ap.add_argument("--llama-poll", type=int, default=50,
                    help="llama.cpp's --poll (its default 50: threads spin waiting for work, "
                         "which loses badly on a CPU shared with other jobs; 0: they sleep)")
    ap.add_argument("--genai-python", type=Path, default=Path("/work/venv-genai/bin/python"),
                    help="a Python with onnxruntime-genai installed")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    for path in (args.model, args.draft):
        if path is not None and not path.is_file():
            sys.exit(f"error: {path} is not a file; pass a .gguf model.")
    pool.share_threads()
    report = race(args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
