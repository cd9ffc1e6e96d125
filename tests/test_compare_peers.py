"""tools/compare/race.py skips a peer that is not installed, saying how to install it, and
refuses a model that is not a file in one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[1] / "tools" / "compare"
sys.path.insert(0, str(COMPARE))

from peers import (  # noqa: E402
    LlamaCompletion,
    LlamaSpeculative,
    Missing,
    genai_python,
    llama_bench,
)


def test_missing_llama_cpp_says_how_to_build_it(tmp_path):
    gguf = tmp_path / "m.gguf"
    for start in (lambda: LlamaCompletion(tmp_path, gguf, 2),
                  lambda: LlamaSpeculative(tmp_path, gguf, gguf, 2),
                  lambda: llama_bench(tmp_path, gguf, 2, 8)):
        with pytest.raises(Missing, match="GGML_NATIVE=OFF") as e:
            start()
        assert str(tmp_path) in str(e.value)


def test_missing_onnxruntime_genai_says_how_to_install_it(tmp_path):
    with pytest.raises(Missing, match="pip install onnxruntime-genai==0.18.0"):
        genai_python(tmp_path / "python")
    python = Path(sys.executable)
    if importlib.util.find_spec("onnxruntime_genai") is None:  # it lives in a venv of its own
        with pytest.raises(Missing, match="does not import"):
            genai_python(python)
    else:
        assert genai_python(python) == python


def test_race_refuses_a_model_that_is_not_a_file(tmp_path):
    out = subprocess.run([sys.executable, str(COMPARE / "race.py"), "--model",
                          str(tmp_path / "none.gguf")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {tmp_path / 'none.gguf'} is not a file; pass a " \
                                 ".gguf model."


def test_checkpoint_of_a_gguf_file_holds_its_weights(tmp_path):
    """peers.py run alone writes the float checkpoint of a GGUF file: its embedding is
    gguf-py's dequantization of the file's token_embd; bad paths are refused in one line,
    nothing written."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.real_models import smollm2_gguf

    script = [sys.executable, str(COMPARE / "peers.py")]
    missing = subprocess.run([*script, str(tmp_path / "none.gguf"), str(tmp_path / "a")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == f"{tmp_path / 'none.gguf'} is not a file; give the " \
                                     "path of a .gguf model file."
    assert not (tmp_path / "a").exists()
    out = tmp_path / "hf"
    done = subprocess.run([*script, str(smollm2_gguf()), str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    reader = gguf.GGUFReader(smollm2_gguf())
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = gguf.dequantize(embd.data, embd.tensor_type).reshape(-1, 576)
    written = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(written, expected.astype(np.float32))
    again = subprocess.run([*script, str(smollm2_gguf()), str(out)], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 1 and again.stderr.strip() == \
        f"{out} exists already; give a new directory to write to."
