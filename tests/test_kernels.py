"""edgespec's own CPU kernel (edgespec/kernels: edgespec.BlockQMatMul through ONNX Runtime).

Oracles: numpy's float64 product of the dequantized weights and the int8-quantized
activations (quantized by numpy the way the kernel documents it), the kernel's portable C
path (bitwise equal to the AVX-512 VNNI one), and the kernel's own one-row results, which
every row of a longer pass must equal bitwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgespec import kernels
from edgespec.export.blockq_ops import kept_rows, lane_tiled, tiled_codes


def weights(n: int, k: int, bits: int, seed: int = 0):
    """Random codes [N, K], per-block scales and offsets [N, K/32], and w = s·u + o."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2 ** bits, (n, k), dtype=np.uint8)
    # float16 values, so the same tables serve both ops (BlockQMatMulHalf reads float16)
    s = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    o = (-s * 2 ** (bits - 1) * rng.random((n, k // 32))).astype(np.float16).astype(np.float32)
    w = u.reshape(n, -1, 32) * s[..., None].astype(np.float64) + o[..., None]
    return u, s, o, w.reshape(n, k)


def session(u, s, o, bits, threads: int = 2, half: bool = False,
            codebook: bool = False) -> ort.InferenceSession:
    """One BlockQMatMul (BlockQMatMulHalf with `half`: float16 scales and offsets)."""
    dtype = np.float16 if half else np.float32
    return session_of(tiled_codes(u, bits), lane_tiled(s).astype(dtype),
                      lane_tiled(o).astype(dtype), u.shape[1], bits, threads, codebook=codebook)


def session_of(codes, scales, offsets, k: int, bits: int, threads: int = 2,
               gated: bool = False, codebook: bool = False) -> ort.InferenceSession:
    """One op over tables already in the kernel's flat layout (float16 ones: the Half op);
    `gated`: x is [gate, up], 2K wide; `codebook`: 4-bit codes index IQ4's grid."""
    n, half = scales.size * 32 // k, scales.dtype == np.float16
    kind = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    consts = [helper.make_tensor("codes", TensorProto.UINT8, [codes.size], codes.tobytes(),
                                 raw=True),
              helper.make_tensor("scales", kind, [scales.size], scales.tobytes(), raw=True),
              helper.make_tensor("offsets", kind, [offsets.size], offsets.tobytes(), raw=True)]
    node = helper.make_node("BlockQMatMulHalf" if half else "BlockQMatMul",
                            ["x", "codes", "scales", "offsets"], ["y"],
                            domain=kernels.DOMAIN, K=k, N=n, bits=bits, gated=int(gated),
                            codebook=int(codebook))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, "S", "W"])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, "S", n])], initializer=consts)
    return kernels.op_session(graph, threads)


