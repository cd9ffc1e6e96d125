"""The runtimes tools/compare/race.py races, each behind one small interface: `generate`
takes a prompt (a conversation, its rendered text and its token ids) and returns decode
tokens/s and the text, measured the same way for everyone: tokens after the first over the
time after the first (prefill excluded), greedy.

A peer that is not installed raises Missing with what to do about it; race.py skips it.
Run alone, it writes the float checkpoint of a GGUF file (gguf_to_checkpoint):

    python tools/compare/peers.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLAMA_BIN = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build2/bin")
LLAMA_BUILD = ("build llama.cpp with GGML_NATIVE=OFF and the AMX options off (the native build "
               "dies with SIGILL on AVX2-only CPUs): cmake -B build2 -DGGML_NATIVE=OFF "
               "-DGGML_AVX2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
               "(on an AVX-512 CPU add -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON, or it races "
               "with AVX2 only) && "
               "cmake --build build2 --target llama-completion llama-bench llama-speculative "
               "-j2, then pass "
               "--llama-bin build2/bin")
GENAI_INSTALL = ("python -m venv /work/venv-genai && /work/venv-genai/bin/pip install "
                 "onnxruntime-genai==0.18.0 onnx onnx-ir transformers torch, then pass "
                 "--genai-python /work/venv-genai/bin/python")
WORKER = Path(__file__).with_name("genai_worker.py")
BUILDER = Path(__file__).with_name("genai_build.py")  # genai's builder, Gemma 3's RoPE fixed


class Missing(Exception):
    """A peer that cannot run here; the message says how to install it."""


@dataclass
class Prompt:
    messages: list[dict[str, str]]
    text: str  # through the chat template (bench_sets.prompt_text)
    ids: list[int]


@dataclass
class Sample:
    tokens_per_s: float
    new_tokens: int
    text: str
    prompt_tokens: int | None = None  # as the peer counted them, where it says


class Edgespec:
    def __init__(self, engine: Any, mode: str):
        self.engine, self.mode = engine, mode

    def generate(self, prompt: Prompt, new: int) -> Sample:
        self.engine.reset()
        result = self.engine.generate(prompt.ids, max_new_tokens=new, mode=self.mode)
        return Sample(result.stats.tokens_per_second, result.stats.new_tokens, result.text,
                      len(prompt.ids))


class LlamaCompletion:
    """llama.cpp's llama-completion on the GGUF file itself, one process per prompt (its
    model load is excluded: its own perf counters time prefill and decode apart)."""

    EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")
    PROMPT = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, poll: int = 50,
                 context: int = 8192):
        self.exe = bin_dir / "llama-completion"
        if not self.exe.is_file():
            raise Missing(f"no {self.exe}; {LLAMA_BUILD}")
        self.args = ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--temp", "0",
                     "-no-cnv", "--no-display-prompt", "--no-warmup", "-c", str(context),
                     "--poll", str(poll)]

    def generate(self, prompt: Prompt, new: int) -> Sample:
        out = subprocess.run([str(self.exe), *self.args, "-n", str(new), "-p", prompt.text],
                             capture_output=True, text=True, timeout=600)
        runs = self.EVAL.search(out.stderr)
        if out.returncode or not runs:
            raise RuntimeError(f"llama-completion failed ({out.returncode}): "
                               f"{out.stderr[-500:]}")
        ms, n = float(runs.group(1)), int(runs.group(2))
        counted = self.PROMPT.search(out.stderr)
        return Sample(n / ms * 1000 if ms else 0.0, n + 1, out.stdout,
                      int(counted.group(1)) if counted else None)


class LlamaSpeculative:
    """llama.cpp's llama-speculative with a GGUF draft (γ = `draft_max`), one process per
    prompt; its decode speed is its own "decoded N tokens in S seconds"."""

    DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")

    def __init__(self, bin_dir: Path, gguf: Path, draft: Path, threads: int, poll: int = 50,
                 draft_max: int = 4, context: int = 8192):
        self.exe = bin_dir / "llama-speculative"
        if not self.exe.is_file():
            raise Missing(f"no {self.exe}; {LLAMA_BUILD}")
        self.args = ["-m", str(gguf), "-md", str(draft), "-t", str(threads), "-td", str(threads),
                     "--temp", "0", "--spec-draft-n-max", str(draft_max), "-c", str(context),
                     "--poll", str(poll)]
        self.acceptance: list[float] = []

    def generate(self, prompt: Prompt, new: int) -> Sample:
        out = subprocess.run([str(self.exe), *self.args, "-n", str(new), "-p", prompt.text],
                             capture_output=True, text=True, timeout=600)
        decoded = self.DECODED.search(out.stderr)
        if out.returncode or not decoded:
            raise RuntimeError(f"llama-speculative failed ({out.returncode}): "
                               f"{out.stderr[-500:]}")
        n, seconds = int(decoded.group(1)), float(decoded.group(2))
        accept = self.ACCEPT.search(out.stderr)
        if accept:
            self.acceptance.append(float(accept.group(1)) / 100)
        return Sample(n / seconds if seconds else 0.0, n + 1, out.stdout[len(prompt.text):])


def llama_bench(bin_dir: Path, gguf: Path, threads: int, new: int, poll: int = 50) -> float:
    """llama-bench's tg figure: decode tokens/s from an empty context, no prompt."""
    exe = bin_dir / "llama-bench"
    if not exe.is_file():
        raise Missing(f"no {exe}; {LLAMA_BUILD}")
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n",
                          str(new), "-r", "1", "--poll", str(poll), "-o", "json"],
                         capture_output=True, text=True,
                         timeout=600, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


