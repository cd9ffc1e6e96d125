"""The bundle: a directory holding graphs, tokenizer files and the manifest `edgespec.json`.

The manifest is the contract between export and the runtimes: which graphs exist, how
they were quantized, which EP profile they target, and the sha256 of every file so that a
truncated download or a half-copied directory is caught before ONNX Runtime reads garbage.
Bundles are only ever written through `write_bundle`, which builds everything in a
temporary sibling directory and renames it into place, so a crash never leaves a
directory that looks like a valid bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgespec.errors import DamagedBundleError, EdgespecError

MANIFEST = "edgespec.json"
FORMAT = "edgespec-bundle"
FORMAT_VERSION = 1
PRECISIONS = ("fp32", "fp16", "int8", "int4", "int2", "gguf")  # gguf: each tensor its own type
EP_PROFILES = ("cpu", "cuda", "dml")
KV_LAYOUTS = ("gqa-shared-buffer", "mha-concat")
KV_DTYPES = ("float32", "float16", "int8")  # int8: codes with per-channel scales in the graph


@dataclass
class ModelEntry:
    """One decoder graph and the shapes the runtime needs to drive it."""

    graph: str
    architecture: str
    precision: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    params: int
    block_size: int | None = None
    kv_layout: str = "gqa-shared-buffer"
    kv_dtype: str = "float32"
    nested: str = ""  # BitNest: "target" or "draft", both views of one shared graph
    compute_dtype: str = ""  # activations; "" for bundles from before int8 KV: = kv_dtype
    data_files: list[str] = field(default_factory=list)
    source: str = ""
    kind: str = ""  # "" a decoder; "eagle" a draft head reading the target's states
    # a head's sampling proposals: its softmax at this times the target's temperature
    # (from its card, spec.drafters.HeadDrafter); 1.0 for every other draft
    proposal_scale: float = 1.0

    @property
    def activation_dtype(self) -> str:
        """The dtype hidden states flow in (what cut segments pass between them)."""
        return self.compute_dtype or self.kv_dtype


@dataclass
class Manifest:
    target: ModelEntry
    draft: ModelEntry | None
    ep_profile: str
    tokenizer_files: list[str]
    eos_token_ids: list[int]
    bos_token_id: int | None
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    vocab_map: str | None = None  # .npy of the draft's kept token ids, when trimmed
    provenance: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": FORMAT, **d}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fail(path: Path, problem: str) -> EdgespecError:
    return DamagedBundleError(f"{path}: {problem}")


def _check_type(mpath: Path, where: str, value: Any, kind: type | tuple) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _fail(mpath, f"'{where}' must be {names}, got {type(value).__name__}; "
                           "the manifest is damaged, re-export the bundle.")


def _model_entry(mpath: Path, where: str, raw: Any) -> ModelEntry:
    _check_type(mpath, where, raw, dict)
    fields = ModelEntry.__dataclass_fields__
    raw = {k: v for k, v in raw.items() if k in fields}  # newer optional fields: ignored
    kinds = {"graph": str, "architecture": str, "precision": str, "kv_layout": str,
             "kv_dtype": str, "nested": str, "compute_dtype": str,
             "source": str, "kind": str, "data_files": list, "block_size": (int, type(None)),
             "proposal_scale": (int, float)}
    for name, f in fields.items():
        if name not in raw:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise _fail(mpath, f"'{where}' lacks the required field '{name}'; "
                               "the manifest is damaged, re-export the bundle.")
        _check_type(mpath, f"{where}.{name}", raw[name], kinds.get(name, int))
    entry = ModelEntry(**raw)
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_positions", "params", "block_size"):
        value = getattr(entry, name)
        if value is not None and value < 1:
            raise _fail(mpath, f"'{where}.{name}' is {value}, but it must be at least 1; "
                               "the manifest is damaged, re-export the bundle.")
    if entry.precision not in PRECISIONS:
        raise _fail(mpath, f"'{where}.precision' is '{entry.precision}', not one of "
                           f"{', '.join(PRECISIONS)}; re-export the bundle.")
    if entry.kv_dtype not in KV_DTYPES:
        raise _fail(mpath, f"'{where}.kv_dtype' is '{entry.kv_dtype}', not one of "
                           f"{', '.join(KV_DTYPES)}; re-export the bundle.")
    if entry.compute_dtype not in ("", "float32", "float16"):
        raise _fail(mpath, f"'{where}.compute_dtype' is '{entry.compute_dtype}', not float32 "
                           "or float16; re-export the bundle.")
    if entry.kind not in ("", "eagle"):
        raise _fail(mpath, f"'{where}.kind' is '{entry.kind}', which this edgespec cannot "
                           "run; upgrade edgespec or re-export the bundle.")
    if not entry.proposal_scale > 0:
        raise _fail(mpath, f"'{where}.proposal_scale' is {entry.proposal_scale}, but it must "
                           "be above 0; the manifest is damaged, re-export the bundle.")
    if entry.kv_layout not in KV_LAYOUTS:
        raise _fail(mpath, f"'{where}.kv_layout' is '{entry.kv_layout}', which this edgespec "
                           "cannot run; upgrade edgespec or re-export the bundle.")
    return entry


def parse_manifest(mpath: Path, raw: Any) -> Manifest:
    """Validate a decoded manifest; every problem is one sentence naming the file."""
    _check_type(mpath, "manifest", raw, dict)
    if raw.get("format") != FORMAT:
        raise _fail(mpath, f"not an edgespec manifest (format is {raw.get('format')!r}, "
                           f"expected '{FORMAT}').")
    version = raw.get("format_version")
    _check_type(mpath, "format_version", version, int)
    if version > FORMAT_VERSION:
        raise _fail(mpath, f"bundle format version {version} is newer than this edgespec "
                           f"reads (up to {FORMAT_VERSION}); upgrade edgespec.")
    for key in ("target", "ep_profile", "tokenizer_files", "eos_token_ids", "files"):
        if key not in raw:
            raise _fail(mpath, f"the manifest lacks the required field '{key}'; "
                               "re-export the bundle.")
    target = _model_entry(mpath, "target", raw["target"])
    draft = None if raw.get("draft") is None else _model_entry(mpath, "draft", raw["draft"])
    if raw["ep_profile"] not in EP_PROFILES:
        raise _fail(mpath, f"'ep_profile' is {raw['ep_profile']!r}, not one of "
                           f"{', '.join(EP_PROFILES)}; re-export the bundle.")
    _check_type(mpath, "tokenizer_files", raw["tokenizer_files"], list)
    _check_type(mpath, "eos_token_ids", raw["eos_token_ids"], list)
    _check_type(mpath, "files", raw["files"], dict)
    if draft is not None and draft.vocab_size != target.vocab_size and not raw.get("vocab_map"):
        raise _fail(mpath, f"the draft's vocabulary ({draft.vocab_size} tokens) differs from "
                           f"the target's ({target.vocab_size}) and no vocab map is given; "
                           "re-export with a matching draft.")
    return Manifest(
        target=target, draft=draft, ep_profile=raw["ep_profile"],
        tokenizer_files=raw["tokenizer_files"], eos_token_ids=raw["eos_token_ids"],
        bos_token_id=raw.get("bos_token_id"), files=raw["files"],
        vocab_map=raw.get("vocab_map"), provenance=raw.get("provenance", {}),
        format_version=version)


def read_manifest(bundle: Path | str, verify: bool = True) -> Manifest:
    """Read and validate a bundle's manifest; with `verify`, hash every listed file."""
    bundle = Path(bundle)
    if not bundle.exists():
        raise EdgespecError(f"{bundle} does not exist; pass the directory of an exported "
                            "bundle (edgespec export ... --out DIR).")
    if not bundle.is_dir():
        raise EdgespecError(f"{bundle} is a file, not a bundle directory; pass the directory "
                            f"that holds {MANIFEST}.")
    mpath = bundle / MANIFEST
    if not mpath.is_file():
        raise EdgespecError(f"{bundle} is not an edgespec bundle: {MANIFEST} is missing; "
                            "export one with `edgespec export`.")
    try:
        raw = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(mpath, f"the manifest is not valid JSON ({e}); re-export the bundle.") from None
    manifest = parse_manifest(mpath, raw)
    referenced = [manifest.target.graph, *manifest.target.data_files, *manifest.tokenizer_files]
    if manifest.draft:
        referenced += [manifest.draft.graph, *manifest.draft.data_files]
    if manifest.vocab_map:
        referenced.append(manifest.vocab_map)
    for name in referenced:
        if name not in manifest.files:
            raise _fail(mpath, f"'{name}' is used but has no sha256 in 'files'; "
                               "re-export the bundle.")
    for name, digest in manifest.files.items():
        path = bundle / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise _fail(mpath, f"file entry '{name}' points outside the bundle; re-export it.")
        if not path.is_file():
            raise DamagedBundleError(f"{path} is missing from the bundle; copy the whole "
                                     "bundle again or re-export it.")
        if verify and sha256(path) != digest:
            raise DamagedBundleError(f"{path} is corrupted (its sha256 does not match the "
                                     "manifest); copy the bundle again or re-export it.")
    return manifest


