"""Export time, bundle size and CPU decode speed per precision, for one checkpoint.

Decode speed is measured at two context lengths with the KV cache already holding that
many positions (filled with zeros instead of a real prefill: the attention and matmul
work of a step is the same, and a 2048-token prefill of a 0.5B model would dominate the
run). A cache copied per step would make the long-context figure collapse; an in-place
cache keeps it close to the short one.

    python tools/bench_export.py tools/demo_pair/target --contexts 128 480
    python tools/bench_export.py --qwen05b /tmp/qwen05b --contexts 128 2048
    python tools/bench_export.py --qwen05b /tmp/qwen05b --precisions int4 --kv-cache int8
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console

from edgespec.bundle import read_manifest
from edgespec.export import export
from edgespec.runtimes import DecoderSession


def make_qwen05b(path: Path, tokenizer_from: Path) -> Path:
    """A random-init model with Qwen2.5-0.5B's shapes (494M parameters, 151,936 vocab)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (path / "config.json").exists():
        return path
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / f, path / f)
    return path


def decode_speed(bundle: Path, context: int, steps: int = 48) -> float:
    m = read_manifest(bundle, verify=False)
    sess = DecoderSession(bundle / "target.onnx", m.target, ["CPUExecutionProvider"],
                          max_len=context + steps + 1)
    sess.cache.length = context - 1
    sess.forward([1])  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        sess.forward([1])
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, nargs="?")
    ap.add_argument("--qwen05b", type=Path, help="build (or reuse) the 0.5B shape here")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8", "int4"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--kv-cache", choices=["float", "int8"], default="float")
    args = ap.parse_args()
    here = Path(__file__).parent
    ckpt = (make_qwen05b(args.qwen05b, here / "demo_pair" / "target") if args.qwen05b
            else args.checkpoint)
    rows = []
    for precision in args.precisions:
        out = Path(tempfile.mkdtemp()) / "bundle"
        t0 = time.perf_counter()
        export(ckpt, out, precision=precision, kv_cache=args.kv_cache,
               console=Console(file=io.StringIO()))
        export_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in out.iterdir())
        speeds = {f"tok/s@{c}": round(decode_speed(out, c), 1) for c in args.contexts}
        rows.append({"precision": precision, "kv_cache": args.kv_cache,
                     "export_s": round(export_s, 1),
                     "bundle_MiB": round(size / 2**20, 1), **speeds})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(out.parent)
    first, last = (f"tok/s@{c}" for c in (args.contexts[0], args.contexts[-1]))
    for row in rows:
        row["long/short"] = round(row[last] / row[first], 2)
    print(json.dumps({"checkpoint": str(ckpt), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
