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

import numpy as np

from edgespec.errors import EdgespecError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16",
           "F64": np.float64, "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8,
           "I16": np.int16, "BOOL": np.bool_}


def _dtype(code: str) -> np.dtype:
    """A safetensors dtype as numpy's. numpy knows "bfloat16" once ml_dtypes registers
    it, imported only for a file that holds one (0.4 s, which a cached --model would
    otherwise pay to open)."""
    if code == "BF16":
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    return np.dtype(_DTYPES[code])


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Map every tensor in one .safetensors file (views into a read-only memmap)."""
    damaged = f"{path} is truncated or damaged; download the checkpoint again."
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > path.stat().st_size - 8:  # a 2^62-byte header is not read, just refused
                raise EdgespecError(damaged)
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgespecError(f"{path} is not a readable safetensors file ({e}).") from None
    if not isinstance(header, dict):
        raise EdgespecError(damaged)
    header.pop("__metadata__", None)
    size = path.stat().st_size - 8 - n
    data = (np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size
            else np.zeros(0, np.uint8))
    out = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        except (KeyError, TypeError, ValueError):
            raise EdgespecError(f"{path}: tensor {name}'s entry lacks a dtype, shape or data "
                                "offsets; the file is damaged, download it again.") from None
        if dtype not in _DTYPES:
            raise EdgespecError(f"{path}: tensor {name} has dtype {dtype}, which "
                                "edgespec cannot read; convert the checkpoint to fp16/bf16.")
        kind = _dtype(dtype)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size
                and end - start == count * kind.itemsize):
            raise EdgespecError(damaged)
        out[name] = data[start:end].view(kind).reshape(shape)
    return out


BNB_4BIT_STATE = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


def _bnb_4bit(path: Path, tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Dequantize one bitsandbytes NF4/FP4 weight with bitsandbytes itself: the format
    (double-quantized absmax, quant maps, a JSON state) is bitsandbytes' to define."""
    try:
        import torch
        from bitsandbytes.functional import QuantState, dequantize_4bit
    except ImportError:
        raise EdgespecError(f"{path} holds bitsandbytes 4-bit weights; install the bnb extra "
                            "(pip install 'edgespec[export,bnb]') to import them.") from None
    prefix = name + "."
    state = {k[len(prefix):]: torch.from_numpy(np.array(v)) for k, v in tensors.items()
             if k.startswith(prefix)}
    quant_state = QuantState.from_dict(state, device=torch.device("cpu"))
    weight = torch.from_numpy(np.array(tensors[name]))
    return dequantize_4bit(weight, quant_state).float().numpy()


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    # what a GGUF import (export.gguf_reader) sets otherwise: Gemma norms already 1 + w,
    # and Llama 3.1's RoPE divisors given as a tensor rather than as config values
    norms_shifted = False
    rope_factors: np.ndarray | None = None

    def linear(self, name: str) -> np.ndarray | Any:
        """A linear layer's weight: float32 here, an exact quantized encoding where the
        source holds one (GGUF)."""
        return self.get(name)

    def get(self, name: str) -> np.ndarray:
        """A tensor as float32 (the exporter's working precision).

        bitsandbytes checkpoints are dequantized here (NF4/FP4 through bitsandbytes,
        LLM.int8 rows as int8 * SCB / 127), so everything downstream sees plain weights;
        the export then requantizes them, stacking its own rounding on bitsandbytes'.
        """
        if name not in self.tensors:
            raise EdgespecError(f"{self.path}: the checkpoint has no tensor '{name}'; "
                                "is it complete and of the architecture its config names?")
        if any(f"{name}.{key}" in self.tensors for key in BNB_4BIT_STATE):
            return _bnb_4bit(self.path, self.tensors, name)
        scb = name.removesuffix(".weight") + ".SCB"
        if self.tensors[name].dtype == np.int8 and scb in self.tensors:
            return (self.tensors[name].astype(np.float32)
                    * (np.asarray(self.tensors[scb], np.float32)[:, None] / 127.0))
        return np.asarray(self.tensors[name], dtype=np.float32)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def num_params(self) -> int:
        """Parameters of the model (not of bitsandbytes' bookkeeping tensors)."""
        total = 0
        for name, t in self.tensors.items():
            state = next((self.tensors[f"{name}.{k}"] for k in BNB_4BIT_STATE
                          if f"{name}.{k}" in self.tensors), None)
            if state is not None:
                total += int(np.prod(json.loads(bytes(np.asarray(state)))["shape"]))
            elif not name.endswith((".SCB", ".weight_format", ".absmax", ".quant_map",
                                    ".nested_absmax", ".nested_quant_map")) and \
                    ".quant_state." not in name:
                total += int(t.size)
        return total


def json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgespecError(f"{path} is not valid JSON ({e}); fix or download it again."
                            ) from None
    if not isinstance(value, dict):
        raise EdgespecError(f"{path} must hold a JSON object; fix or download it again.")
    return value


def load_checkpoint(path: Path) -> Checkpoint:
    """config.json plus model.safetensors, or the shards listed in its index."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise EdgespecError(f"{path} has no config.json; pass a Hugging Face checkpoint "
                            "directory or a Hub id.")
    config = json_object(config_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json_object(index)["weight_map"].values()))
        except (KeyError, AttributeError, TypeError):
            raise EdgespecError(f"{index} has no valid weight_map; download the checkpoint "
                                "again.") from None
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
