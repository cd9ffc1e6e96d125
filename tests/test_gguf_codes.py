"""GGUF tensors in MatMulNBits: the effective weights are bitwise gguf-py's dequantization.

The probe feeds the identity matrix through ONNX Runtime's MatMulNBits (fp32 activations)
plus edgespec's block-sum minimum, so the output rows are the weights ONNX Runtime
really computes with; the oracle is `gguf.quants.dequantize`. Synthetic tensors come
from gguf-py's own quantizer where it has one, K-quants from random block bytes with
realistic scales; real tensors from both registry models.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants
from onnx import TensorProto, helper

from edgespec.export.graph import GraphBuilder
from edgespec.quant.blockwise import dequantize
from edgespec.quant.gguf_codes import ENCODINGS, encode
from edgespec.runtimes.pool import session_options
from tests.real_models import gemma_gguf, smollm2_gguf

T = GGMLQuantizationType
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # gguf-py quantizes these
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]  # random blocks
HALVES_AT = {T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,)}  # float16 fields: d (, dmin)


def run_graph(g: GraphBuilder, inputs: dict[str, np.ndarray], out: str,
              in_types: dict[str, int]) -> np.ndarray:
    graph = helper.make_graph(
        g.nodes, "probe", [helper.make_tensor_value_info(n, t, None)
                           for n, t in in_types.items()],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], initializer=g.inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"])
    return sess.run([out], inputs)[0]


def effective_weights(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """[N, K] as ONNX Runtime computes with them: identity activations, accuracy_level 0."""
    q = encode(blocks, qtype)
    g = GraphBuilder("int8", q.block_size, accuracy_level=0)
    out = g.linear("x", q, "probe")
    eye = np.eye(q.k, dtype=np.float32)[None]
    return run_graph(g, {"x": eye}, out, {"x": TensorProto.FLOAT})[0].T


def assert_bitwise(a: np.ndarray, b: np.ndarray) -> None:
    """Every value identical; a zero may differ in sign only (gguf-py's d·(q - 8) with a
    negative d gives -0.0 where (q - 8)·d over a float zero point gives +0.0: the same
    weight in every product)."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    same = a.view(np.uint32) == b.view(np.uint32)
    assert np.all(same | ((a == 0) & (b == 0)))


