"""Fidelity of an imported GGUF file: edgespec's bundle and llama.cpp on the same file,
each against the same float32 reference, on the same text.

The reference is the file's own weights dequantized to float32 (gguf-py), with float32
activations: a float32 GGUF written here for llama.cpp (`llama-perplexity
--kl-divergence-base`), and transformers' GGUF loading for edgespec. Both runtimes then
score the quantized file with their default (8-bit) activations. Chunks of `--ctx`
tokens, the second half of each scored, as llama-perplexity does.

    python tools/compare/gguf_kl.py MODEL.gguf --llama-cpp DIR/bin --text FILE [--chunks 8]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch


def write_f32(src: Path, dst: Path) -> None:
    """The same file with every tensor dequantized to float32 (metadata copied)."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = 0 if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_kl(bin_dir: Path, model: Path, text: Path, ctx: int, chunks: int,
                 work: Path) -> dict[str, float]:
    f32 = work / "reference-f32.gguf"
    write_f32(model, f32)
    base = work / "base.kld"
    common = ["-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", "2", "-b", str(ctx)]
    subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(f32),
                    "--kl-divergence-base", str(base), *common], check=True,
                   capture_output=True)
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model),
                          "--kl-divergence-base", str(base), "--kl-divergence", *common],
                         check=True, capture_output=True, text=True)
    log = out.stdout + out.stderr
    kl = float(re.search(r"Mean\s+KLD:\s+([-\d.]+)", log).group(1))
    top = float(re.search(r"Same top p:\s+([\d.]+)", log).group(1)) / 100
    return {"kl": kl, "top1": top}


def edgespec_kl(model: Path, text: Path, ctx: int, chunks: int, work: Path
                ) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgespec.bundle import read_manifest
    from edgespec.export import export
    from edgespec.runtimes import DecoderSession

    tok = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    ref_model = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name,
                                                     dtype=torch.float32).eval()
    export(model, work / "bundle")
    m = read_manifest(work / "bundle")
    ids = tok(text.read_text())["input_ids"]
    kls, same = [], []
    for c in range(chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if len(chunk) < ctx:
            break
        sess = DecoderSession(work / "bundle" / "target.onnx", m.target,
                              ["CPUExecutionProvider"], max_len=ctx)
        got = sess.forward(chunk)[ctx // 2:].astype(np.float64)
        with torch.no_grad():
            ref = ref_model(torch.tensor([chunk])).logits[0, ctx // 2:].double().numpy()
        p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
        q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
        kls.append((np.exp(p) * (p - q)).sum(-1))
        same.append(ref.argmax(-1) == got.argmax(-1))
    return {"kl": float(np.concatenate(kls).mean()), "top1": float(np.concatenate(same).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="folder of llama-perplexity")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        ours = edgespec_kl(args.model, args.text, args.ctx, args.chunks, Path(work))
        theirs = llama_cpp_kl(args.llama_cpp, args.model, args.text, args.ctx, args.chunks,
                              Path(work))
    print(f"| {args.model.name} | edgespec KL {ours['kl']:.4f}, top-1 {ours['top1']:.1%} "
          f"| llama.cpp KL {theirs['kl']:.4f}, top-1 {theirs['top1']:.1%} |")


if __name__ == "__main__":
    main()
