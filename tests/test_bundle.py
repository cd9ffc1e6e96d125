"""Manifest round trip, every validation error, and atomic writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.bundle import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    ModelEntry,
    read_manifest,
    sha256,
    write_bundle,
)
from edgespec.errors import EdgespecError


def entry(**kw) -> ModelEntry:
    base = dict(graph="target.onnx", architecture="LlamaForCausalLM", precision="int8",
                vocab_size=100, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=8, max_positions=64, params=1234, block_size=32,
                data_files=["target.onnx.data"])
    return ModelEntry(**{**base, **kw})


def make_bundle(out: Path, draft: bool = True) -> Manifest:
    with write_bundle(out) as (tmp, finish):
        for name in ("target.onnx", "target.onnx.data", "draft.onnx", "tokenizer.json"):
            (tmp / name).write_bytes(name.encode() * 10)
        return finish(Manifest(
            target=entry(), ep_profile="cpu", tokenizer_files=["tokenizer.json"],
            draft=entry(graph="draft.onnx", data_files=[], precision="fp32",
                        block_size=None) if draft else None,
            eos_token_ids=[0, 2], bos_token_id=0, provenance={"by": "test"}))


def test_round_trip(tmp_path):
    written = make_bundle(tmp_path / "b")
    read = read_manifest(tmp_path / "b")
    assert read == written
    assert read.files["target.onnx.data"] == sha256(tmp_path / "b" / "target.onnx.data")
    assert set(read.files) == {"target.onnx", "target.onnx.data", "draft.onnx",
                               "tokenizer.json"}
    raw = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert raw["format"] == "edgespec-bundle" and raw["format_version"] == FORMAT_VERSION


def test_round_trip_without_draft(tmp_path):
    make_bundle(tmp_path / "b", draft=False)
    assert read_manifest(tmp_path / "b").draft is None


def edit(bundle: Path, change) -> None:
    path = bundle / MANIFEST
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


BAD_MANIFESTS = [
    (lambda r: r.update(format="other"), "not an edgespec manifest"),
    (lambda r: r.update(format_version=FORMAT_VERSION + 1), "newer than this edgespec"),
    (lambda r: r.update(format_version="1"), "'format_version' must be int"),
    (lambda r: r.pop("target"), "lacks the required field 'target'"),
    (lambda r: r["target"].pop("vocab_size"), "'target' lacks the required field 'vocab_size'"),
    (lambda r: r["target"].update(num_layers="2"), "'target.num_layers' must be int"),
    (lambda r: r["target"].update(num_layers=True), "'target.num_layers' must be int"),
    (lambda r: r["target"].update(precision="int3"), "'target.precision' is 'int3'"),
    (lambda r: r["target"].update(kv_layout="paged"), "cannot run"),
    (lambda r: r.update(ep_profile="tpu"), "'ep_profile' is 'tpu'"),
    (lambda r: r.update(tokenizer_files="tokenizer.json"), "'tokenizer_files' must be list"),
    (lambda r: r["draft"].update(vocab_size=99), "no vocab map is given"),
    (lambda r: r["files"].pop("draft.onnx"), "'draft.onnx' is used but has no sha256"),
    (lambda r: r["files"].update({"../evil": "0"}), "points outside the bundle"),
    (lambda r: r["files"].update({"extra.bin": "0"}), "extra.bin is missing"),
    (lambda r: r.__setitem__("draft", []), "'draft' must be dict"),
    (lambda r: r["draft"].update(proposal_scale=0), "'draft.proposal_scale' is 0"),
    (lambda r: r["draft"].update(proposal_scale="0.6"), "'draft.proposal_scale' must be"),
]


@pytest.mark.parametrize("change,message", BAD_MANIFESTS)
def test_validation_errors(tmp_path, change, message):
    make_bundle(tmp_path / "b")
    edit(tmp_path / "b", change)
    with pytest.raises(EdgespecError, match=message) as info:
        read_manifest(tmp_path / "b")
    text = str(info.value)
    assert "\n" not in text and text.endswith(".")
    assert MANIFEST in text or "extra.bin" in text  # the sentence names the file


def test_unknown_fields_are_ignored(tmp_path):
    make_bundle(tmp_path / "b")
    edit(tmp_path / "b", lambda r: r["target"].update(future_option=1))
    assert read_manifest(tmp_path / "b").target.params == 1234


def test_missing_path(tmp_path):
    with pytest.raises(EdgespecError, match="does not exist"):
        read_manifest(tmp_path / "nope")


def test_file_instead_of_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(EdgespecError, match="is a file, not a bundle"):
        read_manifest(tmp_path / "f")


def test_directory_without_manifest(tmp_path):
    with pytest.raises(EdgespecError, match="edgespec.json is missing"):
        read_manifest(tmp_path)


def test_invalid_json(tmp_path):
    make_bundle(tmp_path / "b")
    (tmp_path / "b" / MANIFEST).write_text("{not json")
    with pytest.raises(EdgespecError, match="not valid JSON"):
        read_manifest(tmp_path / "b")


def test_missing_file(tmp_path):
    make_bundle(tmp_path / "b")
    (tmp_path / "b" / "target.onnx.data").unlink()
    with pytest.raises(EdgespecError, match="target.onnx.data is missing from the bundle"):
        read_manifest(tmp_path / "b")


def test_corrupted_file(tmp_path):
    make_bundle(tmp_path / "b")
    data = tmp_path / "b" / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(EdgespecError, match="target.onnx.data is corrupted"):
        read_manifest(tmp_path / "b")
    assert read_manifest(tmp_path / "b", verify=False).target.params == 1234


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(ZeroDivisionError), write_bundle(tmp_path / "b") as (tmp, _):
        (tmp / "target.onnx").write_bytes(b"half")
        1 / 0  # noqa: B018 - an export step failing midway
    assert list(tmp_path.iterdir()) == []


def test_write_without_finish_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), write_bundle(tmp_path / "b") as (tmp, _):
        (tmp / "target.onnx").write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_folder_is_taken_unless_the_shell_stands_in_it(tmp_path, monkeypatch):
    (tmp_path / "made").mkdir()
    make_bundle(tmp_path / "made")
    assert read_manifest(tmp_path / "made").target.params == 1234
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(EdgespecError, match="is the current directory"):
        make_bundle(Path("."))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "made"]
    assert list((tmp_path / "here").iterdir()) == []
    # files that come into an empty folder during the export are kept, and it fails
    (tmp_path / "late").mkdir()
    with pytest.raises(OSError), write_bundle(tmp_path / "late") as (tmp, finish):
        (tmp_path / "late" / "notes.txt").write_text("keep me")
        (tmp / "tokenizer.json").write_bytes(b"{}")
        finish(Manifest(target=entry(data_files=[]), draft=None, ep_profile="cpu",
                        tokenizer_files=["tokenizer.json"], eos_token_ids=[0],
                        bos_token_id=None))
    assert (tmp_path / "late" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "late", "made"]


def draftless(tmp: Path, finish) -> None:
    (tmp / "target.onnx").write_bytes(b"new")
    (tmp / "tokenizer.json").write_bytes(b"{}")
    finish(Manifest(target=entry(data_files=[]), draft=None, ep_profile="cpu",
                    tokenizer_files=["tokenizer.json"], eos_token_ids=[0], bos_token_id=None))


def overwrite_with_a_draftless_bundle(out: Path) -> None:
    with write_bundle(out, overwrite=True) as (tmp, finish):
        draftless(tmp, finish)


def test_existing_output_needs_overwrite(tmp_path):
    make_bundle(tmp_path / "b")
    with pytest.raises(EdgespecError, match="already holds a bundle; pass --overwrite"):
        make_bundle(tmp_path / "b")
    overwrite_with_a_draftless_bundle(tmp_path / "b")
    assert read_manifest(tmp_path / "b").draft is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_overwrite_through_a_symlink_replaces_the_bundle_behind_it(tmp_path):
    """It replaced the link itself, said it had failed and left `.link.old-PID` behind."""
    make_bundle(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    overwrite_with_a_draftless_bundle(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and read_manifest(tmp_path / "real").draft is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_a_bundle_another_export_wrote_meanwhile_is_not_replaced(tmp_path):
    with pytest.raises(EdgespecError, match="was written by another export meanwhile"), \
            write_bundle(tmp_path / "b") as (tmp, finish):
        make_bundle(tmp_path / "b")  # the other export, done first
        draftless(tmp, finish)
    assert read_manifest(tmp_path / "b").draft is not None  # the other's, kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_the_current_directory_is_refused_before_any_work(tmp_path, monkeypatch):
    make_bundle(tmp_path / "b")
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(EdgespecError, match="is the current directory"), \
            write_bundle(Path("."), overwrite=True):
        raise AssertionError("the export ran")
    assert read_manifest(tmp_path / "b").draft is not None