def quantized(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the kernel sees it: int8 per row and block of 32, scale max|x|/127."""
    blocks = x.reshape(len(x), -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(blocks * inv), -127, 127)
    return (q * d.astype(np.float64)).reshape(x.shape)


def every_path() -> Iterator[tuple[ctypes.CDLL, int]]:
    """The library ONNX Runtime loaded, limited in turn to each kernel path this CPU runs
    (portable C, AVX2, AVX-512 VNNI), and unlimited again afterwards."""
    lib = ctypes.CDLL(str(kernels.library()))
    try:
        for path in range(kernels.path() + 1):
            lib.blockq_limit_path(path)
            yield lib, path
    finally:
        lib.blockq_limit_path(-1)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_product_is_the_dequantized_one(bits, threads):
    u, s, o, w = weights(208, 576, bits)
    x = np.random.default_rng(1).standard_normal((1, 17, 576)).astype(np.float32)
    y = session(u, s, o, bits, threads).run(None, {"x": x})[0]
    exact = quantized(x[0]) @ w.T
    assert y.shape == (1, 17, 208)
    assert np.abs(y[0] - exact).max() < 2e-6 * np.abs(exact).max()
    # and the activations' int8 error is what it should be against the float product
    assert np.abs(y[0] - x[0] @ w.T).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_every_row_is_bitwise_its_one_row_pass(bits):
    u, s, o, _ = weights(96, 1536, bits, seed=2)
    x = np.random.default_rng(3).standard_normal((1, 17, 1536)).astype(np.float32)
    for threads in (1, 2):
        run = session(u, s, o, bits, threads)
        alone = np.concatenate([run.run(None, {"x": x[:, i:i + 1]})[0] for i in range(17)], 1)
        for rows in (2, 5, 7, 13, 17):
            assert np.array_equal(run.run(None, {"x": x[:, :rows]})[0], alone[:, :rows])
        if threads == 1:
            one_thread = alone
    assert np.array_equal(alone, one_thread)  # nor does the split among threads matter


def test_a_pass_beyond_the_kept_scratch_gives_the_rows_of_short_passes():
    """3,000 rows of 1,536 need more than the 4 MB a thread keeps for an op's buffers, so
    the op takes its own for that call: each row equals its row in passes of 17 (which use
    the kept buffer, before and after it)."""
    u, s, o, w = weights(32, 1536, 8, seed=4)
    x = np.random.default_rng(5).standard_normal((1, 3000, 1536)).astype(np.float32)
    run = session(u, s, o, 8)
    before = run.run(None, {"x": x[:, :17]})[0]
    whole = run.run(None, {"x": x})[0]
    after = np.concatenate([run.run(None, {"x": x[:, i:i + 17]})[0]
                            for i in range(0, 3000, 17)], 1)
    assert np.array_equal(whole, after)
    assert np.array_equal(before, after[:, :17])
    exact = quantized(x[0, :100]) @ w.T
    assert np.abs(whole[0, :100] - exact).max() < 2e-6 * np.abs(exact).max()


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_every_kernel_path_and_table_type_gives_the_same_bits(bits):
    """The portable C kernel (any CPU), the AVX2 one and the AVX-512 VNNI one give the same
    results bit for bit, for whichever of them this CPU runs (the test host: all three),
    from float32 tables and from float16 ones holding the same values."""
    u, s, o, _ = weights(64, 512, bits, seed=4)
    x = np.random.default_rng(5).standard_normal((1, 9, 512)).astype(np.float32)
    x[0, 3, :32] = 0  # a zero block
    results = {}
    for half in (False, True):
        run = session(u, s, o, bits, half=half)
        for _, path in every_path():
            results[half, path] = run.run(None, {"x": x})[0]
    for got in results.values():
        assert np.array_equal(got, results[False, 0])


@pytest.mark.parametrize("half", [False, True])
def test_codebook_indices_multiply_as_the_codes_they_stand_for(half):
    """4-bit indices into IQ4's grid (GGUF's IQ4_NL/IQ4_XS) give bitwise what the 8-bit
    codes they stand for give, on every kernel path, which is numpy's product of the
    looked-up weights; every row is its one-row pass."""
    from edgespec.quant.blockwise import IQ4_CODES

    index, s, _, _ = weights(64, 512, 4, seed=6)
    o = -128 * s  # zero point 128 (float16 exactly)
    codes = IQ4_CODES[index]
    w = codes.reshape(64, -1, 32) * s[..., None].astype(np.float64) + o[..., None]
    x = np.random.default_rng(7).standard_normal((1, 9, 512)).astype(np.float32)
    wide = session(codes, s, o, 8, half=half).run(None, {"x": x})[0]
    run = session(index, s, o, 4, half=half, codebook=True)
    for _, path in every_path():
        assert np.array_equal(run.run(None, {"x": x})[0], wide), path
    exact = quantized(x[0]) @ w.reshape(64, 512).T
    assert np.abs(wide[0] - exact).max() < 2e-6 * np.abs(exact).max()
    alone = np.concatenate([run.run(None, {"x": x[:, i:i + 1]})[0] for i in range(9)], 1)
    assert np.array_equal(alone, wide)
    with pytest.raises(Exception, match="codebook must be 0, or 1 with bits 4"):
        session(codes, s, o, 8, codebook=True)


def test_bad_shapes_are_refused_with_the_reason():
    u, s, o, _ = weights(32, 64, 8)
    with pytest.raises(Exception, match="BlockQMatMul"):
        session(u, s, o, 8).run(None, {"x": np.zeros((1, 2, 32), np.float32)})
    with pytest.raises(Exception, match="bits must be 4, 5, 6 or 8, got 7"):
        session_of(tiled_codes(u, 8), lane_tiled(s), lane_tiled(o), 64, 7)
    with pytest.raises(Exception, match="codes has 2048 elements, expected N\\*K\\*bits/8"):
        session_of(tiled_codes(u, 8), lane_tiled(s), lane_tiled(o), 64, 6).run(
            None, {"x": np.zeros((1, 1, 64), np.float32)})


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("half", [False, True])
def test_kept_rows_of_the_tables_give_those_rows_outputs(bits, half):
    """Re-trimming an exported head slices the kernel's tables: the kept rows' outputs are
    bitwise the full op's, in the chosen order; the padding to a whole tile gives 0."""
    u, s, o, _ = weights(96, 256, bits, seed=6)
    dtype = np.float16 if half else np.float32
    tables = tiled_codes(u, bits), lane_tiled(s).astype(dtype), lane_tiled(o).astype(dtype)
    rows = np.random.default_rng(7).choice(96, 37, replace=False)
    kept = kept_rows(tables[0], 256, bits, rows, *tables[1:])
    assert kept[1].dtype == dtype and kept[1].size == 48 * 256 // 32
    x = np.random.default_rng(8).standard_normal((1, 5, 256)).astype(np.float32)
    full = session_of(*tables, 256, bits).run(None, {"x": x})[0]
    got = session_of(*kept, 256, bits).run(None, {"x": x})[0]
    assert np.array_equal(got[..., :37], full[..., rows])
    assert not got[..., 37:].any()


