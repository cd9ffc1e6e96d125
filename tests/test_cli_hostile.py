"""The CLI against the review's hostile inputs (issue 17): real subprocesses, real files,
real signals. User errors are one sentence, exit 1, and leave nothing half-done."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pexpect
import pytest

from edgespec.bundle import MANIFEST, sha256
from tests.http_server import free_port
from tests.test_cli import assert_user_error, run

CLI = [sys.executable, "-m", "edgespec.cli"]


def tree(path):
    """Every file under `path` with its bytes' digest: what must not change."""
    return {p.relative_to(path).as_posix(): sha256(p) for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture
def checkpoint(tmp_path, demo_target):
    dst = tmp_path / "ck"
    shutil.copytree(demo_target, dst)
    return dst


# 1: --overwrite replaces only a bundle
def test_overwrite_never_deletes_a_checkpoint(tmp_path, checkpoint):
    before = tree(checkpoint)
    assert_user_error(run("export", str(checkpoint), "--out", str(checkpoint), "--overwrite"),
                      "is the folder this export reads")
    other = tmp_path / "other-ck"  # any folder that is not a bundle: someone's files
    shutil.copytree(checkpoint, other)
    assert_user_error(run("export", str(checkpoint), "--out", str(other), "--overwrite"),
                      "not an edgespec bundle")
    assert tree(checkpoint) == before == tree(other)


def test_overwrite_refuses_a_folder_that_holds_the_target(tmp_path, checkpoint):
    bundle = tmp_path / "b"
    assert run("export", str(checkpoint), "--out", str(bundle)).returncode == 0
    inside = bundle / "ck"
    shutil.copytree(checkpoint, inside)
    before = tree(bundle)
    assert_user_error(run("export", str(inside), "--out", str(bundle), "--overwrite"),
                      "which this export reads")
    assert tree(bundle) == before
    shutil.rmtree(inside)
    (bundle / "notes.txt").write_text("mine")  # a file the bundle does not list
    before = tree(bundle)
    assert_user_error(run("export", str(checkpoint), "--out", str(bundle), "--overwrite"),
                      "holds notes.txt, which its bundle does not list")
    assert tree(bundle) == before
    (bundle / "notes.txt").unlink()
    out = run("export", str(checkpoint), "--out", str(bundle), "--overwrite",
              "--precision", "int4")
    assert out.returncode == 0, out.stderr  # a bundle is still replaced
    assert json.loads((bundle / MANIFEST).read_text())["target"]["precision"] == "int4"


def test_a_cache_or_an_out_under_a_file_is_one_sentence(tmp_path, checkpoint):
    (tmp_path / "plain").write_text("keep me")
    assert_user_error(run("generate", "x", "--model", str(checkpoint),
                          env={"EDGESPEC_CACHE": str(tmp_path / "plain")}),
                      "cannot create the model cache", "set EDGESPEC_CACHE")
    assert_user_error(run("export", str(checkpoint), "--out", str(tmp_path / "plain" / "b")),
                      "plain is a file, so", "choose another --out")
    assert (tmp_path / "plain").read_text() == "keep me"


def test_a_damaged_cached_export_is_made_again(tmp_path, checkpoint, monkeypatch):
    import edgespec

    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    args = ("generate", "def f(", "--model", str(checkpoint), "--max-new-tokens", "8")
    first = run(*args, env=env)
    assert first.returncode == 0, first.stderr
    (cached,) = (tmp_path / "cache" / "bundles").iterdir()
    data = cached / "target.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    again = run(*args, env=env)
    assert again.returncode == 0 and "is damaged" in again.stderr, again.stderr
    assert again.stdout == first.stdout
    data.unlink()  # the library mends it the same way
    monkeypatch.setenv("EDGESPEC_CACHE", env["EDGESPEC_CACHE"])
    assert edgespec.load(checkpoint).path == cached and data.is_file()


def test_an_export_another_process_put_in_the_cache_meanwhile_is_used(tmp_path, checkpoint,
                                                                      monkeypatch):
    """Two processes exporting the same model into the cache at once: the one to finish
    second finds the other's bundle in place, and uses it (it was refused as written by
    another export, which is right for --out but not for the cache)."""
    import edgespec
    from edgespec import export as export_package

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    real = export_package.export

    def raced(source, out, **options):
        real(source, out, **options)  # the other process, done first
        real(source, out, **options)  # this one, finding its bundle in place

    monkeypatch.setattr(export_package, "export", raced)
    engine = edgespec.load(checkpoint)
    assert engine.generate("def f(", max_new_tokens=4, mode="ar").token_ids
    assert len(list((tmp_path / "cache" / "bundles").iterdir())) == 1


# 11: --out FILE --overwrite is refused before anything is written
def test_overwrite_refuses_a_file(tmp_path, checkpoint):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    assert_user_error(run("export", str(checkpoint), "--out", str(target), "--overwrite"),
                      "is a file, not a bundle")
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "notes.txt"]


