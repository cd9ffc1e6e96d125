"""Exported graphs against transformers' PyTorch forward (the independent oracle)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.export import export
from edgespec.quant import dequantize, quantize_blockwise
from edgespec.runtimes import DecoderSession
from edgespec.runtimes.decoder import NEG_INF
from tests.conftest import torch_logits, torch_model

CPU = ["CPUExecutionProvider"]
FP32_TOL = 1e-4  # max abs logit diff, fp32 graph vs PyTorch fp32 (observed ~1e-6)
W8_TOL = 2e-3  # int8 graph (fp32 activations) vs PyTorch on the same dequantized weights
A8_TOL = 0.25  # int8 activations too (accuracy_level 4): observed 0.11-0.14 (logits up to ~16)
# quantized (accuracy_level 4) vs fp16 next-token distributions on 256 tokens of held-out
# code; observed over six held-aside files: int8 top-1 0.977-1.0, KL <= 2e-4; int4 top-1
# 0.875-0.99, KL <= 0.014 (on the file tested: 0.992 / 2e-4 and 0.945 / 0.0136)
INT8_TOP1, INT8_KL = 0.97, 2e-3
INT4_TOP1, INT4_KL = 0.88, 0.05


def session(bundle, role="target") -> DecoderSession:
    m = read_manifest(bundle)
    entry = m.target if role == "target" else m.draft
    return DecoderSession(bundle / entry.graph, entry, CPU)


def quantized_reference(path, bits=8, block=32):
    """The PyTorch model computing with exactly the weights the int8 graph holds."""
    model = torch_model(path)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                w = module.weight.numpy()
                module.weight.copy_(torch.from_numpy(dequantize(quantize_blockwise(w, bits,
                                                                                   block))))
        head = model.lm_head.weight.detach().numpy()
        model.lm_head.weight = torch.nn.Parameter(torch.from_numpy(
            dequantize(quantize_blockwise(head, 8, block))))  # unties; embeddings stay fp16
    return model


def q8_0_reference(path):
    """The PyTorch model computing with the default int8's weights: every linear layer
    and the (tied) head as gguf-py's own Q8_0 quantize + dequantize (an independent
    implementation of llama.cpp's reference), the embedding tied to the head's values."""
    import gguf

    def q8_0(w):
        t = gguf.GGMLQuantizationType.Q8_0
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t))

    model = torch_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the demo pair is tied
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(q8_0(module.weight.numpy()))
    return model


def test_demo_checkpoints_load_in_transformers(demo_target, demo_draft):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    for path in (demo_target, demo_draft):
        model = AutoModelForCausalLM.from_pretrained(path)
        assert isinstance(model, LlamaForCausalLM)
        assert model.dtype == torch.float16
        assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"]


def test_draft_is_at_most_an_eighth_of_the_target(demo_target, demo_draft):
    """Cost per token ~ multiply-adds of the linears (embedding lookup excluded)."""
    def macs(path):
        return sum(m.weight.numel() for m in torch_model(path).modules()
                   if isinstance(m, torch.nn.Linear))
    assert macs(demo_draft) <= macs(demo_target) / 8


def test_fp32_graph_matches_pytorch_incrementally(fp32_bundle, demo_target):
    ids = np.random.default_rng(0).integers(0, 4096, 40)
    ref = torch_logits(torch_model(demo_target), ids)
    sess = session(fp32_bundle)
    got = np.concatenate([sess.forward(ids[:29]), sess.forward(ids[29:30]),
                          sess.forward(ids[30:33]), sess.forward(ids[33:])])
    assert np.abs(got - ref).max() < FP32_TOL


def test_fp32_draft_matches_pytorch(fp32_bundle, demo_draft):
    ids = np.random.default_rng(1).integers(0, 4096, 25)
    ref = torch_logits(torch_model(demo_draft), ids)
    assert np.abs(session(fp32_bundle, "draft").forward(ids) - ref).max() < FP32_TOL


@pytest.fixture(scope="module")
def w8_bundle(tmp_path_factory, demo_target, demo_draft):
    out = tmp_path_factory.mktemp("w8") / "bundle"
    # uncalibrated: Q8_0's reference rounding, what gguf-py's quantize computes
    export(demo_target, out, draft=demo_draft, precision="int8", accuracy_level=0,
           calibration=None)
    return out


def incremental_logits(sess: DecoderSession, ids) -> np.ndarray:
    return np.concatenate([sess.forward(ids[:40]), sess.forward(ids[40:41]),
                           sess.forward(ids[41:])])


def test_int8_graph_computes_with_exactly_the_dequantized_weights(w8_bundle, demo_target,
                                                                  demo_draft):
    ids = np.random.default_rng(2).integers(0, 4096, 48)
    for role, path in (("target", demo_target), ("draft", demo_draft)):
        ref = torch_logits(q8_0_reference(path), ids)
        got = incremental_logits(session(w8_bundle, role), ids)
        assert np.abs(got - ref).max() < W8_TOL, role


def test_shipped_bundle_matches_pytorch(demo_bundle, demo_target, demo_draft):
    """The shipped target holds the checkpoint's fp16 weights and computes in fp32, so it
    matches PyTorch fp32 closely; the shipped draft is int8 with int8 activations
    (accuracy_level 4), compared with PyTorch on the same dequantized weights."""
    m = read_manifest(demo_bundle)
    assert (m.target.precision, m.draft.precision) == ("fp16", "int8")
    ids = np.random.default_rng(2).integers(0, 4096, 48)
    target = incremental_logits(session(demo_bundle, "target"), ids)
    assert np.abs(target - torch_logits(torch_model(demo_target), ids)).max() < FP32_TOL
    ref = torch_logits(quantized_reference(demo_draft), ids)
    draft = incremental_logits(session(demo_bundle, "draft"), ids)
    assert np.abs(draft - ref).max() < A8_TOL
    assert (draft.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_tree_bias_verifies_branches_in_one_pass(fp32_bundle, demo_target):
    """Nodes a; b and c both children of a: one pass gives each branch's own logits."""
    model = torch_model(demo_target)
    prefix, a, b, c = [0, 17, 300, 41, 9], 77, 123, 555
    sess = session(fp32_bundle)
    sess.forward(prefix)
    past = len(prefix)
    bias = np.zeros((1, 1, 3, past + 3), np.float32)
    bias[0, 0, 2, past + 1] = NEG_INF  # c does not see its sibling b
    positions = np.array([past, past + 1, past + 1])  # tree depth
    got = sess.forward([a, b, c], positions=positions, bias=bias)
    via_b = torch_logits(model, prefix + [a, b])
    via_c = torch_logits(model, prefix + [a, c])
    assert np.abs(got[0] - via_b[past]).max() < FP32_TOL
    assert np.abs(got[1] - via_b[past + 1]).max() < FP32_TOL
    assert np.abs(got[2] - via_c[past + 1]).max() < FP32_TOL


