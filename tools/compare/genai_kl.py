"""onnxruntime-genai's model on edgespec quality's protocol: KL, top-1 and perplexity of
a genai-built ONNX model against an edgespec reference bundle, on the same text and
chunks as `edgespec quality` (chunks of `--ctx` tokens, the second half of each scored).

genai ships its own onnxruntime, which must not meet edgespec's, so its model runs in
genai's Python (`--genai-python`, this file as the worker: each chunk one pass from an
empty cache), and the log-probabilities come back through a temporary .npy file.

    python tools/compare/genai_kl.py GENAI_MODEL_DIR --reference FP32_BUNDLE \\
        --genai-python VENV/bin/python --text FILE [--chunks 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def worker(model_dir: Path, chunks_file: Path, out: Path) -> None:
    """In genai's environment: the model's logits for every chunk's scored half."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_dir / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
    chunks = json.loads(chunks_file.read_text())
    rows = []
    for ids in chunks:
        feed = {"input_ids": np.array([ids], np.int64),
                "attention_mask": np.ones((1, len(ids)), np.int64)}
        for i in session.get_inputs():
            if i.name.startswith("past_key_values."):
                feed[i.name] = empty
        logits = session.run(["logits"], feed)[0][0]
        half = len(ids) // 2
        rows.append(logits[half - 1:len(ids) - 1])
    np.save(out, np.stack(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a directory with genai's model.onnx")
    ap.add_argument("--reference", type=Path)
    ap.add_argument("--genai-python", default="python")
    ap.add_argument("--text", type=Path)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--worker", nargs=2, type=Path, metavar=("CHUNKS", "OUT"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.model, *a.worker)
        return
    from edgespec.bundle import read_manifest
    from edgespec.quality import DEFAULT_TEXT, chunks_of, figures, log_softmax, scored_logprobs
    from edgespec.tokenizer import Tokenizer

    text = (a.text or DEFAULT_TEXT).read_text(encoding="utf-8", errors="replace")
    chunks = chunks_of(Tokenizer.from_dir(a.reference).encode(text), a.ctx, a.chunks)
    entry = read_manifest(a.reference).target
    ref = scored_logprobs(a.reference / entry.graph, entry, chunks)
    with tempfile.TemporaryDirectory() as tmp:
        chunks_file, out = Path(tmp) / "chunks.json", Path(tmp) / "logits.npy"
        chunks_file.write_text(json.dumps(chunks))
        subprocess.run([a.genai_python, __file__, str(a.model), "--worker", str(chunks_file),
                        str(out)], check=True)
        got = [log_softmax(z) for z in np.load(out)]
    print(json.dumps(figures(ref, got, chunks).as_dict()))


if __name__ == "__main__":
    sys.exit(main())
