"""Which GGUF type each weight of a float model gets, and that weight quantized to it.

edgespec's default int4 is llama.cpp's Q4_K_M recipe (llama-quant.cpp,
llama_tensor_get_type, 0c1e570) and its default int8 is Q8_0, so a bundle has
llama.cpp's bits per weight for the same model: Q4_K everywhere, Q6_K for attn_v and
ffn_down in the layers `more_bits` picks (the first and last eighth and every third in
between) and for the LM head (a tied embedding is the head, stored once). A tensor
whose input size is not a multiple of 256 takes llama.cpp's fallback of the same size
class (Q4_K -> Q5_0, Q6_K -> Q8_0): most of SmolLM2 (hidden size 576) is Q5_0.

The quantized rows are GGUF's own bytes (kquants), encoded for MatMulNBits exactly as
an imported GGUF file is (gguf_codes), so everything the import path supports — tied
gathers, trimmed heads, fp16 compute, exact passes — holds here too.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from edgespec.quant import gguf_codes, kquants
from edgespec.quant.blockwise import QuantizedWeight

FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}
KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
         "token_embd", "output")


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v/ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_type(precision: str, kind: str, layer: int, layers: int, k: int) -> T | None:
    """The type of a [N, k] weight of `kind` in layer `layer` (None: keep it float, as
    llama.cpp keeps a weight no 32-block type fits)."""
    if kind not in KINDS:
        raise ValueError(f"unknown weight kind {kind!r}")
    if precision == "int8":
        qtype = T.Q8_0
    elif precision != "int4":
        raise ValueError(f"no GGUF recipe for precision {precision!r}")
    elif kind == "output" or (kind in ("attn_v", "ffn_down") and more_bits(layer, layers)):
        qtype = T.Q6_K
    else:
        qtype = T.Q4_K
    if k % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    return qtype if k % GGML_QUANT_SIZES[qtype][0] == 0 else None


def quantize_weight(w: np.ndarray, qtype: T, importance: np.ndarray | None = None,
                    hessian: np.ndarray | None = None) -> QuantizedWeight:
    """A float [N, K] weight as `qtype`'s exact MatMulNBits encoding (GPTQ's codes on
    the recipe's blocks when the input's `hessian` is given)."""
    return gguf_codes.encode(
        kquants.quantize(np.asarray(w, np.float32), qtype, importance, hessian), qtype)
