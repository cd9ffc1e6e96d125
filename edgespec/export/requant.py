"""A checkpoint's float linear weights quantized by the GGUF recipe (quant.recipe).

Each weight is quantized with llama.cpp's search. Where calibration measured its input's
XᵀX (`hessians`, keyed like the graph's MatMul nodes: "layers.3.qkv", "layers.3.o",
"layers.3.gate_up", "layers.3.down", "lm_head"), the search is weighted by its diagonal
(the importance of each input column, llama.cpp's imatrix) and GPTQ chooses the codes
on the searched blocks; a tied head keeps round-to-nearest codes, since they are the
embedding's rows too. Where calibration measured only the diagonal (a model too large
for all its XᵀX at once, see calibrate), it weights the search alone.
Fused weights are cut into their parts first, since q/k/v and gate/up may get different
types; parts of one type are fused again (one MatMulNBits). A tied embedding is the
quantized head itself, so the graph gathers it from the head's codes: stored once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from edgespec.export.architectures import LayerWeights, LlamaAdapter, Weight, fuse


@dataclasses.dataclass
class Requantizer:
    adapter: LlamaAdapter
    precision: str  # "int4" or "int8"
    hessians: dict[str, np.ndarray] | None = None

    def weight(self, w: Weight, kind: str, layer: int, key: str) -> Weight:
        """One weight quantized (imported encodings and weights no type fits stay)."""
        from edgespec.quant.recipe import gguf_type, quantize_weight  # needs gguf

        if not isinstance(w, np.ndarray):
            return w
        qtype = gguf_type(self.precision, kind, layer, self.adapter.spec.num_layers,
                          w.shape[1])
        if qtype is None:
            return w
        stat = (self.hessians or {}).get(key)
        if stat is None:
            return quantize_weight(w, qtype)
        if stat.ndim == 1 or w is self.adapter.embeddings():  # importance weights only
            return quantize_weight(w, qtype, stat if stat.ndim == 1 else np.diag(stat).copy())
        return quantize_weight(w, qtype, hessian=stat)

    def parts(self, w: Weight | list[Weight], kinds: tuple[str, ...], sizes: list[int],
              layer: int, key: str) -> Weight | list[Weight]:
        """A fused weight cut into its parts (of `sizes` rows), each quantized; imported
        encodings (a GGUF file's fused codes) stay as they are."""
        if not isinstance(w, (list, np.ndarray)):
            return w
        pieces = w if isinstance(w, list) else np.split(w, np.cumsum(sizes)[:-1])
        return fuse([self.weight(p, kind, layer, key)
                     for p, kind in zip(pieces, kinds, strict=True)])

    def layers(self) -> Iterator[LayerWeights]:
        """The adapter's layers, each quantized when the graph builder asks for it."""
        spec = self.adapter.spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        for i, lw in enumerate(self.adapter.layers()):
            p = f"layers.{i}"
            half = lw.gate_up.shape[0] // 2 if isinstance(lw.gate_up, np.ndarray) else 0
            yield dataclasses.replace(
                lw, qkv=self.parts(lw.qkv, ("attn_q", "attn_k", "attn_v"), [q, kv, kv], i,
                                   f"{p}.qkv"),
                o=self.weight(lw.o, "attn_output", i, f"{p}.o"),
                gate_up=self.parts(lw.gate_up, ("ffn_gate", "ffn_up"), [half, half], i,
                                   f"{p}.gate_up"),
                down=self.weight(lw.down, "ffn_down", i, f"{p}.down"))

    def embeddings_and_head(self) -> tuple[Weight, Weight]:
        """(embeddings, head); the same object when they are tied."""
        embeddings, head = self.adapter.embeddings(), self.adapter.lm_head()
        quantized = self.weight(head, "output", 0, "lm_head")
        if head is embeddings:
            return quantized, quantized
        return self.weight(embeddings, "token_embd", 0, "embed"), quantized
