"""Speculative decoding algorithms over plain numpy arrays (no ONNX Runtime here)."""

from edgespec.spec.chain import verify_chain
from edgespec.spec.decode import ar_decode, chain_decode
from edgespec.spec.drafters import LookupDrafter, ModelDrafter
from edgespec.spec.sampling import SamplingParams, sample, warp
from edgespec.spec.stats import GenerationStats

__all__ = ["GenerationStats", "LookupDrafter", "ModelDrafter", "SamplingParams", "ar_decode",
           "chain_decode", "sample", "verify_chain", "warp"]
