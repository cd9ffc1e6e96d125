"""GroupQueryAttention that computes a token's row the same way in every pass.

ONNX Runtime's CPU GQA multiplies probabilities by V with MLAS's SGEMM, and MLAS routes
a one-row product (alpha 1, beta 0) to a dedicated M=1 kernel (MlasSgemmKernelM1Avx on
x86-64) whose summation order differs from the general kernel's: a token fed alone
attends ~4e-7 differently than the same token inside a multi-token pass, and quantized
matmuls downstream amplify that into visibly different logits. The general kernel gives
each row the same result whatever the number of rows.

So attention never sees one row: every pass hands GQA one extra row, a copy of its last
token at the same position (Pad, mode "edge"), which GQA writes into the cache slot
after the pass's tokens and nobody reads (the next pass overwrites it; the runtime keeps
one spare slot for it, see KVCache). The real rows never see the extra key: it lies
beyond every real row's causal window, and its bias column is -inf as well. The extra
output row is cut off. Cost: two small ops per layer and two per graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # graph.py imports this module
    from edgespec.export.graph import GraphBuilder

NEG = float(np.finfo(np.float32).min)


def _pad_rows(g: GraphBuilder, x: str, axis_len: int, axis: int, name: str,
              mode: str = "edge", value: str = "") -> str:
    pads = [0] * (2 * axis_len)
    pads[axis_len + axis] = 1
    inputs = [x, g.const(f"exact.pads.{axis_len}.{axis}", np.array(pads, np.int64))]
    if value:
        inputs.append(value)
    return g.node("Pad", inputs, [f"{name}.pad1"], f"{name}.pad1", mode=mode)[0]


def padded_bias(g: GraphBuilder, bias: str) -> str:
    """[1,1,S,T] -> [1,1,S+1,T+1], the new row and column -inf."""
    def make() -> str:
        value = g.fconst("exact.neg", NEG)
        rows = _pad_rows(g, bias, 4, 2, f"{bias}.r", "constant", value)
        return _pad_rows(g, rows, 4, 3, f"{bias}.c", "constant", value)
    return g.once(f"exact.bias.{bias}", make)


def padded_lengths(g: GraphBuilder, seqlens_k: str, total: str) -> tuple[str, str]:
    """GQA's seqlens_k and total length, one more for the extra row."""
    def make(t: str) -> str:
        return g.node("Add", [t, g.const(f"exact.one.{t}", np.array(1, np.int32))],
                      [f"{t}.plus1"], f"{t}.plus1")[0]
    return (g.once(f"exact.{seqlens_k}", lambda: make(seqlens_k)),
            g.once(f"exact.{total}", lambda: make(total)))


def padded_positions(g: GraphBuilder) -> str:
    return g.once("exact.positions", lambda: _pad_rows(g, "position_ids", 2, 1,
                                                       "position_ids"))


def padded_qkv(g: GraphBuilder, qkv: list[str], name: str) -> list[str]:
    """The query, key and value inputs (empty names stay empty), last row repeated."""
    return [_pad_rows(g, t, 3, 1, f"{name}.{j}") if t else t for j, t in enumerate(qkv)]


def first_rows(g: GraphBuilder, attn: str, name: str) -> str:
    """The attention output without the extra row."""
    return g.node("Slice", [attn, g.const("exact.zero", np.array([0], np.int64)),
                            g.const("exact.minus1", np.array([-1], np.int64)),
                            g.const("exact.axis1", np.array([1], np.int64))],
                  [f"{name}.rows"], f"{name}.rows")[0]