class Rows(ctypes.Structure):
    """blockq.h's BlockqRows."""
    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("sum", ctypes.c_void_p),
                ("isum", ctypes.c_void_p), ("M", ctypes.c_int64), ("K", ctypes.c_int64),
                ("sum16", ctypes.c_void_p), ("isum16", ctypes.c_void_p),
                ("rowwise", ctypes.c_int)]


def test_activation_codes_are_numpys_on_every_path():
    """The activations' int8 codes, scales and code sums on each path against numpy's
    (round half to even), with exact ties (peak 127: codes are x itself), clamping and a
    zero block; stored block-major (blockq.h)."""
    x = np.random.default_rng(9).standard_normal((3, 96)).astype(np.float32)
    x[0, :32] = np.arange(-16, 16) + 0.5
    x[0, 0] = 127
    x[1, 32:64] = 0
    blocks = x.reshape(3, 3, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    codes = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    assert (codes[0, 0, 1:] == np.rint(x[0, 1:32])).all()  # the ties are in the oracle
    halves = codes.reshape(3, 3, 2, 16).sum(-1, dtype=np.int32).transpose(1, 0, 2)
    for lib, _ in every_path():
        q, got_d = np.zeros((3, 3, 32), np.int8), np.zeros((3, 3), np.float32)
        got_sum, isum = np.zeros_like(got_d), np.zeros((3, 3), np.int32)
        sum16, isum16 = np.zeros((3, 3, 2), np.float32), np.zeros((3, 3, 2), np.int32)
        rows = Rows(q.ctypes.data, got_d.ctypes.data, got_sum.ctypes.data,
                    isum.ctypes.data, 3, 96, sum16.ctypes.data, isum16.ctypes.data, 0)
        lib.blockq_quantize_rows(ctypes.c_void_p(x.ctypes.data), ctypes.byref(rows))
        assert np.array_equal(q, codes.transpose(1, 0, 2)) and np.array_equal(got_d, d.T)
        assert np.array_equal(isum, codes.sum(-1, dtype=np.int32).T)
        assert np.array_equal(got_sum, d.T * isum.astype(np.float32))
        assert np.array_equal(isum16, halves)  # each half block's, for sub-blocks of 16
        assert np.array_equal(sum16, d.T[..., None] * halves.astype(np.float32))


def silu_mul(x: np.ndarray) -> np.ndarray:
    """numpy's silu(gate) * up in float64, x = [gate, up] on the last axis."""
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


def test_gated_activation_is_silu_times_up_on_every_path():
    """blockq_silu_mul (the gated op's input) against numpy's float64 silu · up, within a
    few float32 roundings, over the whole range (large |gate| saturates, no inf or NaN),
    and bitwise the same on every path."""
    gate = np.concatenate([np.linspace(-120, 120, 2048), np.random.default_rng(10)
                           .standard_normal(2048) * 4]).astype(np.float32)
    up = np.random.default_rng(11).standard_normal(gate.size).astype(np.float32)
    x = np.concatenate([gate.reshape(8, -1), up.reshape(8, -1)], axis=1)  # [8, 2 * 512]
    want = silu_mul(x)
    got = {}
    for lib, path in every_path():
        out = np.zeros((8, 512), np.float32)
        lib.blockq_silu_mul(ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(8),
                            ctypes.c_int64(512), ctypes.c_void_p(out.ctypes.data))
        got[path] = out
    assert np.isfinite(got[0]).all()
    assert (np.abs(got[0] - want) <= 4e-7 * np.abs(want) + 1e-35).all()  # gate < -87: ~0
    for out in got.values():
        assert np.array_equal(out, got[0])


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_gated_product_is_the_dequantized_one_and_row_invariant(bits):
    """The gated op = the product of the dequantized weight and the int8-quantized
    silu(gate) · up (numpy's), and every row is bitwise its one-row result."""
    u, s, o, w = weights(64, 256, bits, seed=12)
    x = (np.random.default_rng(13).standard_normal((1, 9, 512)) * 3).astype(np.float32)
    dtype = np.float16
    run = session_of(tiled_codes(u, bits), lane_tiled(s).astype(dtype),
                     lane_tiled(o).astype(dtype),
                     256, bits, gated=True)
    y = run.run(None, {"x": x})[0]
    act = silu_mul(x[0]).astype(np.float32)
    exact = quantized(act) @ w.T
    # an activation a rounding away from numpy's may quantize to the neighbouring code
    assert np.abs(y[0] - exact).max() < 1e-3 * np.abs(exact).max()
    assert np.abs(y[0] - act @ w.T).max() < 0.02 * np.abs(exact).max()
    alone = np.concatenate([run.run(None, {"x": x[:, i:i + 1]})[0] for i in range(9)], 1)
    assert np.array_equal(y, alone)


def k_weights(n: int, k: int, bits: int, sub: int, seed: int = 0, same: bool = False):
    """Random codes and K-quant tables (blockq.h): D, M float16 per super-block of 256,
    σ, μ int8 per sub-block (`same`: μ = σ, a zero point), and w = D·σ·u + M·μ."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2 ** bits, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // 256)) * 1e-3 + 1e-4).astype(np.float16)
    m = (-d.astype(np.float32) * 2 ** (bits - 1)).astype(np.float16)
    sigma = rng.integers(-64, 64, (n, k // sub), dtype=np.int8)
    mu = sigma if same else rng.integers(0, 64, (n, k // sub), dtype=np.int8)
    per = 256 // sub

    def grid(big: np.ndarray, small: np.ndarray) -> np.ndarray:
        return (np.repeat(big.astype(np.float64), per, axis=1) * small)[..., None]

    w = u.reshape(n, -1, sub) * grid(d, sigma) + grid(m, mu)
    return u, (d, m, sigma, mu), w.reshape(n, k)


def k_session(u, tables, bits: int, sub: int, threads: int = 2) -> ort.InferenceSession:
    """One BlockQMatMulK over codes [N, K] and K-quant tables (k_weights)."""
    return k_session_of(tiled_codes(u, bits), [lane_tiled(t) for t in tables], u.shape[1],
                        bits, sub, threads)


def k_session_of(codes, tables, k: int, bits: int, sub: int,
                 threads: int = 2) -> ort.InferenceSession:
    """One BlockQMatMulK over tables already in the kernel's flat layout."""
    n = codes.size * 8 // bits // k
    kinds = (TensorProto.FLOAT16, TensorProto.FLOAT16, TensorProto.INT8, TensorProto.INT8)
    names = ("scales", "offsets", "sub_scales", "sub_offsets")
    consts = [helper.make_tensor("codes", TensorProto.UINT8, [codes.size], codes.tobytes(),
                                 raw=True)]
    for name, kind, flat in zip(names, kinds, tables, strict=True):
        consts.append(helper.make_tensor(name, kind, [flat.size], flat.tobytes(), raw=True))
    node = helper.make_node("BlockQMatMulK", ["x", "codes", *names], ["y"],
                            domain=kernels.DOMAIN, K=k, N=n, bits=bits, sub=sub)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, "S", k])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, "S", n])], initializer=consts)
    return kernels.op_session(graph, threads)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("sub", [16, 32])
