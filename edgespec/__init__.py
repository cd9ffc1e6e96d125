"""edgespec: lossless speculative decoding with ONNX Runtime on the hardware people own.

    import edgespec
    engine = edgespec.load()                 # the embedded demo bundle
    print(engine.generate("def quicksort(items):", max_new_tokens=64).text)
"""

from __future__ import annotations

__version__ = "0.1.0"

from edgespec.engine import Engine, GenerationConfig, GenerationResult, Job, load  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402

__all__ = ["EdgespecError", "Engine", "GenerationConfig", "GenerationResult", "Job", "load",
           "__version__"]
