"""Build the decoder-step ONNX graph that every edgespec runtime drives.

Contract (DESIGN.md): inputs `input_ids [1,S]`, `position_ids [1,S]`,
`attention_bias [1,1,S,T]` (T = past + S; added to the causal scores, so a token *tree*
of S nodes is verified in one pass by masking non-ancestors with -inf), and per layer
`past_key_i` / `past_value_i` of shape [1, kv_heads, max_len, head_dim]. Outputs:
`logits [1,S,V]` and `present_key_i` / `present_value_i`.

The cpu profile uses GroupQueryAttention with a shared past/present buffer: the runtime
binds the same OrtValue to `past_key_i` and `present_key_i`, GQA writes the S new
entries at slots past..past+S-1 and nothing is copied. GQA applies RoPE itself, reading
the rotation from `position_ids` (tree nodes take their depth), and derives the past
length from the total length, which the graph reads off the bias' last dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgespec import kernels
from edgespec.errors import EdgespecError
from edgespec.export import blockq_ops, exact_rows, linear_ops
from edgespec.export.architectures import DecoderSpec, LayerWeights, Weight
from edgespec.quant.bitnest import NestedWeight, nest
from edgespec.quant.blockwise import (
    QuantizedWeight,
    dequantize,
    pack_rows,
    quantize_blockwise,
    split_blocks,
)

OPSET = 21
MS = "com.microsoft"
if TYPE_CHECKING:  # rotation reads this module's as_float
    from edgespec.export.rotation import Rotated

BITS = {"int8": 8, "int4": 4, "int2": 2}


def invariant(q: QuantizedWeight) -> QuantizedWeight:
    """4-bit codes in blocks of more than 16 as MatMulNBits blocks of 16 (the same
    weights; scales stored once, repeated at load), for graphs whose passes may have one
    row (not the cpu profile's, see exact_rows). ONNX Runtime's one-row kernel for 4-bit
    blocks of 32 sums in another order than its multi-row kernel, so a token's logits
    depended on how many tokens shared its pass (SmolLM2 Q4_1: 0.74 between a step and a
    5-token chain), and greedy speculation could leave AR's path at a near-tie. In blocks
    of 16 they agree bitwise (8-bit codes do at every block size)."""
    return split_blocks(q, 16) if q.bits == 4 and q.block_size > 16 else q


def one_row_exact(q: QuantizedWeight) -> bool:
    """Whether MatMulNBits computes a row of these codes alike in one-row passes."""
    return q.bits == 8 or q.block_size <= 16


def rows_of(weight: Weight) -> int:
    return weight.n if isinstance(weight, QuantizedWeight) else int(weight.shape[0])


def as_float(weight: Weight) -> np.ndarray:
    """An imported encoding's float values, for the paths that quantize anew (BitNest)."""
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else weight


def head_layout(spec: DecoderSpec) -> tuple[int, np.ndarray] | None:
    """GroupQueryAttention's CPU kernel wants head sizes in multiples of 16 and rotary
    halves in multiples of 8. Other heads are zero-padded: each rotary half to a multiple
    of 8 (the pad rotates with frequency 0, i.e. not at all), the unrotated rest after
    them, to a multiple of 16 in all. Zeros change neither q·k nor the attended values.
    Returns the padded size and where each real dimension sits in it (None: no padding)."""
    d, half = spec.head_dim, len(spec.inv_freq)
    if d % 16 == 0 and half % 8 == 0:
        return None
    rotary_half = -(-half // 8) * 8
    tail = d - 2 * half
    size = -(-(2 * rotary_half + tail) // 16) * 16
    where = np.concatenate([np.arange(half), rotary_half + np.arange(half),
                            2 * rotary_half + np.arange(tail)]).astype(np.int64)
    return size, where


def kv_head_dim(spec: DecoderSpec, attention: str = "gqa") -> int:
    """The head size of the KV cache (padded for GQA, see head_layout)."""
    layout = head_layout(spec) if attention == "gqa" else None
    return layout[0] if layout else spec.head_dim


@dataclass
class RotatedTable:
    """A draft head's embedding read from a rotated target's own table (export.rotation):
    the rows gathered as the target gathers them, so the bundle stores them once, then
    turned back into the model's basis, which the head reads, by `unrotate` (Qᵀ)."""

    table: np.ndarray  # E Q
    unrotate: np.ndarray
    rowwise: bool  # the target gathers them from its tied head's row-wise int8 codes


class GraphBuilder:
    """Accumulates nodes and initializers; `linear` picks MatMul or MatMulNBits.

    `dtype` is the compute dtype of activations, norms and the KV cache: float32 for the
    CPU, float16 for CUDA (whose GQA has no float32 kernel).
    """

    def __init__(self, precision: str, block_size: int, accuracy_level: int,
                 dtype: type = np.float32, zero_points: bool = False,
                 symmetric: bool = True, nested: str | None = None):
        self.nested = nested  # BitNest: "shared" (one graph, residual gated), "target", "draft"
        self.zero_points = zero_points  # DirectML's MatMulNBits wants all four inputs
        self.symmetric = symmetric
        self.precision = precision
        self.block_size = block_size
        self.accuracy_level = accuracy_level
        self.dtype = np.dtype(dtype)
        self.onnx_dtype = helper.np_dtype_to_tensor_dtype(self.dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._consts: set[str] = set()
        self._once: dict[str, str] = {}  # tensors computed once per graph (see once)
        self.gate: tuple[str, str] = ("", "")  # BitNest: see gate_residuals
        self.pack_six = False  # see small_ints
        self.rowwise = False  # float weights as linear_ops.rowwise_int8 (a rotated export)
        self.hessians: dict[str, np.ndarray] = {}  # rowwise weights' inputs' XᵀX, for GPTQ
        self.two_rows = False  # passes have two rows at least (exact_rows)
        self.pad_attention = False  # only attention's passes do (every linear exact at one)
        self.own_kernel = False  # codes on edgespec's kernel where it takes them (blockq_ops.fits)
        self.own_attention = False  # edgespec's attention op instead of GQA (gqa)
        self.kv_half = False  # its caches in float16 (AttentionHalf)
        self._six: list[tuple[str, np.ndarray]] = []

    def const(self, name: str, array: np.ndarray) -> str:
        """A named constant; asking again for a name already made reuses it."""
        if name not in self._consts:
            self._consts.add(name)
            self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def fconst(self, name: str, array: np.ndarray | float) -> str:
        """A float constant in the compute dtype."""
        return self.const(name, np.asarray(array, dtype=self.dtype))

    def node(self, op: str, inputs: Iterable[str], outputs: Iterable[str], name: str,
             domain: str = "", **attrs) -> list[str]:
        outputs = list(outputs)
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name,
                                           domain=domain, **attrs))
        return outputs

    def linear(self, x: str, weight: Weight, name: str, bits: int | None = None,
               whole_nest: bool = False, store: str | None = None) -> str:
        """y = x @ weight.T, weight in the [out, in] layout. In a BitNest graph every
        weight is nested; `whole_nest` has the draft read both nibbles too (the LM head:
        as in every int4 export, a 4-bit head costs more acceptance than it saves).
        An imported encoding (GGUF) is used as it is, under the constant names `store`
        (a tied embedding and head share them)."""
        if self.rowwise:
            return linear_ops.rowwise_int8(self, x, weight, name, store)
        if isinstance(weight, QuantizedWeight):
            if not self.nested:
                return self.quantized(x, weight, name, store)
            weight = dequantize(weight)
        if self.nested:
            nw = nest(weight, self.block_size)
            if whole_nest:  # both models read both nibbles: one 8-bit plane serves both
                return self._nbits(x, nw.as_8bit(), name)
            return self._nested(x, nw, name, self.nested)
        q = self._quantize(weight, bits)
        if q is None:
            store = np.float16 if self.precision == "fp16" else self.dtype
            w = self.const(f"{name}.weight", np.ascontiguousarray(weight.T.astype(store)))
            if np.dtype(store) != self.dtype:  # fp16 on disk, upcast once at session load
                w = self.node("Cast", [w], [f"{name}.weight.c"], f"{name}.upcast",
                              to=self.onnx_dtype)[0]
            return self.node("MatMul", [x, w], [f"{name}.out"], name)[0]
        return self.quantized(x, q, name)

    def _quantize(self, weight: np.ndarray, bits: int | None = None) -> QuantizedWeight | None:
        """A float weight's codes at this export's precision (None: it stays float)."""
        bits = bits or BITS.get(self.precision)
        if bits is None:
            return None
        # 8-bit codes stay symmetric: ONNX Runtime's CPU kernel takes no 8-bit zero points
        return quantize_blockwise(weight, bits, self.block_size, self.symmetric or bits == 8)

    def on_own_kernel(self, q: QuantizedWeight) -> bool:
        return self.own_kernel and blockq_ops.fits(q)

    def skip_norm(self, x: str, skip: str, weight: np.ndarray, weight_name: str, name: str,
                  total: str, eps: float) -> tuple[str, str]:
        """x + skip and its RMS norm times `weight` (the node and its output named `name`),
        and the sum (`total`): edgespec's SkipRMSNorm where the export runs on the kernel
        library (a few µs a node less in a pass of several tokens, norm.h), else ONNX
        Runtime's SkipSimplifiedLayerNormalization."""
        gamma = self.fconst(weight_name, weight)
        if self.own_kernel and self.dtype == np.float32 and len(weight) % 16 == 0:
            normed, summed = self.node("SkipRMSNorm", [x, skip, gamma], [name, total], name,
                                       domain=kernels.DOMAIN, epsilon=eps)
            return normed, summed
        normed, _, _, summed = self.node("SkipSimplifiedLayerNormalization", [x, skip, gamma],
                                         [name, "", "", total], name, domain=MS, epsilon=eps)
        return normed, summed

    def gated_down(self, gate_up: str, weight: Weight, name: str,
                   rotation: np.ndarray | None = None) -> str | None:
        """A gated MLP's down projection on the own kernel straight from the fused gate-up
        output: it takes silu(gate) * up as it reads its input (three nodes fewer a
        layer), and on a rotated export the `rotation` of its input too. None where
        `linear` would not put this weight on the kernel."""
        if self.rowwise and rotation is not None:
            return linear_ops.gated_rotated(self, gate_up, weight, rotation, name)
        if self.rowwise or self.nested or rotation is not None:
            return None
        q = weight if isinstance(weight, QuantizedWeight) else self._quantize(weight)
        if q is None or not self.on_own_kernel(q):
            return None
        return blockq_ops.linear(self, gate_up, q, name, name, gated=True)

    def quantized(self, x: str, q: QuantizedWeight, name: str, store: str | None = None) -> str:
        """A quantized linear on the own kernel where it takes the codes, else MatMulNBits."""
        if self.on_own_kernel(q):
            return blockq_ops.linear(self, x, q, name, store or name)
        return self._nbits(x, q, name, store)

    def _nested(self, x: str, nw: NestedWeight, name: str, view: str) -> str:
        """The base alone ("draft"), base + residual ("target"), or the residual gated by
        `use_residual` ("shared": one graph for both)."""
        base = self._nbits(x, nw.base, f"{name}.base")
        if view == "draft":
            return base
        if view == "shared":
            return self._gated_residual(x, base, nw, name)
        residual = self._nbits(x, nw.residual, f"{name}.residual")
        return self.node("Add", [base, residual], [f"{name}.out"], f"{name}.nest")[0]

    def trimmed_nested_head(self, x: str, weight: np.ndarray, rows: np.ndarray,
                            name: str) -> str:
        """BitNest + VocabTrim: the target reads the whole nested head, the draft the
        same codes of the kept `rows` only (both nibbles, as for an untrimmed head); the
        branch outputs differ in width, [.., V] or [.., K]."""
        outer, self.nodes = self.nodes, []
        full = self._nbits(x, nest(weight, self.block_size).as_8bit(), f"{name}.full")
        then_nodes, self.nodes = self.nodes, []
        kept = self._nbits(x, nest(weight[rows], self.block_size).as_8bit(), f"{name}.kept")
        else_nodes, self.nodes = self.nodes, outer
        out = [helper.make_tensor_value_info(n, self.onnx_dtype, None) for n in (full, kept)]
        return self.node("If", ["use_residual"], [f"{name}.out"], f"{name}.if",
                         then_branch=helper.make_graph(then_nodes, f"{name}.then", [], out[:1]),
                         else_branch=helper.make_graph(else_nodes, f"{name}.else", [],
                                                       out[1:]))[0]

    def _gated_residual(self, x: str, base: str, nw: NestedWeight, name: str) -> str:
        """One graph for both BitNest models, without control flow: the residual matmul
        sees the S rows of `x` when `use_residual` is true (the target) and none for the
        draft, and its output is zero-padded back to S rows. MatMulNBits on zero rows
        costs nothing, and every constant stays in the main graph, where ONNX Runtime
        prepacks it and frees the raw codes (an `If` branch kept them twice)."""
        rows, pads = self.gate
        xs = self.node("Slice", [x, self.const("i64.zero1", np.array([0], np.int64)), rows,
                                 self.const("i64.one1", np.array([1], np.int64))],
                       [f"{name}.rows"], f"{name}.rows")[0]
        residual = self._nbits(xs, nw.residual, f"{name}.residual")
        residual = self.node("Pad", [residual, pads], [f"{name}.residual.pad"],
                             f"{name}.residual.pad")[0]
        return self.node("Add", [base, residual], [f"{name}.out"], f"{name}.nest")[0]

    def gate_residuals(self, x: str) -> None:
        """The rows the residual matmuls see, S * use_residual (S: the rows of the stream
        `x`), and the Pad widths that restore S rows: computed once per graph."""
        s = self.node("Shape", [x], ["gate.shape"], "gate.shape", start=1, end=2)[0]
        use = self.node("Cast", ["use_residual"], ["gate.use"], "gate.use",
                        to=TensorProto.INT64)[0]
        rows = self.node("Mul", [s, use], ["gate.rows"], "gate.rows")[0]
        missing = self.node("Sub", [s, rows], ["gate.missing"], "gate.missing")[0]
        pads = self.node("Concat", [self.const("gate.pads.head", np.zeros(4, np.int64)), missing,
                                    self.const("gate.pads.tail", np.zeros(1, np.int64))],
                         ["gate.pads"], "gate.pads", axis=0)[0]
        self.gate = (rows, pads)

    def once(self, key: str, make: Callable[[], str]) -> str:
        """The tensor `make` builds, built the first time `key` is asked for only (several
        consumers of one scale table, one RoPE position range)."""
        if key not in self._once:
            self._once[key] = make()
        return self._once[key]

    def linear_parts(self, x: str, weight: Weight | list[Weight], name: str) -> list[str]:
        """One output per part: a fused weight gives one, unfusable imported parts
        (q, k and v of different GGUF types) one each."""
        if isinstance(weight, list):
            return [self.linear(x, w, f"{name}{i}") for i, w in enumerate(weight)]
        return [self.linear(x, weight, name)]

    def rebuilt(self, store: str, kind: str, q: QuantizedWeight) -> str:
        """`q.scales` or `q.mins` ([N * n_blocks]) as a tensor of the compute dtype. Where
        the source says how it stores them (GGUF: float16, or float16 times small
        integers), those are the constants and the float32 values are computed at session
        load (ONNX Runtime folds constant subgraphs), exactly as gguf-py computes them."""
        key = f"{store}.{kind}"
        if kind not in (q.stored or {}):
            return self.fconst(key, getattr(q, kind))
        if self.dtype == np.float32:
            return self.rebuilt32(store, kind, q)
        return self.once(key, lambda: self.node("Cast", [self.rebuilt32(store, kind, q)],
                                                [f"{key}.c"], f"{key}.c", to=self.onnx_dtype)[0])

    def rebuilt32(self, store: str, kind: str, q: QuantizedWeight) -> str:
        """The float32 value of stored scales or minimums (see `rebuilt`)."""
        key = f"{store}.{kind}"

        def make() -> str:
            factors = [self.node("Cast", [self.small_ints(f"{key}.{i}", p)], [f"{key}.{i}.f"],
                                 f"{key}.{i}.cast", to=TensorProto.FLOAT)[0]
                       for i, p in enumerate(q.stored[kind])]
            out = factors[0]
            for i, f in enumerate(factors[1:]):
                out = self.node("Mul", [out, f], [f"{key}.mul{i}"], f"{key}.mul{i}")[0]
            out = self.node("Reshape", [out, self.const("i64.flat", np.array([-1], np.int64))],
                            [f"{key}.flat"], f"{key}.flat")[0]
            if kind == "mins" and "centre" in q.stored:  # m' = m + c·s (see gguf_codes)
                (centre,) = q.stored["centre"]
                c = self.node("Cast", [self.const(f"{key}.centre", centre.reshape(
                    -1) if centre.ndim else centre)], [f"{key}.centre.f"], f"{key}.centre.f",
                    to=TensorProto.FLOAT)[0]
                cs = self.node("Mul", [c, self.rebuilt32(store, "scales", q)], [f"{key}.cs"],
                               f"{key}.cs")[0]
                out = self.node("Add", [out, cs], [f"{key}.centred"], f"{key}.centred")[0]
            return out

        return self.once(f"{key}.f32", make)

    def small_ints(self, name: str, a: np.ndarray) -> str:
        """A stored integer factor. With `pack_six` (set by build_decoder), 6-bit unsigned
        ones (K-quants' sub-block scales and minimums) are held in 6 bits as GGUF keeps
        them, not a byte each (Q4_K: 4.5 bits per weight, not 4.625): all of a graph's go
        into one constant of 4-bit and 2-bit parts, joined once at session load
        (finish_six) and split into the factors — per-factor unpacking cost more graph
        than it saved on small models."""
        if not self.pack_six or a.dtype != np.uint8 or a.size < 256 or a.max(initial=0) >= 64:
            return self.const(name, a)
        self._six.append((f"{name}.flat", a.reshape(-1)))
        shape = self.const("shape." + "x".join(map(str, a.shape)), np.array(a.shape, np.int64))
        return self.node("Reshape", [f"{name}.flat", shape], [f"{name}.v"], f"{name}.v")[0]

    def finish_six(self) -> None:
        """The 6-bit factors' one constant, joined and split into them by nodes placed
        first in the graph (they read constants only)."""
        if not self._six:
            return
        names, parts = zip(*self._six, strict=True)
        pad = (-sum(p.size for p in parts)) % 4
        values = np.concatenate([*parts, np.zeros(pad, np.uint8)])[None]
        body, self.nodes = self.nodes, []
        shape = self.const("six.shape", np.array([values.size], np.int64))
        low = self.unpacked(self.const("six.low", pack_rows(values & 0x0F, 4)), 4, shape,
                            "six.low")
        high = self.unpacked(self.const("six.high", pack_rows(values >> 4, 2)), 2, shape,
                             "six.high")
        high = self.node("BitShift", [high, self.const("four.u8", np.array(4, np.uint8))],
                         ["six.hs"], "six.hs", direction="LEFT")[0]
        joined = self.node("BitwiseOr", [low, high], ["six.values"], "six.values")[0]
        # Split reads its sizes when the session loads: they must stay inside the graph
        # file (< 1 KiB, not external data), so factors go in groups of 64
        start, i64 = 0, np.int64
        for g in range(0, len(parts), 64):
            sizes = [p.size for p in parts[g:g + 64]]
            group = self.node("Slice", [joined, self.const(f"six.{g}.at", np.array([start], i64)),
                                        self.const(f"six.{g}.end", np.array(
                                            [start + sum(sizes)], i64))],
                              [f"six.{g}"], f"six.{g}")[0]
            self.node("Split", [group, self.const(f"six.{g}.sizes", np.array(sizes, i64))],
                      list(names[g:g + 64]), f"six.{g}.split", axis=0)
            start += sum(sizes)
        self.nodes += body

    def unpacked(self, packed: str, bits: int, shape: str, name: str) -> str:
        """Codes packed `8 // bits` per byte (low bits first) -> one byte each, [.., shape]."""
        shifts = self.const(f"shifts.{bits}", np.arange(0, 8, bits, dtype=np.uint8))
        mask = self.const(f"mask.{bits}", np.array(2 ** bits - 1, np.uint8))
        wide = self.node("Unsqueeze", [packed, self.const("i64.last", np.array([-1], np.int64))],
                         [f"{name}.w"], f"{name}.w")[0]
        shifted = self.node("BitShift", [wide, shifts], [f"{name}.s"], f"{name}.s",
                            direction="RIGHT")[0]
        codes = self.node("BitwiseAnd", [shifted, mask], [f"{name}.m"], f"{name}.m")[0]
        return self.node("Reshape", [codes, shape], [f"{name}.g"], f"{name}.g")[0]

    def codes(self, store: str, q: QuantizedWeight) -> str:
        """MatMulNBits' B: the packed codes, or, for 5/6-bit values held in 8-bit codes,
        their GGUF-sized low and high parts joined at session load."""
        if "codes" not in (q.stored or {}):
            return self.const(f"{store}.qweight", q.packed)

        def make() -> str:
            low, high = (self.const(f"{store}.qweight.{part}", a)
                         for part, a in zip(("low", "high"), q.stored["codes"], strict=True))
            high_bits = blockq_ops.code_bits(q) - 4
            shape = self.const(f"{store}.qweight.shape", np.array(q.packed.shape, np.int64))
            low = self.unpacked(low, 4, shape, f"{store}.qweight.low")
            high = self.unpacked(high, high_bits, shape, f"{store}.qweight.high")
            high = self.node("BitShift", [high, self.const("four.u8", np.array(4, np.uint8))],
                             [f"{store}.qweight.hs"], f"{store}.qweight.hs",
                             direction="LEFT")[0]
            return self.node("BitwiseOr", [low, high], [f"{store}.qweight"],
                             f"{store}.qweight")[0]

        return self.once(f"{store}.qweight", make)

    def zero_point_input(self, store: str, q: QuantizedWeight) -> str:
        """The packed zero points; one value for every block (GGUF's types) is stored once
        and expanded at session load."""
        packed = q.packed_zero_points()
        if not np.all(packed == packed[0]):
            return self.const(f"{store}.zp", packed)
        return self.once(f"{store}.zp", lambda: self.node(
            "Expand", [self.const(f"zp.{packed[0]}", packed[:1]),
                       self.const(f"{store}.zp.shape", np.array(packed.shape, np.int64))],
            [f"{store}.zp"], f"{store}.zp")[0])

    def _nbits(self, x: str, q: QuantizedWeight, name: str, store: str | None = None) -> str:
        store, q = store or name, self.layout(q)
        inputs = [x, self.codes(store, q), self.rebuilt(store, "scales", q)]
        if self.zero_points or not q.symmetric:
            inputs.append(self.zero_point_input(store, q))
        y = self.node("MatMulNBits", inputs, [f"{name}.out"], name, domain=MS,
                      K=q.k, N=q.n, bits=q.bits, block_size=q.block_size,
                      accuracy_level=self.accuracy_level)[0]
        if q.mins is None:
            return y
        # w = q·s + m per block: x·w = MatMulNBits(x) + (block sums of x) · mᵀ
        nb = q.packed.shape[1]
        blocks = self.node("Reshape", [x, self.const(f"blocks.{nb}x{q.block_size}", np.array(
            [1, -1, nb, q.block_size], np.int64))], [f"{name}.xb"], f"{name}.xb")[0]
        sums = self.node("ReduceSum", [blocks, self.const("i64.last", np.array([-1], np.int64))],
                         [f"{name}.xsum"], f"{name}.xsum", keepdims=0)[0]
        mins = self.rebuilt(store, "mins", q)

        def transposed() -> str:  # [N * nb] -> [nb, N]
            grid = self.node("Reshape", [mins, self.const(f"{store}.mins.shape", np.array(
                [q.n, nb], np.int64))], [f"{store}.mins.grid"], f"{store}.mins.grid")[0]
            return self.node("Transpose", [grid], [f"{store}.mins.t"], f"{store}.mins.t",
                             perm=[1, 0])[0]

        offset = self.node("MatMul", [sums, self.once(f"{store}.mins.t", transposed)],
                           [f"{name}.min"], f"{name}.min")[0]
        return self.node("Add", [y, offset], [f"{name}.out.m"], f"{name}.addmin")[0]

    def layout(self, q: QuantizedWeight) -> QuantizedWeight:
        """The codes as MatMulNBits reads them (a codebook's as the 8-bit codes it holds):
        as they are where no pass has one row."""
        q = q.widened()
        return q if self.two_rows else invariant(q)

    def gather_rows(self, q: QuantizedWeight, ids: str, store: str) -> str:
        """Embedding rows straight from a quantized table (the tied LM head's own codes,
        stored once): S rows gathered, unpacked and dequantized, ((u - z) · s + m) as
        `dequantize` computes it."""
        if self.on_own_kernel(q):
            return blockq_ops.gather_rows(self, q, ids, store)
        q = self.layout(q)  # the layout the tied head's MatMulNBits reads
        nb, block = q.packed.shape[1], q.block_size
        codes = self.node("Gather", [self.codes(store, q), ids],
                          [f"{store}.rows"], f"{store}.rows")[0]  # [1, S, nb, bytes]
        grid = self.const(f"blocks.{nb}x{block}", np.array([1, -1, nb, block], np.int64))
        if q.bits < 8:
            codes = self.unpacked(codes, q.bits, grid, f"{store}.rows")
        else:
            codes = self.node("Reshape", [codes, grid], [f"{store}.rows.g"],
                              f"{store}.rows.g")[0]
        w = self.node("Cast", [codes], [f"{store}.rows.f"], f"{store}.rows.f",
                      to=TensorProto.FLOAT)[0]
        if np.all(q.zero_points == q.zero_points.flat[0]):
            zero = self.const(f"{store}.zp0", np.array(q.zero_points.flat[0], np.float32))
        else:
            zero = self.node("Cast", [self.node("Gather", [self.const(
                f"{store}.zp.rows", q.zero_points), ids], [f"{store}.zpr"], f"{store}.zpr")[0]],
                [f"{store}.zprf"], f"{store}.zprf", to=TensorProto.FLOAT)[0]
            zero = self.node("Unsqueeze", [zero, self.const("i64.last", np.array(
                [-1], np.int64))], [f"{store}.zpru"], f"{store}.zpru")[0]
        w = self.node("Sub", [w, zero], [f"{store}.rows.c"], f"{store}.rows.c")[0]
        flat = self.node("Add", [self.node("Mul", [self.node("Unsqueeze", [ids, self.const(
            "i64.last", np.array([-1], np.int64))], [f"{store}.ids"], f"{store}.ids")[0],
            self.const(f"nb.{nb}", np.array(nb, np.int64))], [f"{store}.ids.nb"],
            f"{store}.ids.nb")[0], self.const(f"range.{nb}", np.arange(nb, dtype=np.int64))],
            [f"{store}.blocks"], f"{store}.blocks")[0]  # [1, S, nb]: rows' block indices

        def per_block(kind: str) -> str:
            values = self.rebuilt(store, kind, q)
            if self.dtype != np.float32:  # gathered in float32, like the codes
                values = self.node("Cast", [values], [f"{store}.{kind}.f32"],
                                   f"{store}.{kind}.f32", to=TensorProto.FLOAT)[0]
            got = self.node("Gather", [values, flat], [f"{store}.{kind}.rows"],
                            f"{store}.{kind}.rows")[0]
            return self.node("Unsqueeze", [got, self.const("i64.last", np.array(
                [-1], np.int64))], [f"{store}.{kind}.u"], f"{store}.{kind}.u")[0]

        w = self.node("Mul", [w, per_block("scales")], [f"{store}.rows.d"], f"{store}.rows.d")[0]
        if q.mins is not None:
            w = self.node("Add", [w, per_block("mins")], [f"{store}.rows.m2"],
                          f"{store}.rows.m2")[0]
        out = self.node("Reshape", [w, self.const("rows.shape", np.array([1, -1, nb * block],
                                                                         np.int64))],
                        [f"{store}.rows.out"], f"{store}.rows.out")[0]
        if nb * block != q.k:
            out = self.node("Slice", [out, self.const("i64.zero1", np.array([0], np.int64)),
                                      self.const(f"k.{q.k}", np.array([q.k], np.int64)),
                                      self.const("i64.last", np.array([-1], np.int64))],
                            [f"{store}.rows.k"], f"{store}.rows.k")[0]
        return out


def window_bias(g: GraphBuilder, bias: str, shape: str, window: int) -> str:
    """`bias` plus -inf where a key lies `window` or more positions behind the query.

    Positions, not buffer slots: tree nodes sit at slots past..past+S-1 but their
    positions are their depths, so GQA's own slot-based window would cut the wrong keys.
    Keys in the cache are at positions 0..past-1; the new keys are the queries themselves.
    """
    name = f"window{window}"
    zero, one = g.const("i64.zero", np.array(0, np.int64)), g.const("i64.one",
                                                                    np.array(1, np.int64))
    sizes = g.node("Slice", [shape, g.const("i64.two", np.array([2], np.int64)),
                             g.const("i64.four", np.array([4], np.int64))],
                   [f"{name}.st"], f"{name}.st")[0]
    s, t = g.node("Split", [sizes], [f"{name}.s", f"{name}.t"], f"{name}.split", axis=0,
                  num_outputs=2)
    past = g.node("Squeeze", [g.node("Sub", [t, s], [f"{name}.p1"], f"{name}.sub")[0]],
                  [f"{name}.past"], f"{name}.past")[0]
    cached = g.node("Range", [zero, past, one], [f"{name}.cached"], f"{name}.range")[0]
    new = g.node("Squeeze", ["position_ids", g.const("i64.axis0", np.array([0], np.int64))],
                 [f"{name}.new"], f"{name}.new")[0]
    keys = g.node("Concat", [cached, new], [f"{name}.keys"], f"{name}.keys", axis=0)[0]
    queries = g.node("Unsqueeze", [new, g.const("i64.axis1", np.array([1], np.int64))],
                     [f"{name}.q"], f"{name}.q")[0]
    dist = g.node("Sub", [queries, keys], [f"{name}.dist"], f"{name}.dist")[0]
    far = g.node("GreaterOrEqual", [dist, g.const(f"{name}.w", np.array(window, np.int64))],
                 [f"{name}.far"], f"{name}.far")[0]
    masked = g.node("Where", [far, g.fconst("neg_inf", np.finfo(g.dtype).min), bias],
                    [f"{name}.bias"], f"{name}.where")[0]
    return masked


def gqa(g: GraphBuilder, spec: DecoderSpec, i: int, p: str, qkv: list[str], seqlens_k: str,
        total: str, rope: list[str], bias: str,
        kv_scales: tuple[np.ndarray, np.ndarray] | None = None) -> str:
    """GroupQueryAttention: RoPE inside, KV written in place into the shared buffer.
    Or, on graphs with `own_attention`, edgespec's own attention op with the same inputs
    (edgespec/kernels/attend.h): exact at one row, and a tree node's output bitwise what
    the same token gives in a chain.
    Sliding windows are in `bias` (see window_bias), not GQA's slot-based window.
    `kv_scales` (per kv head and channel, [kv_heads, 1, head_dim]) make the cache int8
    codes: GQA quantizes the rotated K and V it writes and dequantizes what it reads."""
    attrs = dict(num_heads=spec.num_heads, kv_num_heads=spec.num_kv_heads, do_rotary=1,
                 rotary_interleaved=0)
    quantized = []
    if kv_scales is not None:
        attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                     kv_cache_bit_width=8)
        quantized = ["", *(g.const(f"{p}.{kind}_scale", scale.astype(np.float32))
                           for kind, scale in zip("kv", kv_scales, strict=True))]
    if spec.attn_scale or head_layout(spec):
        attrs["scale"] = spec.attn_scale or spec.head_dim ** -0.5
    if spec.attn_softcap:
        attrs["softcap"] = spec.attn_softcap
    positions = "position_ids"
    if g.two_rows or g.pad_attention:  # the stream's rows, or attention's: see exact_rows
        positions, bias = exact_rows.padded_positions(g), exact_rows.padded_bias(g, bias)
        seqlens_k, total = exact_rows.padded_lengths(g, seqlens_k, total)
    if g.own_attention:  # int8 caches: the scales follow the bias, without GQA's gap
        op = "AttentionInt8" if kv_scales is not None else (
            "AttentionHalf" if g.kv_half else "Attention")
        return g.node(op,
                      [*qkv, f"past_key_{i}", f"past_value_{i}", *rope, positions, bias,
                       *quantized[1:]],
                      [f"{p}.attn", f"present_key_{i}", f"present_value_{i}"], f"{p}.attn",
                      domain=kernels.DOMAIN, num_heads=spec.num_heads,
                      kv_num_heads=spec.num_kv_heads,
                      scale=float(spec.attn_scale or spec.head_dim ** -0.5),
                      **({"softcap": float(spec.attn_softcap)} if spec.attn_softcap else {}))[0]
    if g.pad_attention:
        qkv = [exact_rows.two_rows(g, t) if t else t for t in qkv]
    attn = g.node("GroupQueryAttention",
                  [*qkv, f"past_key_{i}", f"past_value_{i}", seqlens_k, total, *rope,
                   positions, bias, *quantized],
                  [f"{p}.attn", f"present_key_{i}", f"present_value_{i}"], f"{p}.attn",
                  domain=MS, **attrs)[0]
    return exact_rows.real_rows(g, attn, f"{p}.attn") if g.pad_attention else attn


def mha(g: GraphBuilder, spec: DecoderSpec, i: int, p: str, qkv: list[str], rope: list[str],
        bias: str) -> str:
    """MultiHeadAttention for DirectML, whose GQA cannot verify several tokens against a
    cache: RoPE as its own op, K/V repeated to every query head, the mask entirely in the
    bias, and present = past + new (a concatenation, not an in-place write)."""
    q, k, v = qkv
    rotary = dict(domain=MS, interleaved=0, rotary_embedding_dim=2 * len(spec.inv_freq))
    q = g.node("RotaryEmbedding", [q, "position_ids", *rope], [f"{p}.q.rot"], f"{p}.q.rot",
               num_heads=spec.num_heads, **rotary)[0]
    k = g.node("RotaryEmbedding", [k, "position_ids", *rope], [f"{p}.k.rot"], f"{p}.k.rot",
               num_heads=spec.num_kv_heads, **rotary)[0]
    rep = spec.num_heads // spec.num_kv_heads
    if rep > 1:
        grouped = g.const(f"{p}.kv.grouped", np.array([1, -1, spec.num_kv_heads, 1,
                                                       spec.head_dim], np.int64))
        expanded = g.const(f"{p}.kv.expand", np.array([1, 1, 1, rep, 1], np.int64))
        flat = g.const(f"{p}.kv.flat", np.array([1, -1, spec.num_heads * spec.head_dim],
                                                np.int64))
        k, v = (g.node("Reshape", [g.node("Expand", [g.node(
            "Reshape", [t, grouped], [f"{t}.g"], f"{t}.g")[0], expanded], [f"{t}.e"],
            f"{t}.e")[0], flat], [f"{t}.rep"], f"{t}.rep")[0] for t in (k, v))
    return g.node("MultiHeadAttention",
                  [q, k, v, "", "", bias, f"past_key_{i}", f"past_value_{i}"],
                  [f"{p}.attn", f"present_key_{i}", f"present_value_{i}"], f"{p}.attn",
                  domain=MS, num_heads=spec.num_heads, unidirectional=0,
                  scale=spec.attn_scale or spec.head_dim ** -0.5)[0]


def rope_caches(g: GraphBuilder, spec: DecoderSpec, inv_freq: np.ndarray,
                name: str) -> list[str]:
    """cos/sin [max_positions, rotary_dim/2] for the half-split (rotate_half) layout, as
    transformers computes them (float32 angles); a rotary_dim below head_dim is partial
    rotary, which GQA reads off the cache width. Only the frequencies are stored: the
    tables (tens of MB at 32k positions) are computed at session load."""
    positions = g.once("rope.positions", lambda: g.node(
        "Range", [g.const("rope.start", np.array(0, np.float32)),
                  # one more row: GQA checks it against an exact pass's padded length
                  g.const("rope.limit", np.array(spec.max_positions + 1, np.float32)),
                  g.const("rope.delta", np.array(1, np.float32))],
        ["rope.positions"], "rope.positions")[0])
    column = g.const("rope.column", np.array([-1, 1], np.int64))
    pos = g.node("Reshape", [positions, column], [f"{name}.pos"], f"{name}.pos")[0]
    angles = g.node("Mul", [pos, g.const(f"{name}.inv_freq", inv_freq.astype(np.float32))],
                    [f"{name}.angles"], f"{name}.angles")[0]
    out = []
    for fn in ("Cos", "Sin"):
        t = g.node(fn, [angles], [f"{name}.{fn.lower()}"], f"{name}.{fn.lower()}")[0]
        if g.dtype != np.float32:
            t = g.node("Cast", [t], [f"{name}.{fn.lower()}.c"], f"{name}.{fn.lower()}.c",
                       to=g.onnx_dtype)[0]
        out.append(t)
    return out


def pad_heads(g: GraphBuilder, x: str, heads: int, spec: DecoderSpec, name: str) -> str:
    """[1, S, heads·d] -> [1, S, heads·d'] laid out as head_layout says: a zero column is
    appended to each head and gathered into the pad positions."""
    size, where = head_layout(spec)
    source = np.full(size, spec.head_dim, np.int64)  # the zero column
    source[where] = np.arange(spec.head_dim)
    split = g.const(f"heads{heads}x{spec.head_dim}", np.array([1, -1, heads, spec.head_dim],
                                                             np.int64))
    y = g.node("Reshape", [x, split], [f"{name}.heads"], f"{name}.heads")[0]
    y = g.node("Pad", [y, g.const("pads.zero_column", np.array([0, 0, 0, 0, 0, 0, 0, 1],
                                                                np.int64))],
               [f"{name}.z"], f"{name}.z")[0]
    y = g.node("Gather", [y, g.const("head.pad_source", source)], [f"{name}.pad"],
               f"{name}.pad", axis=-1)[0]
    merged = g.const(f"merged{heads}x{size}", np.array([1, -1, heads * size], np.int64))
    return g.node("Reshape", [y, merged], [f"{name}.padded"], f"{name}.padded")[0]


def unpad_heads(g: GraphBuilder, x: str, spec: DecoderSpec, name: str) -> str:
    """The inverse of pad_heads for the attention output (query heads)."""
    size, where = head_layout(spec)
    split = g.const(f"heads{spec.num_heads}x{size}", np.array(
        [1, -1, spec.num_heads, size], np.int64))
    merged = g.const(f"merged{spec.num_heads}x{spec.head_dim}", np.array(
        [1, -1, spec.num_heads * spec.head_dim], np.int64))
    y = g.node("Reshape", [x, split], [f"{name}.heads"], f"{name}.heads")[0]
    y = g.node("Gather", [y, g.const("head.real_dims", where)], [f"{name}.cut"], f"{name}.cut",
               axis=-1)[0]
    return g.node("Reshape", [y, merged], [f"{name}.merged"], f"{name}.merged")[0]


def build_decoder(spec: DecoderSpec, embeddings: Weight, layers: Iterable[LayerWeights],
                  final_norm: np.ndarray, lm_head: Weight, precision: str = "fp32",
                  block_size: int = 32, accuracy_level: int = 0, dtype: type = np.float32,
                  attention: str = "gqa", symmetric: bool = True, nested: str | None = None,
                  draft_head_rows: np.ndarray | None = None,
                  kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
                  on_layer: Callable[[int], None] | None = None, hidden_output: bool = False,
                  fusion: Weight | None = None,
                  rotation: Rotated | None = None,
                  hessians: dict[str, np.ndarray] | None = None,
                  last_logits: bool = False, own_kernel: bool | None = None,
                  own_attention: bool | None = None,
                  kv_half: bool | None = False) -> onnx.ModelProto:
    """The whole decoder step as one graph.

    Quantized precisions keep the embedding table in fp16 (a Gather reads S rows, so its
    precision costs memory, not speed) and the LM head at 8 bits even for int4/int2
    bodies: the head decides which token wins, and low-bit heads cost accuracy that
    no speculative trick recovers. Imported encodings (GGUF) keep their own types; a
    quantized embedding is gathered from its codes, shared with a tied head. Logits and
    the bias stay float32 at the graph's edge whatever the compute dtype, so the
    runtime's contract does not change.
    `draft_head_rows` (BitNest with VocabTrim) gives the nested draft a head of those
    rows only. `kv_scales` (one (K, V) pair per layer) store the KV cache as int8 codes;
    `kv_half` as float16 (on edgespec's attention op: the cpu profile with the library;
    None: where that op runs a graph whose linears run on edgespec's kernel, whose int8
    activations round far more than float16 caches do).
    `hidden_output` adds the final-norm states as output `hidden` [1,S,d] (what an EAGLE
    draft head reads); `fusion` ([d, 2d]) makes the graph such a head: input `hidden_in`
    [1,S,d] is joined to the token embeddings and projected back to d before the layers
    (edgespec.export.draft_head); its `embeddings` may be a RotatedTable. `rotation`
    (export.rotation): the weights given are rotated ones; the graph runs down_proj's
    input rotation and the head's input matrix,
    and an int8 graph computes every linear as the exact row-quantized integer GEMM, its
    codes chosen by GPTQ where `hessians` (calibrate, by node name) has the input's XᵀX.
    `last_logits` scores the pass's last row only (logits [1,1,V]): a draft head drafts
    from its last row, and its first pass reads a whole prompt. Other graphs take input
    `logits_from` ([1] int64) instead and score rows from there on (logits [1,S-from,V]):
    a verification pass scores every row (0), a prefill the last two (the LM head over a
    whole prompt is a fifth of a SmolLM2 prefill, most of a Gemma 3 one); two, not one,
    so its rows go through the same multi-row kernels as in any other pass (exact_rows)
    and stay bitwise what a full pass gives.
    `own_kernel` runs the codes it takes on edgespec's CPU kernel (blockq_ops.fits);
    None: on the cpu profile with int8 activations (accuracy_level 4) where this
    installation has the library (kernels.for_export). `own_attention` puts attention on
    its attention op (gqa); None: on the cpu profile where the library is there. Its
    graphs say so in their metadata (kernels.EXACT_TREES): a token's logits are then
    bitwise the same on a tree branch as in a chain, so trees need no second pass.
    """
    g = GraphBuilder(precision, block_size, accuracy_level, dtype,
                     zero_points=attention == "mha", symmetric=symmetric, nested=nested)
    g.pack_six = True
    g.rowwise = rotation is not None and precision == "int8"
    g.hessians = hessians or {}
    g.two_rows = attention == "gqa" and g.dtype == np.float32  # the cpu profile
    if own_kernel is None:  # it quantizes activations to int8: accuracy_level 4's choice
        own_kernel = g.two_rows and accuracy_level == 4 and kernels.for_export()
    g.own_kernel = own_kernel and not nested
    kv_dim_head = kv_head_dim(spec, attention)
    if own_attention is None:
        own_attention = g.two_rows and kernels.for_export()
    g.own_attention = own_attention and kv_dim_head % 8 == 0
    if kv_half is None:
        kv_half = g.own_attention and g.own_kernel and precision not in ("fp32", "fp16")
    if kv_half and not g.own_attention:
        raise EdgespecError("a float16 KV cache needs edgespec's attention op (the cpu "
                            "profile, the kernel library built, a head size that is a "
                            "multiple of 8); export with --kv-cache float.")
    g.kv_half = kv_half
    if g.own_kernel:  # its linears, and all others left (see invariant), are exact at one
        # row: only GroupQueryAttention needs two, edgespec's own attention none
        g.two_rows, g.pad_attention = False, not g.own_attention
    rotated_table = embeddings if isinstance(embeddings, RotatedTable) else None
    if rotated_table is not None:
        embeddings = rotated_table.table
    tied = embeddings is lm_head
    if nested or draft_head_rows is not None:  # BitNest nests float weights anew
        embeddings, lm_head = as_float(embeddings), as_float(lm_head)
    s_dim, t_dim = "sequence", "total_sequence"
    if attention == "gqa":
        past_shape = present_shape = [1, spec.num_kv_heads, "max_length", kv_dim_head]
    else:
        past_shape = [1, spec.num_heads, "past_sequence", spec.head_dim]
        present_shape = [1, spec.num_heads, t_dim, spec.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, s_dim]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, s_dim]),
              helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT,
                                            [1, 1, s_dim, t_dim])]
    if nested == "shared":
        inputs.append(helper.make_tensor_value_info("use_residual", TensorProto.BOOL, []))
    # a trimmed draft head (VocabTrim) has fewer rows than the vocabulary
    vocab = "vocab" if draft_head_rows is not None else rows_of(lm_head)
    if not last_logits:
        inputs.append(helper.make_tensor_value_info("logits_from", TensorProto.INT64, [1]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                             [1, 1 if last_logits else "scored", vocab])]
    if hidden_output:
        outputs.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT,
                                                     [1, s_dim, spec.hidden_size]))
    if fusion is not None:
        inputs.append(helper.make_tensor_value_info("hidden_in", TensorProto.FLOAT,
                                                    [1, s_dim, spec.hidden_size]))
    kv_type = (TensorProto.INT8 if kv_scales is not None
               else TensorProto.FLOAT16 if kv_half else g.onnx_dtype)
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", kv_type,
                                                        past_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", kv_type,
                                                         present_shape))

    float_table = None  # a float embedding table, which a tied float head reads too
    if g.rowwise and tied or rotated_table is not None and rotated_table.rowwise:
        x = linear_ops.gather_rowwise(g, embeddings, "input_ids",
                                      "lm_head" if tied else "embed")
    elif isinstance(embeddings, QuantizedWeight):
        x = g.gather_rows(embeddings, "input_ids", "lm_head" if tied else "embed")
        if g.dtype != np.float32:
            x = g.node("Cast", [x], ["embed.out"], "embed.cast", to=g.onnx_dtype)[0]
    else:
        table = embeddings.astype(g.dtype if precision == "fp32" else np.float16)
        float_table = g.const("embed.weight", table)
        x = g.node("Gather", [float_table, "input_ids"], ["embed.raw"], "embed")[0]
        if table.dtype != g.dtype:
            x = g.node("Cast", [x], ["embed.out"], "embed.cast", to=g.onnx_dtype)[0]
    if rotated_table is not None:
        x = g.node("MatMul", [x, g.fconst("embed.unrotate", rotated_table.unrotate)],
                   ["embed.unrotated"], "embed.unrotate")[0]
    if spec.embed_scale:
        x = g.node("Mul", [x, g.fconst("embed.scale", spec.embed_scale)], ["embed.scaled"],
                   "embed.scale")[0]
    if fusion is not None:
        features = "hidden_in" if g.dtype == np.float32 else g.node(
            "Cast", ["hidden_in"], ["hidden_in.c"], "hidden_in.cast", to=g.onnx_dtype)[0]
        x = g.node("Concat", [x, features], ["fusion.in"], "fusion.concat", axis=-1)[0]
    if g.two_rows:
        x = exact_rows.two_rows(g, x)
    if nested == "shared":
        g.gate_residuals(x)
    if fusion is not None:
        x = g.linear(x, fusion, "fusion")
    bias = "attention_bias"
    if g.dtype != np.float32:
        bias = g.node("Cast", [bias], ["attention_bias.c"], "bias.cast", to=g.onnx_dtype)[0]

    # GQA's lengths, read off the bias: total = T, seqlens_k = T - 1.
    shape = g.node("Shape", ["attention_bias"], ["bias.shape"], "bias.shape")[0]
    total64 = g.node("Gather", [shape, g.const("three", np.array(3, np.int64))],
                     ["total.i64"], "total.gather", axis=0)[0]
    total = g.node("Cast", [total64], ["total_sequence_length"], "total.cast",
                   to=TensorProto.INT32)[0]
    seqlens = g.node("Sub", [total, g.const("one", np.array(1, np.int32))], ["seqlens.s"],
                     "seqlens.sub")[0]
    seqlens_k = g.node("Reshape", [seqlens, g.const("shape1", np.array([1], np.int64))],
                       ["seqlens_k"], "seqlens.reshape")[0]
    layout = head_layout(spec) if attention == "gqa" else None
    rotary_half = (layout[1][len(spec.inv_freq)] if layout and len(spec.inv_freq)
                   else len(spec.inv_freq))

    def frequencies(inv_freq: np.ndarray) -> np.ndarray:  # padded rotary halves turn at 0
        return np.pad(inv_freq, (0, rotary_half - len(inv_freq)))

    rope = rope_caches(g, spec, frequencies(spec.inv_freq), "rope")
    local_rope = (rope_caches(g, spec, frequencies(spec.local_inv_freq), "rope.local")
                  if spec.local_inv_freq is not None else rope)
    if attention == "mha":  # MHA wants the bias per head: [1, heads, S, T]
        dims = g.node("Concat", [g.const("bias.heads", np.array([1, spec.num_heads], np.int64)),
                                 g.node("Slice", [shape, g.const("two", np.array([2], np.int64)),
                                                  g.const("four", np.array([4], np.int64))],
                                        ["bias.st"], "bias.st")[0]],
                      ["bias.dims"], "bias.dims", axis=0)[0]
        mha_bias = g.node("Expand", [bias, dims], ["attention_bias.h"], "bias.expand")[0]
    eps = spec.rms_norm_eps
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def rms(x: str, weight: np.ndarray, name: str) -> str:
        return g.node("SimplifiedLayerNormalization", [x, g.fconst(f"{name}.weight", weight)],
                      [name], name, epsilon=eps, axis=-1, stash_type=1)[0]

    def head_norm(x: str, weight: np.ndarray, heads: int, name: str) -> str:
        """RMSNorm over each head's vector (Qwen3's q/k norms)."""
        split = g.const(f"{name}.heads", np.array([1, -1, heads, spec.head_dim], np.int64))
        merged = g.const(f"{name}.merged", np.array([1, -1, heads * spec.head_dim], np.int64))
        y = g.node("Reshape", [x, split], [f"{name}.split"], f"{name}.split")[0]
        y = rms(y, weight, f"{name}.norm")
        return g.node("Reshape", [y, merged], [f"{name}.out"], f"{name}.merge")[0]

    resid, delta = x, None
    windows: dict[int, str] = {}  # one window bias per distinct window size, shared
    for i, lw in enumerate(layers):
        p = f"layers.{i}"
        if delta is None:
            h = rms(resid, lw.input_norm, f"{p}.norm1")
        else:
            h, resid = g.skip_norm(resid, delta, lw.input_norm, f"{p}.input_norm",
                                   f"{p}.norm1", f"{p}.resid1", eps)
        qkv = g.linear_parts(h, lw.qkv, f"{p}.qkv")
        if lw.qkv_bias is not None:
            qkv = [g.node("Add", [qkv[0], g.fconst(f"{p}.qkv.bias", lw.qkv_bias)],
                          [f"{p}.qkv.b"], f"{p}.qkv.bias")[0]] if len(qkv) == 1 else [
                g.node("Add", [t, g.fconst(f"{p}.qkv.bias{j}", b)], [f"{t}.b"], f"{t}.bias")[0]
                for j, (t, b) in enumerate(zip(qkv, np.split(lw.qkv_bias, [q_dim, q_dim + kv_dim]),
                                               strict=True))]
        pad = kv_dim_head != spec.head_dim
        if len(qkv) == 3 or lw.q_norm is not None or attention == "mha" or pad:
            q, k, v = qkv if len(qkv) == 3 else g.node(
                "Split", [qkv[0], g.const(f"{p}.qkv.sizes", np.array(
                    [q_dim, kv_dim, kv_dim], np.int64))], [f"{p}.q", f"{p}.k", f"{p}.v"],
                f"{p}.qkv.split", axis=-1)
            if lw.q_norm is not None:
                q = head_norm(q, lw.q_norm, spec.num_heads, f"{p}.qn")
                k = head_norm(k, lw.k_norm, spec.num_kv_heads, f"{p}.kn")
            if pad:
                q = pad_heads(g, q, spec.num_heads, spec, f"{p}.qp")
                k, v = (pad_heads(g, t, spec.num_kv_heads, spec, f"{p}.{c}p")
                        for t, c in ((k, "k"), (v, "v")))
            qkv_inputs = [q, k, v]
        else:
            qkv_inputs = [qkv[0], "", ""]
        if attention == "gqa":
            layer_bias = bias
            if spec.sliding_window and spec.sliding_window[i]:
                w = spec.sliding_window[i]
                windows[w] = windows.get(w) or window_bias(g, bias, shape, w)
                layer_bias = windows[w]
            layer_rope = local_rope if spec.sliding_window and spec.sliding_window[i] else rope
            attn = gqa(g, spec, i, p, qkv_inputs, seqlens_k, total, layer_rope, layer_bias,
                       kv_scales[i] if kv_scales is not None else None)
            if pad:
                attn = unpad_heads(g, attn, spec, f"{p}.attn.u")
        else:
            attn = mha(g, spec, i, p, qkv_inputs, rope, mha_bias)
        o = g.linear(attn, lw.o, f"{p}.o")
        if lw.attn_out_norm is not None:
            o = rms(o, lw.attn_out_norm, f"{p}.attn_out_norm")
        h, resid = g.skip_norm(resid, o, lw.mlp_norm, f"{p}.mlp_norm", f"{p}.norm2",
                               f"{p}.resid2", eps)
        gate_up = g.linear_parts(h, lw.gate_up, f"{p}.gate_up")
        delta = None
        if len(gate_up) == 1 and spec.activation == "silu":
            delta = g.gated_down(gate_up[0], lw.down, f"{p}.down",
                                 None if rotation is None else rotation.down_block)
        if delta is None:
            gate, up = gate_up if len(gate_up) == 2 else g.node(
                "Split", gate_up, [f"{p}.gate", f"{p}.up"], f"{p}.split", axis=-1,
                num_outputs=2)
            if spec.activation == "gelu_tanh":
                act = g.node("FastGelu", [gate], [f"{p}.gelu"], f"{p}.gelu", domain=MS)[0]
            else:
                sig = g.node("Sigmoid", [gate], [f"{p}.sig"], f"{p}.sig")[0]
                act = g.node("Mul", [gate, sig], [f"{p}.silu"], f"{p}.silu")[0]
            act = g.node("Mul", [act, up], [f"{p}.act"], f"{p}.act")[0]
            if rotation is not None:
                act = linear_ops.rotate_blocks(g, act, rotation.down_block,
                                               spec.intermediate_size, f"{p}.down.rotate")
            delta = g.linear(act, lw.down, f"{p}.down")
        if lw.mlp_out_norm is not None:
            delta = rms(delta, lw.mlp_out_norm, f"{p}.mlp_out_norm")
        if on_layer:
            on_layer(i)

    h, _ = g.skip_norm(resid, delta, final_norm, "final_norm", "final.norm", "final.resid",
                       eps)
    # a head whose one-row kernel is exact reads the real rows alone (a row less to score);
    # an imported 4-bit head in blocks of 32 scores the copy too, cut from its logits
    cut_late = (g.two_rows and isinstance(lm_head, QuantizedWeight) and not g.rowwise
                and not one_row_exact(lm_head) and not g.on_own_kernel(lm_head))
    if g.two_rows and not cut_late:
        h = exact_rows.real_rows(g, h, "final.norm")
    if rotation is not None:  # the rotated, weightless norm's output -> the head's input
        h = g.node("MatMul", [h, g.fconst("head_input", rotation.head_input)],
                   ["final.head_input"], "final.head_input")[0]
        if hidden_output:  # in the model's own basis, as a draft head was trained on it
            g.node("MatMul", [h, g.fconst("unrotate", rotation.unrotate)], ["hidden"],
                   "hidden")
    elif hidden_output:
        hidden = exact_rows.real_rows(g, h, "hidden") if cut_late else h
        g.node("Cast", [hidden], ["hidden"], "hidden", to=TensorProto.FLOAT)
    h = g.node("Slice", [h, g.const("i64.minus1", np.array([-1], np.int64)) if last_logits
                         else "logits_from",
                         g.const("i64.end", np.array([np.iinfo(np.int64).max], np.int64)),
                         g.const("exact.axis1", np.array([1], np.int64))],
               ["final.scored"], "final.scored")[0]
    head_bits = 8 if precision in BITS else None
    if draft_head_rows is not None:
        logits = g.trimmed_nested_head(h, lm_head, draft_head_rows, "lm_head")
    elif tied and float_table and head_bits is None and not nested and rotation is None:
        # the table stored once: ONNX Runtime folds its transpose at session load
        w = g.node("Transpose", [float_table], ["lm_head.tied"], "lm_head.tied",
                   perm=[1, 0])[0]
        if precision != "fp32" and g.dtype == np.float32:
            w = g.node("Cast", [w], ["lm_head.tied.c"], "lm_head.upcast", to=g.onnx_dtype)[0]
        logits = g.node("MatMul", [h, w], ["lm_head.out"], "lm_head")[0]
    else:
        logits = g.linear(h, lm_head, "lm_head", bits=head_bits, whole_nest=True,
                          store="lm_head")
    if spec.final_softcap:  # c * tanh(logits / c)
        cap = g.fconst("final_softcap", spec.final_softcap)
        scaled = g.node("Div", [logits, cap], ["logits.scaled"], "softcap.div")[0]
        tanh = g.node("Tanh", [scaled], ["logits.tanh"], "softcap.tanh")[0]
        logits = g.node("Mul", [tanh, cap], ["logits.capped"], "softcap.mul")[0]
    if cut_late:
        logits = exact_rows.real_rows(g, logits, "logits")
    if g.dtype != np.float32:
        g.node("Cast", [logits], ["logits"], "logits", to=TensorProto.FLOAT)
    else:
        g.node("Identity", [logits], ["logits"], "logits")
    g.finish_six()
    graph = helper.make_graph(g.nodes, f"edgespec-{spec.architecture}", inputs, outputs,
                              initializer=g.inits)
    domains = [MS] + ([blockq_ops.DOMAIN] if any(
        n.domain == blockq_ops.DOMAIN for n in g.nodes) else [])
    model = helper.make_model(graph, producer_name="edgespec", ir_version=10,
                              opset_imports=[helper.make_opsetid("", OPSET)] + [
                                  helper.make_opsetid(d, 1) for d in domains])
    if g.own_attention:
        helper.set_model_props(model, {kernels.EXACT_TREES: "1"})
    return model