def test_k_quant_tables_give_the_dequantized_product_on_every_path(bits, sub):
    """BlockQMatMulK (GGUF's K-quants, kept at their size): numpy's product of D·σ·u + M·μ
    and the int8-quantized activations; every path, thread count and row bitwise the same
    as the portable one-row result."""
    u, tables, w = k_weights(80, 768, bits, sub, seed=14)
    x = np.random.default_rng(15).standard_normal((1, 17, 768)).astype(np.float32)
    x[0, 4, 16:48] = 0  # a zero block, and halves of blocks
    results = []
    for threads in (1, 2):
        run = k_session(u, tables, bits, sub, threads)
        for _, path in every_path():
            results.append(run.run(None, {"x": x})[0])
            alone = np.concatenate([run.run(None, {"x": x[:, i:i + 1]})[0]
                                    for i in range(17)], 1)
            assert np.array_equal(results[-1], alone), (threads, path)
    for got in results:
        assert np.array_equal(got, results[0])
    exact = quantized(x[0]) @ w.T
    assert np.abs(results[0][0] - exact).max() < 2e-6 * np.abs(exact).max()


def test_k_quant_tables_in_blocks_of_32_are_bitwise_the_per_block_float_ones():
    """Sub-blocks of 32 form each block's scale D·σ and offset M·μ exactly, so the K op
    gives bitwise what the per-block op gives from float32 tables of those products."""
    u, (d, m, sigma, mu), _ = k_weights(64, 512, 4, 32, seed=16)

    def per_block(big: np.ndarray, small: np.ndarray) -> np.ndarray:
        return np.repeat(big.astype(np.float32), 8, axis=1) * small.astype(np.float32)

    x = np.random.default_rng(17).standard_normal((1, 5, 512)).astype(np.float32)
    want = session(u, per_block(d, sigma), per_block(m, mu), 4).run(None, {"x": x})[0]
    got = k_session(u, (d, m, sigma, mu), 4, 32).run(None, {"x": x})[0]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bits", [6, 8])
