"""Read a Hugging Face checkpoint directory into numpy, without torch.

safetensors' numpy backend cannot represent bfloat16, which most modern checkpoints use,
so the (simple, stable) safetensors layout is read here directly: an 8-byte header
length, a JSON header of dtype/shape/offsets, then raw little-endian data, memory-mapped.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from edgespec.errors import EdgespecError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F64": np.float64, "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8,
           "I16": np.int16, "BOOL": np.bool_}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Map every tensor in one .safetensors file (views into a read-only memmap)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgespecError(f"{path} is not a readable safetensors file ({e}).") from None
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise EdgespecError(f"{path}: tensor {name} has dtype {info['dtype']}, which "
                                "edgespec cannot read; convert the checkpoint to fp16/bf16.")
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]

    def get(self, name: str) -> np.ndarray:
        """A tensor as float32 (the exporter's working precision)."""
        if name not in self.tensors:
            raise EdgespecError(f"{self.path}: the checkpoint has no tensor '{name}'; "
                                "is it complete and of the architecture its config names?")
        return np.asarray(self.tensors[name], dtype=np.float32)

    def has(self, name: str) -> bool:
        return name in self.tensors


def load_checkpoint(path: Path) -> Checkpoint:
    """config.json plus model.safetensors, or the shards listed in its index."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise EdgespecError(f"{path} has no config.json; pass a Hugging Face checkpoint "
                            "directory or a Hub id.")
    config = json.loads(config_path.read_text())
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise EdgespecError(f"{path} has no model.safetensors; only safetensors checkpoints "
                            "can be exported (convert .bin files with transformers first).")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        if not (path / name).is_file():
            raise EdgespecError(f"{path / name} is listed in the index but missing; "
                                "download the checkpoint again.")
        tensors.update(read_safetensors(path / name))
    return Checkpoint(path, config, tensors)
