"""Architecture adapters: a Hugging Face checkpoint -> one normalized decoder description.

Every supported family is mapped onto the same `DecoderSpec` + per-layer weights, so the
graph builder knows a single decoder shape with a few switches (qkv bias, q/k norms,
sandwich norms, soft-capping, sliding windows, GELU). Adding an architecture means adding
an adapter here, not a new builder. Whatever can be folded into weights is folded here:
Gemma's (1 + w) norms become plain weights, fused checkpoint tensors are split or joined
to the builder's layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.export.checkpoint import BNB_4BIT_STATE, Checkpoint
from edgespec.quant.blockwise import QuantizedWeight

# a linear weight: float [out, in], an exact imported encoding, or parts that could not be
# fused into one matmul (imported q/k/v of different GGUF types)
Weight = np.ndarray | QuantizedWeight


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
    max_positions: int
    tie_embeddings: bool
    inv_freq: np.ndarray  # RoPE inverse frequencies (len = rotary_dim / 2)
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: list[int | None] = field(default_factory=list)  # per layer
    local_inv_freq: np.ndarray | None = None  # Gemma 3: sliding layers' own RoPE


@dataclass
class LayerWeights:
    """Linear weights in the Hugging Face [out, in] layout, already fused where possible."""

    qkv: Weight | list[Weight]  # [(heads + 2 * kv_heads) * head_dim, hidden], or [q, k, v]
    o: Weight
    gate_up: Weight | list[Weight]  # [2 * intermediate, hidden]: gate rows first, or [gate, up]
    down: Weight
    input_norm: np.ndarray
    mlp_norm: np.ndarray  # the norm in front of the MLP
    qkv_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # per-head RMSNorm weights [head_dim] (Qwen3)
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None  # Gemma-2 sandwich norms on branch outputs
    mlp_out_norm: np.ndarray | None = None


def fuse(parts: list[Weight]) -> Weight | list[Weight]:
    """Row-stacked parts as one weight (one matmul) where they share an encoding; imported
    parts of different kinds stay a list, each its own matmul."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return parts
    first = parts[0]

    def layout(q: QuantizedWeight) -> tuple:
        stored = {k: tuple(a.shape[1:] + (a.dtype,) for a in v)
                  for k, v in (q.stored or {}).items() if k != "centre"}
        book = None if q.codebook is None else q.codebook.tobytes()
        return q.bits, q.block_size, q.k, q.mins is None, stored, book

    if any(layout(p) != layout(first) for p in parts):
        return parts

    def join(arrays: list[np.ndarray]) -> np.ndarray:
        """Stored factors along rows; a factor shared by all rows (a scalar centre, the
        ones that repeat a scale over two blocks) stays one where the parts agree."""
        shared = [a.ndim == 0 or a.shape[0] == 1 for a in arrays]
        if all(shared) and all(np.array_equal(a, arrays[0]) for a in arrays):
            return arrays[0]
        return np.concatenate([np.broadcast_to(a, (p.n * p.packed.shape[1],)) if a.ndim == 0
                               else a for a, p in zip(arrays, parts, strict=True)])
    cat = np.concatenate
    return QuantizedWeight(
        packed=cat([p.packed for p in parts]), scales=cat([p.scales for p in parts]),
        zero_points=cat([p.zero_points for p in parts]), bits=first.bits,
        block_size=first.block_size, n=sum(p.n for p in parts), k=first.k,
        symmetric=all(p.symmetric for p in parts),
        mins=None if first.mins is None else cat([p.mins for p in parts]),
        stored={k: tuple(join([p.stored[k][i] for p in parts]) for i in range(len(v)))
                for k, v in first.stored.items()} if first.stored else None,
        codebook=first.codebook)