def test_kept_rows_of_k_quant_tables_give_those_rows_outputs(bits):
    """Re-trimming a head in K-quant tables keeps the rows of its codes and of all four
    tables, bitwise the full op's outputs in the chosen order (6 bits: GGUF's Q6_K head)."""
    u, tables, _ = k_weights(96, 512, bits, 16, seed=18)
    flat = [lane_tiled(t) for t in tables]
    rows = np.random.default_rng(19).choice(96, 37, replace=False)
    codes, *kept = kept_rows(tiled_codes(u, bits), 512, bits, rows, *flat)
    assert [t.dtype for t in kept] == [t.dtype for t in flat]
    x = np.random.default_rng(20).standard_normal((1, 3, 512)).astype(np.float32)
    full = k_session(u, tables, bits, 16).run(None, {"x": x})[0]
    got = k_session_of(codes, kept, 512, bits, 16).run(None, {"x": x})[0]
    assert np.array_equal(got[..., :37], full[..., rows])
    assert not got[..., 37:].any()


def test_k_quant_tables_are_refused_where_they_cannot_be():
    u, tables, _ = k_weights(32, 256, 4, 16)
    with pytest.raises(Exception, match="sub must be 16 or 32"):
        k_session(u, tables, 4, 64)
    u, tables, _ = k_weights(32, 256, 4, 16)
    short = (tables[0], tables[1], tables[2][:, :8], tables[3][:, :8])
    with pytest.raises(Exception, match="sub_scales has 256 elements, expected N\\*K/sub"):
        k_session(u, short, 4, 16).run(None, {"x": np.zeros((1, 1, 256), np.float32)})


