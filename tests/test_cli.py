"""The `edgespec` command as users run it: a real subprocess, real exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from edgespec.bundle import MANIFEST


def run(*args: str, stdin: str | None = None, env: dict | None = None,
        timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_generate_json_on_demo_bundle():
    out = run("generate", "def quicksort(items):", "--max-new-tokens", "48", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "token_ids", "stats"}
    assert set(result["stats"]) >= {"mode", "prompt_tokens", "new_tokens", "target_passes",
                                    "draft_passes", "acceptance_rate",
                                    "tokens_per_target_pass", "tokens_per_second", "wall_s"}
    assert result["stats"]["mode"] == "spec"
    assert 0 < len(result["token_ids"]) <= 48
    again = json.loads(run("generate", "def quicksort(items):", "--max-new-tokens", "48",
                           "--json").stdout)
    assert again["token_ids"] == result["token_ids"] and again["text"] == result["text"]
    ar = json.loads(run("generate", "def quicksort(items):", "--max-new-tokens", "48",
                        "--json", "--mode", "ar", "--logprobs", "2").stdout)
    assert ar["token_ids"] == result["token_ids"] and "logprobs" not in result
    assert [e["token"] for e in ar["logprobs"]] == ar["token_ids"]
    assert all(len(e["top"]) == 2 and e["top"][0][1] >= e["logprob"] for e in ar["logprobs"])
    assert_user_error(run("generate", "x", "--logprobs", "2"), "--json")


def test_generate_streams_prompt_and_continuation():
    out = run("generate", "--max-new-tokens", "16", stdin="class Stack:\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("class Stack:\n") and len(out.stdout) > len("class Stack:\n")
    assert "tok/s" in out.stderr and "[spec, cpu]" in out.stderr


def test_the_stats_line_of_a_one_token_answer_claims_no_speed():
    """Speed is tokens after the first over the time after prefill: none for one token,
    which the line showed as "1 tokens, 0.0 tok/s", a hang to the eye."""
    out = run("generate", "def f(x):", "--max-new-tokens", "1")
    assert out.returncode == 0, out.stderr
    assert "1 token, 1 target pass," in out.stderr and "tok/s" not in out.stderr


@pytest.mark.parametrize("command", ["export", "generate", "chat", "serve", "bench", "doctor"])
def test_help(command):
    out = run(command, "--help")
    assert out.returncode == 0 and "Usage:" in out.stdout


@pytest.mark.parametrize("args, fragments", [
    (["export", "--precision", "int3", "x"], ["'int3' is not one of", "'edgespec export --help'"]),
    (["generate", "--tempreature", "1", "x"], ["Did you mean '--temperature'",
                                               "'edgespec generate --help'"]),
    (["nope"], ["No such command 'nope'", "'edgespec --help'"]),
    (["export"], ["Missing argument 'TARGET'"]),
])
def test_usage_errors_are_one_line(args, fragments):
    assert_user_error(run(*args), *fragments, code=2)


def test_doctor_reads_edgespec_kernels_and_refuses_a_value_it_does_not_know():
    from edgespec import kernels

    if kernels.vectorized():  # else exports use ONNX Runtime's kernels either way
        out = run("doctor", env={"EDGESPEC_KERNELS": "onnxruntime"})
        assert "EDGESPEC_KERNELS=onnxruntime" in " ".join(out.stdout.split()), out.stdout
    assert_user_error(run("doctor", env={"EDGESPEC_KERNELS": "bogus"}),
                      "EDGESPEC_KERNELS is 'bogus'")


def test_doctor():
    out = run("doctor")
    assert out.returncode == 0, out.stderr
    assert "provider cpu" in out.stdout and "works" in out.stdout
    assert "demo bundle" in out.stdout and "ok" in out.stdout


def assert_user_error(out: subprocess.CompletedProcess, *fragments: str, code: int = 1) -> None:
    assert out.returncode == code
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()  # one line, no blank one a progress bar left behind
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_model_directory():
    assert_user_error(run("generate", "x", "--model", "/nonexistent"),
                      "/nonexistent does not exist")


def test_corrupted_bundle(bundle_copy):
    data = bundle_copy / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert_user_error(run("generate", "x", "--model", str(bundle_copy)),
                      "target.onnx.data is corrupted")


def test_bundle_missing_a_file(bundle_copy):
    (bundle_copy / "draft.onnx").unlink()
    assert_user_error(run("generate", "x", "--model", str(bundle_copy)),
                      "draft.onnx is missing")


def test_newer_format_version(bundle_copy):
    manifest = json.loads((bundle_copy / MANIFEST).read_text())
    manifest["format_version"] += 1
    (bundle_copy / MANIFEST).write_text(json.dumps(manifest))
    assert_user_error(run("generate", "x", "--model", str(bundle_copy)),
                      "newer than this edgespec", "upgrade edgespec")


def test_prompt_longer_than_context():
    assert_user_error(run("generate", "x = 1\n" * 600), "tokens but the model's context")


def test_unavailable_device():
    assert_user_error(run("generate", "x", "--device", "cuda"), "cuda execution provider")
    assert_user_error(run("generate", "x", "--draft-device", "cuda"), "cuda execution provider")


def test_draft_on_its_own_device_gives_the_same_output():
    """--draft-device places the draft apart (here: both on the CPU, the only provider)."""
    base = ["generate", "def quicksort(items):", "--max-new-tokens", "24", "--json"]
    apart = json.loads(run(*base, "--draft-device", "cpu").stdout)
    ar = json.loads(run(*base, "--mode", "ar").stdout)
    assert apart["token_ids"] == ar["token_ids"] and apart["stats"]["device"] == "cpu"


def test_bad_flag_value_is_a_usage_error():
    out = run("generate", "x", "--temperature", "-1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--temperature" in out.stderr


def test_a_flag_the_mode_does_not_use_is_refused_before_the_prompt_is_echoed():
    out = run("generate", "def quicksort(items):", "--mode", "ar", "--adaptive")
    assert_user_error(out, "adaptive does nothing in mode ar")
    assert out.stdout == ""


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id_alone(tmp_path):
    (tmp_path / "models").mkdir()
    out = subprocess.run([sys.executable, "-m", "edgespec.cli", "export", "models/typo",
                          "--out", "b"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert_user_error(out, "could not download models/typo",
                      "nor is it in the local folder models/")
    assert not (tmp_path / "b").exists()


def test_export_takes_an_empty_folder_and_refuses_one_with_files(tmp_path, demo_target):
    (tmp_path / "b").mkdir()
    assert run("export", str(demo_target), "--out", str(tmp_path / "b")).returncode == 0
    assert (tmp_path / "b" / "edgespec.json").is_file()
    assert_user_error(run("export", str(demo_target), "--out", str(tmp_path / "b")),
                      "already holds a bundle; pass --overwrite")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("keep me")
    refused = run("export", str(demo_target), "--out", str(tmp_path / "c"))
    assert_user_error(refused, "not an edgespec bundle")  # not told to pass --overwrite
    assert "pass --overwrite" not in refused.stderr
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("flags", [["--precision", "int4"], ["--ep-profile", "cuda"],
                                   ["--draft", "nested"]])
def test_export_quant_rot_refuses_what_it_cannot_build(tmp_path, demo_target, flags):
    """--quant rot is int8 (or fp32) on the cpu profile: anything else is one sentence,
    and nothing is written."""
    assert_user_error(run("export", str(demo_target), "--out", str(tmp_path / "b"),
                          "--quant", "rot", *flags), "--quant rot")
    assert not (tmp_path / "b").exists()


def test_gpu_profiles_store_fp16_and_say_so(tmp_path, demo_target, demo_draft):
    """dml takes fp16 by default (it has no 8-bit kernel, int8 being the default elsewhere),
    and fp32 on cuda or dml, which compute in float16, is stored as fp16 with a note: it
    was stored so before, but labelled fp32. Run on the CPU, such a bundle decodes AR only
    (its passes are not exact there), and says so rather than leave its draft idle unseen."""
    dml = run("export", str(demo_target), "--out", str(tmp_path / "d"), "--ep-profile", "dml")
    assert dml.returncode == 0, dml.stderr
    cuda = run("export", str(demo_target), "--out", str(tmp_path / "c"), "--ep-profile", "cuda",
               "--precision", "fp32", "--draft", str(demo_draft))
    assert cuda.returncode == 0, cuda.stderr
    assert "note: the cuda profile computes in float16, so float weights are stored as fp16" \
        in cuda.stderr
    for out in ("d", "c"):
        manifest = json.loads((tmp_path / out / MANIFEST).read_text())
        assert manifest["target"]["precision"] == "fp16"
    fp16 = run("export", str(demo_target), "--out", str(tmp_path / "h"), "--ep-profile",
               "cuda", "--precision", "fp16")
    assert fp16.returncode == 0, fp16.stderr
    assert (tmp_path / "c" / "target.onnx.data").stat().st_size == \
        (tmp_path / "h" / "target.onnx.data").stat().st_size
    gen = run("generate", "def f(x):", "--model", str(tmp_path / "c"), "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr
    assert "exported for the cuda profile and runs on the CPU here" in gen.stderr
    assert "[ar, cpu]" in gen.stderr


def test_export_then_generate(tmp_path, demo_target, demo_draft):
    out = run("export", str(demo_target), "--draft", str(demo_draft), "--out",
              str(tmp_path / "b"), "--precision", "int4", "--draft-precision", "int8",
              "--quant", "sym", "--block-size", "64")
    assert out.returncode == 0, out.stderr
    assert "target.onnx" in out.stderr  # the summary table
    gen = run("generate", "def f(x):", "--model", str(tmp_path / "b"), "--json",
              "--max-new-tokens", "8")
    assert gen.returncode == 0, gen.stderr
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert manifest["target"]["precision"] == "int4" and manifest["target"]["block_size"] == 64
    assert manifest["draft"]["block_size"] == 64


def test_export_k_recipe_then_quality(tmp_path, demo_target):
    """The default int4 (the GGUF recipe) from the command line, a user calibration text,
    then `edgespec quality` against the float checkpoint: JSON figures in range, and the
    bundle against itself is exact."""
    text = tmp_path / "calib.txt"
    text.write_text("def mean(xs):\n    return sum(xs) / len(xs)\n" * 40)
    out = run("export", str(demo_target), "--out", str(tmp_path / "b"), "--precision",
              "int4", "--calibration", str(text))
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert manifest["target"]["block_size"] is None
    assert manifest["provenance"]["quant"] == "k"
    assert manifest["provenance"]["calibration"] == "calib.txt"
    # no bigger than llama.cpp's Q4_K_M of the same checkpoint (llama-quantize 0c1e570 of
    # its F32 GGUF: 3,777,472 bytes, tokenizer included; this bundle's graph + weights)
    target = manifest["target"]
    assert sum((tmp_path / "b" / f).stat().st_size
               for f in (target["graph"], *target["data_files"])) <= 3_777_472
    assert "target vs the float model (fractions.py, 1024 tokens scored): KL" in out.stderr
    q = run("quality", str(tmp_path / "b"), "--reference", str(demo_target), "--json")
    assert q.returncode == 0, q.stderr
    figures = json.loads(q.stdout)
    assert 0 < figures["kl"] < 0.05 and figures["top1"] > 0.85 and figures["tokens"] == 1024
    assert figures["ppl"] > figures["reference_ppl"] * 0.95
    # export measured the same thing against the float graph it had built
    for key, value in manifest["provenance"]["quality"].items():
        assert figures[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
    same = json.loads(run("quality", str(tmp_path / "b"), "--reference", str(tmp_path / "b"),
                          "--json", "--chunks", "2").stdout)
    assert same["kl"] == 0 and same["top1"] == 1 and same["ppl"] == same["reference_ppl"]
    table = run("quality", str(tmp_path / "b"), "--reference", str(tmp_path / "b"),
                "--chunks", "1")
    assert "KL mean" in table.stdout and "top-1" in table.stdout
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    assert_user_error(run("quality", str(tmp_path / "b"), "--reference", str(demo_target),
                          "--text", str(short)), "fewer than one chunk")


def test_an_export_that_fails_midway_says_one_line(tmp_path, demo_target):
    """A checkpoint without one of its tensors fails while the progress bar is up: its
    sentence alone, without the blank line the bar left in a log."""
    from safetensors.numpy import load_file, save_file

    ckpt = shutil.copytree(demo_target, tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    assert_user_error(run("export", str(ckpt), "--out", str(tmp_path / "b")),
                      "no tensor 'model.layers.1.mlp.down_proj.weight'")
    assert not (tmp_path / "b").exists()


def test_quality_refuses_bad_input(tmp_path, demo_target):
    assert_user_error(run("quality", str(demo_target), "--reference", str(demo_target)),
                      "edgespec.json")
    assert_user_error(run("export", str(demo_target), "--out", str(tmp_path / "c"),
                          "--precision", "int4", "--calibration", str(tmp_path / "none.txt")),
                      "is not a file")
    assert not (tmp_path / "c").exists()
    from edgespec.engine import demo_bundle

    demo = str(demo_bundle())
    assert_user_error(run("quality", demo, "--reference", demo, "--ctx", "1024"),
                      "--ctx 1024 is longer than the model's context of 512")
    short = tmp_path / "short"  # a reference of a shorter context: it was told to shorten
    shutil.copytree(demo, short)  # a prompt or max_new_tokens, which quality has not
    manifest = json.loads((short / MANIFEST).read_text())
    manifest["target"]["max_positions"] = 256
    (short / MANIFEST).write_text(json.dumps(manifest))
    assert_user_error(run("quality", demo, "--reference", str(short), "--ctx", "300"),
                      "--ctx 300 is longer than the reference's context of 256")
    # another model's vocabulary is told from its config alone, before any export (which
    # would stop at this folder's missing weights)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    assert_user_error(run("quality", demo, "--reference", str(tmp_path / "other")),
                      "vocabulary (4096 tokens) differs from the reference's (1000)")


def test_import_is_light():
    """Neither export's dependencies nor onnx (read only to cut offload segments)."""
    code = ("import sys, edgespec; edgespec.load; "
            "bad = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_bench_json_runs_every_mode_losslessly():
    out = run("bench", "--limit", "1", "--max-new-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["prompt_set"] == "demo" and report["temperatures"] == [0.0, 0.7]
    modes = {r["mode"] for r in report["rows"]}
    assert modes == {"ar", "chain γ=4", "chain adaptive", "tree 16", "lookup"}
    # the demo bundle's default (what generate runs with no flags) is the γ=4 chain
    assert {r["mode"] for r in report["rows"] if r["is_default"]} == {"chain γ=4"}
    greedy = [r for r in report["rows"] if r["temperature"] == 0]
    assert all(r["greedy_differs_from_ar"] == 0 for r in greedy)
    assert all(r["greedy_differs_from_ar"] is None for r in report["rows"]
               if r["temperature"] > 0)
    assert all(r["speedup_vs_ar"] == 1.0 for r in report["rows"] if r["mode"] == "ar")
    for t in (0.0, 0.7):
        rows = [r for r in report["rows"] if r["temperature"] == t and r["mode"] == "ar"]
        # "all" pools the categories: its tokens are theirs summed
        assert rows[-1]["category"] == "all"
        assert rows[-1]["new_tokens"] == sum(r["new_tokens"] for r in rows[:-1])
    spec = next(r for r in greedy if r["mode"] == "chain γ=4" and r["category"] == "all")
    assert spec["tokens_per_target_pass"] > 1
    # stderr is a pipe here, where no bar is drawn: a line a prompt run says how far it is
    runs = 2 * len({r["category"] for r in report["rows"]} - {"all"})
    assert f"benchmarking: {runs} of {runs} prompt runs done" in out.stderr



def test_bench_table_in_a_file_keeps_every_name_whole():
    """Out of a terminal rich draws 80 columns, and cut `summarization` to `summari…`."""
    out = run("bench", "--limit", "1", "--max-new-tokens", "4", "--temperature", "0",
              "--mode", "ar", "--mode", "adaptive")
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and "chain adaptive" in out.stdout
    assert "tokens/pass" in out.stdout and "acceptance" in out.stdout


def test_bench_says_what_it_cut_to_fit_the_context():
    out = run("bench", "--limit", "1", "--category", "chat", "--mode", "ar", "--temperature",
              "0", "--max-new-tokens", "500", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["cut_prompts"] == 1 and report["kept_tokens"] == 512 - 500 - 1
    assert_user_error(run("bench", "--max-new-tokens", "600"), "leave no room for a prompt")


def test_bench_table_of_ar_alone_stars_nothing():
    out = run("bench", "--limit", "1", "--category", "chat", "--mode", "ar", "--temperature",
              "0", "--max-new-tokens", "4", env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "1 prompt ×" in out.stdout and " *" not in out.stdout
    assert "runs with no flags" not in out.stdout and "vs AR: decode tok/s" in out.stdout

def test_bench_on_the_real_set_with_chosen_modes_and_rounds():
    out = run("bench", "--prompts", "real", "--category", "chat", "--category", "code",
              "--limit", "1", "--mode", "lookup", "--temperature", "0", "--rounds", "2",
              "--max-new-tokens", "8", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["categories"] == ["chat", "code"] and report["prompts"] == 2
    assert {r["mode"] for r in report["rows"]} == {"ar", "lookup"}  # AR always runs
    assert all(r["greedy_differs_from_ar"] == 0 for r in report["rows"])
    low, high = next(r for r in report["rows"] if r["mode"] == "lookup" and
                     r["category"] == "all")["speedup_range"]
    assert 0 < low <= high


def test_bench_refuses_an_unknown_category():
    out = run("bench", "--prompts", "real", "--category", "poetry")
    assert_user_error(out, "no category poetry", "chat, multi-turn, code")


def test_bench_mode_ids_match_the_bench_modes():
    from edgespec.bench import MODES
    from edgespec.cli import MODE_IDS

    assert tuple(MODES) == MODE_IDS


def test_bench_prompt_set_is_shipped():
    from edgespec.bench_sets import load_set

    prompts = load_set("demo")
    assert len(prompts) >= 40
    assert {p["category"] for p in prompts} == {"completion", "editing", "docstring", "chat",
                                                "summarization"}


def test_doctor_reports_gpu_memory_with_a_fake_nvidia_smi(tmp_path, monkeypatch):
    """nvidia-smi's CSV is what doctor reads; a stand-in script on PATH plays the driver."""
    from edgespec.doctor import gpu_memory

    assert gpu_memory().startswith("unknown")  # this machine has no NVIDIA driver
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 140000 MiB, 143771 MiB'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert gpu_memory() == "NVIDIA H200, 140000 MiB, 143771 MiB"
