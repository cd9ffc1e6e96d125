"""edgespec against the anchors, on the same model pair and prompts, in one process.

- Hugging Face transformers (PyTorch CPU, fp32): plain `generate` and assisted generation
  (`assistant_model=` the draft).
- onnxruntime-genai (its own builder, int8, `-e cpu`): plain and speculative (a
  `model.draft` section and `speculative.max_draft_tokens` in genai_config.json).
- edgespec (its own export, int8): AR and spec (chain γ=4).

All greedy, the same held-out prompts (the demo pair's held-aside stdlib files), the
same number of new tokens; time is end to end (prefill included) per generation, so
every runtime is measured the same way. Also reports whether each runtime's greedy
output equals edgespec AR's.

    pip install onnxruntime-genai onnx-ir && python tools/compare/compare_anchors.py
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

TOOLS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TOOLS))

from measure_demo import CARD, held_out_prompts  # noqa: E402

import edgespec  # noqa: E402
from edgespec.export import export  # noqa: E402


def oga_build(ckpt: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                    str(ckpt), "-o", str(out), "-p", "int8", "-e", "cpu", "-c",
                    str(out.parent / "cache")], check=True, capture_output=True)


def oga_models(target: Path, draft: Path, work: Path) -> tuple[Path, Path]:
    """A plain target model dir and a copy of it with the draft wired in."""
    plain, spec, draft_dir = work / "oga-target", work / "oga-spec", work / "oga-draft"
    oga_build(target, plain)
    oga_build(draft, draft_dir)
    shutil.copytree(plain, spec)
    (spec / "draft").mkdir()
    for f in draft_dir.glob("model.onnx*"):
        shutil.copy(f, spec / "draft" / f.name)
    config = json.loads((spec / "genai_config.json").read_text())
    decoder = json.loads((draft_dir / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["draft"] = {**decoder, "filename": "draft/model.onnx"}
    config["speculative"] = {"max_draft_tokens": 4}
    (spec / "genai_config.json").write_text(json.dumps(config, indent=1))
    return plain, spec


def oga_run(model_dir: Path, prompts: list[list[int]], new: int) -> tuple[float, list]:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    outputs, seconds = [], 0.0
    for ids in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new, do_sample=False)
        t0 = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        seconds += time.perf_counter() - t0
        outputs.append(list(gen.get_sequence(0))[len(ids):])
    return sum(len(o) for o in outputs) / seconds, outputs


def hf_run(target: Path, draft: Path | None, prompts: list[list[int]],
           new: int) -> tuple[float, list]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assistant = (AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
                 if draft else None)
    outputs, seconds = [], 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                 do_sample=False, assistant_model=assistant, pad_token_id=0)
        seconds += time.perf_counter() - t0
        outputs.append(out[0, len(ids):].tolist())
    return sum(len(o) for o in outputs) / seconds, outputs


def edgespec_run(bundle: Path, prompts: list[list[int]], new: int,
                 **kwargs) -> tuple[float, list]:
    engine = edgespec.load(bundle)
    outputs, seconds = [], 0.0
    for ids in prompts:
        engine.reset()
        t0 = time.perf_counter()
        result = engine.generate(ids, max_new_tokens=new, **kwargs)
        seconds += time.perf_counter() - t0
        outputs.append(result.token_ids)
    return sum(len(o) for o in outputs) / seconds, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=TOOLS / "demo_pair" / "target")
    ap.add_argument("--draft", type=Path, default=TOOLS / "demo_pair" / "draft")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--card", type=Path, default=CARD, help="model card naming held-out files")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    export(args.target, work / "edgespec", draft=args.draft, precision="int8",
           console=Console(file=io.StringIO()))
    prompts = held_out_prompts(edgespec.load(work / "edgespec"), args.prompts, args.card)
    plain, spec = oga_models(args.target, args.draft, work)
    runs = {
        "edgespec ar (int8)": lambda: edgespec_run(work / "edgespec", prompts, args.new,
                                                   mode="ar"),
        "edgespec spec γ=4 (int8)": lambda: edgespec_run(work / "edgespec", prompts,
                                                         args.new, mode="spec"),
        "onnxruntime-genai (int8)": lambda: oga_run(plain, prompts, args.new),
        "onnxruntime-genai spec k=4 (int8)": lambda: oga_run(spec, prompts, args.new),
        "transformers (fp32)": lambda: hf_run(args.target, None, prompts, args.new),
        "transformers assisted (fp32)": lambda: hf_run(args.target, args.draft, prompts,
                                                       args.new),
    }
    results = {name: run() for name, run in runs.items()}
    reference = results["edgespec ar (int8)"][1]
    base = results["onnxruntime-genai (int8)"][0]
    report = {name: {"tokens_per_s": round(tps, 1),
                     "vs_onnxruntime_genai_plain": round(tps / base, 2),
                     "greedy_equals_edgespec_ar": float(np.mean(
                         [o[:len(r)] == r[:len(o)] for o, r in zip(out, reference,
                                                                   strict=True)]))}
              for name, (tps, out) in results.items()}
    print(json.dumps({"prompts": len(prompts), "new_tokens": args.new, "results": report},
                     indent=1))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
