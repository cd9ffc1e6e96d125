"""Speculative decoding algorithms over plain numpy arrays (no ONNX Runtime here)."""

from edgespec.spec.chain import verify_chain
from edgespec.spec.sampling import SamplingParams, sample, warp

__all__ = ["SamplingParams", "sample", "verify_chain", "warp"]