def test_cache_trim_rolls_back(fp32_bundle, demo_target):
    ids = [0, 5, 6, 7, 8, 9]
    ref = torch_logits(torch_model(demo_target), ids + [42])
    sess = session(fp32_bundle)
    sess.forward(ids + [1, 2, 3])
    sess.cache.trim(3)  # a rejected continuation
    assert np.abs(sess.forward([42])[0] - ref[-1]).max() < FP32_TOL


def test_export_errors(tmp_path, demo_target):
    with pytest.raises(EdgespecError, match="does not exist; pass a .gguf file, a checkpoint"):
        export("./missing/dir", tmp_path / "b")
    with pytest.raises(EdgespecError, match="'webgpu' is not one of cpu, cuda, dml"):
        export(demo_target, tmp_path / "b", ep_profile="webgpu")
    with pytest.raises(EdgespecError, match="dml profile supports fp32, fp16 and int4.*"
                                            "instead of --precision int8, pass"):
        export(demo_target, tmp_path / "b", ep_profile="dml", precision="int8")
    with pytest.raises(EdgespecError, match="instead of --draft-precision int2, pass"):
        export(demo_target, tmp_path / "b", ep_profile="dml", precision="fp16",
               draft=demo_target, draft_precision="int2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EdgespecError, match="has no config.json"):
        export(tmp_path / "empty", tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_unsupported_architecture_lists_supported(tmp_path, demo_target):
    ckpt = shutil.copytree(demo_target, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgespecError, match="FalconForCausalLM is not supported.*Llama"):
        export(ckpt, tmp_path / "b")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("key,change", [("hidden_size", 2), ("num_key_value_heads", 2),
                                        ("intermediate_size", 2)])
def test_a_config_that_does_not_describe_its_weights_is_refused(tmp_path, demo_target, key,
                                                                change):
    ckpt = shutil.copytree(demo_target, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config[key] *= change
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(EdgespecError, match="config.json describes .* does not match the "
                                            "weights"):
        export(ckpt, tmp_path / "b", precision="fp32")
    assert not (tmp_path / "b").exists()


def test_mismatched_draft_vocabulary_is_refused(tmp_path, demo_target):
    draft = shutil.copytree(demo_target, tmp_path / "draft")
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]  # two tokens' ids swapped: a readable, other tokenizer
    first, second = (next(k for k, v in vocab.items() if v == i) for i in (300, 301))
    vocab[first], vocab[second] = 301, 300
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(EdgespecError, match="draft's tokenizer differs.*id 300"):
        export(demo_target, tmp_path / "b", draft=draft)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_tokenizer_the_model_cannot_take_is_refused_at_export(tmp_path, demo_target,
                                                                demo_draft, role):
    """Before, these exported: an unreadable tokenizer into a bundle that could not load
    (and exported so again), ids past a smaller embedding into ONNX Runtime's Gather error
    on the first such token."""
    from tests.conftest import torch_model

    model = torch_model(demo_draft)
    model.resize_token_embeddings(1000)
    model.save_pretrained(tmp_path / "small")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_draft / f, tmp_path / "small" / f)
    pair = {"target": (tmp_path / "small", None), "draft": (demo_target, tmp_path / "small")}
    with pytest.raises(EdgespecError, match="small's tokenizer has 4096 tokens but its "
                                            "embedding only 1000 rows"):
        export(pair[role][0], tmp_path / "b", draft=pair[role][1], precision="fp32")
    broken = shutil.copytree(demo_target, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("garbage")
    with pytest.raises(EdgespecError, match="cannot be read as a tokenizer .*; fix broken's "
                                            "tokenizer or download it again"):
        export(broken, tmp_path / "b", draft=demo_draft if role == "draft" else None)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("padded", ["draft", "target"])
def test_a_draft_whose_embedding_is_padded_to_another_size_is_taken(tmp_path, demo_target,
                                                                    demo_draft, padded):
    """Same tokenizer, vocab_size padded differently (Qwen2.5's 0.5B and 7B): the draft
    scores the ids both have, and speculation stays exact."""
    import edgespec
    from tests.conftest import torch_model

    source = {"draft": demo_draft, "target": demo_target}[padded]
    model = torch_model(source)
    model.resize_token_embeddings(model.config.vocab_size + 64, mean_resizing=False)
    model.save_pretrained(tmp_path / "padded")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / f, tmp_path / "padded" / f)
    pair = {"draft": (demo_target, tmp_path / "padded"),
            "target": (tmp_path / "padded", demo_draft)}[padded]
    export(pair[0], tmp_path / "b", draft=pair[1], precision="fp32")
    engine = edgespec.load(tmp_path / "b")
    ar = engine.generate("def quicksort(items):", max_new_tokens=40, mode="ar")
    spec = engine.generate("def quicksort(items):", max_new_tokens=40, mode="spec")
    assert spec.token_ids == ar.token_ids and spec.stats.accepted > 0


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     KeyboardInterrupt()])
def test_interrupted_export_leaves_nothing(tmp_path, demo_target, monkeypatch, failure):
    """The disk fills up (or the user presses Ctrl-C) while the weights are written."""
    import edgespec.export.pipeline as exporter

    def broken_save(*args, **kwargs):
        raise failure

    monkeypatch.setattr(exporter.onnx, "save_model", broken_save)
    expected = EdgespecError if isinstance(failure, OSError) else KeyboardInterrupt
    with pytest.raises(expected) as info:
        export(demo_target, tmp_path / "out" / "b")
    if expected is EdgespecError:
        assert "No space left on device" in str(info.value)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("precision,min_top1,max_kl", [("int8", INT8_TOP1, INT8_KL),
                                                       ("int4", INT4_TOP1, INT4_KL)])
