"""Speculative decoding algorithms over plain numpy arrays (no ONNX Runtime here)."""

from edgespec.spec.chain import verify_chain
from edgespec.spec.decode import ar_decode, chain_decode, tree_decode
from edgespec.spec.drafters import (
    HeadDrafter,
    HeadTreeDrafter,
    HybridDrafter,
    LookupDrafter,
    ModelDrafter,
    TreeDrafter,
)
from edgespec.spec.sampling import SamplingParams, sample, warp
from edgespec.spec.stats import GenerationStats
from edgespec.spec.tree import DraftTree, verify_tree

__all__ = ["DraftTree", "GenerationStats", "HeadDrafter", "HeadTreeDrafter", "HybridDrafter",
           "LookupDrafter", "ModelDrafter", "SamplingParams", "TreeDrafter", "ar_decode",
           "chain_decode", "sample", "tree_decode", "verify_chain", "verify_tree", "warp"]