def row_product(u: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy's RowQMatMul, bit for bit: each row coded by its own peak (d = peak / 127,
    codes rint(x / d) in float32), the exact integer sums of (u - 128) times the codes, and
    float32(I) * (s[n] * d[m])."""
    d = np.abs(x).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(x * inv), -127, 127).astype(np.int64)
    exact = q @ (u.astype(np.int64) - 128).T
    return exact.astype(np.float32) * (s[None, :] * d)


@pytest.mark.parametrize("k", [1536, 96])
def test_row_product_is_numpys_bit_for_bit_on_every_path(k):
    """The row-wise op against row_product exactly, on every kernel path this CPU has
    (AMX tiles for passes of 8 rows or more where it has them, taking pairs of blocks
    where K allows, K = 1536, else one: K = 96; two row groups from 17 rows), for 1 to 40
    rows, one or two threads, a zero row and codes at both ends (1 and 255)."""
    rng = np.random.default_rng(11)
    u = rng.integers(1, 256, (80, k), dtype=np.uint8)
    u[:, :32] = 1
    u[:, 32:64] = 255
    s = (rng.random(80) * 0.01 + 1e-4).astype(np.float32)
    x = rng.standard_normal((1, 40, k)).astype(np.float32)
    x[0, 3] = 0
    x[0, 5, :64] = 100  # the peak in the codes' extreme columns: large exact sums
    want = row_product(u, s, x[0])
    for _, path in every_path():
        for threads in (1, 2):
            run = row_session(u, s, threads)
            for rows in (1, 2, 5, 8, 16, 17, 23, 33, 40):
                got = run.run(None, {"x": x[:, :rows]})[0][0]
                assert np.array_equal(got, want[:rows]), (path, threads, rows)


def test_row_product_is_the_float_product_within_int8_error():
    """Against the float product of the weights w = (u - 128) s and x: the activations'
    per-row int8 rounding, and nothing more."""
    rng = np.random.default_rng(12)
    u = rng.integers(1, 256, (64, 576), dtype=np.uint8)
    s = (rng.random(64) * 0.01 + 1e-4).astype(np.float32)
    x = rng.standard_normal((1, 9, 576)).astype(np.float32)
    got = row_session(u, s).run(None, {"x": x})[0][0]
    exact = x[0].astype(np.float64) @ ((u.astype(np.float64) - 128) * s[:, None]).T
    assert np.abs(got - exact).max() < 0.01 * np.abs(exact).max()


def fwht(x: np.ndarray, b: int) -> np.ndarray:
    """numpy's blockq_hadamard: each block of b values through the butterflies (a, b) ->
    (a + b, a - b) of stage h = 1, 2, .., b/2 in turn, in float32."""
    y = x.astype(np.float32).reshape(*x.shape[:-1], -1, b).copy()
    h = 1
    while h < b:
        pairs = y.reshape(*y.shape[:-1], b // (2 * h), 2, h)
        low, high = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = low + high, low - high
        h *= 2
    return y.reshape(x.shape)


@pytest.mark.parametrize("b", [2, 8, 16, 128])
def test_hadamard_is_the_butterflies_and_sylvesters_matrix_on_every_path(b):
    """blockq_hadamard against numpy's butterflies bit for bit on every path, and against
    Sylvester's matrix times sqrt(b) (export/rotation.py's, which the graph had multiplied
    by) within float32 rounding."""
    from edgespec.export.rotation import hadamard
    x = np.random.default_rng(14).standard_normal((3, 256)).astype(np.float32)
    want = fwht(x, b)
    exact = (x.astype(np.float64).reshape(3, -1, b) @ hadamard(b) * np.sqrt(b)).reshape(3, -1)
    assert np.abs(want - exact).max() < 1e-5 * np.abs(exact).max()
    for lib, path in every_path():
        got = x.copy()
        lib.blockq_hadamard(ctypes.c_void_p(got.ctypes.data), ctypes.c_int64(3),
                            ctypes.c_int64(256), ctypes.c_int64(b))
        assert np.array_equal(got, want), path


@pytest.mark.parametrize("gated", [True, False])
def test_row_product_of_a_rotated_input_is_numpys_bit_for_bit_on_every_path(gated):
    """RowQMatMul with hadamard (a rotated down projection), on its MLP's gate-up output
    (`gated`: silu(gate) · up, the library's own, checked above against numpy) or on its
    input as it is: the block Hadamard (fwht), then row_product, exactly, on every path,
    1 to 33 rows."""
    rng = np.random.default_rng(15)
    k, b = 384, 128
    u = rng.integers(1, 256, (48, k), dtype=np.uint8)
    s = (rng.random(48) * 0.01 + 1e-4).astype(np.float32)
    x = (rng.standard_normal((1, 33, 2 * k if gated else k)) * 3).astype(np.float32)
    act = x[0]
    if gated:
        act = np.zeros((33, k), np.float32)
        ctypes.CDLL(str(kernels.library())).blockq_silu_mul(
            ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(33), ctypes.c_int64(k),
            ctypes.c_void_p(act.ctypes.data))
    want = row_product(u, s, fwht(act, b))
    for _, path in every_path():
        run = kernels.op_session(row_graph(u, s, gated=gated, hadamard=b), 2)
        for rows in (1, 5, 17, 33):
            got = run.run(None, {"x": x[:, :rows]})[0][0]
            assert np.array_equal(got, want[:rows]), (path, rows)


def row_graph(u: np.ndarray, scales: np.ndarray, gated: bool = False,
              hadamard: int = 0) -> helper.GraphProto:
    consts = [helper.make_tensor("codes", TensorProto.UINT8, [u.size],
                                 tiled_codes(u, 8).tobytes(), raw=True),
              helper.make_tensor("scales", TensorProto.FLOAT, [scales.size], scales.tobytes(),
                                 raw=True)]
    node = helper.make_node("RowQMatMul", ["x", "codes", "scales"], ["y"],
                            domain=kernels.DOMAIN, K=u.shape[1], N=u.shape[0],
                            gated=int(gated), hadamard=hadamard)
    return helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, "S", "W"])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, "S", u.shape[0]])], initializer=consts)


def row_session(u: np.ndarray, s: np.ndarray, threads: int = 2) -> ort.InferenceSession:
    """One RowQMatMul: 8-bit codes u = w + 128 [N, K] and a float scale per column."""
    return kernels.op_session(row_graph(u, s), threads)


def test_row_op_refuses_bad_inputs_with_the_reason():
    u = np.full((32, 64), 128, np.uint8)
    with pytest.raises(Exception, match="X's last dimension is 32, expected 64"):
        row_session(u, np.ones(32, np.float32)).run(None, {"x": np.zeros((1, 2, 32),
                                                                          np.float32)})
    with pytest.raises(Exception, match="scales has 16 elements, expected N = 32"):
        kernels.op_session(row_graph(u, np.ones(16, np.float32)), 2).run(
            None, {"x": np.zeros((1, 2, 64), np.float32)})
    with pytest.raises(Exception, match="hadamard must be 0, or on RowQMatMul a power of two"):
        kernels.op_session(row_graph(u, np.ones(32, np.float32), hadamard=48), 2).run(
            None, {"x": np.zeros((1, 2, 64), np.float32)})


def skip_rms(x: np.ndarray, skip: np.ndarray, gamma: np.ndarray, eps: float):
    """numpy's SkipRMSNorm bit for bit (norm.h): the sum, its squares added lane by lane
    (16 lanes, element i in lane i % 16, in order), the lanes folded by halves, then
    (sum · 1/sqrt(ss / K + eps)) · gamma, all in float32."""
    total = x + skip
    squares = total * total
    lanes = np.zeros(total.shape[:-1] + (16,), np.float32)
    for chunk in np.split(squares, total.shape[-1] // 16, axis=-1):
        lanes = lanes + chunk
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    inv = np.float32(1) / np.sqrt(lanes / np.float32(total.shape[-1]) + np.float32(eps))
    return (total * inv) * gamma, total


def norm_graph(k: int, eps: float, ours: bool = True) -> helper.GraphProto:
    """SkipRMSNorm, or ONNX Runtime's SkipSimplifiedLayerNormalization, over x, skip [1, S, k]
    and gamma."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "S", k])
          for n in ("x", "skip")]
    gamma = helper.make_tensor_value_info("gamma", TensorProto.FLOAT, ["G"])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "S", k]) for n in ("y", "sum")]
    if ours:
        node = helper.make_node("SkipRMSNorm", ["x", "skip", "gamma"], ["y", "sum"],
                                domain=kernels.DOMAIN, epsilon=eps)
    else:
        node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"],
                                ["y", "", "", "sum"], domain="com.microsoft", epsilon=eps)
    return helper.make_graph([node], "g", io + [gamma], outs)


