"""Blockwise codes: numpy reference vs what ONNX Runtime's MatMulNBits computes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgespec.quant import QuantizedWeight, dequantize, quantize_blockwise
from edgespec.runtimes.pool import session_options


def run_matmulnbits(x: np.ndarray, q: QuantizedWeight, zero_points: bool) -> np.ndarray:
    inits = [numpy_helper.from_array(q.packed, "b"), numpy_helper.from_array(q.scales, "s")]
    if zero_points:
        inits.append(numpy_helper.from_array(q.packed_zero_points(), "z"))
    node = helper.make_node("MatMulNBits", ["x", "b", "s"] + ["z"] * zero_points, ["y"],
                            domain="com.microsoft", K=q.k, N=q.n, bits=q.bits,
                            block_size=q.block_size, accuracy_level=0)
    graph = helper.make_graph(
        [node], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("bits,symmetric,explicit_zp", [
    (2, True, False), (4, True, False), (8, True, False),  # implicit zero point
    (2, False, True), (4, False, True),  # asymmetric: zero points stored
    (4, True, True),  # symmetric with the zero points spelled out (the dml profile)
])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("k", [64, 80])  # 80: K not a multiple of the block, padded
def test_matmulnbits_computes_with_our_dequantized_weight(bits, symmetric, explicit_zp, block,
                                                          k):
    rng = np.random.default_rng(bits * 1000 + block + k)
    w = rng.normal(size=(24, k)).astype(np.float32) + 0.5  # lopsided blocks
    x = rng.normal(size=(3, k)).astype(np.float32)
    q = quantize_blockwise(w, bits, block, symmetric)
    ref = x @ dequantize(q).T
    np.testing.assert_allclose(run_matmulnbits(x, q, explicit_zp), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [48, 64, 80])  # 48, 80: padded past K in blocks of 32
@pytest.mark.parametrize("symmetric", [True, False])
def test_codes_split_into_blocks_of_16_compute_the_same_weight(k, symmetric):
    """The layout graphs with one-row passes read (export.graph.invariant): blocks of 16
    MatMulNBits accepts (ceil(K / 16) a row), computing what the blocks of 32 hold."""
    from edgespec.quant.blockwise import split_blocks

    rng = np.random.default_rng(k)
    w = rng.normal(size=(24, k)).astype(np.float32) + 0.5
    x = rng.normal(size=(3, k)).astype(np.float32)
    q = quantize_blockwise(w, 4, 32, symmetric)
    split = split_blocks(q, 16)
    assert split.packed.shape == (24, -(-k // 16), 8)
    np.testing.assert_array_equal(dequantize(split), dequantize(q))
    np.testing.assert_allclose(run_matmulnbits(x, split, not symmetric), x @ dequantize(q).T,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
def test_asymmetric_beats_symmetric_on_lopsided_weights(bits):
    w = np.random.default_rng(bits).uniform(0.0, 1.0, size=(32, 128)).astype(np.float32)
    err = {sym: np.abs(dequantize(quantize_blockwise(w, bits, 32, sym)) - w).mean()
           for sym in (True, False)}
    assert err[False] < 0.75 * err[True]


@pytest.mark.parametrize("bits,max_rel", [(8, 1 / 127), (4, 1 / 7), (2, 1.0)])
def test_rounding_error_is_at_most_half_a_step(bits, max_rel):
    rng = np.random.default_rng(bits)
    w = rng.normal(size=(16, 64)).astype(np.float32)
    q = quantize_blockwise(w, bits, 32)
    err = np.abs(dequantize(q) - w).reshape(16, 2, 32)
    step = q.scales.reshape(16, 2, 1)
    assert (err <= step / 2 + 1e-6).all()
    assert np.abs(dequantize(q) - w).max() <= max_rel * np.abs(w).max()


def test_block_maximum_is_exact_and_zero_blocks_survive():
    w = np.zeros((2, 32), np.float32)
    w[0, 5] = -3.0
    w[0, 7] = 1.0
    deq = dequantize(quantize_blockwise(w, 8, 32))
    assert deq[0, 5] == -3.0 and np.all(deq[1] == 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="2, 4 or 8"):
        quantize_blockwise(np.zeros((2, 32)), bits=3)
    with pytest.raises(ValueError, match="power of two"):
        quantize_blockwise(np.zeros((2, 48)), block_size=48)
