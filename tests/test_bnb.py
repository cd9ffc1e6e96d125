"""Importing bitsandbytes checkpoints (NF4 with double quantization, LLM.int8) saved by
transformers itself: the exported fp32 graph must compute with exactly the weights
bitsandbytes dequantizes to."""

from __future__ import annotations

import shutil

import bitsandbytes as bnb
import numpy as np
import pytest
import torch

from edgespec.bundle import read_manifest
from edgespec.export import export
from edgespec.runtimes import DecoderSession
from tests.conftest import torch_logits


def dequantized_twin(quantized):
    """The same model in fp32 with each bitsandbytes layer replaced by its dequantized
    weight, computed by bitsandbytes from the loaded (not the saved) state."""
    from transformers import AutoModelForCausalLM

    twin = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32).eval()
    state = {}
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            state[f"{name}.weight"] = bnb.functional.dequantize_4bit(w.data, w.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            state[f"{name}.weight"] = module.weight.data.float() * (
                module.weight.SCB.float()[:, None] / 127.0)
    for name, tensor in quantized.state_dict().items():
        if name.endswith("norm.weight") or "embed_tokens" in name or name == "lm_head.weight":
            state[name] = tensor.float()
    twin.load_state_dict(state, strict=False)
    return twin


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bnb_checkpoint_imports_exactly(tmp_path, demo_target, kind):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)
             if kind == "nf4" else BitsAndBytesConfig(load_in_8bit=True))
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "src", quantization_config=quant,
                                                     device_map="cpu")
    quantized.save_pretrained(tmp_path / "bnb")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_target / f, tmp_path / "bnb" / f)

    export(tmp_path / "bnb", tmp_path / "bundle", precision="fp32")
    m = read_manifest(tmp_path / "bundle")
    assert m.target.params == sum(p.numel() for p in dequantized_twin(quantized).parameters())
    sess = DecoderSession(tmp_path / "bundle" / "target.onnx", m.target,
                          ["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 4096, 12)
    ref = torch_logits(dequantized_twin(quantized), ids)
    assert np.abs(sess.forward(ids) - ref).max() < 1e-4
