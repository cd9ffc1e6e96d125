"""The GGUF quantizers (quant.kquants) and the Q4_K_M recipe (quant.recipe).

Oracles: gguf-py's dequantizers read the bytes we write (so the layout is GGUF's own);
gguf-py's reference quantizers (max-abs scales) for the error the search must beat;
a real llama.cpp Q4_K_M file (Gemma 3 270M) for the types the recipe must pick."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from edgespec.quant import kquants
from edgespec.quant.blockwise import dequantize
from edgespec.quant.recipe import gguf_type, quantize_weight
from tests.real_models import gemma_gguf

RNG = np.random.default_rng(7)
# lopsided, heavy-tailed columns, as in trained weights
W = (RNG.standard_t(5, (96, 512)) * RNG.uniform(0.3, 3, 512)).astype(np.float32)
IMPORTANCE = RNG.uniform(0.05, 4, 512).astype(np.float32) ** 2


def weighted_mse(qtype: T, data: np.ndarray, imp: np.ndarray = IMPORTANCE) -> float:
    back = gguf.quants.dequantize(data, qtype).reshape(W.shape)
    return float((((back - W) ** 2) * imp).mean())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0])
def test_bytes_are_ggufs_layout_and_encode_exactly(qtype):
    """gguf-py reads our rows as close to W (relative error at the type's resolution),
    and the MatMulNBits encoding of them has bitwise gguf-py's weights."""
    data = kquants.quantize(W, qtype, IMPORTANCE, rows=40)
    assert data.shape == (96, 512 // gguf.GGML_QUANT_SIZES[qtype][0]
                          * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(data, qtype).reshape(W.shape)
    bits = {T.Q4_K: 4, T.Q6_K: 6, T.Q5_0: 5, T.Q8_0: 8}[qtype]
    rel = np.sqrt(((back - W) ** 2).mean() / (W ** 2).mean())
    assert rel < 2.0 ** -(bits - 1.5)
    q = quantize_weight(W, qtype, IMPORTANCE)
    np.testing.assert_array_equal(dequantize(q), back)


@pytest.mark.parametrize("qtype,plain", [(T.Q4_K, T.Q4_1), (T.Q5_0, T.Q5_0), (T.Q6_K, T.Q5_1),
                                         (T.Q8_0, T.Q8_0)])
def test_weighted_search_beats_max_abs_scales(qtype, plain):
    """With importance, the searched codes have a lower importance-weighted error than
    gguf-py's max-abs reference quantizer of the same or more bits per weight."""
    reference = weighted_mse(plain, gguf.quants.quantize(W, plain))
    searched = weighted_mse(qtype, kquants.quantize(W, qtype, IMPORTANCE))
    assert searched < 0.95 * reference


def test_importance_moves_error_to_unimportant_columns():
    """Weighting by importance lowers the weighted error against the unweighted search."""
    for qtype in (T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0):
        assert weighted_mse(qtype, kquants.quantize(W, qtype, IMPORTANCE)) < weighted_mse(
            qtype, kquants.quantize(W, qtype))


def test_zero_and_constant_blocks():
    w = np.zeros((4, 256), np.float32)
    w[1] = 0.5
    w[2, :32] = -3.0
    for qtype in (T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0):
        back = gguf.quants.dequantize(kquants.quantize(w, qtype), qtype).reshape(w.shape)
        np.testing.assert_allclose(back, w, atol=0.02)


def test_recipe_picks_llama_cpp_q4_k_m_types():
    """Every weight of a real llama-quantize Q4_K_M file (Gemma 3 270M: hidden size 640,
    so most types fall back to 32-blocks) has the type the recipe gives it."""
    reader = gguf.GGUFReader(gemma_gguf())
    layers = int(reader.get_field("gemma3.block_count").contents())
    seen = set()
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue
        m = re.match(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        kind, layer = (m.group(2), int(m.group(1))) if m else ("output", 0)  # tied embedding
        assert gguf_type("int4", kind, layer, layers, int(t.shape[0])) == t.tensor_type, t.name
        seen.add(t.tensor_type)
    assert seen == {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0}


def test_recipe_types():
    assert gguf_type("int4", "attn_q", 5, 30, 1024) == T.Q4_K
    assert gguf_type("int4", "ffn_down", 0, 30, 1024) == T.Q6_K
    assert gguf_type("int4", "output", 0, 30, 576) == T.Q8_0  # Q6_K's 32-block fallback
    assert gguf_type("int8", "attn_q", 5, 30, 576) == T.Q8_0
    assert gguf_type("int4", "attn_q", 5, 30, 100) is None  # no 32-block type fits


MIX = (RNG.standard_normal((512, 512)) / np.sqrt(512) + np.eye(512)) * RNG.uniform(0.2, 2, 512)


def correlated_inputs(rows: int, seed: int) -> np.ndarray:
    """Activations whose columns are correlated and of unequal size, like a layer's:
    one distribution, a different sample per seed."""
    return (np.random.default_rng(seed).standard_normal((rows, 512)) @ MIX).astype(np.float32)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0])
def test_gptq_codes_on_the_formats_blocks_cut_the_layers_output_error(qtype):
    """With the input's XᵀX, GPTQ's codes (read back by gguf-py, so still the format's
    own bytes) give a lower output error ||XWᵀ - XŴᵀ|| than the same blocks rounded to
    nearest, on activations the Hessian never saw."""
    x = correlated_inputs(2048, 1)
    held_out = correlated_inputs(512, 2)
    h = x.T.astype(np.float64) @ x
    diag = np.diag(h).astype(np.float32)
    rounded = gguf.quants.dequantize(kquants.quantize(W, qtype, diag), qtype).reshape(W.shape)
    data = kquants.quantize(W, qtype, diag, h, rows=40)
    gptq = gguf.quants.dequantize(data, qtype).reshape(W.shape)
    reference = held_out @ W.T

    def error(w: np.ndarray) -> float:
        return float(np.linalg.norm(reference - held_out @ w.T))

    assert error(gptq) < 0.85 * error(rounded)
    np.testing.assert_array_equal(dequantize(quantize_weight(W, qtype, diag, h)), gptq)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(qtype):
    """A diagonal XᵀX couples no columns: there is nothing to compensate, and GPTQ's
    codes are each weight rounded to the nearest value its block allows."""
    grid = kquants.QUANTIZERS[qtype](W, IMPORTANCE)
    nearest = np.clip(np.rint(np.divide(W - (0 if grid.offset is None else grid.offset),
                                        grid.scale, out=np.zeros_like(W),
                                        where=grid.scale != 0)), grid.lo, grid.hi)
    gptq = kquants.quantize(W, qtype, IMPORTANCE, np.diag(IMPORTANCE.astype(np.float64)))
    np.testing.assert_array_equal(gptq, grid.pack(nearest))
