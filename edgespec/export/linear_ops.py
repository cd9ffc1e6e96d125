"""Which ONNX Runtime kernel computes a quantized linear, chosen for batch invariance.

Speculation is lossless only if a token's logits are bitwise the same fed alone or inside
a verify pass (DESIGN.md). Measured on ONNX Runtime 1.32's CPU EP (x86-64, AVX2;
tools/probe_batch_invariance.py): fp32 MatMul with a constant B, MatMulNBits with 8-bit
codes (any block size) and with 4-bit codes in blocks of 16 give every row the same
result whatever the number of rows; MatMulNBits with 4-bit codes in blocks of 32 or more
routes a one-row product to its own kernel, which sums differently (~1e-6 per linear,
amplified through the layers into logits that differ by ~0.8), and gives every row of a
multi-row pass the same result. The row-quantized int8 GEMM here is invariant by
construction: integer accumulation is exact and every scale belongs to one row or one
column.

So the cpu profile's passes never have one row (export.exact_rows), and elsewhere 4-bit
codes run in blocks of 16 (graph.invariant). `rowwise_int8` is the integer GEMM: edgespec's
RowQMatMul where the kernel library takes the export's linears (AMX tiles for passes of 8
rows or more where the CPU has them), else MLAS QGEMM (uint8 x uint8: the uint8 x int8
kernel of AVX2 saturates its 16-bit pair sums, measured wrong by up to 9e6 on full-range
codes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgespec.export import blockq_ops
from edgespec.kernels import DOMAIN

if TYPE_CHECKING:  # graph.py imports this module
    from edgespec.export.graph import GraphBuilder

MS = "com.microsoft"


def quantize_rows_u8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> codes [K, N] uint8 (q + 128, q in [-127, 127]) and per-output
    scales [N]: symmetric int8 per output channel."""
    w = np.asarray(weight, np.float32)
    scale = np.abs(w).max(axis=1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int16) + 128
    return np.ascontiguousarray(q.T.astype(np.uint8)), scale


def row_scale(g: GraphBuilder, x: str, name: str) -> tuple[str, str]:
    """x [1, S, K] -> (codes uint8 [1, S, K], peak [1, S, 1]): each row quantized by its
    own absolute maximum, codes round(127 x / peak) + 128, so no row's codes depend on
    another's. An all-zero row has peak 0 and any codes: its output, codes times its
    peak, is still exactly 0."""
    peak = g.node("ReduceMax", [g.node("Abs", [x], [f"{name}.abs"], f"{name}.abs")[0],
                                g.const("linear.last", np.array([-1], np.int64))],
                  [f"{name}.peak"], f"{name}.peak", keepdims=1)[0]
    unit = g.node("Div", [x, peak], [f"{name}.unit"], f"{name}.unit")[0]
    codes = g.node("QuantizeLinear", [unit, g.fconst("linear.step", 1 / 127),
                                      g.const("linear.zp", np.array(128, np.uint8))],
                   [f"{name}.codes"], f"{name}.codes")[0]
    return codes, peak


def on_kernel(g: GraphBuilder, weight: np.ndarray) -> bool:
    """Whether a row-wise linear runs on edgespec's kernel: where the export puts its
    linears there and the shape fits its tiles."""
    n, k = np.shape(weight)
    return g.own_kernel and k % blockq_ops.BLOCK == 0 and n % blockq_ops.LANES == 0


def weight_codes(g: GraphBuilder, weight: np.ndarray, store: str,
                 unit: float = 1.0) -> tuple[str, str]:
    """The constants of a weight's int8 codes (uint8, q + 128) and column scales, made once
    per `store` (a tied head and the embedding share them): GPTQ's codes where calibration
    measured the weight's input (`g.hessians`, by node name), else round-to-nearest. For
    MatMulIntegerToFloat codes [K, N] and scale / 127 (it takes each row's peak); on
    edgespec's kernel (op RowQMatMul) its tiled codes and the scales themselves, times
    `unit` (what the op's input is short of: 1/√B where it takes an unnormalized
    Hadamard)."""
    def make() -> str:
        hessian = g.hessians.get(store)
        if hessian is None or hessian.ndim == 1:  # no XᵀX measured (calibrate's budget)
            codes, scale = quantize_rows_u8(weight)
        else:
            from edgespec.quant.gptq import gptq_int8

            q, scale = gptq_int8(np.asarray(weight, np.float32), hessian)
            codes = np.ascontiguousarray((q.astype(np.int16) + 128).astype(np.uint8).T)
        if on_kernel(g, weight):
            g.fconst(f"{store}.colscale", scale * unit)
            return g.const(f"{store}.rowtiles", blockq_ops.tiled_codes(codes.T, 8))
        g.fconst(f"{store}.colscale", scale / 127.0)
        return g.const(f"{store}.rowcodes", codes)

    return g.once(f"{store}.rowcodes", make), f"{store}.colscale"