class Genai:
    """onnxruntime-genai in its own environment, as a worker process that loads the model
    once (tools/compare/genai_worker.py)."""

    def __init__(self, python: Path, model_dir: Path, decode: Any):
        self.decode = decode  # ids -> text, for comparing outputs
        self.proc = subprocess.Popen([str(python), str(WORKER), str(model_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the onnxruntime-genai worker did not start on {model_dir}.")
        self.version = json.loads(ready)["ready"]

    def generate(self, prompt: Prompt, new: int) -> Sample:
        self.proc.stdin.write(json.dumps({"ids": prompt.ids, "max_new_tokens": new}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        ids = answer["ids"]
        tps = (len(ids) - 1) / answer["decode_s"] if answer["decode_s"] > 0 else 0.0
        return Sample(tps, len(ids), self.decode(ids, skip_special_tokens=True),
                      len(prompt.ids))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def genai_python(python: Path) -> Path:
    """`python` if onnxruntime-genai imports there, else Missing with how to install it."""
    if not python.is_file():
        raise Missing(f"no {python}; install onnxruntime-genai into its own environment: "
                      f"{GENAI_INSTALL}")
    check = subprocess.run([str(python), "-c", "import onnxruntime_genai"],
                           capture_output=True, text=True)
    if check.returncode:
        raise Missing(f"onnxruntime_genai does not import in {python}; {GENAI_INSTALL}")
    return python


def build_genai_model(python: Path, gguf: Path, work: Path, threads: int) -> Path:
    """genai's own int4 model of the GGUF's weights: transformers dequantizes the GGUF
    into a checkpoint (in this environment), genai's builder quantizes that (in its own);
    built once per file into `work`."""
    hf, out = work / "hf", work / "genai-int4"
    if not (hf / "config.json").is_file():
        gguf_to_checkpoint(gguf, hf)
    if not (out / "genai_config.json").is_file():
        subprocess.run([str(python), str(BUILDER), "-i", str(hf), "-o", str(out), "-p", "int4",
                        "-e", "cpu", "-c", str(work / "cache")], check=True, capture_output=True)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = \
        threads
    config_path.write_text(json.dumps(config, indent=4))
    return out


def genai_with_draft(target: Path, draft: Path, out: Path, draft_tokens: int = 4) -> Path:
    """A copy of genai model `target` that speculates with genai model `draft` (a
    "model.draft" section and speculative.max_draft_tokens in genai_config.json)."""
    import shutil

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(target, out)
    (out / "draft").mkdir()
    for f in draft.glob("model.onnx*"):
        shutil.copy(f, out / "draft" / f.name)
    config = json.loads((out / "genai_config.json").read_text())
    decoder = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["draft"] = {**decoder, "filename": "draft/model.onnx"}
    config["speculative"] = {"max_draft_tokens": draft_tokens}
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))
    return out


def gguf_to_checkpoint(gguf: Path, out: Path) -> None:
    """The float checkpoint transformers reads from a GGUF file (its own dequantization):
    what genai's builder quantizes, and what `edgespec export` takes as a Hugging Face model
    (SmolLM2 at the default int8 of a checkpoint, with no hub here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    plain.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.replace(out)


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Write the float checkpoint transformers reads "
                                             "from a GGUF file.")
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    if not a.gguf.is_file():
        raise SystemExit(f"{a.gguf} is not a file; give the path of a .gguf model file.")
    if a.out.exists():
        raise SystemExit(f"{a.out} exists already; give a new directory to write to.")
    gguf_to_checkpoint(a.gguf, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
