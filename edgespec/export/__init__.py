"""Sources (Hugging Face checkpoints, GGUF files) -> edgespec bundles: `export`.

The pipeline (edgespec.export.pipeline) brings onnx and the export helpers with it, 0.4 s
of imports; they load when an export runs, so a `--model` already in the cache opens
without them (model_cache reads edgespec.export.source, .hub and .draft_head only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgespec.export.pipeline import export, vocab_counts

__all__ = ["export", "vocab_counts"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from edgespec.export import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'edgespec.export' has no attribute '{name}'")
