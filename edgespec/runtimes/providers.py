"""Execution provider choice, and the check of what a session really got.

onnxruntime-gpu imports fine without CUDA, lists CUDAExecutionProvider as available and
then silently runs on the CPU. So a device is only "working" after a session was created
on it and `session.get_providers()` still names it.
"""

from __future__ import annotations

import shutil
import subprocess

import onnxruntime as ort

from edgespec.errors import EdgespecError

DEVICES = ("auto", "cuda", "dml", "cpu")
PROVIDER = {"cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider",
            "cpu": "CPUExecutionProvider"}
EXTRA = {"cuda": "pip install 'edgespec[gpu]' (onnxruntime-gpu with CUDA 12/13 and cuDNN 9)",
         "dml": "pip install 'edgespec[directml]' on Windows"}


def resolve_providers(device: str = "auto") -> list[str]:
    """Providers to ask ONNX Runtime for, in order of preference."""
    if device not in DEVICES:
        raise EdgespecError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}.")
    available = ort.get_available_providers()
    if device == "auto":
        wanted = [PROVIDER[d] for d in ("cuda", "dml") if PROVIDER[d] in available]
        return [*wanted, PROVIDER["cpu"]]
    if PROVIDER[device] not in available:
        hint = f"; install it with {EXTRA[device]}" if device in EXTRA else ""
        raise EdgespecError(f"the {device} execution provider is not available in this "
                            f"onnxruntime ({', '.join(available)}){hint}, or use --device cpu.")
    return [PROVIDER[device]] if device == "cpu" else [PROVIDER[device], PROVIDER["cpu"]]


def check_providers(providers: object) -> list[str]:
    """Providers a caller named (load(providers=...)), checked as --device is: a string
    was read a letter at a time, and an absent provider fell back to the CPU unsaid."""
    if isinstance(providers, str) or not isinstance(providers, (list, tuple)) or not providers \
            or not all(isinstance(p, str) for p in providers):
        raise EdgespecError(f"providers must be a non-empty list of ONNX Runtime provider "
                            f"names such as ['CPUExecutionProvider'], not {providers!r}.")
    available = ort.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise EdgespecError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                            f"available in this onnxruntime ({', '.join(available)}); name "
                            "only those, or pass device= instead.")
    return list(providers)


def check_session(session: ort.InferenceSession, device: str, providers: list[str]) -> str:
    """The device a session actually runs on; an explicit request that fell back is an error."""
    got = session.get_providers()
    if device not in ("auto", "cpu") and PROVIDER[device] not in got:
        raise EdgespecError(f"ONNX Runtime could not start the {device} execution provider "
                            f"(the session fell back to {got[0]}); check the drivers and "
                            f"libraries it needs, or use --device cpu.")
    for name in providers:
        if name in got:
            return next(d for d, p in PROVIDER.items() if p == name)
    return "cpu"


def nvidia_smi(fields: str) -> list[str]:
    """Rows of `nvidia-smi --query-gpu=fields`, one per GPU; raises OSError when there is
    no NVIDIA driver to ask."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        raise OSError("no nvidia-smi: no NVIDIA driver here")
    try:
        out = subprocess.run([tool, f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except subprocess.SubprocessError as e:
        raise OSError(f"nvidia-smi failed: {e}") from None
    return [line.strip() for line in out.splitlines() if line.strip()]
