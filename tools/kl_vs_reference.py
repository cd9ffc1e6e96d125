"""KL(reference ‖ bundle) per token and top-1 agreement of bundles against a reference bundle.

The quick fidelity check for a kernel choice (issue 15 asks for int8-class fidelity,
KL at most llama.cpp Q8_0's): chunks of a text file are fed as one pass each to both
targets, and the second half of every chunk is scored (the first half is context).

    python tools/kl_vs_reference.py REFERENCE_BUNDLE BUNDLE... [--text FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import edgespec


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def chunk_logits(path: Path, chunks: list[list[int]]) -> list[np.ndarray]:
    engine = edgespec.load(path, device="cpu")
    out = []
    for ids in chunks:
        engine.target.cache.reset()
        out.append(log_softmax(engine.target.forward(ids)[len(ids) // 2:]))
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--text", type=Path, default=Path(argparse.__file__))
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    tokenizer = edgespec.load(a.reference, device="cpu").tokenizer
    ids = tokenizer.encode(a.text.read_text())
    step = max(a.tokens, (len(ids) - a.tokens) // a.chunks)
    chunks = [ids[i:i + a.tokens] for i in range(0, len(ids) - a.tokens, step)][:a.chunks]
    ref = chunk_logits(a.reference, chunks)
    report = {}
    for bundle in a.bundles:
        got = chunk_logits(bundle, chunks)
        kl = np.concatenate([(np.exp(r) * (r - g)).sum(-1) for r, g in zip(ref, got,
                                                                            strict=True)])
        top1 = np.concatenate([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got,
                                                                            strict=True)])
        report[str(bundle)] = {"kl": round(float(kl.mean()), 5),
                               "top1": round(float(top1.mean()), 4), "tokens": int(kl.size)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
