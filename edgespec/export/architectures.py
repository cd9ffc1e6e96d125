"""Architecture adapters: a Hugging Face checkpoint -> one normalized decoder description.

Every supported family is mapped onto the same `DecoderSpec` + per-layer weights, so the
graph builder knows a single decoder shape. Adding an architecture means adding an
adapter here (and, where it differs, a flag the builder honours), not a new builder.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.export.checkpoint import Checkpoint


@dataclass
class DecoderSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tie_embeddings: bool


@dataclass
class LayerWeights:
    """Linear weights in the Hugging Face [out, in] layout, already fused where possible."""

    qkv: np.ndarray  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: np.ndarray
    gate_up: np.ndarray  # [2 * intermediate, hidden]: gate rows first
    down: np.ndarray
    input_norm: np.ndarray
    post_attention_norm: np.ndarray


class LlamaAdapter:
    """Llama and Mistral share names and math (Mistral's sliding window is unused here)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        c = ckpt.config
        if c.get("rope_scaling"):
            raise EdgespecError(f"{ckpt.path}: RoPE scaling {c['rope_scaling']} is not "
                                "supported yet by this exporter.")
        heads = c["num_attention_heads"]
        self.spec = DecoderSpec(
            architecture=c["architectures"][0], vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=c.get("rope_theta", 10000.0),
            max_positions=c.get("max_position_embeddings", 2048),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)))

    def embeddings(self) -> np.ndarray:
        return self.ckpt.get("model.embed_tokens.weight")

    def layers(self) -> Iterator[LayerWeights]:
        g = self.ckpt.get
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            yield LayerWeights(
                qkv=np.concatenate([g(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                o=g(p + "self_attn.o_proj.weight"),
                gate_up=np.concatenate([g(p + "mlp.gate_proj.weight"),
                                        g(p + "mlp.up_proj.weight")]),
                down=g(p + "mlp.down_proj.weight"),
                input_norm=g(p + "input_layernorm.weight"),
                post_attention_norm=g(p + "post_attention_layernorm.weight"))

    def final_norm(self) -> np.ndarray:
        return self.ckpt.get("model.norm.weight")

    def lm_head(self) -> np.ndarray:
        if self.spec.tie_embeddings or not self.ckpt.has("lm_head.weight"):
            return self.embeddings()
        return self.ckpt.get("lm_head.weight")


ADAPTERS: dict[str, Any] = {
    "LlamaForCausalLM": LlamaAdapter,
    "MistralForCausalLM": LlamaAdapter,
}


def adapter_for(ckpt: Checkpoint) -> LlamaAdapter:
    archs = ckpt.config.get("architectures") or [ckpt.config.get("model_type", "unknown")]
    if archs[0] not in ADAPTERS:
        raise EdgespecError(f"{ckpt.path}: architecture {archs[0]} is not supported; "
                            f"edgespec exports {', '.join(sorted(ADAPTERS))}.")
    return ADAPTERS[archs[0]](ckpt)
