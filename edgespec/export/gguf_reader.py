"""A GGUF file -> the checkpoint a Hugging Face directory would give (config + tensors).

gguf-py reads the file; this module renames llama.cpp's tensors to transformers' names,
turns the metadata into a transformers-style config and undoes the two things llama.cpp's
converter did to the weights: the row permutation of Llama's q/k projections (for its
interleaved RoPE) and Gemma's norm weights stored as 1 + w (`norms_shifted`). Quantized
tensors stay quantized: `linear()` hands the graph builder their exact MatMulNBits
encoding (edgespec.quant.gguf_codes), `get()` their float values.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.export.checkpoint import Checkpoint
from edgespec.export.source import check_gguf_magic
from edgespec.quant.blockwise import QuantizedWeight

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}
# per architecture, where llama.cpp's names mean something else
LAYER_OVERRIDES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, gate first
    **{arch: {"post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"} for arch in ("gemma2", "gemma3")},
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value, or `default` where the file lacks the key."""
    found = reader.get_field(key)
    return default if found is None else found.contents()


def read_metadata(reader: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """The architecture and a transformers-style config.json from the file's metadata."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise EdgespecError(f"{path}: GGUF architecture '{arch}' is not supported; edgespec "
                            f"imports {', '.join(ARCHITECTURES)}.")

    def key(name: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{name}", default)
        if value is None:
            raise EdgespecError(f"{path}: the GGUF metadata lacks '{arch}.{name}'; the file is "
                                "incomplete or from an unsupported converter.")
        return value

    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise EdgespecError(f"{path}: per-layer head counts are not supported.")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise EdgespecError(f"{path} has no token_embd.weight tensor; it is not a complete "
                            "decoder model.")
    names = set(shapes)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": shapes["token_embd.weight"][1],  # ggml order: [hidden, vocab]
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_theta": key("rope.freq_base", 10000.0),
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "hidden_act": "gelu_pytorch_tanh" if arch.startswith("gemma") else "silu",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise EdgespecError(f"{path}: RoPE scaling '{scaling}' is not supported yet "
                                "(supported: linear).")
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": key("rope.scaling.factor")}
    if arch in ("gemma2", "gemma3"):
        window = key("attention.sliding_window")
        every = 2 if arch == "gemma2" else field(
            reader, f"{arch}.attention.sliding_window_pattern", 6)
        config["sliding_window"] = window
        config["layer_types"] = ["full_attention" if (i + 1) % every == 0 else
                                 "sliding_attention" for i in range(config["num_hidden_layers"])]
        # llama.cpp's rule: the 27B model scales queries by hidden/heads, the others by head_dim
        config["query_pre_attn_scalar"] = (hidden // heads if config["num_hidden_layers"] == 62
                                           else head_dim)
        config["attn_logit_softcapping"] = field(reader, f"{arch}.attn_logit_softcapping")
        config["final_logit_softcapping"] = field(reader, f"{arch}.final_logit_softcapping")
    if arch == "gemma3":
        config["rope_local_base_freq"] = field(reader, f"{arch}.rope.freq_base_swa", 10000.0)
    return arch, config


def _hf_name(arch: str, name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        hf = {**LAYER_NAMES, **LAYER_OVERRIDES.get(arch, {})}.get(parts[2])
        if hf:
            return f"model.layers.{parts[1]}.{hf}.{suffix}"
    return None


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (rows regrouped for interleaved RoPE): rows are
    output features, so quantized rows move whole and stay exact."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


class GGUFCheckpoint(Checkpoint):
    """A checkpoint whose quantized tensors keep GGUF's codes (`keep_codes`) or are
    dequantized like any float checkpoint (the requantize route)."""

    def __init__(self, path: Path, config: dict[str, Any], tensors: dict[str, np.ndarray],
                 quantized: dict[str, tuple[np.ndarray, Any]], keep_codes: bool,
                 norms_shifted: bool, rope_factors: np.ndarray | None):
        super().__init__(path, config, tensors)
        self.quantized = quantized
        self.keep_codes = keep_codes
        self.norms_shifted = norms_shifted
        self.rope_factors = rope_factors

    def has(self, name: str) -> bool:
        return name in self.tensors or name in self.quantized

    def get(self, name: str) -> np.ndarray:
        if name in self.quantized:
            from gguf.quants import dequantize

            data, qtype = self.quantized[name]
            return dequantize(data, qtype)
        return super().get(name)

    def linear(self, name: str) -> np.ndarray | QuantizedWeight:
        if name in self.quantized and self.keep_codes:
            from edgespec.quant.gguf_codes import encode

            return encode(*self.quantized[name])
        return self.get(name)

    def num_params(self) -> int:
        from gguf import GGML_QUANT_SIZES

        total = sum(int(t.size) for t in self.tensors.values())
        for data, qtype in self.quantized.values():
            values, size = GGML_QUANT_SIZES[qtype]
            total += data.shape[0] * (data.shape[1] // size) * values
        return total


def load_gguf(path: Path, keep_codes: bool = True) -> GGUFCheckpoint:
    """Read a GGUF file into a checkpoint; unsupported types are refused by name."""
    from gguf import GGMLQuantizationType

    from edgespec.quant.gguf_codes import ENCODINGS

    reader = open_reader(path)
    arch, config = read_metadata(reader, path)
    tensors: dict[str, np.ndarray] = {}
    quantized: dict[str, tuple[np.ndarray, Any]] = {}
    rope_factors = None
    permute = {"self_attn.q_proj": config["num_attention_heads"],
               "self_attn.k_proj": config["num_key_value_heads"]} if arch == "llama" else {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3.1+: per-frequency divisors, precomputed
            rope_factors = np.asarray(t.data, np.float64)
            continue
        name = _hf_name(arch, t.name)
        if name is None:
            raise EdgespecError(f"{path}: tensor '{t.name}' has no place in a {arch} decoder; "
                                "the file holds parts edgespec does not import.")
        data = t.data
        heads = next((h for stem, h in permute.items() if f".{stem}." in name), None)
        if heads is not None:
            data = _unpermute(np.asarray(data), heads)
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name in FLOAT_TYPES:
            if qtype.name == "BF16":
                import ml_dtypes

                data = np.asarray(data).view(ml_dtypes.bfloat16)
            tensors[name] = np.asarray(data).reshape([int(d) for d in reversed(t.shape)])
        elif qtype in ENCODINGS or (not keep_codes and _dequantizes(data, qtype)):
            quantized[name] = (data, qtype)
        elif keep_codes:
            raise EdgespecError(
                f"{path}: tensor '{t.name}' is {qtype.name}, which edgespec cannot hold "
                f"exactly (supported: {', '.join(FLOAT_TYPES)}, "
                f"{', '.join(q.name for q in ENCODINGS)}); use a file of another quantization, "
                "or export it with --requantize to quantize it anew.")
        else:
            raise EdgespecError(f"{path}: tensor '{t.name}' is {qtype.name}, which gguf-py "
                                "cannot dequantize; use a file of another quantization.")
    return GGUFCheckpoint(path, config, tensors, quantized, keep_codes,
                          norms_shifted=arch.startswith("gemma"), rope_factors=rope_factors)


def _dequantizes(data: np.ndarray, qtype: Any) -> bool:
    """Whether gguf-py dequantizes this type (the requantize route reads any it does)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    size = GGML_QUANT_SIZES[qtype][1]
    try:
        dequantize(np.asarray(data).reshape(-1)[:size], qtype)
    except NotImplementedError:
        return False
    return True


def open_reader(path: Path) -> Any:
    """gguf-py's reader, with a truncated or foreign file refused in one sentence.

    Reading a file's tables takes seconds where the vocabulary is large (Gemma 3's 262,144
    tokens: 8 s), and an export reads them for its checks, the tokenizer and the tensors:
    the last two files' readers are kept while the files are unchanged, until
    forget_readers()."""
    check_gguf_magic(path)
    st = path.stat()
    try:
        return _parsed(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except (ValueError, IndexError, OSError, KeyError, UnicodeDecodeError):
        raise EdgespecError(f"{path} is a damaged or truncated GGUF file (gguf-py cannot "
                            "read its tensor table); download it again.") from None


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def forget_readers() -> None:
    """Let the kept readers go (and their maps of the files), once an export is done."""
    _parsed.cache_clear()
