"""edgespec's own ONNX Runtime CPU kernels: a custom-op library built from C at install.

`setup.py` compiles blockq.c (the batch-invariant block-quantized product), attend.c (the
batch-invariant attention) and ort_op.c (their ONNX Runtime binding, ops
edgespec.BlockQMatMul and edgespec.Attention) into one shared library, optional:
without a C compiler the install still succeeds, exports use ONNX Runtime's own kernels
and a bundle that needs the library says so when it is opened.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import onnxruntime as ort

from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    import onnx

HERE = Path(__file__).parent
DOMAIN = "edgespec"  # the ops' ONNX domain
LAYOUT = 10  # blockq.h's layout and ops: cached exports are made anew when it changes
# model metadata of graphs on the attention op: a tree pass's rows are bitwise chain rows
EXACT_TREES = "edgespec.exact_trees"


def _candidates() -> list[Path]:
    """Built libraries beside this file (an editable install), then in every edgespec
    package on the path (a source checkout importing its own tree beside a regular
    install of the same sources)."""
    dirs = [HERE] + [Path(entry) / "edgespec" / "kernels" for entry in sys.path if entry]
    return [p for d in dirs for p in sorted(d.glob("_blockq*"))
            if p.suffix in (".so", ".pyd", ".dylib")]


@functools.cache
def library() -> Path | None:
    """The built library of this package's layout that ONNX Runtime can load, if any."""
    for path in _candidates():
        try:
            if ctypes.CDLL(str(path)).blockq_layout() != LAYOUT:
                continue  # built from other sources
            ort.SessionOptions().register_custom_ops_library(str(path))
        except Exception:  # not a library of ours, another ONNX Runtime ABI or CPU
            continue
        return path
    return None


def available() -> bool:
    return library() is not None


# blockq.c's column kernels (3: AMX's tiles take row-wise passes of 8 rows or more)
PATHS = {3: "AVX-512 VNNI and AMX", 2: "AVX-512 VNNI", 1: "AVX2", 0: "portable C"}


def path() -> int | None:
    """Which of the library's column kernels runs here (PATHS), None without the library."""
    lib = library()
    return None if lib is None else int(ctypes.CDLL(str(lib)).blockq_path())


def vectorized() -> bool:
    """Whether the library runs a SIMD kernel here (not its portable C one)."""
    return bool(path())


def asked() -> str:
    """$EDGESPEC_KERNELS: "edgespec" (the default) or "onnxruntime", for bundles that run
    on any ONNX Runtime install."""
    choice = os.environ.get("EDGESPEC_KERNELS", "edgespec")
    if choice not in ("edgespec", "onnxruntime"):
        raise EdgespecError(f"EDGESPEC_KERNELS is '{choice}'; set it to 'edgespec' (the "
                            "default) or 'onnxruntime', or unset it.")
    return choice


def for_export() -> bool:
    """Whether cpu-profile exports put their linears on these kernels: where built and
    vectorized (the portable path is exact but slower than ONNX Runtime's kernels), unless
    EDGESPEC_KERNELS=onnxruntime asks otherwise."""
    return asked() == "edgespec" and vectorized()


def describe() -> str:
    """What `edgespec doctor` says about the kernels: which path runs them, or why none."""
    asked()  # a value it does not know is refused here too
    if library() is None:
        return "not built (installed without a C compiler): exports use ONNX Runtime's"
    if vectorized() and asked() == "onnxruntime":
        return (f"built, {PATHS[path()]}: cpu exports use ONNX Runtime's "
                "(EDGESPEC_KERNELS=onnxruntime)")
    if vectorized():
        return f"built, {PATHS[path()]}: cpu exports use them"
    return "built, portable C only (no AVX2 here): cpu exports use ONNX Runtime's"


def register(opts: ort.SessionOptions) -> None:
    """Make the kernels available to sessions opened with `opts` (when built)."""
    path = library()
    if path is not None:
        opts.register_custom_ops_library(str(path))


def op_session(graph: onnx.GraphProto, threads: int) -> ort.InferenceSession:
    """A CPU session over a bare graph of the kernels' ops, or of ONNX Runtime's contrib ops
    they stand in for (tests, tools/bench_kernel.py)."""
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1),
        helper.make_opsetid("com.microsoft", 1)])
    from edgespec.runtimes.pool import session_options

    opts = session_options(threads)
    register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
