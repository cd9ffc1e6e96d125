"""VocabTrim benchmark: draft step time and bytes per K on a large-vocabulary draft, and
acceptance / end-to-end speed per K on the demo pair.

Large-vocabulary shape: a random-init Qwen2.5-shaped draft (151,936 tokens, hidden 896,
2 layers, tied embeddings), int8. Its LM head is ~80% of its weights, the regime where
trimming pays. Frequencies come from a corpus (the standard library's text) here: which
rows are kept does not change the step time.

Head-dominated pair (`--padded DIR`): the trained demo pair with its vocabulary padded
to Qwen2.5's 151,936 ids. The new embedding/head rows are zero, so their logit is 0:
never the greedy choice while the best real logit is positive (true on every step
checked), so greedy decoding is the demo's own, but every step now reads a 151,936-row
head, as real large-vocabulary pairs do. Sampling would be dominated by the zero rows, so
this mode is greedy only and counts frequencies on a corpus.

    python tools/bench_vocab_trim.py --large /tmp/qwen_draft   # step time per K
    python tools/bench_vocab_trim.py --demo                    # acceptance per K, demo
    python tools/bench_vocab_trim.py --padded /tmp/padded_pair # end to end, big head
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

from rich.console import Console

import edgespec
from edgespec.bundle import read_manifest
from edgespec.export import export
from edgespec.runtimes import DecoderSession

HERE = Path(__file__).parent
QUIET = Console(file=io.StringIO())


def make_large_draft(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (path / "config.json").exists():
        return path
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # ids only matter for counting
        shutil.copy(HERE / "demo_pair" / "target" / f, path / f)
    return path


def make_padded_pair(path: Path, vocab: int = 151936) -> Path:
    """The demo pair with `vocab` ids: zero rows appended to the tied embedding/head."""
    import torch
    from transformers import AutoModelForCausalLM

    for role in ("target", "draft"):
        out = path / role
        if (out / "config.json").exists():
            continue
        model = AutoModelForCausalLM.from_pretrained(HERE / "demo_pair" / role,
                                                     dtype=torch.float32)
        old = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(vocab, mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[old:] = 0
        model.to(torch.float16).save_pretrained(out)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(HERE / "demo_pair" / role / f, out / f)
    return path


def step_ms(bundle: Path, steps: int = 40) -> float:
    m = read_manifest(bundle, verify=False)
    sess = DecoderSession(bundle / m.draft.graph, m.draft, ["CPUExecutionProvider"],
                          max_len=512)
    sess.forward(list(range(32)))
    t0 = time.perf_counter()
    for _ in range(steps):
        sess.forward([5])
    return (time.perf_counter() - t0) / steps * 1000


def large(path: Path, ks: list[int]) -> list[dict]:
    ckpt = make_large_draft(path)
    corpus = f"corpus:{Path(sysconfig.get_paths()['stdlib']) / 'json'}"
    rows = []
    for k in ks:
        out = Path(tempfile.mkdtemp()) / "b"
        export(ckpt, out, draft=ckpt, precision="int8", vocab_trim=k if k < 151936 else None,
               trim_source=corpus, console=QUIET)
        data = (out / "draft.onnx.data").stat().st_size
        head_bytes = (k if k < 151936 else 151936) * 896  # int8 head rows read per step
        rows.append({"K": k, "draft_step_ms": round(step_ms(out), 2),
                     "draft_MiB": round(data / 2**20, 1),
                     "head_MiB_read_per_step": round(head_bytes / 2**20, 1)})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(out.parent)
    full = rows[-1]["draft_step_ms"]
    for r in rows:
        r["step_speedup_vs_full"] = round(full / r["draft_step_ms"], 2)
    return rows


def demo(ks: list[int], prompts: int, new: int, pair: Path = HERE / "demo_pair",
         vocab: int = 4096, trim_source: str = "target") -> list[dict]:
    from measure_demo import CARD, held_out_prompts  # tools/ is on sys.path when run

    rows = []
    for k in ks:
        out = Path(tempfile.mkdtemp()) / "b"
        export(pair / "target", out, draft=pair / "draft", precision="fp16",
               draft_precision="int8", vocab_trim=k if k < vocab else None,
               trim_source=trim_source, console=QUIET)  # the shipped demo's precisions
        engine = edgespec.load(out)
        shipped = edgespec.load() if vocab != 4096 else None  # the unpadded demo
        stats, differ, unlike_demo = [], 0, 0
        for ids in held_out_prompts(engine, prompts, CARD):
            ar = engine.generate(ids, max_new_tokens=new, mode="ar")
            spec = engine.generate(ids, max_new_tokens=new, mode="spec", draft_tokens=4)
            differ += spec.token_ids != ar.token_ids
            if shipped is not None:
                unlike_demo += shipped.generate(ids, max_new_tokens=new,
                                                mode="ar").token_ids != ar.token_ids
            stats.append((ar.stats, spec.stats))

        def tps(group):
            return sum(s.new_tokens - 1 for s in group) / sum(s.wall_s - s.prefill_s
                                                              for s in group)

        spec_stats = [s for _, s in stats]
        rows.append({"K": k, "acceptance": round(sum(s.accepted for s in spec_stats)
                                                 / sum(s.drafted for s in spec_stats), 3),
                     "spec_tokens_per_s": round(tps(spec_stats), 1),
                     "speedup_vs_ar": round(tps(spec_stats) / tps([a for a, _ in stats]), 2),
                     "draft_step_ms": round(1000 * sum(s.draft_s for s in spec_stats)
                                            / sum(s.draft_passes for s in spec_stats), 3),
                     "greedy_outputs_differing_from_ar": differ,
                     "ar_tokens_per_s": round(tps([a for a, _ in stats]), 1)})
        if shipped is not None:
            rows[-1]["ar_outputs_differing_from_the_unpadded_demo"] = unlike_demo
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(out.parent)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--large", type=Path, help="build (or reuse) the 151,936-vocab draft here")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--padded", type=Path, help="build (or reuse) the padded demo pair here")
    ap.add_argument("--ks", type=int, nargs="+")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    if args.large:
        ks = args.ks or [8192, 16384, 32768, 65536, 151936]
        print(json.dumps({"large_vocab_draft": large(args.large, ks)}, indent=1))
    if args.demo:
        ks = args.ks or [256, 512, 1024, 2048, 4096]
        print(json.dumps({"demo_pair": demo(ks, args.prompts, args.new)}, indent=1))
    if args.padded:
        ks = args.ks or [8192, 16384, 32768, 65536, 151936]
        corpus = f"corpus:{Path(sysconfig.get_paths()['stdlib']) / 'json'}"
        rows = demo(ks, args.prompts, args.new, make_padded_pair(args.padded), 151936, corpus)
        print(json.dumps({"padded_demo_pair": rows}, indent=1))


if __name__ == "__main__":
    main()
