"""The one compiled part: edgespec's ONNX Runtime kernel library (edgespec/kernels).

Optional: where no C compiler is at hand the package installs without it and exports use
ONNX Runtime's own kernels. The library is loaded by ONNX Runtime, never imported.
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-std=c11"]
setup(ext_modules=[Extension(
    "edgespec.kernels._blockq",
    sources=["edgespec/kernels/ort_op.c", "edgespec/kernels/blockq.c",
             "edgespec/kernels/attend.c", "edgespec/kernels/norm.c"],
    depends=["edgespec/kernels/blockq.h", "edgespec/kernels/ort_abi.h",
             "edgespec/kernels/attend.h", "edgespec/kernels/simd.h",
             "edgespec/kernels/norm.h"],
    extra_compile_args=flags,
    libraries=[] if sys.platform == "win32" else ["m"],
    optional=True,
)])