def test_quantized_agreement_with_the_fp16_model(tmp_path, demo_target, precision, min_top1,
                                                  max_kl):
    """Top-1 agreement and mean KL(fp16 || quantized) of next-token distributions on real
    code the demo never trained on (a held-aside stdlib file), accuracy_level 4."""
    import sysconfig

    from edgespec.tokenizer import Tokenizer

    card = json.loads((demo_target.parent / "model_card.json").read_text())
    source = (Path(sysconfig.get_paths()["stdlib"]) / card["held_aside_files"][3]).read_text()
    ids = Tokenizer.from_dir(demo_target).encode(source)[:256]
    export(demo_target, tmp_path / "b", precision=precision)
    ref = torch_logits(torch_model(demo_target), ids)
    got = session(tmp_path / "b").forward(ids)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    p, q = log_softmax(ref.astype(np.float64)), log_softmax(got.astype(np.float64))
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    print(f"{precision}: top-1 agreement {top1:.3f}, mean KL {kl:.4f}")
    assert top1 >= min_top1 and kl <= max_kl


def test_a_model_too_big_for_its_hessians_calibrates_importance_only(tmp_path, demo_target,
                                                                    monkeypatch):
    """Past calibrate.GRAM_BUDGET an export measures each linear input's squares only:
    the importance-weighted search without GPTQ. Each step of information counts, on text
    calibration never saw: GPTQ (XᵀX) < importance (its diagonal) < none, in KL."""
    from edgespec.export import calibrate

    def kl(**options) -> float:
        out = tmp_path / "b"
        export(demo_target, out, draft="none", precision="int4", overwrite=True,
               summary=False, **options)
        return json.loads((out / "edgespec.json").read_text())["provenance"]["quality"]["kl"]

    gptq = kl()
    monkeypatch.setattr(calibrate, "GRAM_BUDGET", 0)
    importance = kl()
    assert gptq < importance < kl(calibration=None)


