"""Every supported architecture, random-init and tiny, exported and compared with
transformers' PyTorch forward: prefill, single steps and multi-token chunks."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.export import export
from edgespec.runtimes import DecoderSession
from edgespec.runtimes.decoder import NEG_INF
from tests.conftest import torch_logits

TOL = 1e-4
VOCAB = 4096
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def configs():
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
    return {
        "llama": LlamaConfig(**BASE),
        "llama-tied-mqa": LlamaConfig(**{**BASE, "num_key_value_heads": 1,
                                         "tie_word_embeddings": True}),
        "llama3.1-rope": LlamaConfig(**BASE, rope_parameters=llama3_rope),
        "llama-linear-rope": LlamaConfig(**BASE, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "mistral-sliding": MistralConfig(**BASE, sliding_window=6),
        "qwen2": Qwen2Config(**{**BASE, "tie_word_embeddings": True}),
        "qwen3": Qwen3Config(**BASE, head_dim=32),
        "phi3": Phi3Config(**BASE, pad_token_id=0),
        "gemma": GemmaConfig(**BASE, head_dim=32, hidden_activation="gelu_pytorch_tanh"),
        "gemma2": Gemma2Config(**BASE, head_dim=16, query_pre_attn_scalar=24,
                               sliding_window=5, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0),
        # sliding layers with a RoPE base of their own, a global layer with a scaled one
        "gemma3": Gemma3TextConfig(**BASE, head_dim=32, query_pre_attn_scalar=20,
                                   sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention",
                                                "sliding_attention"],
                                   rope_parameters={
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 1000000.0}}),
        # head sizes GQA's CPU kernel cannot take (padded) and one it can
        "llama-head8": LlamaConfig(**BASE, head_dim=8),
        "qwen3-head24": Qwen3Config(**BASE, head_dim=24),
        "llama-head40": LlamaConfig(**{**BASE, "num_key_value_heads": 1}, head_dim=40),
        "gemma3-head80": Gemma3TextConfig(**BASE, head_dim=80, sliding_window=6),
    }


@pytest.fixture(scope="module", params=list(configs()))
def checkpoint(request, tmp_path_factory, demo_target):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = configs()[request.param]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms/biases, so the tests see them (init is ones/zeros)
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_target / f, path / f)
    return path, model


def test_fp32_export_matches_transformers(checkpoint, tmp_path):
    path, model = checkpoint
    export(path, tmp_path / "b", precision="fp32")
    data = (tmp_path / "b" / "target.onnx.data").stat().st_size
    assert data < 4 * model.num_parameters() * 1.02  # a tied embedding is stored once
    sess = session(tmp_path / "b")
    ids = np.random.default_rng(0).integers(0, VOCAB, 24)
    ref = torch_logits(model, ids)
    got = np.concatenate([sess.forward(ids[:9]), sess.forward(ids[9:10]),
                          sess.forward(ids[10:11]), sess.forward(ids[11:])])
    assert np.abs(got - ref).max() < TOL * max(1.0, np.abs(ref).max())


def test_a_bfloat16_checkpoint_exports_as_transformers_reads_it(tmp_path, demo_target):
    """Hub checkpoints are mostly bfloat16 (safetensors BF16, which edgespec reads through
    ml_dtypes, imported only then): the fp32 export of one computes what transformers
    computes from the same file."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs()["llama"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_target / f, tmp_path / "ckpt" / f)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt",
                                                     dtype=torch.float32).eval()
    export(tmp_path / "ckpt", tmp_path / "b", precision="fp32")
    ids = np.random.default_rng(5).integers(0, VOCAB, 16)
    ref = torch_logits(reference, ids)
    got = session(tmp_path / "b").forward(ids)
    assert np.abs(got - ref).max() < TOL * max(1.0, np.abs(ref).max())


# a config.json as some releases wrote it: (architecture, the model's own settings, keys
# left out of its config.json, keys set there)
EDITED = {
    "gemma, legacy gelu": ("gemma", {}, ["architectures", "hidden_activation"],
                           {"hidden_act": "gelu"}),
    "qwen2, a model_type only": ("qwen2", {}, ["architectures"], {}),
    "qwen2, windows from a layer on": ("qwen2", {"use_sliding_window": True,
                                                 "sliding_window": 5, "max_window_layers": 2},
                                       ["layer_types"], {}),
    "gemma2, soft-caps left out": ("gemma2", {}, ["attn_logit_softcapping",
                                                  "final_logit_softcapping"], {}),
    "gemma, head size left out": ("gemma", {"head_dim": 256}, ["head_dim"], {}),
    "qwen3, head size left out": ("qwen3", {"head_dim": 128}, ["head_dim"], {}),
    # transformers 5 keeps a stored head that differs from the embedding (and warns)
    "llama, tied in its config but a head of its own": ("llama", {}, [],
                                                        {"tie_word_embeddings": True}),
}


