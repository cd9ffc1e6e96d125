"""edgespec's own ONNX Runtime CPU kernels: a custom-op library built from C at install.

`setup.py` compiles blockq.c (the batch-invariant block-quantized product) and ort_op.c
(its ONNX Runtime binding, op edgespec.BlockQMatMul) into one shared library, optional:
without a C compiler the install still succeeds, exports use ONNX Runtime's own kernels
and a bundle that needs the library says so when it is opened.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import onnxruntime as ort

HERE = Path(__file__).parent
DOMAIN = "edgespec"  # the ops' ONNX domain


@functools.cache
def library() -> Path | None:
    """The built library, if this installation has one that ONNX Runtime can load."""
    for path in sorted(HERE.glob("_blockq*")):
        if path.suffix in (".so", ".pyd", ".dylib"):
            opts = ort.SessionOptions()
            try:
                opts.register_custom_ops_library(str(path))
            except Exception:  # built for another ONNX Runtime ABI or CPU
                continue
            return path
    return None


def available() -> bool:
    return library() is not None


def for_export() -> bool:
    """Whether cpu-profile exports put their linears on these kernels: where built, unless
    EDGESPEC_KERNELS=onnxruntime asks for bundles that run on any ONNX Runtime install."""
    return available() and os.environ.get("EDGESPEC_KERNELS", "edgespec") != "onnxruntime"


def register(opts: ort.SessionOptions) -> None:
    """Make the kernels available to sessions opened with `opts` (when built)."""
    path = library()
    if path is not None:
        opts.register_custom_ops_library(str(path))