def rope_parameters(config: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in `rope_parameters` (per layer type for Gemma 3);
    older configs split them into `rope_theta` and `rope_scaling`. One dict either way."""
    params = dict(config.get("rope_parameters") or {})
    if layer_type in params:
        params = dict(params[layer_type])
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if layer_type == "full_attention":  # Gemma 3 scales its global layers only
        params.update(config.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return params


def inverse_frequencies(config: dict[str, Any], head_dim: int, path: Any,
                        layer_type: str = "full_attention") -> np.ndarray:
    rope = rope_parameters(config, layer_type)
    dim = int(head_dim * rope["partial_rotary_factor"])
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = rope["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / rope["factor"]
    if kind == "llama3":  # Llama 3.1+: low frequencies slowed down, a smooth band between
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return np.where(medium, smoothed, scaled)
    raise EdgespecError(f"{path}: RoPE type '{kind}' is not supported yet (supported: "
                        "default, linear, llama3).")


class LlamaAdapter:
    """Llama 1-3.x and Mistral: the reference layout every other adapter varies."""

    branch_norms = False  # norms on the attention and MLP outputs, which rotations cannot pass

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        c = ckpt.config
        for key in REQUIRED:
            value = c.get(key)
            kind = float if key == "rms_norm_eps" else int
            if isinstance(value, bool) or not isinstance(value, (kind, int)) or value <= 0:
                told = "missing" if key not in c else f"{value!r}, not a positive {kind.__name__}"
                raise EdgespecError(f"{ckpt.path}: config.json's {key} is {told}; correct it or "
                                    "download the checkpoint again.")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        self.spec = DecoderSpec(
            architecture=c["architectures"][0], vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=c["rms_norm_eps"],
            max_positions=c.get("max_position_embeddings", 2048),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            inv_freq=inverse_frequencies(c, head_dim, ckpt.path),
            sliding_window=self.sliding_windows(c))
        if self.spec.tie_embeddings and type(ckpt) is Checkpoint and \
                ckpt.has("lm_head.weight") and not np.array_equal(
                    ckpt.tensors["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"]):
            # a head of its own stored beside a "tied" config: transformers 5 keeps it
            self.spec.tie_embeddings = False
        if not self.spec.tie_embeddings and type(ckpt) is Checkpoint and \
                not ckpt.has("lm_head.weight"):
            raise EdgespecError(
                f"{ckpt.path}: config.json has untied embeddings (tie_word_embeddings false "
                "or left out) but the checkpoint has no lm_head.weight, so transformers would "
                "score with a random head: add the head's weights, or set "
                "tie_word_embeddings to true if the embeddings are the head.")
        if ckpt.rope_factors is not None:  # a GGUF's precomputed Llama 3 RoPE divisors
            self.spec.inv_freq = self.spec.inv_freq / ckpt.rope_factors
        act = self.activation(c)
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise EdgespecError(f"{ckpt.path}: activation '{act}' is not supported yet.")
        self.spec.activation = "silu" if act == "silu" else "gelu_tanh"
        if c.get("mlp_bias") or c.get("attention_bias") and not self.has_qkv_bias:
            raise EdgespecError(f"{ckpt.path}: linear biases other than Qwen2's q/k/v "
                                "biases are not supported yet.")

    has_qkv_bias = False

    @staticmethod
    def activation(c: dict[str, Any]) -> str:
        return c.get("hidden_act") or c.get("hidden_activation") or "silu"

    def check_shapes(self) -> None:
        """A config that does not describe its weights (an edited hidden_size, a wrong
        head count) is refused here, as transformers refuses to load it, rather than
        exported into a graph that computes garbage or fails when it runs."""
        s = self.spec
        d, q, kv, i = (s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                       s.intermediate_size)
        shapes = {"embed_tokens.weight": (s.vocab_size, d), "lm_head.weight": (s.vocab_size, d),
                  "q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d),
                  "o_proj.weight": (d, q), "qkv_proj.weight": (q + 2 * kv, d),
                  "gate_proj.weight": (i, d), "up_proj.weight": (i, d),
                  "down_proj.weight": (d, i), "gate_up_proj.weight": (2 * i, d)}
        for name, tensor in self.ckpt.tensors.items():
            want = shapes.get(name.rsplit(".", 2)[-2] + ".weight" if name.endswith(
                ".weight") else "")
            packed = any(f"{name}.{k}" in self.ckpt.tensors for k in BNB_4BIT_STATE)
            if want and not packed and tuple(tensor.shape) != want:
                raise EdgespecError(
                    f"{self.ckpt.path}: {name} is {list(tensor.shape)}, but config.json "
                    f"describes {list(want)}; the config does not match the weights (a "
                    "wrong size or head count): correct it or download the checkpoint again.")

    def sliding_windows(self, c: dict[str, Any]) -> list[int | None]:
        window = c.get("sliding_window")
        types = c.get("layer_types")
        n = c["num_hidden_layers"]
        if not window or (types is None and c.get("use_sliding_window") is False):
            return [None] * n
        if types is None:  # Qwen2/3 slide from layer max_window_layers on, others all
            first = c.get("max_window_layers", 0) if c.get("use_sliding_window") else 0
            return [window if i >= first else None for i in range(n)]
        return [window if t == "sliding_attention" else None for t in types]

    def get(self, name: str) -> np.ndarray:
        return self.ckpt.get(name)

    def linear(self, name: str) -> Weight:
        return self.ckpt.linear(name)

    def embeddings(self) -> Weight:
        """One object per export, so a tied head *is* the embedding (stored once)."""
        if not hasattr(self, "_embeddings"):
            self._embeddings = self.linear("model.embed_tokens.weight")
        return self._embeddings

    def norm(self, name: str) -> np.ndarray:
        return self.get(name)

    def attention(self, p: str) -> tuple[Weight | list[Weight], np.ndarray | None]:
        """The fused [q; k; v] weight and, where the model has them, its biases."""
        w = fuse([self.linear(f"{p}self_attn.{x}_proj.weight") for x in "qkv"])
        if not self.has_qkv_bias:
            return w, None
        return w, np.concatenate([self.get(f"{p}self_attn.{x}_proj.bias") for x in "qkv"])

    def gate_up(self, p: str) -> Weight | list[Weight]:
        return fuse([self.linear(f"{p}mlp.gate_proj.weight"),
                     self.linear(f"{p}mlp.up_proj.weight")])

    def layer(self, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv, bias = self.attention(p)
        return LayerWeights(
            qkv=qkv, qkv_bias=bias, o=self.linear(p + "self_attn.o_proj.weight"),
            gate_up=self.gate_up(p), down=self.linear(p + "mlp.down_proj.weight"),
            input_norm=self.norm(p + "input_layernorm.weight"),
            mlp_norm=self.norm(p + "post_attention_layernorm.weight"))

    def layers(self) -> Iterator[LayerWeights]:
        for i in range(self.spec.num_layers):
            yield self.layer(i)

    def final_norm(self) -> np.ndarray:
        return self.norm("model.norm.weight")

    def lm_head(self) -> Weight:
        if self.spec.tie_embeddings or not self.ckpt.has("lm_head.weight"):
            return self.embeddings()
        return self.linear("lm_head.weight")


class Qwen2Adapter(LlamaAdapter):
    """Qwen2 / Qwen2.5: Llama plus biases on q, k and v."""

    has_qkv_bias = True


class Qwen3Adapter(LlamaAdapter):
    """Qwen3: no biases, but an RMSNorm over each head of q and k before RoPE."""

    def layer(self, i: int) -> LayerWeights:
        lw = super().layer(i)
        p = f"model.layers.{i}.self_attn."
        lw.q_norm, lw.k_norm = self.get(p + "q_norm.weight"), self.get(p + "k_norm.weight")
        return lw


class Phi3Adapter(LlamaAdapter):
    """Phi-3 / 3.5: q/k/v and gate/up already fused in the checkpoint (gate first)."""

    def attention(self, p: str) -> tuple[Weight, np.ndarray | None]:
        return self.linear(f"{p}self_attn.qkv_proj.weight"), None

    def gate_up(self, p: str) -> Weight:
        return self.linear(f"{p}mlp.gate_up_proj.weight")


class GemmaAdapter(LlamaAdapter):
    """Gemma: embeddings scaled by sqrt(hidden), norms multiply by (1 + w), GELU (tanh)."""

    def __init__(self, ckpt: Checkpoint):
        super().__init__(ckpt)
        self.spec.embed_scale = math.sqrt(self.spec.hidden_size)

    @staticmethod
    def activation(c: dict[str, Any]) -> str:
        """As transformers reads it: the official releases' legacy "gelu" meant the tanh
        approximation, which is also the default."""
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        return "gelu_pytorch_tanh" if act == "gelu" else act

    def norm(self, name: str) -> np.ndarray:
        """(1 + w); llama.cpp's converter already stored 1 + w in GGUF files."""
        return self.get(name) if self.ckpt.norms_shifted else 1.0 + self.get(name)


class Gemma2Adapter(GemmaAdapter):
    """Gemma-2: sandwich norms, attention and final soft-capping, a query scale of its
    own, and sliding-window attention on alternate layers."""

    branch_norms = True

    def __init__(self, ckpt: Checkpoint):
        super().__init__(ckpt)
        c = ckpt.config
        self.spec.attn_scale = c.get("query_pre_attn_scalar", self.spec.head_dim) ** -0.5
        self.spec.attn_softcap = c.get("attn_logit_softcapping")
        self.spec.final_softcap = c.get("final_logit_softcapping")
        if c.get("layer_types") is None and c.get("sliding_window"):
            self.spec.sliding_window = [c["sliding_window"] if i % 2 == 0 else None
                                        for i in range(self.spec.num_layers)]

    def layer(self, i: int) -> LayerWeights:
        lw = super().layer(i)
        p = f"model.layers.{i}."
        lw.attn_out_norm = self.norm(p + "post_attention_layernorm.weight")
        lw.mlp_norm = self.norm(p + "pre_feedforward_layernorm.weight")
        lw.mlp_out_norm = self.norm(p + "post_feedforward_layernorm.weight")
        return lw


class Gemma3Adapter(Gemma2Adapter):
    """Gemma 3: Gemma-2's layer with q/k norms (Gemma-style 1 + w), sliding layers with
    RoPE of their own base (10k) between global ones (1M, possibly scaled), no softcaps."""

    def __init__(self, ckpt: Checkpoint):
        super().__init__(ckpt)
        c = ckpt.config
        if "rope_local_base_freq" in c:  # transformers 4 configs
            local = {"rope_theta": c["rope_local_base_freq"], "rope_type": "default"}
            c = {**c, "rope_parameters": {"sliding_attention": local}}
        self.spec.local_inv_freq = inverse_frequencies(c, self.spec.head_dim, ckpt.path,
                                                       "sliding_attention")
        if c.get("layer_types") is None and c.get("sliding_window"):  # older configs
            every = c.get("sliding_window_pattern", 6)
            self.spec.sliding_window = [None if (i + 1) % every == 0 else c["sliding_window"]
                                        for i in range(self.spec.num_layers)]

    def layer(self, i: int) -> LayerWeights:
        lw = super().layer(i)
        p = f"model.layers.{i}.self_attn."
        lw.q_norm, lw.k_norm = self.norm(p + "q_norm.weight"), self.norm(p + "k_norm.weight")
        return lw


ADAPTERS: dict[str, type[LlamaAdapter]] = {
    "LlamaForCausalLM": LlamaAdapter,
    "MistralForCausalLM": LlamaAdapter,
    "Qwen2ForCausalLM": Qwen2Adapter,
    "Qwen3ForCausalLM": Qwen3Adapter,
    "Phi3ForCausalLM": Phi3Adapter,
    "GemmaForCausalLM": GemmaAdapter,
    "Gemma2ForCausalLM": Gemma2Adapter,
    "Gemma3ForCausalLM": Gemma3Adapter,
}


# config.json's model_type -> its causal LM class, for a config that names no architectures
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


# What a config.json may leave out and the adapters read, as transformers' config classes
# (5.x) default it: an absent key means the class's value (Gemma 2's soft-caps, Gemma's
# and Qwen3's head size, Mistral's window), not none (tests check it against transformers).
_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_QWEN = {**_COMMON, "max_position_embeddings": 32768, "use_sliding_window": False,
         "max_window_layers": 28}
_GEMMA = {**_COMMON, "tie_word_embeddings": True, "head_dim": 256}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {**_COMMON, "max_position_embeddings": 2048},
    "MistralForCausalLM": {**_COMMON, "max_position_embeddings": 131072, "sliding_window": 4096},
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": {**_QWEN, "head_dim": 128},
    "Phi3ForCausalLM": {**_COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "GemmaForCausalLM": {**_GEMMA, "max_position_embeddings": 8192},
    "Gemma2ForCausalLM": {**_GEMMA, "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "sliding_window": 4096},
    "Gemma3ForCausalLM": {**_GEMMA, "max_position_embeddings": 131072,
                          "query_pre_attn_scalar": 256, "sliding_window": 4096},
}
# the sizes every adapter reads, which have no default worth taking (transformers' are a 7B's)
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "rms_norm_eps")


def architecture(config: dict[str, Any]) -> str:
    """The causal LM class a config names, as transformers' AutoModelForCausalLM reads it."""
    if config.get("architectures"):
        return config["architectures"][0]
    model_type = config.get("model_type", "unknown")
    return MODEL_TYPES.get(model_type, model_type)


def takes_rotations(config: dict[str, Any]) -> bool:
    """Whether `--quant rot` can fold its rotations into this architecture's weights."""
    adapter = ADAPTERS.get(architecture(config))
    return adapter is not None and not adapter.branch_norms


def adapter_for(ckpt: Checkpoint) -> LlamaAdapter:
    ckpt.config["architectures"] = archs = ckpt.config.get("architectures") or [
        architecture(ckpt.config)]
    if archs[0] not in ADAPTERS:
        raise EdgespecError(f"{ckpt.path}: architecture {archs[0]} is not supported; "
                            f"edgespec exports {', '.join(sorted(ADAPTERS))}.")
    for key, value in CONFIG_DEFAULTS[archs[0]].items():
        ckpt.config.setdefault(key, value)
    adapter = ADAPTERS[archs[0]](ckpt)
    if type(ckpt) is Checkpoint:  # a GGUF file's config is read from its own tensors
        adapter.check_shapes()
    return adapter
