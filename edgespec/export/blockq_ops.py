"""Quantized linears on edgespec's own CPU kernel (edgespec/kernels, op edgespec.BlockQMatMul).

ONNX Runtime's `MatMulNBits` re-reads a weight for every row of a pass (five rows cost
~2x one), sends one-row passes to a kernel that sums in another order, and has no place
for a per-block minimum (Q4_1, Q4_K: four more nodes per linear, 12-24% of a step). The
own kernel reads each weight block once for all rows, quantizes activations per row and
block of 32 to int8 as llama.cpp does for these types, applies scale and offset inside,
and gives every row bitwise the same result whatever the number of rows (blockq.h).

It takes any block-of-32 encoding with 4-, 5-, 6- or 8-bit codes (GGUF Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL, Q8_0; edgespec's own int4/int8) as codes u, scale s and offset o per block:
w = s·u + o, o = m - z·s for the encoding's zero point z and minimum m; scales and offsets
are computed and laid out at session load from the source's own storage (ONNX Runtime
folds the constant nodes). Encodings whose scales are a float16 per super-block of 256
times a small integer per sub-block of 16 or 32 (GGUF's K-quants Q2_K-Q6_K, IQ4_XS;
edgespec's own int4, which is Q4_K_M) keep that form (`k_tables`, op BlockQMatMulK): 4.6
bits a Q4_K weight are read instead of 6 with a float scale and offset per block, and
blocks of 16 run on the kernel too. Codes are stored in the kernel's tiled layout, 5- and
6-bit ones (GGUF's Q5_*, Q6_K) as 4-bit low parts and 1 or 2 bit planes that the kernel
reads as they are, so a bundle is no bigger than the GGUF file's codes and a step reads
no more of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

from edgespec.kernels import DOMAIN
from edgespec.quant.blockwise import IQ4_CODES, QuantizedWeight, unpack_rows

if TYPE_CHECKING:  # graph.py imports this module
    from edgespec.export.graph import GraphBuilder

LANES, BLOCK, SUPER = 16, 32, 256
PLANES_AT = 256  # where a 5- or 6-bit tile-block's bit planes begin (blockq.h)


def k_tables(q: QuantizedWeight) -> tuple[np.ndarray, ...] | None:
    """The K-quant tables of `q` where its scales are stored as a float16 per super-block of
    256 times an integer per sub-block: D, M float16 [N, K/256] and σ, μ int8 [N, K/sub]
    with w = D·σ·u + M·μ for the raw codes u (a minimum m = M·μ, or a zero point z as
    M = -z·D and μ = σ); None for other encodings."""
    stored = q.stored or {}
    pairs = [stored.get("scales", ())] + ([stored["mins"]] if "mins" in stored else [])
    supers, subs = q.k // SUPER, q.k // q.block_size
    if q.k % SUPER or any(len(pair) != 2 for pair in pairs):
        return None
    # float16 [N, G, 1] and integers [N, G, P] as the encodings give them, or flat per row
    # (QuantizedWeight.rows)
    if any(big.dtype != np.float16 or big.size != q.n * supers or small.size != q.n * subs
           or not np.issubdtype(small.dtype, np.integer) for big, small in pairs):
        return None
    parts, mins = pairs[0], (pairs[1] if len(pairs) == 2 else None)
    d, sigma = parts[0].reshape(q.n, supers), parts[1].reshape(q.n, subs)
    if mins is not None:
        m, mu = mins[0].reshape(q.n, supers), mins[1].reshape(q.n, subs)
    else:
        z = q.zero_points.reshape(-1)
        if q.mins is not None or np.any(z != z[0]):
            return None
        m, mu = (-(np.float32(z[0]) * d.astype(np.float32))).astype(np.float16), sigma
        if not np.array_equal(m.astype(np.float32), -np.float32(z[0]) * d.astype(np.float32)):
            return None  # -z·D is not a float16
    if any(v.min() < -128 or v.max() > 127 for v in (sigma, mu)):
        return None
    return (d.astype(np.float16), m.astype(np.float16), sigma.astype(np.int8),
            mu.astype(np.int8))


def code_bits(q: QuantizedWeight) -> int:
    """The width the kernel reads `q`'s codes at: GGUF's 5- and 6-bit values (8-bit codes
    stored as 4-bit low parts and high parts) at their own."""
    if "codes" in (q.stored or {}):
        return 4 + 8 * q.stored["codes"][1].shape[-1] // q.block_size
    return q.bits


def fits(q: QuantizedWeight) -> bool:
    """Whether the kernel takes these codes: blocks of 32 (or K-quant tables in sub-blocks
    of 16), 4-, 5-, 6- or 8-bit codes (4-bit ones may index IQ4's grid, the one codebook it
    knows), whole tiles of 16 output columns."""
    blocks = q.block_size == BLOCK or (q.block_size == 16 and q.codebook is None
                                       and k_tables(q) is not None)
    return (blocks and code_bits(q) in (4, 5, 6, 8) and q.k % BLOCK == 0 and q.n % LANES == 0
            and (q.codebook is None or np.array_equal(q.codebook, IQ4_CODES)))


def tiled_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [N, K] (one byte each, below 2**bits) -> the kernel's layout (blockq.h), flat
    uint8."""
    n, k = codes.shape
    tiles = codes.reshape(n // LANES, LANES, k // BLOCK, 8, 4).transpose(0, 2, 3, 1, 4)
    if bits == 8:
        return np.ascontiguousarray(tiles, dtype=np.uint8).reshape(-1)
    # groups 2h in the low nibbles, 2h + 1 in the high ones; then a bit plane per bit above 4
    pairs = (tiles & 0x0F).reshape(n // LANES, k // BLOCK, 4, 2, LANES, 4)
    parts = [(pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n // LANES, k // BLOCK, -1)]
    for p in range(bits - 4):
        bit = ((tiles >> (4 + p)) & 1).reshape(n // LANES, k // BLOCK, 8, -1)
        parts.append(np.packbits(bit, axis=-1, bitorder="little").reshape(
            n // LANES, k // BLOCK, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1), dtype=np.uint8).reshape(-1)


def untiled_codes(tiles: np.ndarray, k: int, bits: int) -> np.ndarray:
    """tiled_codes' inverse: the codes [N, K], one byte each."""
    n, nb = tiles.size * 8 // bits // k, k // BLOCK
    blocks = tiles.reshape(n // LANES, nb, -1)
    if bits == 8:
        groups = blocks.reshape(n // LANES, nb, 8, LANES, 4)
    else:  # undo the nibble pairing (groups 2h, 2h + 1), then add the planes' bits
        pairs = blocks[..., :PLANES_AT].reshape(n // LANES, nb, 4, 1, LANES, 4)
        groups = np.concatenate([pairs & 0x0F, pairs >> 4], axis=3).reshape(
            n // LANES, nb, 8, LANES, 4)
        for p in range(bits - 4):
            at = PLANES_AT + 64 * p
            plane = blocks[..., at:at + 64].reshape(n // LANES, nb, 8, 8)
            bit = np.unpackbits(plane, axis=-1, bitorder="little")
            groups = groups | (bit.reshape(groups.shape) << (4 + p))
    return groups.transpose(0, 3, 1, 2, 4).reshape(n, k)


def kept_rows(codes: np.ndarray, k: int, bits: int, rows: np.ndarray,
              *tables: np.ndarray) -> tuple[np.ndarray, ...]:
    """A linear's codes and per-lane tables in the kernel's layout (flat, as the op reads
    them: scales and offsets, and a K-quant op's sub-block ones) keeping only output
    `rows`, padded with zero rows to whole tiles (their outputs are 0): for re-trimming an
    exported head without the source weights."""
    rows_k = untiled_codes(codes, k, bits)
    n = len(rows_k)
    pad = -len(rows) % LANES

    def kept(table: np.ndarray) -> np.ndarray:
        per_row = table.reshape(n, -1)[rows]
        return np.concatenate([per_row, np.zeros((pad, per_row.shape[1]), per_row.dtype)])

    def table(values: np.ndarray) -> np.ndarray:  # [N/16, per tile, 16]
        per = values.size // n
        return lane_tiled(kept(values.reshape(n // LANES, per, LANES).transpose(0, 2, 1)))

    return (tiled_codes(kept(rows_k), bits), *(table(t) for t in tables))


def lane_tiled(values: np.ndarray) -> np.ndarray:
    """Per-row values [N, X] -> the kernel's per-lane layout [N/16, X, 16], flat."""
    n, per = values.shape
    return np.ascontiguousarray(values.reshape(n // LANES, LANES, per).transpose(0, 2, 1)
                                ).reshape(-1)


def _tiled(g: GraphBuilder, per_block: str, q: QuantizedWeight, name: str) -> str:
    """Per-block floats [N * nb] (row-major) -> the kernel's layout [N/16 * nb * 16]."""
    nb = q.k // BLOCK
    grid = g.node("Reshape", [per_block, g.const(f"tiles.{q.n}x{nb}", np.array(
        [q.n // LANES, LANES, nb], np.int64))], [f"{name}.grid"], f"{name}.grid")[0]
    turned = g.node("Transpose", [grid], [f"{name}.turned"], f"{name}.turned",
                    perm=[0, 2, 1])[0]
    return g.node("Reshape", [turned, g.const("i64.flat", np.array([-1], np.int64))],
                  [f"{name}.tiled"], f"{name}.tiled")[0]


def _zero(g: GraphBuilder, q: QuantizedWeight, store: str) -> str:
    """The zero points as float32: one scalar where every block has the same."""
    z = q.zero_points.reshape(-1)
    if np.all(z == z[0]):
        return g.const(f"zero.{z[0]}.f", np.array(z[0], np.float32))
    return g.const(f"{store}.zero.f", z.astype(np.float32))


def _values(q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scales and offsets [N * nb] the graph computes at session load."""
    scales = q.scales.astype(np.float32)
    shift = scales * q.zero_points.reshape(-1).astype(np.float32)
    mins = np.float32(0) if q.mins is None else q.mins.astype(np.float32)
    return scales, (mins - shift).astype(np.float32)


def halves(q: QuantizedWeight) -> bool:
    """Whether every scale and offset is exactly a float16 (GGUF's Q4_0, Q4_1, Q5_*, Q8_0
    are; Q4_K's d·sc products mostly not): then the kernel reads them at half the bytes."""
    return all(np.array_equal(v.astype(np.float16).astype(np.float32), v)
               for v in _values(q))


def _codes(g: GraphBuilder, q: QuantizedWeight, store: str) -> str:
    """The kernel's tiled codes for `q`."""
    codes = unpack_rows(q.packed, q.bits).reshape(q.n, -1)[:, :q.k]
    return g.const(f"{store}.tiles", tiled_codes(codes, code_bits(q)))


def _block_tables(g: GraphBuilder, q: QuantizedWeight, store: str) -> tuple[str, str, bool]:
    """Per-block scales and offsets in the kernel's layout, and whether they are float16."""
    half = halves(q)

    def flat_scales() -> str:
        return g.rebuilt32(store, "scales", q) if "scales" in (q.stored or {}) else \
            g.const(f"{store}.scales.f32", q.scales.astype(np.float32))

    def table(values: str, name: str) -> str:
        tiled = _tiled(g, values, q, name)
        if not half:
            return tiled
        return g.node("Cast", [tiled], [f"{name}.half"], f"{name}.half",
                      to=TensorProto.FLOAT16)[0]

    def offsets() -> str:
        scales = flat_scales()
        shift = g.node("Mul", [scales, _zero(g, q, store)], [f"{store}.zs"], f"{store}.zs")[0]
        if q.mins is None:
            off = g.node("Neg", [shift], [f"{store}.off"], f"{store}.off")[0]
        else:
            mins = g.rebuilt32(store, "mins", q) if "mins" in (q.stored or {}) else \
                g.const(f"{store}.mins.f32", q.mins.astype(np.float32))
            off = g.node("Sub", [mins, shift], [f"{store}.off"], f"{store}.off")[0]
        return table(off, f"{store}.offsets")

    return (g.once(f"{store}.tiled_scales", lambda: table(flat_scales(), f"{store}.scales")),
            g.once(f"{store}.tiled_offsets", offsets), half)


def _tables(g: GraphBuilder, q: QuantizedWeight, store: str) -> tuple[list[str], str]:
    """The op's inputs after X for `q` (made once per `store`) and the op that takes them."""
    codes = g.once(f"{store}.tiles", lambda: _codes(g, q, store))
    tables = k_tables(q)
    if tables is None:
        scales, offsets, half = _block_tables(g, q, store)
        return [codes, scales, offsets], "BlockQMatMulHalf" if half else "BlockQMatMul"
    names = []
    for kind, values in zip(("scales", "offsets", "sub_scales", "sub_offsets"), tables,
                            strict=True):
        if kind == "sub_offsets" and np.array_equal(values, tables[2]):
            names.append(names[2])  # μ = σ: the one table read twice
            continue
        key = f"{store}.k.{kind}"
        names.append(g.once(key, lambda key=key, values=values: g.const(key, lane_tiled(values))))
    return [codes, *names], "BlockQMatMulK"


def linear(g: GraphBuilder, x: str, q: QuantizedWeight, name: str, store: str,
           gated: bool = False) -> str:
    """y = x @ wᵀ on the own kernel; `gated`: x is [gate, up] and y = (silu(gate)·up) @ wᵀ."""
    tables, op = _tables(g, q, store)
    return g.node(op, [x, *tables], [f"{name}.out"], name, domain=DOMAIN, K=q.k, N=q.n,
                  bits=code_bits(q), **({"gated": 1} if gated else {}),
                  **({"codebook": 1} if q.codebook is not None else {}),
                  **({"sub": q.block_size} if op == "BlockQMatMulK" else {}))[0]


def _op(g: GraphBuilder, store: str, kind: str, inputs: list[str], out: str, **attrs) -> str:
    return g.node(kind, inputs, [f"{store}.g.{out}"], f"{store}.g.{out}", **attrs)[0]


def _i64(g: GraphBuilder, key: str, value: int) -> str:
    return g.const(f"gq.{key}.{value}", np.array(value, np.int64))


def lane_codes(g: GraphBuilder, codes: str, ids: str, k: int, bits: int,
               store: str) -> tuple[str, str, str]:
    """The bytes of rows `ids` of tiled codes (row n is lane n % 16 of tile n // 16): uint8
    [1, S, units, 4], 4 bytes of each 64-byte unit of its tile (a group of 8-bit codes, or
    two in nibbles), and the rows' tiles and lanes."""
    nb, i64 = k // BLOCK, np.int64
    units = 8 if bits == 8 else 4  # 16 x 4 bytes each: one group, or two in nibbles
    block_bytes = 64 * bits
    tile = _op(g, store, "Div", [ids, _i64(g, "lanes", LANES)], "tile")
    lane = _op(g, store, "Mod", [ids, _i64(g, "lanes", LANES)], "lane")
    tile_at = _op(g, store, "Mul", [tile, _i64(g, "tile_bytes", nb * block_bytes)], "tile_at")
    # the row's 4 bytes in every unit of its tile (byte indices into the flat codes: a
    # Reshape of them to rows of 4 would be folded at session load into a copy of the whole
    # table, 160 MB for Gemma 3's head)
    unit_at = (np.arange(nb)[:, None] * block_bytes + np.arange(units) * 64).reshape(-1)
    four_bytes = (unit_at[:, None] + np.arange(4)).reshape(-1).astype(i64)
    base = _op(g, store, "Add", [tile_at, _op(g, store, "Mul", [lane, _i64(g, "four", 4)],
                                              "lane4")], "codes.base")
    base = _op(g, store, "Unsqueeze", [base, g.const("i64.last", np.array([-1], i64))],
               "codes.bu")
    at = _op(g, store, "Add", [base, g.const(f"gq.codes.{nb}.{bits}", four_bytes)], "codes.at")
    got = _op(g, store, "Gather", [codes, at], "codes")
    return _op(g, store, "Reshape", [got, g.const(f"gq.units.{nb * units}", np.array(
        [1, -1, nb * units, 4], i64))], "units"), tile, lane


def gather_rows(g: GraphBuilder, q: QuantizedWeight, ids: str, store: str) -> str:
    """Embedding rows [1, S, K] read from a tied head's tiled codes (stored once): row n
    is lane n % 16 of tile n // 16, s·u + o per block (or sub-block: s = D·σ, o = M·μ)."""
    (codes, *tables), kind = _tables(g, q, store)
    nb, i64, bits = q.k // BLOCK, np.int64, code_bits(q)
    block_bytes = 64 * bits

    def const(key: str, value: int) -> str:
        return _i64(g, key, value)

    def op(kind: str, inputs: list[str], out: str, **attrs) -> str:
        return _op(g, store, kind, inputs, out, **attrs)

    def u8(key: str, value) -> str:
        return g.const(f"gq.u8.{key}", np.array(value, np.uint8))

    got, tile, lane = lane_codes(g, codes, ids, q.k, bits, store)
    last = g.const("i64.last", np.array([-1], i64))
    tile_at = f"{store}.g.tile_at"

    def bytes_at(lane_at: str, steps: np.ndarray, key: str) -> str:
        """The bytes at tile_at + lane_at + each of `steps` (a byte offset within a tile)."""
        base = op("Unsqueeze", [op("Add", [tile_at, lane_at], f"{key}.base"), last], f"{key}.bu")
        return op("Gather", [codes, op("Add", [base, g.const(f"gq.{key}.{nb}.{bits}", steps)],
                                       f"{key}.at")], key)

    if bits != 8:  # group 2h in the low nibbles, 2h + 1 in the high ones
        two = g.const("i64.minus2", np.array([-2], i64))
        low = op("BitwiseAnd", [got, u8("15", 15)], "low")
        high = op("BitShift", [got, u8("4", 4)], "high", direction="RIGHT")
        got = op("Concat", [op("Unsqueeze", [low, two], "lowu"),
                            op("Unsqueeze", [high, two], "highu")], "pairs", axis=-2)
    planes = bits - 4 if bits != 8 else 0
    if planes:  # 5 and 6 bits: lanes 2c and 2c + 1 share a byte of a plane, 4 bits each
        pair = op("Div", [lane, const("two", 2)], "lane2")
        odd = op("Unsqueeze", [op("Cast", [op("Mul", [op("Mod", [lane, const("two", 2)], "odd"),
                                                      const("four", 4)], "odd4")], "odd8",
                                  to=TensorProto.UINT8), last], "oddu")
    for p in range(planes):  # plane p's byte in every group, its bit j for input j
        plane_at = (np.arange(nb)[:, None] * block_bytes + PLANES_AT
                    + (p * 8 + np.arange(8)) * 8)
        byte = bytes_at(pair, plane_at.reshape(-1).astype(i64), f"plane{p}")  # [1, S, nb * 8]
        nibble = op("BitShift", [byte, odd], f"plane{p}.n", direction="RIGHT")
        bit = op("BitwiseAnd", [op("BitShift", [op("Unsqueeze", [nibble, last], f"plane{p}.u"),
                                                u8("0123", np.arange(4))], f"plane{p}.s",
                                   direction="RIGHT"), u8("1", 1)], f"plane{p}.b")
        bit = op("BitShift", [op("Reshape", [bit, g.const(f"gq.pairs.{nb}", np.array(
            [1, -1, nb * 4, 2, 4], i64))], f"plane{p}.r"), u8(str(4 + p), 4 + p)],
                 f"plane{p}.h", direction="LEFT")
        got = op("BitwiseOr", [got, bit], f"with{p}")
    if q.codebook is not None:  # indices -> the codes they stand for
        index = op("Cast", [got], "book.i", to=TensorProto.INT32)
        got = op("Gather", [g.const("codebook", q.codebook), index], "book")
    block = q.block_size if kind == "BlockQMatMulK" else BLOCK
    nblocks = q.k // block
    values = op("Cast", [op("Reshape", [got, g.const(f"blocks.{nblocks}x{block}", np.array(
        [1, -1, nblocks, block], i64))], "grid")], "values", to=TensorProto.FLOAT)

    def lanes(table: str, per_tile: int, key: str) -> str:
        """Lane n % 16 of the row's tile in a per-lane table: [1, S, per_tile] float."""
        start = op("Add", [op("Mul", [tile, const("fstep", per_tile * LANES)], f"{key}.0"),
                           lane], f"{key}.base")
        at = op("Add", [op("Unsqueeze", [start, last], f"{key}.bu"), g.const(
            f"gq.fsteps.{per_tile}", np.arange(per_tile, dtype=i64) * LANES)], f"{key}.at")
        got = op("Gather", [table, at], key)
        if kind == "BlockQMatMul":  # float32 tables already
            return got
        return op("Cast", [got], f"{key}.f", to=TensorProto.FLOAT)

    def per_block(at: int, key: str) -> str:
        """Each block's (or sub-block's) scale or offset: [1, S, blocks, 1]."""
        if kind != "BlockQMatMulK":
            got = lanes(tables[at], nb, key)
        else:  # D or M per super-block times σ or μ per sub-block
            supers, per = q.k // SUPER, SUPER // block
            big = op("Unsqueeze", [lanes(tables[at], supers, f"{key}.D"), last], f"{key}.Du")
            small = op("Reshape", [lanes(tables[at + 2], nblocks, f"{key}.sub"), g.const(
                f"gq.supers.{supers}x{per}", np.array([1, -1, supers, per], i64))], f"{key}.sg")
            got = op("Reshape", [op("Mul", [big, small], f"{key}.prod"), g.const(
                f"gq.blocks.{nblocks}", np.array([1, -1, nblocks], i64))], f"{key}.flat")
        return op("Unsqueeze", [got, last], f"{key}.u")

    w = op("Add", [op("Mul", [values, per_block(0, "s")], "scaled"), per_block(1, "o")], "w")
    return op("Reshape", [w, g.const(f"gq.rows.{q.k}", np.array([1, -1, q.k], i64))], "out")
