"""A GGUF file of a real model's shape with random weights, for speed checks on sizes the
registry does not have (no hub here): llama.cpp's converter needs a checkpoint, this needs
only a donor GGUF for the tokenizer and chat template (its vocabulary sets the embedding's
rows). Weights are float16, N(0, 0.02²) with unit norms; quantize the result with
llama.cpp's own `llama-quantize` to get the types its users have (Q4_K_M, Q6_K, ...).

    python tools/shaped_gguf.py DONOR.gguf OUT.gguf --shape llama-1b
    llama-quantize OUT.gguf OUT-Q4_K_M.gguf Q4_K_M

Speeds on such a file are those of the real model of that shape (a step reads the same
bytes and does the same arithmetic); what it says is noise, so acceptance is not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

# hidden, layers, heads, KV heads, feed-forward: Llama-3.2-1B and Qwen3-0.6B's body
SHAPES = {"llama-1b": (2048, 16, 32, 8, 8192), "qwen3-0.6b": (1024, 28, 16, 8, 3072)}


def write(donor: Path, out: Path, shape: str, seed: int = 0) -> None:
    d, layers, heads, kv_heads, ff = SHAPES[shape]
    reader = gguf.GGUFReader(donor)
    arch = reader.get_field("general.architecture").contents()
    if arch != "llama":
        raise SystemExit(f"{donor} is a {arch} file; the donor must be a llama one")
    vocab = len(reader.get_field("tokenizer.ggml.tokens").contents())
    writer = gguf.GGUFWriter(out, arch)
    shaped = {"embedding_length": d, "block_count": layers, "feed_forward_length": ff,
              "attention.head_count": heads, "attention.head_count_kv": kv_heads,
              "rope.dimension_count": d // heads}
    for field in reader.fields.values():
        name = field.name
        if name == "general.architecture" or name.startswith("GGUF."):
            continue
        key = name.removeprefix(f"{arch}.")
        if key in shaped:
            writer.add_uint32(name, shaped.pop(key))
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = 1 if name == "general.file_type" else field.contents()  # all F16
        writer.add_key_value(name, value, kind, sub_type=sub)
    for key, value in shaped.items():
        writer.add_uint32(f"{arch}.{key}", value)
    rng = np.random.default_rng(seed)

    def tensor(name: str, rows: int, cols: int = 0) -> None:
        if not cols:
            writer.add_tensor(name, np.ones(rows, np.float32))
            return
        data = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        writer.add_tensor(name, data.astype(np.float16))

    head_dim = d // heads
    tensor("token_embd.weight", vocab, d)
    tensor("output_norm.weight", d)
    for i in range(layers):
        for name, rows, cols in (("attn_q", d, d), ("attn_k", kv_heads * head_dim, d),
                                 ("attn_v", kv_heads * head_dim, d), ("attn_output", d, d),
                                 ("ffn_gate", ff, d), ("ffn_up", ff, d), ("ffn_down", d, ff)):
            tensor(f"blk.{i}.{name}.weight", rows, cols)
        tensor(f"blk.{i}.attn_norm.weight", d)
        tensor(f"blk.{i}.ffn_norm.weight", d)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("donor", type=Path, help="a llama GGUF whose tokenizer is taken")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.donor, args.out, args.shape, args.seed)


if __name__ == "__main__":
    main()