def _replaceable(out: Path) -> None:
    """--overwrite replaces an edgespec bundle and nothing else: not a file, not a
    checkpoint directory (`export ck --out ck --overwrite` once deleted the weights)."""
    if not out.is_dir():
        raise EdgespecError(f"{out} is a file, not a bundle; an export replaces only an "
                            "edgespec bundle directory (with --overwrite), so choose "
                            "another --out.")
    try:
        raw = json.loads((out / MANIFEST).read_text())
        is_bundle = raw.get("format") == FORMAT
        listed = {*raw.get("files", {}), MANIFEST}
    except (OSError, ValueError, AttributeError, TypeError):
        is_bundle = False
    if not is_bundle:
        raise EdgespecError(f"{out} is not an edgespec bundle (no valid {MANIFEST}); an "
                            "export replaces only bundles (with --overwrite), so choose "
                            "another --out.")
    others = sorted(p.relative_to(out).as_posix() for p in out.rglob("*")
                    if not p.is_dir() and p.relative_to(out).as_posix() not in listed)
    if others:
        raise EdgespecError(f"{out} holds {others[0]}"
                            f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}, "
                            "which its bundle does not list; move it out of the folder "
                            "before --overwrite replaces the folder.")


@contextmanager
def _cleanup_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C does, so `finally` removes the partial
    directory (their default action kills the process on the spot)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def source_scratch() -> Iterator[Path]:
    """A scratch folder to read a source into (a GGUF file's tokenizer, rebuilt), removed
    however the run ends, SIGTERM and SIGHUP included."""
    with _cleanup_on_termination(), tempfile.TemporaryDirectory(
            prefix="edgespec-source-") as scratch:
        yield Path(scratch)