def edited_checkpoint(path, demo_target, name: str, settings: dict, drop: list, put: dict):
    import json

    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = configs()[name]
    for key, value in settings.items():
        setattr(config, key, value)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_target / f, path / f)
    saved = json.loads((path / "config.json").read_text())
    for key in drop:
        saved.pop(key, None)
    (path / "config.json").write_text(json.dumps({**saved, **put}))


@pytest.mark.parametrize("case", list(EDITED))
def test_a_config_as_some_releases_wrote_it_exports_as_transformers_reads_it(tmp_path,
                                                                           demo_target, case):
    """Gemma's first releases say `hidden_act: gelu` for the tanh approximation; some
    configs name no `architectures`, only a model_type; Qwen2's older ones slide from
    `max_window_layers` on, without `layer_types`; and a key left out means transformers'
    default (Gemma 2's soft-caps 50 and 30, Gemma's head size 256, Qwen3's 128)."""
    from transformers import AutoModelForCausalLM

    edited_checkpoint(tmp_path / "ckpt", demo_target, *EDITED[case])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt",
                                                     dtype=torch.float32).eval()
    export(tmp_path / "ckpt", tmp_path / "b", precision="fp32")
    ids = np.random.default_rng(2).integers(0, VOCAB, 16)
    ref = torch_logits(reference, ids)
    assert np.abs(session(tmp_path / "b").forward(ids) - ref).max() < \
        TOL * max(1.0, np.abs(ref).max())


def test_the_config_defaults_are_transformers_own():
    import transformers

    from edgespec.export.architectures import CONFIG_DEFAULTS

    for arch, defaults in CONFIG_DEFAULTS.items():
        name = arch.replace("ForCausalLM", "TextConfig" if arch.startswith("Gemma3") else "Config")
        config = getattr(transformers, name)()
        assert {k: getattr(config, k) for k in defaults} == defaults, arch


@pytest.mark.parametrize("drop, put, told", [
    (["hidden_size"], {}, "config.json's hidden_size is missing"),
    ([], {"rms_norm_eps": None}, "config.json's rms_norm_eps is None, not a positive float"),
    ([], {"num_hidden_layers": "3"}, "num_hidden_layers is '3', not a positive int")])
def test_a_config_without_a_size_it_needs_is_refused_in_one_sentence(tmp_path, demo_target,
                                                                     drop, put, told):
    edited_checkpoint(tmp_path / "ckpt", demo_target, "qwen2", {}, drop, put)
    with pytest.raises(EdgespecError, match=told):
        export(tmp_path / "ckpt", tmp_path / "b", precision="fp32")
    assert not (tmp_path / "b").exists()


def test_rotated_export_computes_the_same_function(checkpoint, tmp_path):
    """--quant rot folds orthogonal rotations into the weights (export.rotation): in fp32
    the graph must still compute transformers' logits, for every family that has no norm
    on its branch outputs; Gemma 2/3's sandwich norms are refused with a sentence."""
    path, model = checkpoint
    if getattr(model.config, "model_type", "") in ("gemma2", "gemma3_text"):
        with pytest.raises(EdgespecError, match="cannot pass through"):
            export(path, tmp_path / "b", precision="fp32", quant="rot")
        assert not (tmp_path / "b").exists()
        return
    export(path, tmp_path / "b", precision="fp32", quant="rot")
    sess = session(tmp_path / "b")
    ids = np.random.default_rng(3).integers(0, VOCAB, 24)
    ref = torch_logits(model, ids)
    got = np.concatenate([sess.forward(ids[:9]), sess.forward(ids[9:10]),
                          sess.forward(ids[10:])])
    assert np.abs(got - ref).max() < TOL * max(1.0, np.abs(ref).max())


def session(bundle) -> DecoderSession:
    m = read_manifest(bundle)
    return DecoderSession(bundle / "target.onnx", m.target, ["CPUExecutionProvider"])