def rowwise_int8(g: GraphBuilder, x: str, weight: np.ndarray, name: str,
                 store: str | None = None) -> str:
    """y = x @ weight.T as an exact integer GEMM: per-row int8 activations, per-channel
    int8 weights, MatMulIntegerToFloat applying the row scale and the column scale; on
    edgespec's kernel, where it takes the shape, one RowQMatMul (which quantizes the rows
    itself, and runs a pass of several on AMX's tiles where the CPU has them)."""
    codes, scale = weight_codes(g, weight, store or name)
    if on_kernel(g, weight):
        return _row_op(g, x, codes, scale, weight, name)
    xq, peak = row_scale(g, x, name)
    zp = g.const("linear.zp", np.array(128, np.uint8))
    return g.node("MatMulIntegerToFloat", [xq, codes, peak, scale, zp, zp],
                  [f"{name}.out"], name, domain=MS)[0]


def gated_rotated(g: GraphBuilder, gate_up: str, weight: np.ndarray, block: np.ndarray,
                  name: str) -> str | None:
    """A rotated export's down projection straight from its MLP's fused gate-up output: one
    RowQMatMul that takes silu(gate) · up and the block Hadamard of down_proj's input
    (`block`: Sylvester's H_B, rotation.down_block) itself, where the graph had six nodes
    more (Split, the activation, its Mul, two Reshapes and the rotation's MatMul). The op's
    transform is unnormalized, so the column scales take the 1/√B. None off the kernel (or
    for a block the op does not compute)."""
    from edgespec.export.rotation import hadamard

    b = block.shape[0]
    if not on_kernel(g, weight) or not np.array_equal(block, hadamard(b)):
        return None
    codes, scale = weight_codes(g, weight, name, unit=1 / np.sqrt(b))
    return _row_op(g, gate_up, codes, scale, weight, name, gated=1, hadamard=b)


def _row_op(g: GraphBuilder, x: str, codes: str, scale: str, weight: np.ndarray, name: str,
            **attributes: int) -> str:
    n, k = np.shape(weight)
    return g.node("RowQMatMul", [x, codes, scale], [f"{name}.out"], name, domain=DOMAIN,
                  K=k, N=n, **attributes)[0]


def gather_rowwise(g: GraphBuilder, weight: np.ndarray, ids: str, store: str) -> str:
    """Embedding rows [1, S, K] from a tied head's `rowwise_int8` codes (stored once):
    columns `ids` of its [K, N] codes (rows of its tiled ones), times their column scales."""
    codes, scale = weight_codes(g, weight, store)
    if on_kernel(g, weight):
        k = np.shape(weight)[1]
        units, _, _ = blockq_ops.lane_codes(g, codes, ids, k, 8, store)
        rows = g.node("Reshape", [units, g.const(f"rows.{k}", np.array([1, -1, k], np.int64))],
                      [f"{store}.rows"], f"{store}.rows")[0]
    else:
        cols = g.node("Gather", [codes, ids], [f"{store}.cols"], f"{store}.cols",
                      axis=1)[0]  # [K, 1, S]
        rows = g.node("Transpose", [cols], [f"{store}.rows"], f"{store}.rows",
                      perm=[1, 2, 0])[0]
    rows = g.node("Cast", [rows], [f"{store}.rows.f"], f"{store}.rows.f", to=1)[0]
    centred = g.node("Sub", [rows, g.fconst("linear.zp.f", 128.0)], [f"{store}.rows.c"],
                     f"{store}.rows.c")[0]
    col = g.node("Gather", [scale, ids], [f"{store}.rows.s"], f"{store}.rows.s")[0]
    col = g.node("Unsqueeze", [col, g.const("linear.last", np.array([-1], np.int64))],
                 [f"{store}.rows.su"], f"{store}.rows.su")[0]
    unit = g.node("Mul", [centred, col], [f"{store}.rows.u"], f"{store}.rows.u")[0]
    if on_kernel(g, weight):  # the scales themselves
        return unit
    return g.node("Mul", [unit, g.fconst("linear.127", 127.0)], [f"{store}.rows.out"],
                  f"{store}.rows.out")[0]


def rotate_blocks(g: GraphBuilder, x: str, block: np.ndarray, width: int, name: str) -> str:
    """x [1, S, n] times a block-diagonal matrix of `block` [B, B] (a Hadamard matrix):
    one float MatMul over the S·n/B blocks, the same for every row whatever S is."""
    b = block.shape[0]
    split = g.node("Reshape", [x, g.const(f"blocks.{b}", np.array([1, -1, b], np.int64))],
                   [f"{name}.blocks"], f"{name}.blocks")[0]
    turned = g.node("MatMul", [split, g.fconst(f"rotation.{b}", block)], [f"{name}.turned"],
                    name)[0]
    return g.node("Reshape", [turned, g.const(f"rows.{width}", np.array([1, -1, width],
                                                                       np.int64))],
                  [f"{name}.out"], f"{name}.merge")[0]
