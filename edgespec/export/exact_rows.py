"""Passes that never have one row, so a token's row is computed the same way in every pass.

Two of ONNX Runtime's CPU kernels route a one-row product to a kernel of its own that sums
in another order than their multi-row kernel:
- GroupQueryAttention multiplies probabilities by V with MLAS's SGEMM, whose M=1 kernel
  (MlasSgemmKernelM1Avx on x86-64) attends ~4e-7 differently;
- MatMulNBits with 4-bit codes in blocks of 32 or more (accuracy_level 4) has a one-row
  kernel too: 0.25-0.9 apart in the logits of a 30-layer SmolLM2-sized stack.
Quantized matmuls downstream amplify any such difference into visibly different logits.
Every row of a pass of two rows or more, though, is bitwise the same whatever the number
of rows and its place among them (tools/probe_batch_invariance.py; M = 2..64 compared).

So a one-token pass gets a second row right after the embedding: a copy of its token at
the same position (Pad, mode "edge"). The stream carries it through every layer and it
is cut off at the end. Its key and value land in the cache slot after the pass's token,
which nobody reads (the next pass overwrites it; the runtime keeps one spare slot for it,
see KVCache); the real row never sees that key: it lies beyond the real row's causal
window, and its bias column is -inf as well. Its bias row copies the real one, so the copy
computes what its token computes and its values stay those of a real row. Passes of two
tokens or more are left as they are.

Graphs whose linears all run on edgespec's own kernel or on one-row-exact MatMulNBits
encodings (graph.build_decoder with own_kernel) pad attention alone instead: q, k and v
get the copied row just before GroupQueryAttention and its output is cut right after, so
a one-token pass runs its linears on one row.

Cost (stream padding): a one-token pass runs its linears on two rows. With 4-bit codes in
blocks of 32 that is still cheaper than the blocks of 16 that exactness took before (a SmolLM2-sized
stack of 30 layers: 10.1 ms at M=2 against 13.4 at M=1), and multi-token passes keep the
faster kernel. A handful of small ops per graph, none per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

if TYPE_CHECKING:  # graph.py imports this module
    from edgespec.export.graph import GraphBuilder

NEG = float(np.finfo(np.float32).min)


def _rows(g: GraphBuilder) -> str:
    """S, the pass's token count, as a [1] int64."""
    return g.once("exact.rows", lambda: g.node(
        "Shape", ["input_ids"], ["exact.rows"], "exact.rows", start=1, end=2)[0])


def _missing(g: GraphBuilder) -> str:
    """max(2 - S, 0) as a [1] int64: the rows a pass is short of two."""
    return g.once("exact.missing", lambda: g.node("Max", [g.node(
        "Sub", [g.const("exact.two", np.array([2], np.int64)), _rows(g)], ["exact.short"],
        "exact.short")[0], g.const("exact.zero", np.array([0], np.int64))],
        ["exact.missing"], "exact.missing")[0])


def _pads(g: GraphBuilder, rank: int, axis: int) -> str:
    """Pad's pads for `rank` dimensions: the missing rows at the end of `axis`."""
    def make() -> str:
        ends = [g.const(f"exact.zeros{n}", np.zeros(n, np.int64))
                for n in (rank + axis, rank - axis - 1) if n]
        inputs = [ends[0], _missing(g), *ends[1:]]
        return g.node("Concat", inputs, [f"exact.pads.{rank}.{axis}"],
                      f"exact.pads.{rank}.{axis}", axis=0)[0]
    return g.once(f"exact.pads.{rank}.{axis}", make)


def _padded(g: GraphBuilder, x: str, rank: int, axis: int, name: str, mode: str = "edge",
            value: str = "") -> str:
    inputs = [x, _pads(g, rank, axis)] + ([value] if value else [])
    return g.node("Pad", inputs, [f"{name}.two"], f"{name}.two", mode=mode)[0]


def two_rows(g: GraphBuilder, x: str) -> str:
    """The stream [1, S, d] with at least two rows."""
    return _padded(g, x, 3, 1, x)


def padded_positions(g: GraphBuilder) -> str:
    return g.once("exact.positions", lambda: _padded(g, "position_ids", 2, 1,
                                                     "position_ids"))


def padded_bias(g: GraphBuilder, bias: str) -> str:
    """[1,1,S,T] -> [1,1,S',T+S'-S]: a copied row, and -inf in the new key column."""
    def make() -> str:
        rows = _padded(g, bias, 4, 2, f"{bias}.r")
        return _padded(g, rows, 4, 3, f"{bias}.c", "constant", g.fconst("exact.neg", NEG))
    return g.once(f"exact.bias.{bias}", make)


def padded_lengths(g: GraphBuilder, seqlens_k: str, total: str) -> tuple[str, str]:
    """GQA's seqlens_k ([1]) and total length (a scalar), counting the copied row."""
    missing = g.once("exact.missing.i32", lambda: g.node(
        "Cast", [_missing(g)], ["exact.missing.i32"], "exact.missing.i32",
        to=TensorProto.INT32)[0])
    scalar = g.once("exact.missing.scalar", lambda: g.node(
        "Squeeze", [missing], ["exact.missing.scalar"], "exact.missing.scalar")[0])

    def plus(t: str, extra: str) -> str:
        return g.node("Add", [t, extra], [f"{t}.two"], f"{t}.two")[0]
    return (g.once(f"exact.{seqlens_k}", lambda: plus(seqlens_k, missing)),
            g.once(f"exact.{total}", lambda: plus(total, scalar)))


def real_rows(g: GraphBuilder, x: str, name: str) -> str:
    """[1, S', ...] -> the pass's own S rows."""
    return g.node("Slice", [x, g.const("exact.zero", np.array([0], np.int64)), _rows(g),
                            g.const("exact.axis1", np.array([1], np.int64))],
                  [f"{name}.real"], f"{name}.real")[0]