def source_of(architecture: str, kind: str = "hf"):
    from edgespec.export.source import Source

    def unread():
        raise AssertionError("choosing a quantization reads no weights")

    return Source(architecture, Path("."), {"architectures": [architecture]}, [], None,
                  unread, kind)


@pytest.mark.parametrize("change,rotated", [
    ({}, True), ({"precision": "int4", "draft_precision": "int4"}, False),
    ({"draft_precision": "int4"}, False), ({"ep_profile": "cuda"}, False),
    ({"accuracy_level": 0}, False), ({"nested": True}, False),
    ({"target": "Gemma3ForCausalLM"}, False), ({"target": "Gemma2ForCausalLM"}, False),
    ({"target": "Qwen3ForCausalLM"}, True), ({"kind": "gguf"}, False),
    ({"kind": "gguf", "requantize": True}, True), ({"draft": "LlamaForCausalLM"}, True),
    ({"draft": "Gemma3ForCausalLM"}, False)])
def test_auto_quantization_is_rot_where_the_kernels_run_it(change, rotated, monkeypatch):
    """--quant auto: rotated int8 only for float weights at int8 on the cpu profile with
    int8 activations, the kernel library built, and every model able to take rotations;
    llama.cpp's recipe everywhere else. A quantization asked for is kept as it is."""
    from edgespec import kernels
    from edgespec.export.pipeline import chosen_quant

    case = {"target": "LlamaForCausalLM", "kind": "hf", "draft": None, "precision": "int8",
            "draft_precision": "int8", "ep_profile": "cpu", "accuracy_level": 4,
            "nested": False, "requantize": False, **change}
    target = source_of(case["target"], case["kind"])
    draft = source_of(case["draft"], case["kind"]) if case["draft"] else None
    args = (target, draft, case["precision"], case["draft_precision"], case["ep_profile"],
            case["accuracy_level"], case["nested"], case["requantize"])
    rot = rotated and kernels.for_export()
    assert chosen_quant("auto", *args) == ("rot" if rot else "k")
    assert all(chosen_quant(q, *args) == q for q in ("k", "sym", "asym", "rot"))
    monkeypatch.setenv("EDGESPEC_KERNELS", "onnxruntime")  # exports for any ONNX Runtime
    assert chosen_quant("auto", *args) == "k"