@contextmanager
def write_bundle(out: Path | str, overwrite: bool = False) -> Iterator[tuple[Path, Callable]]:
    """Yield a temporary directory and a `finish(manifest)` callback; rename on success.

    The temp directory is a sibling of `out` (same filesystem, so the rename is atomic)
    and is deleted if anything fails, Ctrl-C, SIGTERM and SIGHUP included. `finish`
    hashes every file it finds, so the manifest always lists exactly what was written.
    """
    with _cleanup_on_termination(), _write_bundle(Path(out), overwrite) as written:
        yield written


@contextmanager
def _write_bundle(out: Path, overwrite: bool) -> Iterator[tuple[Path, Callable]]:
    if out.is_symlink() and out.exists():  # the bundle behind the link is what is replaced
        out = out.resolve()
    if Path.cwd().is_relative_to(out.resolve()):  # a folder the shell stands in stays
        raise EdgespecError(f"{out} is the current directory (or holds it), which an export "
                            "cannot replace; choose another --out, such as ../NAME.")
    empty = out.is_dir() and not any(out.iterdir())  # a folder made for it is taken
    existed = out.exists() and not empty
    if existed:
        _replaceable(out)  # refused outright unless it is a bundle
        if not overwrite:
            raise EdgespecError(f"{out} already holds a bundle; pass --overwrite to replace "
                                "it or choose another --out.")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise EdgespecError(f"{blocking} is a file, so {out} cannot be made inside it; "
                            "choose another --out.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    finished: list[Manifest] = []

    def finish(manifest: Manifest) -> Manifest:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; a bundle is a normal folder
        for p in tmp.rglob("*"):
            if p.is_file():
                p.chmod(0o666 & ~umask)
        manifest.files = {p.relative_to(tmp).as_posix(): sha256(p)
                          for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != MANIFEST}
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        parse_manifest(tmp / MANIFEST, manifest.to_json())
        finished.append(manifest)
        return manifest

    try:
        yield tmp, finish
        if not finished:
            raise RuntimeError("write_bundle: finish(manifest) was never called")
        if empty:
            out.rmdir()  # fails, deleting nothing, if files came into it meanwhile
            tmp.rename(out)
        elif out.exists():
            if not existed:  # another export finished first: its bundle is not ours to take
                raise EdgespecError(f"{out} was written by another export meanwhile; nothing "
                                    "of this one was left behind, pass --overwrite to replace "
                                    "it or choose another --out.")
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