# 10: SIGTERM and SIGHUP leave no partial directory
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_export_killed_by_a_signal_cleans_up(tmp_path, demo_target, demo_draft, sig):
    out = tmp_path / "b"
    proc = subprocess.Popen([*CLI, "export", str(demo_target), "--draft", str(demo_draft),
                             "--vocab-trim", "1000", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".b.partial-*")) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    time.sleep(0.3)  # well inside the write (counting tokens takes seconds)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig
    assert "Traceback" not in proc.stderr.read().decode()
    assert list(tmp_path.iterdir()) == []


def test_export_killed_while_it_reads_its_source_leaves_no_scratch_folder(tmp_path):
    """A GGUF file is read (its tokenizer rebuilt) into a scratch folder before the bundle
    is begun; a SIGTERM then unwinds too."""
    from tests.real_models import smollm2_gguf

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([*CLI, "export", str(smollm2_gguf()), "--out",
                             str(tmp_path / "b")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.time() + 120
    while not list(scratch.glob("edgespec-source-*")) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "Traceback" not in proc.stderr.read().decode()
    assert not list(scratch.glob("edgespec-source-*")) and not (tmp_path / "b").exists()


# 12: damaged inputs are one sentence
def _safetensors(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("damage,fragment", [
    ("config", "config.json is not valid JSON"),
    ("truncated", "truncated or damaged"),
    ("no-dtype", "lacks a dtype"),
    ("huge-header", "truncated or damaged"),
])
def test_damaged_checkpoints(tmp_path, checkpoint, damage, fragment):
    weights = checkpoint / "model.safetensors"
    if damage == "config":
        (checkpoint / "config.json").write_text("{not json")
    elif damage == "truncated":
        raw = weights.read_bytes()
        weights.write_bytes(raw[:len(raw) // 2])
    elif damage == "no-dtype":
        _safetensors(weights, {"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    else:
        weights.write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    assert_user_error(run("export", str(checkpoint), "--out", str(tmp_path / "b")), fragment)
    assert not (tmp_path / "b").exists()


def _rehash(bundle, name):
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["files"][name] = sha256(bundle / name)
    (bundle / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("field,value", [("max_positions", -5), ("num_layers", 0)])
def test_manifest_with_impossible_sizes(bundle_copy, field, value):
    manifest = json.loads((bundle_copy / MANIFEST).read_text())
    manifest["target"][field] = value
    (bundle_copy / MANIFEST).write_text(json.dumps(manifest))
    assert_user_error(run("generate", "x", "--model", str(bundle_copy)),
                      f"'target.{field}' is {value}")


def test_tokenizer_config_not_json(bundle_copy):
    (bundle_copy / "tokenizer_config.json").write_text("{oops")
    _rehash(bundle_copy, "tokenizer_config.json")
    assert_user_error(run("generate", "x", "--model", str(bundle_copy)),
                      "tokenizer_config.json is not valid JSON")


def test_vocab_trim_below_the_special_tokens(bundle_copy):
    before = tree(bundle_copy)
    assert_user_error(run("vocab-trim", str(bundle_copy), "--k", "1"), "choose a larger K")
    assert tree(bundle_copy) == before


# 15: vocab-trim on an empty corpus, --vocab-trim without a draft
def test_vocab_trim_on_an_empty_corpus(tmp_path, bundle_copy):
    (tmp_path / "empty.txt").write_text("")
    before = tree(bundle_copy)
    assert_user_error(run("vocab-trim", str(bundle_copy), "--k", "100", "--trim-source",
                          f"corpus:{tmp_path / 'empty.txt'}"), "holds no text")
    assert tree(bundle_copy) == before


def test_vocab_trim_flag_without_a_draft(tmp_path, checkpoint):
    assert_user_error(run("export", str(checkpoint), "--out", str(tmp_path / "b"),
                          "--vocab-trim", "100"), "no --draft model was given")
    assert not (tmp_path / "b").exists()



@pytest.mark.parametrize("source,fragment", [("bogus", "neither 'target' nor"),
                                             ("corpus:/no/such/dir", "does not exist")])
def test_a_bad_trim_source_is_refused_before_any_work(tmp_path, checkpoint, demo_draft,
                                                       bundle_copy, source, fragment):
    assert_user_error(run("export", str(checkpoint), "--draft", str(demo_draft), "--out",
                          str(tmp_path / "b"), "--vocab-trim", "100", "--trim-source", source),
                      fragment)
    assert not (tmp_path / "b").exists()
    before = tree(bundle_copy)
    assert_user_error(run("vocab-trim", str(bundle_copy), "--k", "100", "--trim-source",
                          source), fragment)
    assert tree(bundle_copy) == before

@pytest.mark.parametrize("args,flag", [(["serve", "--port", "70000"], "--port"),
                                       (["generate", "x", "--seed", "-1"], "--seed"),
                                       (["generate", "x", "--threads", "2000"], "--threads"),
                                       (["plan", "--gpu-memory", "12MiB", "--bandwidth", "0"],
                                        "--bandwidth")])
def test_out_of_range_options_are_usage_errors(args, flag):
    out = run(*args)
    assert out.returncode == 2 and flag in out.stderr and "Traceback" not in out.stderr


# 9: undecodable input
def test_binary_stdin_is_refused():
    out = subprocess.run([*CLI, "generate", "--max-new-tokens", "4"], input=b"\xff\xfe\x00",
                         capture_output=True, timeout=120)
    assert out.returncode == 1 and b"stdin is not UTF-8" in out.stderr
    assert b"Traceback" not in out.stderr


def test_undecodable_argv_is_refused():
    out = subprocess.run([*CLI, "generate", "ab\udcff".encode(errors="surrogateescape"),
                          "--max-new-tokens", "4"], capture_output=True, timeout=120)
    assert out.returncode == 1 and b"not valid Unicode" in out.stderr
    assert b"Traceback" not in out.stderr and out.stdout == b""


# 15: an over-long prompt is not echoed before the error
def test_over_long_prompt_is_not_echoed():
    out = run("generate", "x = 1\n" * 600)
    assert out.returncode == 1 and out.stdout == ""


# 5, 15: keys: never empty, preferably not in argv; a keyless public bind warns
@pytest.mark.parametrize("env,args", [({}, ["--api-key", ""]),
                                      ({"EDGESPEC_API_KEY": ""}, [])])
def test_empty_api_key_is_refused(env, args):
    out = subprocess.run([*CLI, "serve", "--port", str(free_port()), *args], timeout=60,
                         capture_output=True, text=True, env={**os.environ, **env})
    assert_user_error(out, "API key is empty")


def _serve(args, env=None, cwd=None):
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), *args],
                            stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, **(env or {})})
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("serving"):
            break
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except httpx.TransportError:
            time.sleep(0.1)
    return proc, port, lines


def test_key_from_the_environment_stays_out_of_ps():
    proc, port, lines = _serve([], {"EDGESPEC_API_KEY": "sk-env-77"})
    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sk-env-77"}).status_code == 200
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"sk-env-77" not in f.read()
        assert not any("visible" in line for line in lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_model_named_by_a_relative_path_is_served_under_its_folders_name(bundle_copy):
    """`--model .` served the id '' (Path('.').name)."""
    proc, port, lines = _serve(["--model", "."], cwd=bundle_copy,
                               env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [bundle_copy.name]
        assert any(f"serving {bundle_copy.name} on" in line for line in lines), lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_keyless_public_bind_warns():
    proc, _, lines = _serve(["--host", "0.0.0.0"])
    proc.terminate()
    proc.wait(timeout=30)
    assert any(line.startswith("warning:") and "no API key" in line for line in lines), lines


# 15: text then Ctrl-D leaves the chat without sending the text
def test_chat_ctrl_d_after_text_sends_nothing_and_on_an_empty_line_leaves():
    """Ctrl-D never sends what is typed so far: readline ignores it on a line with text
    (as the shell does); on an empty line it leaves."""
    child = pexpect.spawn(sys.executable, ["-m", "edgespec.cli", "chat", "--mode", "ar"],
                          encoding="utf-8", timeout=60, dimensions=(40, 200))
    child.expect_exact(">>> ")
    child.send("Write a long Python module.")
    child.sendeof()
    child.send("\x15")  # Ctrl-U: the line emptied
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "tok/s" not in child.before


@pytest.fixture
def base_model(bundle_copy):
    """The demo bundle as a base model's is: no chat template."""
    config = json.loads((bundle_copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bundle_copy / "tokenizer_config.json").write_text(json.dumps(config))
    _rehash(bundle_copy, "tokenizer_config.json")
    return bundle_copy


def test_a_base_model_is_refused_by_chat_and_chat_prompts(base_model):
    assert_user_error(run("chat", "--model", str(base_model), stdin="Hi\n"),
                      "no chat template", "edgespec generate PROMPT")
    assert_user_error(run("generate", "Hi", "--chat", "--model", str(base_model)),
                      "no chat template", "leave out --chat")
    plain = run("generate", "def main(", "--model", str(base_model), "--max-new-tokens", "8")
    assert plain.returncode == 0 and plain.stdout.startswith("def main("), plain.stderr


def test_a_base_gguf_file_is_refused_by_chat_before_it_is_exported(tmp_path):
    """Gemma 3 270M's file has no chat template: said at once, with nothing exported into
    the cache (the export took a minute before the refusal)."""
    from tests.real_models import gemma_gguf

    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    assert_user_error(run("chat", "--model", str(gemma_gguf()), stdin="Hi\n", env=env),
                      "no chat template", "edgespec generate PROMPT")
    assert_user_error(run("generate", "Hi", "--chat", "--model", str(gemma_gguf()), env=env),
                      "no chat template", "leave out --chat")
    assert not (tmp_path / "cache" / "bundles").exists()  # the file's hash memo at most


def test_the_server_sends_a_base_models_chats_to_completions(base_model):
    import edgespec
    from edgespec.server import create_app
    from tests.http_server import running

    with edgespec.load(base_model) as engine, running(create_app(engine, "base")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "base", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "base", "prompt": "def main(", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_serve_refuses_a_busy_port_or_a_foreign_host_before_loading(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert_user_error(run("serve", "--port", port, "--model", str(tmp_path / "nothing")),
                          f"port {port} on 127.0.0.1 is in use", "--port")
    assert_user_error(run("serve", "--host", "999.1.1.1", "--port", port),
                      "cannot listen on '999.1.1.1'")



@pytest.mark.parametrize("flags,fragment", [
    (["--draft", "none", "--vocab-trim", "100"], "--vocab-trim shapes the draft, but --draft "
                                                  "none makes none; leave it out"),
    (["--draft", "none", "--draft-precision", "int4"], "--draft-precision shapes the draft"),
    (["--draft", "nested", "--ep-profile", "dml"], "--draft nested works with the cpu and cuda"),
    (["--nest", "4+4"], "--nest sets the codes of --draft nested"),
    (["--trim-source", "target"], "--trim-source chooses what --vocab-trim counts"),
    (["--draft", "nested", "--precision", "fp16"], "--draft nested builds an int8 target"),
    (["--draft", "nested", "--draft-precision", "int8"], "4-bit half of the target's codes"),
    (["--requantize"], "this target is not one"),
])
def test_export_refuses_options_it_would_ignore(tmp_path, checkpoint, flags, fragment):
    assert_user_error(run("export", str(checkpoint), "--out", str(tmp_path / "b"), *flags),
                      fragment)
    assert not (tmp_path / "b").exists()


def test_export_refuses_a_bundle_and_its_own_source_as_out(tmp_path, checkpoint):
    bundle = tmp_path / "b"
    assert run("export", str(checkpoint), "--out", str(bundle)).returncode == 0
    assert_user_error(run("export", str(bundle), "--out", str(tmp_path / "c")),
                      "is an edgespec bundle, which is exported already")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert_user_error(run("export", str(gguf), "--out", str(gguf), "--overwrite"),
                      f"--out {gguf} is the file this export reads")
    assert gguf.read_bytes()[:4] == b"GGUF"
    for command in ("export", "train-draft"):  # "" would be Path("."): said as it was typed
        assert_user_error(run(command, str(checkpoint), "--out", ""),
                          "Invalid value for '--out': is empty; name the path to write", code=2)