def k_quant_blocks(qtype: GGMLQuantizationType, rows: int, rng: np.random.Generator,
                   width: int = 512, scales: tuple[float, float] = (1e-3, 3e-2)) -> np.ndarray:
    """Random blocks (`width` values a row) whose float16 scales are realistic
    (1e-3..3e-2), so the products and minimums are the magnitudes real files hold."""
    values, size = GGML_QUANT_SIZES[qtype]
    per_row = width // values
    raw = rng.integers(0, 256, size=(rows, per_row, size), dtype=np.uint8)
    for at in HALVES_AT.get(qtype, (0, 2) if qtype in (T.Q4_K, T.Q5_K) else (0,)):
        raw[..., at:at + 2] = rng.uniform(*scales, size=(rows, per_row, 1)).astype(
            np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def blocks_of(qtype: GGMLQuantizationType, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of 512 values: gguf-py's quantization of random weights where it has one,
    realistic random blocks otherwise."""
    if qtype in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((rows, 512)).astype(np.float32) * 0.05, qtype)
    return k_quant_blocks(qtype, rows, rng)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_by_gguf_py_are_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 0.2, (48, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero row: zero scales
    w[5, :32] += 0.5  # a lopsided block: minimums far from -8·d
    blocks = quants.quantize(w, qtype)
    ref = quants.dequantize(blocks, qtype)
    assert_bitwise(dequantize(encode(blocks, qtype)), ref)
    assert_bitwise(effective_weights(blocks, qtype), ref)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_from_random_blocks_are_exact(qtype):
    blocks = k_quant_blocks(qtype, 40, np.random.default_rng(int(qtype)))
    ref = quants.dequantize(blocks, qtype)
    assert_bitwise(dequantize(encode(blocks, qtype)), ref)
    assert_bitwise(effective_weights(blocks, qtype), ref)


@pytest.mark.parametrize("qtype", [t for t in ENCODINGS if encode(blocks_of(
    t, 1, np.random.default_rng(0)), t).block_size == 32], ids=lambda t: t.name)
def test_blocks_of_32_on_the_own_kernel_compute_with_gguf_pys_weights(qtype):
    """On the cpu profile, block-of-32 types run on edgespec's kernel (int8 activations):
    its product is that of gguf-py's dequantized weights and the activations as the
    kernel quantizes them (numpy, float64), to float rounding."""
    from edgespec import kernels
    from tests.test_kernels import quantized

    blocks = blocks_of(qtype, 48, np.random.default_rng(int(qtype)))
    q = encode(blocks, qtype)
    g = GraphBuilder("int8", q.block_size, accuracy_level=4)
    g.own_kernel = True
    out = g.linear("x", q, "probe")
    assert any(n.domain == kernels.DOMAIN for n in g.nodes)
    graph = helper.make_graph(g.nodes, "probe", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, None)], [helper.make_tensor_value_info(
            out, TensorProto.FLOAT, None)], initializer=g.inits)
    x = np.random.default_rng(1).standard_normal((1, 5, q.k)).astype(np.float32)
    y = kernels.op_session(graph, 2).run(None, {"x": x})[0][0]
    exact = quantized(x[0]) @ quants.dequantize(blocks, qtype).astype(np.float64).T
    assert np.abs(y - exact).max() < 2e-6 * np.abs(exact).max()


def test_every_supported_type_is_probed():
    assert set(ENCODINGS) == set(QUANTIZABLE) | set(K_QUANTS)


@cache
def reader(path: Path) -> GGUFReader:
    return GGUFReader(path)


def real_tensors():
    """One tensor of every quantized type in each registry file (first of each type)."""
    for path in (smollm2_gguf(), gemma_gguf()):
        seen = set()
        for t in reader(path).tensors:
            if t.tensor_type in ENCODINGS and t.tensor_type not in seen and t.shape[1] <= 2048:
                seen.add(t.tensor_type)
                yield pytest.param(path, t.name, id=f"{path.name[:6]}-{t.name}")


@pytest.mark.parametrize("path,name", real_tensors())
def test_real_tensors_are_exact(path, name):
    t = next(t for t in reader(path).tensors if t.name == name)
    ref = quants.dequantize(t.data, t.tensor_type)
    assert_bitwise(effective_weights(np.asarray(t.data), t.tensor_type), ref)


@pytest.mark.parametrize("own_kernel", [False, True], ids=["nbits", "own"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q5_K,
                                   T.Q2_K, T.Q3_K, T.IQ4_XS], ids=lambda t: t.name)
def test_embedding_rows_gathered_from_codes_are_exact(qtype, own_kernel):
    """The tied head's codes serve as the embedding table: the gathered rows are the
    dequantized rows, bitwise, from MatMulNBits' layout and from the own kernel's (its
    tiles, K-quant tables, 5- and 6-bit codes' bit planes)."""
    blocks = blocks_of(qtype, 64, np.random.default_rng(7))
    q = encode(blocks, qtype)
    g = GraphBuilder("int8", q.block_size, accuracy_level=0)
    g.own_kernel = own_kernel
    assert g.on_own_kernel(q) == own_kernel
    out = g.gather_rows(q, "ids", "embed")
    ids = np.array([[0, 63, 5, 5, 17]], np.int64)
    got = run_graph(g, {"ids": ids}, out, {"ids": TensorProto.INT64})
    assert_bitwise(got[0], quants.dequantize(blocks, qtype)[ids[0]])


def test_stored_parts_keep_the_file_size():
    """A 5-bit type is held as GGUF holds it (low nibbles + a bit plane + float16
    scales), not as the 8-bit codes ONNX Runtime builds from it at load."""
    blocks = quants.quantize(np.random.default_rng(0).standard_normal((64, 256)).astype(
        np.float32), T.Q5_0)
    g = GraphBuilder("int8", 32, accuracy_level=4)
    g.linear("x", encode(blocks, T.Q5_0), "probe")
    stored = sum(onnx.numpy_helper.to_array(t).nbytes for t in g.inits)
    assert stored <= blocks.nbytes * 1.01


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_iq4_stays_four_bits_a_weight_on_the_own_kernel(qtype):
    """IQ4's indices are what the kernel reads (it looks the codes up itself), so the
    graph's constants are the file's size, not the 8-bit codes MatMulNBits would take."""
    blocks = k_quant_blocks(qtype, 64, np.random.default_rng(5))
    g = GraphBuilder("int8", 32, accuracy_level=4)
    g.own_kernel = True
    g.linear("x", encode(blocks, qtype), "probe")
    assert [a.i for n in g.nodes for a in n.attribute if a.name == "codebook"] == [1]
    stored = sum(onnx.numpy_helper.to_array(t).nbytes for t in g.inits)
    assert stored <= blocks.nbytes * 1.05


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_six_bit_scales_are_held_in_six_bits_and_exact(qtype):
    """As build_decoder stores them (pack_six): the 6-bit sub-block scales and minimums in
    6 bits each, joined at load; the weights stay bitwise gguf-py's and Q4_K's constants
    no bigger than the file's blocks."""
    blocks = k_quant_blocks(qtype, 64, np.random.default_rng(3))
    q = encode(blocks, qtype)
    g = GraphBuilder("int8", q.block_size, accuracy_level=0)
    g.pack_six = True
    out = g.linear("x", q, "probe")
    g.finish_six()
    assert any(t.name == "six.low" for t in g.inits)
    eye = np.eye(q.k, dtype=np.float32)[None]
    got = run_graph(g, {"x": eye}, out, {"x": TensorProto.FLOAT})[0].T
    assert_bitwise(got, quants.dequantize(blocks, qtype))
    if qtype == T.Q4_K:  # (Q5_K's per-block centres, where not exact, cost ~10% more)
        stored = sum(onnx.numpy_helper.to_array(t).nbytes for t in g.inits)
        assert stored <= blocks.nbytes * 1.01