@pytest.mark.parametrize("profile", ["cuda", "dml"])
def test_gpu_profile_fp16_graph_on_cpu_ep(checkpoint, tmp_path, profile):
    """The cuda and dml profiles compute in fp16 (CUDA's GQA has no fp32 kernel; dml uses
    MultiHeadAttention with a concatenated cache); the CPU EP runs the same graphs, so
    their wiring is checked here against PyTorch in fp32, including a rollback. fp16
    keeps ~3 significant digits: a tolerance of 2e-2 of the largest logit."""
    path, model = checkpoint
    config = model.config
    if profile == "dml" and (getattr(config, "sliding_window", None)
                             or getattr(config, "attn_logit_softcapping", None)):
        with pytest.raises(EdgespecError, match="dml profile cannot express"):
            export(path, tmp_path / "b", precision="fp16", ep_profile=profile)
        assert not (tmp_path / "b").exists()
        return
    export(path, tmp_path / "b", precision="fp16", ep_profile=profile)
    m = read_manifest(tmp_path / "b")
    assert m.target.kv_dtype == "float16"
    assert m.target.kv_layout == {"cuda": "gqa-shared-buffer", "dml": "mha-concat"}[profile]
    sess = session(tmp_path / "b")
    ids = np.random.default_rng(2).integers(0, VOCAB, 24)
    ref = torch_logits(model, ids)
    got = np.concatenate([sess.forward(ids[:9]), sess.forward(ids[9:10]),
                          sess.forward(ids[10:])])
    tol = 2e-2 * max(1.0, np.abs(ref).max())
    assert np.abs(got - ref).max() < tol
    sess.cache.trim(4)
    assert np.abs(sess.forward(ids[20:]) - ref[20:]).max() < tol


def test_tree_pass_gives_each_node_its_path_logits(checkpoint, tmp_path):
    """Tree a -> (b -> d, c) after a prefix: one pass, four nodes, three paths."""
    path, model = checkpoint
    export(path, tmp_path / "b", precision="fp32")
    sess = session(tmp_path / "b")
    prefix = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 8)]
    a, b, c, d = 11, 222, 3333, 44
    sess.forward(prefix)
    n = len(prefix)
    parents = [-1, 0, 0, 1]
    bias = np.full((1, 1, 4, n + 4), NEG_INF, np.float32)
    bias[0, 0, :, :n] = 0
    for node in range(4):
        anc = node
        while anc >= 0:
            bias[0, 0, node, n + anc] = 0
            anc = parents[anc]
    got = sess.forward([a, b, c, d], positions=np.array([n, n + 1, n + 1, n + 2]), bias=bias)
    via_d = torch_logits(model, prefix + [a, b, d])
    via_c = torch_logits(model, prefix + [a, c])
    want = np.stack([via_d[n], via_d[n + 1], via_c[n + 1], via_d[n + 2]])
    assert np.abs(got - want).max() < TOL * max(1.0, np.abs(want).max())


def test_greedy_generation_matches_transformers(checkpoint, tmp_path):
    path, model = checkpoint
    export(path, tmp_path / "b", precision="fp32")
    sess = session(tmp_path / "b")
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, VOCAB, 6)]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6),
                              max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 6:].tolist()
    got, logits = [], sess.forward(prompt)
    for _ in range(32):
        got.append(int(np.argmax(logits[-1])))
        logits = sess.forward(got[-1:])
    assert got == want


def test_int4_export_runs_and_stays_close(checkpoint, tmp_path):
    path, model = checkpoint
    export(path, tmp_path / "b", precision="int4", block_size=32)
    sess = session(tmp_path / "b")
    ids = np.random.default_rng(1).integers(0, VOCAB, 16)
    ref = torch_logits(model, ids)
    got = sess.forward(ids)
    # random weights are the worst case for 4 bits; this checks wiring, not quality
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    assert corr > 0.9


def test_an_untied_config_without_a_head_is_refused(tmp_path, demo_target):
    """A config that unties the embeddings from a checkpoint that stores no head: transformers
    loads it with a freshly initialized head (its logits are noise), so the export refuses
    it rather than score with the embedding, which the config says is not the head."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    edited_checkpoint(tmp_path / "ckpt", demo_target, "qwen2", {"tie_word_embeddings": True},
                      [], {"tie_word_embeddings": False})
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    with pytest.raises(EdgespecError, match="has no lm_head.weight"):
        export(tmp_path / "ckpt", tmp_path / "b", precision="fp32")
    assert not (tmp_path / "b").exists()
