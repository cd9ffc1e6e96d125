"""The default int4 and int8 of a real model (SmolLM2-135M-Instruct, its GGUF weights in
float32 as the reference) against llama.cpp's Q4_K_M and Q8_0 of the same weights.

Scored like `llama-perplexity --kl-divergence` on CPython's fractions.py + random.py (16
chunks of 256 tokens, second halves): text the quantizer never sees (it calibrates on
the model's own chat answers). The llama.cpp figures are measured, on the same weights
and text: 0c1e570's `llama-quantize` of the float32 file (tools/compare/gguf_kl.py's
write_f32), then `llama-perplexity --kl-divergence`: Q4_K_M KL 0.0529, top-1 89.6%, in a
105,454,144-byte file; Q8_0 KL 0.0039, top-1 96.9%, 144,811,072 bytes. edgespec measured
here: int4 KL 0.018, top-1 92.4% (0.028, 92.0% before GPTQ chose the codes); int8
(uncalibrated) 0.0040, 96.7%.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import onnx
import pytest

from edgespec.bundle import read_manifest
from edgespec.export import export
from edgespec.quality import measure
from tests.real_models import smollm2_gguf

Q4_K_M = dict(kl=0.0529, top1=0.896, size=105_454_144)
Q8_0 = dict(kl=0.0039, top1=0.969, size=144_811_072)


@pytest.fixture(scope="module")
def scoring(tmp_path_factory):
    """(the fp32 reference bundle, the text)."""
    root = tmp_path_factory.mktemp("quant-real")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = root / "text.py"
    text.write_text((stdlib / "fractions.py").read_text() + (stdlib / "random.py").read_text())
    export(smollm2_gguf(), root / "fp32", precision="fp32", requantize=True, summary=False)
    return root / "fp32", text


def bundle_bytes(path: Path) -> int:
    m = read_manifest(path)
    return sum((path / f).stat().st_size for f in (m.target.graph, *m.target.data_files))


@pytest.mark.parametrize("precision,llama,max_kl,min_top1", [
    ("int4", Q4_K_M, 0.022, 0.915), ("int8", Q8_0, 0.0039, 0.965)])
def test_default_quantization_beats_llama_cpp(tmp_path, scoring, precision, llama, max_kl,
                                              min_top1):
    reference, text = scoring
    out = tmp_path / precision
    export(smollm2_gguf(), out, precision=precision, requantize=True, summary=False)
    q = measure(out, reference, text, ctx=256, chunks=16)
    print(precision, q, bundle_bytes(out))
    assert max_kl <= llama["kl"] and q.kl <= max_kl and q.top1 >= min_top1
    assert bundle_bytes(out) <= llama["size"]
    # the tied embedding is gathered from the head's codes: no table of its own is stored
    names = {t.name for t in onnx.load(out / "target.onnx", load_external_data=False)
             .graph.initializer}
    assert not any(n.startswith("embed.") for n in names)
    assert any(n.startswith("lm_head.") for n in names)
