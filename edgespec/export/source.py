"""What a model to export comes as: a Hugging Face checkpoint directory, a Hub id, or a
GGUF file. Each becomes a `Source`: a directory holding the tokenizer files, the config,
the special ids, and a way to load the weights. A GGUF file's tokenizer files are written
from its metadata into a scratch directory the caller owns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.errors import EdgespecError
from edgespec.export.checkpoint import Checkpoint, load_checkpoint
from edgespec.export.hub import resolve_checkpoint


@dataclass
class Source:
    name: str  # as the user gave it
    tokenizer_dir: Path
    config: dict[str, Any]
    eos_ids: list[int]
    bos_id: int | None
    load: Callable[[], Checkpoint]
    kind: str  # "hf" or "gguf"

    @property
    def label(self) -> str:
        return Path(self.name).name


def check_gguf_magic(path: Path) -> None:
    """A file given as a GGUF model must start with GGUF's magic: said before any work."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise EdgespecError(f"{path} cannot be read ({e.strerror or e}).") from None
    if magic != b"GGUF":
        raise EdgespecError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass "
                            "a real .gguf model file.")


def is_gguf(path: Path) -> bool:
    """Named .gguf or starting with GGUF's magic (a damaged one is refused later, by name)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _hf_source(name: str | Path, trust_remote_code: bool) -> Source:
    path = resolve_checkpoint(name, trust_remote_code)
    if (path / "edgespec.json").is_file():
        raise EdgespecError(f"{path} is an edgespec bundle, which is exported already; give "
                            "the checkpoint or .gguf file it came from (a bundle itself runs "
                            "as --model).")
    if not (path / "config.json").is_file():
        raise EdgespecError(f"{path} has no config.json; pass a Hugging Face checkpoint "
                            "directory, a Hub id or a .gguf file.")
    if not (path / "tokenizer.json").is_file():
        raise EdgespecError(f"{path} has no tokenizer.json; edgespec needs a fast tokenizer "
                            "next to the weights.")
    try:
        config = json.loads((path / "config.json").read_text())
        gen = (json.loads((path / "generation_config.json").read_text())
               if (path / "generation_config.json").is_file() else {})
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgespecError(f"{path}: config.json or generation_config.json is not valid JSON "
                            f"({e}); download the checkpoint again.") from None
    if not isinstance(config, dict) or not isinstance(gen, dict):
        raise EdgespecError(f"{path}: config.json must hold a JSON object; download the "
                            "checkpoint again.")
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    return Source(str(name), path, config, [eos] if isinstance(eos, int) else list(eos or []),
                  gen.get("bos_token_id", config.get("bos_token_id")),
                  lambda: load_checkpoint(path), "hf")


def _gguf_source(path: Path, scratch: Path, keep_codes: bool) -> Source:
    from edgespec.export.gguf_reader import load_gguf, open_reader, read_metadata
    from edgespec.export.gguf_tokenizer import write_tokenizer

    reader = open_reader(path)
    arch, config = read_metadata(reader, path)
    scratch.mkdir(parents=True, exist_ok=True)
    eos_ids = write_tokenizer(reader, arch, path, scratch)
    return Source(str(path), scratch, config, eos_ids, config.get("bos_token_id"),
                  lambda: load_gguf(path, keep_codes), "gguf")


def open_source(name: str | Path, scratch: Path, trust_remote_code: bool = False,
                keep_codes: bool = True) -> Source:
    """`scratch`: a directory the caller removes afterwards (GGUF tokenizer files)."""
    path = Path(name).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise EdgespecError(f"{path} is a file but not a GGUF model; pass a .gguf file, a "
                                "checkpoint directory or a Hub id.")
        return _gguf_source(path, scratch, keep_codes)
    return _hf_source(name, trust_remote_code)
