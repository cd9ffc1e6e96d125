"""Turn a TARGET/DRAFT argument into a local checkpoint directory.

A local directory is used as is; anything else is taken as a Hugging Face Hub id and
fetched with huggingface_hub (its cache, its token, its offline mode). Kept apart so
the rest of export never touches the network.
"""

from __future__ import annotations

from pathlib import Path

from edgespec.errors import EdgespecError

PATTERNS = ["config.json", "generation_config.json", "*.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja"]


def looks_like_hub_id(name: str) -> bool:
    """'owner/model': one slash, not a path."""
    return not name.startswith((".", "/", "~")) and name.count("/") == 1


def resolve_checkpoint(name_or_path: str | Path, trust_remote_code: bool = False) -> Path:
    """A local directory as it is (files are GGUF models, export.source's business), or a
    Hub id downloaded."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if not looks_like_hub_id(name):
        raise EdgespecError(f"{name} does not exist; pass a .gguf file, a checkpoint "
                            "directory or a Hub id like 'Qwen/Qwen2.5-0.5B'.")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise EdgespecError("downloading from the Hub needs the export extra: "
                            "pip install 'edgespec[export]'.") from None
    patterns = PATTERNS + (["*.py"] if trust_remote_code else [])
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:  # network, auth, missing repo: all user-facing
        folder = name.split("/")[0]
        local = (f"; nor is it in the local folder {folder}/, if a path was meant"
                 if Path(folder).is_dir() else "")
        raise EdgespecError(f"could not download {name} from the Hugging Face Hub "
                            f"({type(e).__name__}: {str(e).splitlines()[0]}){local}."
                            ) from None