def test_skip_rms_norm_is_numpys_bit_for_bit_on_every_path_and_onnx_runtimes_within_rounding():
    """The residual add and RMS norm against skip_rms exactly on every path, for 1 to 80
    rows (80 · 576 values: split among threads) and a zero row, and against ONNX Runtime's
    SkipSimplifiedLayerNormalization within float32 rounding."""
    rng = np.random.default_rng(16)
    k, eps = 576, 1e-5
    x = (rng.standard_normal((1, 80, k)) * 4).astype(np.float32)
    skip = rng.standard_normal((1, 80, k)).astype(np.float32)
    x[0, 2], skip[0, 2] = 1.0, -1.0  # a zero sum: eps alone
    gamma = (rng.random(k) + 0.5).astype(np.float32)
    want_y, want_sum = skip_rms(x[0], skip[0], gamma, eps)
    for _, path in every_path():
        for threads in (1, 2):
            run = kernels.op_session(norm_graph(k, eps), threads)
            for rows in (1, 5, 17, 80):
                y, total = run.run(None, {"x": x[:, :rows], "skip": skip[:, :rows],
                                          "gamma": gamma})
                assert np.array_equal(total[0], want_sum[:rows]), (path, threads, rows)
                assert np.array_equal(y[0], want_y[:rows]), (path, threads, rows)
    theirs = kernels.op_session(norm_graph(k, eps, ours=False), 2).run(
        None, {"x": x, "skip": skip, "gamma": gamma})[0][0]
    assert np.abs(theirs - want_y).max() < 1e-5 * np.abs(want_y).max()


def test_skip_rms_norm_refuses_bad_inputs_with_the_reason():
    run = kernels.op_session(norm_graph(48, 1e-6), 2)
    x = np.zeros((1, 2, 48), np.float32)
    with pytest.raises(Exception, match="skip must have X's shape"):
        run.run(None, {"x": x, "skip": np.zeros((1, 3, 48), np.float32),
                       "gamma": np.ones(48, np.float32)})
    with pytest.raises(Exception, match=r"gamma must be \[K\], K \(X's last dimension, 48\)"):
        run.run(None, {"x": x, "skip": x, "gamma": np.ones(32, np.float32)})
