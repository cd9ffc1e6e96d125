"""What `--model` names -> a bundle directory: a bundle as it is, anything else (a GGUF
file, a Hugging Face checkpoint directory, a Hub id) exported once into the user cache.

A cached bundle is keyed by the source's content (sha256 of its files), the export
options and EXPORTER, so a changed file is exported again and an unchanged one never is. Hashing a
big file costs seconds, so each file's hash is remembered against its size and
modification time. Exports are written atomically (write_bundle), so an interrupted one
leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from edgespec.bundle import FORMAT_VERSION, MANIFEST, sha256
from edgespec.errors import DamagedBundleError, EdgespecError, WriteError

T = TypeVar("T")

# bumped when exports change what their graphs can do: a bundle cached before still runs,
# but the cache then exports anew (2: prefills score their last rows only; 3: tied
# embeddings gather bytes, no table copy at session load)
EXPORTER = 3
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json")


def cache_dir() -> Path:
    """$EDGESPEC_CACHE, else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec."""
    if os.environ.get("EDGESPEC_CACHE"):
        return Path(os.environ["EDGESPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "edgespec"


def _file_hash(path: Path, memo: dict[str, Any]) -> str:
    st = path.stat()
    key = str(path.resolve())
    seen = memo.get(key)
    if seen and seen["size"] == st.st_size and seen["mtime_ns"] == st.st_mtime_ns:
        return seen["sha256"]
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256(path)}
    return memo[key]["sha256"]


def source_hash(path: Path) -> str:
    """The content hash of a GGUF file or of a checkpoint directory's model files."""
    memo_path = cache_dir() / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    known = json.dumps(memo, sort_keys=True)
    if path.is_file():
        digest = _file_hash(path, memo)
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and (
            p.name in SOURCE_FILES or p.suffix == ".safetensors"))
        h = hashlib.sha256()
        for p in files:
            h.update(f"{p.name}:{_file_hash(p, memo)}\n".encode())
        digest = h.hexdigest()
    if json.dumps(memo, sort_keys=True) == known:  # nothing new to remember
        return digest
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError:
        pass  # an unwritable cache only costs hashing again next time
    return digest


def cache_key(content: str, options: dict[str, Any]) -> str:
    """What a cached export depends on: the source's content hash, the options, this
    edgespec and the heads it ships (a head shipped or retrained later changes what a
    default export holds; a retrained one has the same size, so its content counts), and
    whether its graphs run on edgespec's own kernels here (their layout's version)."""
    from edgespec import __version__, kernels
    from edgespec.export.draft_head import SHIPPED

    heads = sorted(f"{p.name}:{source_hash(p)}" for p in SHIPPED.glob("*.npz"))
    return hashlib.sha256(json.dumps({"source": content, "options": options,
                                      "edgespec": __version__, "format": FORMAT_VERSION,
                                      "exporter": EXPORTER, "heads": heads,
                                      "kernels": kernels.LAYOUT if kernels.for_export()
                                      else None},
                                     sort_keys=True).encode()).hexdigest()[:20]


def cached_bundle(source: str | Path, console: Console | None = None,
                  check: Callable[[Path], None] | None = None, **options: Any) -> Path:
    """The bundle exported from `source` with `options` (edgespec.export.export's),
    exported now if the cache has none yet, once `check(source path)` lets it (what the
    caller would refuse the bundle for, told before a minute of export, not after)."""
    from edgespec.export.source import check_gguf_magic, is_gguf

    path = Path(source).expanduser()
    if path.is_file() and not is_gguf(path):
        raise EdgespecError(f"{path} is a file but not a GGUF model; pass a bundle, a .gguf "
                            "file, a checkpoint directory or a Hub id.")
    if path.is_file():
        check_gguf_magic(path)
    if path.exists():
        content = source_hash(path)
    else:  # a Hub id: the download is the content; its revision is huggingface_hub's
        from edgespec.export.hub import resolve_checkpoint

        path = resolve_checkpoint(str(source))
        content = source_hash(path)
    out = cache_dir() / "bundles" / f"{path.stem}-{cache_key(content, options)}"
    if (out / MANIFEST).is_file():
        return out
    if is_gguf(path):  # a truncated file is told alone, not after "exporting ... once"
        from edgespec.export.gguf_reader import open_reader

        open_reader(path)
    if check is not None:
        check(path)
    from edgespec.export import export

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgespecError(f"cannot create the model cache {out.parent} ({e.strerror or e}); "
                            "set EDGESPEC_CACHE to a folder you can write.") from None
    console = console or Console(stderr=True)
    console.print(f"[dim]exporting {path} once into {out} (later runs reuse it)[/dim]",
                  highlight=False)
    try:
        export(path, out, console=console, summary=False, **options)
    except WriteError as e:
        raise EdgespecError(f"could not write the export of {path.name} into the model cache "
                            f"{out.parent} ({e.reason}); nothing was left behind, "
                            f"{'free space or ' if e.full else ''}set EDGESPEC_CACHE to "
                            "another folder.") from None
    except EdgespecError:  # refused as "already holds a bundle", or as written meanwhile:
        if (out / MANIFEST).is_file():  # another process made this same export first
            return out
        raise
    return out


def open_cached(model: str | Path | None, opener: Callable[[Path | None], T],
                console: Console | None = None,
                check: Callable[[Path], None] | None = None) -> T:
    """`opener(bundle)` for the bundle `model` names (resolve_model); a cached export found
    damaged (a file truncated or changed since) is deleted and exported again, once: the
    cache is edgespec's own, and its user has no --overwrite to mend it with."""
    bundle = resolve_model(model, console, check)
    try:
        return opener(bundle)
    except DamagedBundleError:
        cached = cache_dir().resolve() / "bundles"
        if bundle is None or bundle.resolve().parent != cached or \
                Path(model).expanduser().resolve() == bundle.resolve():
            raise
        (console or Console(stderr=True)).print(
            f"[dim]the cached export {bundle} is damaged (a file is missing or has changed); "
            "exporting it again[/dim]", highlight=False)
        shutil.rmtree(bundle)
        return opener(resolve_model(model, console, check))


def resolve_model(model: str | Path | None, console: Console | None = None,
                  check: Callable[[Path], None] | None = None) -> Path | None:
    """A bundle directory for `--model` (None: the embedded demo bundle); `check` as
    cached_bundle's."""
    if model is None:
        return None
    if not isinstance(model, (str, os.PathLike)):
        raise EdgespecError(f"a model is a path or a Hub id (str or Path), not "
                            f"{type(model).__name__}.")
    path = Path(model).expanduser()
    if path.is_dir() and (path / MANIFEST).is_file():
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        raise EdgespecError(f"{path} is neither a bundle (no {MANIFEST}) nor a Hugging Face "
                            "checkpoint (no config.json); pass a bundle, a .gguf file, a "
                            "checkpoint directory or a Hub id.")
    from edgespec.export.hub import looks_like_hub_id  # edgespec.export: heavy, lazily

    if not path.exists() and not looks_like_hub_id(str(model)):
        raise EdgespecError(f"{model} does not exist; pass a bundle directory, a .gguf file, "
                            "a checkpoint directory or a Hub id like 'Qwen/Qwen2.5-0.5B'.")
    return cached_bundle(model, console, check)
