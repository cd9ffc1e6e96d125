"""GGUF files in, as users have them: the two registry models exported and compared with
transformers' own GGUF loading (an independent dequantizer and tokenizer conversion),
`--model FILE.gguf` through the cache, and damaged or unsupported files refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
import torch

import edgespec
from edgespec import kernels
from edgespec.bundle import read_manifest
from edgespec.export import export
from edgespec.quant import kquants
from edgespec.runtimes import DecoderSession
from edgespec.tokenizer import Tokenizer
from tests.real_models import gemma_gguf, smollm2_gguf
from tests.test_cli import assert_user_error, run

T = gguf.GGMLQuantizationType

# held-out text: prose, code and a list, none of it in edgespec's built-in prompts
HELD_OUT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, "
            "counting one hundred and twelve steps before the lamp room.\n\n"
            "def merge(left, right):\n    out = []\n    while left and right:\n"
            "        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
            "    return out + left + right\n\n"
            "Shopping list: flour, two eggs, a litre of milk, and some fresh basil.")
TEXTS = ["Hello world", "What is the capital of France?", "  leading spaces\tand tabs\n\n",
         "def f(x):\n    return x**2 + 12345 * 0.5", "Ünïcödé — 日本語のテキスト 🙂🚀",
         "numbers 1 22 333 4444 3.14159", "a  b   c    d", "don't won't I'm they'll", " ",
         "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>"]


def hf(path: Path):
    """transformers' tokenizer and fp32 model from the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def smollm2():
    return (smollm2_gguf(), *hf(smollm2_gguf()))


@pytest.fixture(scope="module")
def gemma():
    return (gemma_gguf(), *hf(gemma_gguf()))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Default exports (and SmolLM2 with fp32 activations, the exact-weights check)."""
    root = tmp_path_factory.mktemp("gguf")
    export(smollm2_gguf(), root / "smollm2")
    export(smollm2_gguf(), root / "smollm2-acc0", accuracy_level=0)
    export(gemma_gguf(), root / "gemma")
    return root


def bundle_logits(bundle: Path, ids: list[int]) -> np.ndarray:
    m = read_manifest(bundle)
    sess = DecoderSession(bundle / "target.onnx", m.target, ["CPUExecutionProvider"])
    # a prefill, a single step, then a chunk: every kind of pass
    return np.concatenate([sess.forward(ids[:20]), sess.forward(ids[20:21]),
                           sess.forward(ids[21:])])


def kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == got.argmax(-1)).mean())


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2, bundles):
    _, ref, _ = smollm2
    ours = Tokenizer.from_dir(bundles / "smollm2")
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"])
    for messages in ([{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi 🙂"},
                      {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "def f(): pass — explain"}]):
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert ours.encode_chat(messages) == want
        begun = [*messages, {"role": "assistant", "content": "Sure: 2"}]
        want = ref.apply_chat_template(begun, continue_final_message=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert ours.encode_chat(begun, continue_final=True) == want


def test_gemma_tokenizer_matches_transformers(gemma, bundles):
    _, ref, _ = gemma
    ours = Tokenizer.from_dir(bundles / "gemma")
    for text in TEXTS + [HELD_OUT]:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"])


def test_smollm2_logits_match_transformers(smollm2, bundles):
    """Exact weights: with fp32 activations the logits are transformers' own (KL ~1e-11);
    the default int8 activations (as llama.cpp's) stay close: measured KL 0.0038, top-1
    98% on this text."""
    _, tok, model = smollm2
    ids = tok(HELD_OUT)["input_ids"]
    ref = reference_logits(model, ids)
    kl, top1 = kl_top1(ref, bundle_logits(bundles / "smollm2-acc0", ids))
    assert kl < 1e-8 and top1 == 1.0
    kl, top1 = kl_top1(ref, bundle_logits(bundles / "smollm2", ids))
    assert kl < 0.01 and top1 >= 0.9, (kl, top1)


def test_gemma_logits_match_transformers(gemma, bundles):
    """Measured: KL 0.0027, top-1 98% (default export, int8 activations)."""
    _, tok, model = gemma
    ids = tok(HELD_OUT)["input_ids"]
    kl, top1 = kl_top1(reference_logits(model, ids), bundle_logits(bundles / "gemma", ids))
    assert kl < 0.01 and top1 >= 0.9, (kl, top1)


def test_gemma_greedy_continuations_equal_transformers(gemma, tmp_path):
    """With fp32 activations (the weights are exact), greedy decoding of the real 270M
    follows transformers' token for token, across its sliding and global layers."""
    path, tok, model = gemma
    export(path, tmp_path / "b", accuracy_level=0)
    engine = edgespec.load(tmp_path / "b")
    for prompt in ("The three primary colours are", "def fibonacci(n):"):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        got = engine.generate(ids, max_new_tokens=12, mode="ar").token_ids
        assert got == want[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_default_exports_are_batch_invariant(bundles, name):
    """A token's logits are bitwise the same fed alone, inside 5- and 17-token chains,
    on a branch of a 5- or 17-node token tree (edgespec's own attention: Gemma's sliding
    windows and head norms included) or last in a prefill that scores its last two rows
    only, so speculation cannot change a greedy answer even at a near-tie."""
    from edgespec.runtimes.exactness import measure

    engine = edgespec.load(bundles / name, device="cpu")
    rng = np.random.default_rng(0)
    prefix, ids = (rng.integers(3, engine.target.vocab, n).tolist() for n in (40, 17))
    assert engine.target.exact_trees == kernels.for_export()
    got = measure(engine.target, prefix, ids, trees=(5, 17) if kernels.for_export() else ())
    assert got.chain == got.prefill == {5: 0.0, 17: 0.0}
    if kernels.for_export():
        assert got.tree == {5: 0.0, 17: 0.0}


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_default_exports_speculate_with_the_shipped_head(bundles, name):
    """No --draft: the head shipped for the file is in the bundle, the default mode
    drafts with it, and greedy output is the bundle's own AR output."""
    engine = edgespec.load(bundles / name)
    assert read_manifest(bundles / name).draft.kind == "eagle"
    for prompt in ("The three primary colours are", "def fibonacci(n):"):
        ids = engine.tokenizer.encode(prompt)
        spec = engine.generate(ids, max_new_tokens=24)
        assert spec.stats.mode == "spec" and spec.stats.drafted > 0
        assert spec.token_ids == engine.generate(ids, max_new_tokens=24, mode="ar").token_ids


def test_greedy_lookup_equals_ar_on_chat_prompts(bundles):
    engine = edgespec.load(bundles / "smollm2")
    for question in ("What is the capital of France?", "Repeat after me: red, green, blue, "
                     "red, green, blue.", "Write a Python function that adds two numbers."):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": question}])
        ar = engine.generate(ids, max_new_tokens=48, mode="ar")
        lookup = engine.generate(ids, max_new_tokens=48, mode="lookup")
        assert lookup.token_ids == ar.token_ids, question


def test_a_gguf_draft_speculates_losslessly(tmp_path):
    """Target and draft both from GGUF files (here the same file: every draft token is
    accepted); greedy speculation gives the bundle's own AR tokens."""
    export(smollm2_gguf(), tmp_path / "b", draft=smollm2_gguf(), accuracy_level=0)
    engine = edgespec.load(tmp_path / "b")
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    spec = engine.generate(ids, max_new_tokens=16)
    assert spec.stats.mode == "spec" and spec.stats.acceptance_rate > 0.9
    assert spec.token_ids == engine.generate(ids, max_new_tokens=16, mode="ar").token_ids


def test_bundles_are_no_bigger_than_the_files(bundles):
    for name, source in (("smollm2", smollm2_gguf()), ("gemma", gemma_gguf())):
        # the encoding of the file's weights; the shipped draft head comes on top
        size = sum(f.stat().st_size for f in (bundles / name).iterdir()
                   if not f.name.startswith("draft"))
        assert size <= 1.1 * source.stat().st_size, (name, size / source.stat().st_size)
        assert read_manifest(bundles / name).target.precision == "gguf"


# What loading an engine adds to a fresh process's resident memory, in bytes.
LOADED_RSS = """import sys
import edgespec
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) << 10
before = rss()
engine = edgespec.load(sys.argv[1], threads=1)
print(rss() - before)
"""


def test_a_loaded_engine_holds_little_more_than_its_weights(bundles):
    """Loading reads a 14 MB tokenizer.json through ~290 MB of heap and folds the graphs'
    constant tables (kernel layouts, rotary tables) through several copies of each; after
    it, Gemma 3's engine held 6.1 times its bundle's weights. What stays is what it uses:
    the weights, the tables, the tokenizer, the KV caches' first pages."""
    bundle = bundles / "gemma"
    weights = sum(f.stat().st_size for f in bundle.glob("*.data"))
    out = subprocess.run([sys.executable, "-c", LOADED_RSS, str(bundle)], capture_output=True,
                         text=True, timeout=300, check=True)
    grown = int(out.stdout.split()[-1])
    assert grown < 2.5 * weights, (grown >> 20, weights >> 20)


def test_the_files_linears_run_on_the_own_kernel(bundles):
    """Every linear of both files runs on edgespec's kernel (BlockQMatMulHalf where every
    scale and offset is a float16: Q4_1, Q5_0, Q8_0; BlockQMatMulK for Gemma's K-quants,
    Q4_K and Q6_K in blocks of 16, in their super-block tables; Q5_0 and Q6_K at 5 and 6
    bits a code), so the logits tests above
    measure it. The accuracy_level 0 export (fp32 activations) keeps ONNX Runtime's
    kernels."""
    def ops(name: str) -> dict[str, set[int]]:
        graph = onnx.load(str(bundles / name / "target.onnx"), load_external_data=False).graph
        found: dict[str, set[int]] = {}
        for n in graph.node:
            if "MatMul" in n.op_type and n.op_type != "MatMul":
                found.setdefault(n.op_type, set()).update(
                    a.i for a in n.attribute if a.name in ("block_size", "bits"))
        return found

    assert ops("smollm2") == {"BlockQMatMulHalf": {4, 8}}
    assert ops("gemma") == {"BlockQMatMulK": {4, 6}, "BlockQMatMulHalf": {5, 8}}
    assert set(ops("smollm2-acc0")) == {"MatMulNBits"}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run(*args, env=env, timeout=600)  # exports of real models take a while


def test_a_gguf_file_exports_for_directml_as_it_is_and_says_what_bitnest_does(tmp_path):
    import json

    out = cli("export", str(smollm2_gguf()), "--out", str(tmp_path / "d"), "--ep-profile",
              "dml", "--draft", "none")  # the float tensors' default: fp16, not int8
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "d" / "edgespec.json").read_text())
    assert manifest["ep_profile"] == "dml" and manifest["target"]["precision"] == "gguf"
    nested = cli("export", str(smollm2_gguf()), "--out", str(tmp_path / "n"), "--draft",
                 "nested", "--precision", "int4")  # a conflict: refused before any note
    assert_user_error(nested, "--draft nested builds an int8 target")
    assert_user_error(cli("export", str(smollm2_gguf()), "--out", str(tmp_path / "e"),
                          "--ep-profile", "dml", "--precision", "int8"),  # before any note
                      "the dml profile supports fp32, fp16 and int4 weights")
    gguf = str(smollm2_gguf())  # refused after the note (the file as --out), fast
    nested = cli("export", gguf, "--out", gguf, "--overwrite", "--draft", "nested")
    lines = [line for line in nested.stderr.splitlines() if line.strip()]
    assert nested.returncode == 1 and len(lines) == 2, nested.stderr
    assert "re-quantizes" in lines[0] and "do not keep their GGUF types" in lines[0]
    assert "is the file this export reads" in lines[1]


def test_model_option_takes_a_gguf_file_and_exports_it_once(tmp_path, bundles):
    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    args = ("generate", "--model", str(smollm2_gguf()), "--chat", "--max-new-tokens", "12",
            "--json", "What is the capital of France?")
    first = cli(*args, env=env)
    assert first.returncode == 0, first.stderr
    assert "exporting" in first.stderr
    cached = list((tmp_path / "cache" / "bundles").iterdir())
    assert len(cached) == 1
    second = cli(*args, env=env)
    assert second.returncode == 0 and "exporting" not in second.stderr
    assert list((tmp_path / "cache" / "bundles").iterdir()) == cached
    import json

    got = json.loads(second.stdout)
    # the cached bundle is the default export: the same tokens as the one made here
    engine = edgespec.load(bundles / "smollm2")
    ids = engine.tokenizer.encode_chat([{"role": "user",
                                         "content": "What is the capital of France?"}])
    assert got["token_ids"] == engine.generate(ids, max_new_tokens=12).token_ids
    assert got["stats"]["mode"] == "spec"  # the head shipped for this file drafts
    planned = cli("plan", str(smollm2_gguf()), "--gpu-memory", "2GiB", "--json", env=env)
    assert planned.returncode == 0 and "exporting" not in planned.stderr, planned.stderr
    assert json.loads(planned.stdout)["offload"] == "none"  # its cached bundle, whole
    # a cached file opens without the export's imports (onnx and ml_dtypes: 0.4 s)
    opened = subprocess.run(
        [sys.executable, "-c", "import sys, edgespec; edgespec.load(sys.argv[1]).generate("
         "'Hi', max_new_tokens=2); print(sorted({'onnx', 'ml_dtypes'} & set(sys.modules)))",
         str(smollm2_gguf())], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=300, check=True)
    assert opened.stdout.split("\n")[-2] == "[]", opened.stdout


def tiny_gguf(path: Path, arch: str = "llama", qtype=gguf.GGMLQuantizationType.Q8_0,
              tokenizer: bool = True, d: int = 64, embed=gguf.GGMLQuantizationType.Q8_0,
              vocab: int = 300) -> Path:
    """A small but well-formed GGUF file (2 layers, d 64) written with gguf-py, its linears
    in `qtype` and its tied embedding in `embed`; the types gguf-py cannot quantize get
    random blocks with realistic scales."""
    from tests.test_gguf_codes import k_quant_blocks

    w = gguf.GGUFWriter(path, arch)
    ff = 2 * d
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        from edgespec.export.gguf_tokenizer import _byte_alphabet

        w.add_token_list([*_byte_alphabet().values(), "ab",
                          *(f"tok{i}" for i in range(257, vocab))])
        w.add_token_types([1] * vocab)
        w.add_token_merges(["a b"])
        w.add_eos_token_id(0)
    rng = np.random.default_rng(0)

    def tensor(name: str, shape: tuple[int, ...], kind=qtype) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * 0.05
        if kind == gguf.GGMLQuantizationType.F32 or len(shape) == 1:
            w.add_tensor(name, data)
        elif kind in (T.Q4_K, T.Q6_K):  # edgespec's port of llama.cpp's own quantizers
            w.add_tensor(name, kquants.quantize(data, kind), raw_dtype=kind)
        elif kind.name.startswith("IQ") or kind.name.endswith("_K"):  # gguf-py cannot quantize
            # IQ4_XS's d multiplies a 6-bit scale and a grid value up to 127, Q5_K's a 6-bit
            # scale and a code up to 31: weights ~0.1
            scales = (1e-5, 3e-4) if kind in (T.IQ4_XS, T.Q5_K) else (1e-3, 3e-2)
            w.add_tensor(name, k_quant_blocks(kind, shape[0], rng, shape[1], scales),
                         raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    tensor("token_embd.weight", (vocab, d), embed)
    tensor("output_norm.weight", (d,))
    for i in range(2):
        for name, shape in (("attn_q", (d, d)), ("attn_k", (d // 2, d)), ("attn_v", (d // 2, d)),
                            ("attn_output", (d, d)), ("ffn_gate", (ff, d)),
                            ("ffn_up", (ff, d))):
            tensor(f"blk.{i}.{name}.weight", shape)
        tensor(f"blk.{i}.ffn_down.weight", (d, ff), gguf.GGMLQuantizationType.Q8_0)
        tensor(f"blk.{i}.attn_norm.weight", (d,))
        tensor(f"blk.{i}.ffn_norm.weight", (d,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_tiny_well_formed_file_exports_and_runs(tmp_path):
    """The control for the refusals below: the same writer's file is accepted."""
    out = tmp_path / "b"
    result = cli("export", str(tiny_gguf(tmp_path / "tiny.gguf")), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "note:" not in result.stderr
    assert edgespec.load(out).generate([5, 6, 7], max_new_tokens=3, mode="ar").token_ids
    # options for weights the file keeps in its own codes say how little they reach
    noted = cli("export", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "c"),
                "--quant", "sym", "--block-size", "64", "--calibration",
                str(tmp_path / "no such text"))  # unused, so not read (it was refused)
    assert noted.returncode == 0, noted.stderr
    assert "--quant and --block-size apply to its float tensors only; --calibration is not " \
        "used" in " ".join(noted.stderr.split())
    requantized = cli("export", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "d"),
                      "--quant", "sym", "--block-size", "64", "--requantize")
    assert requantized.returncode == 0 and "note:" not in requantized.stderr



# the code width the own kernel reads each type at (5- and 6-bit codes at their own)
KERNEL_BITS = {T.Q2_K: 4, T.Q3_K: 4, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6, T.IQ4_NL: 4,
               T.IQ4_XS: 4, T.Q5_0: 5, T.Q5_1: 5}


@pytest.mark.parametrize("qtype", list(KERNEL_BITS), ids=lambda t: t.name)
def test_files_of_the_low_bit_types_export_with_their_own_weights(tmp_path, qtype):
    """K-quants (sub-blocks of 16 or 32), IQ4's table codes and the 5-bit types, in every
    linear and in the tied embedding the head shares: with float32 activations
    (MatMulNBits) the logits are transformers' own from the file; the default export puts
    every one on the own kernel (the K-quants in their super-block tables, 5- and 6-bit
    codes read at their width), and its logits (int8 activations) are close and batch
    invariant."""
    from edgespec.runtimes.exactness import measure

    path = tiny_gguf(tmp_path / "tiny.gguf", qtype=qtype, d=256, embed=qtype, vocab=304)
    _, model = hf(path)
    ids = list(range(3, 40))
    ref = reference_logits(model, ids)
    export(path, tmp_path / "acc0", accuracy_level=0)
    assert np.abs(bundle_logits(tmp_path / "acc0", ids) - ref).max() < 1e-4
    export(path, tmp_path / "b")
    nodes = onnx.load(tmp_path / "b" / "target.onnx").graph.node
    ops = {n.op_type for n in nodes}
    assert "MatMulNBits" not in ops
    assert ("BlockQMatMulK" in ops) == (qtype.name.endswith("_K") or qtype == T.IQ4_XS)
    assert {a.i for n in nodes for a in n.attribute if a.name == "bits"} == {
        KERNEL_BITS[qtype], 8}  # ffn_down is Q8_0
    assert kl_top1(ref, bundle_logits(tmp_path / "b", ids))[0] < 0.01
    with edgespec.load(tmp_path / "b", device="cpu") as engine:
        got = measure(engine.target, ids[:20], ids[20:37], trees=())
        assert got.chain == got.prefill == {5: 0.0, 17: 0.0}


def test_a_type_held_only_dequantized_exports_with_requantize(tmp_path):
    """IQ3_S (a lattice codebook) has no exact encoding, so a plain export refuses it and
    says what to do; with --requantize it is read through gguf-py's dequantization like a
    float file: at fp32 the logits are transformers' own from the file."""
    path = tiny_gguf(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.IQ3_S, d=256)
    refused = cli("export", str(path), "--out", str(tmp_path / "a"))
    assert_user_error(refused, "is IQ3_S, which edgespec cannot hold exactly")
    assert "--requantize" in refused.stderr and not (tmp_path / "a").exists()
    export(path, tmp_path / "b", requantize=True, precision="fp32")
    ids = list(range(3, 40))
    ref = reference_logits(hf(path)[1], ids)
    assert np.abs(bundle_logits(tmp_path / "b", ids) - ref).max() < 1e-4


def test_load_takes_a_gguf_file_and_exports_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "tiny.gguf")
    with edgespec.load(path) as engine:
        first = engine.generate([5, 6, 7], max_new_tokens=3, mode="ar").token_ids
    (bundle,) = (tmp_path / "cache" / "bundles").iterdir()
    with edgespec.load(bundle) as engine:
        assert engine.generate([5, 6, 7], max_new_tokens=3, mode="ar").token_ids == first
    with edgespec.load(path) as engine:  # the cached export, not a second one
        assert len(list((tmp_path / "cache" / "bundles").iterdir())) == 1


@pytest.mark.parametrize("case,expected", [
    ("truncated", "damaged or truncated"),
    ("not-gguf", "not a GGUF file"),
    ("unknown-arch", "architecture 'mamba' is not supported"),
    ("unsupported-type", "is IQ3_S, which edgespec cannot hold exactly"),
    ("no-tokenizer", "carries no tokenizer"),
])
def test_bad_gguf_files_are_refused_in_one_sentence(tmp_path, case, expected):
    path = tmp_path / "model.gguf"
    if case == "truncated":
        path.write_bytes(smollm2_gguf().read_bytes()[:5_000_000])
    elif case == "not-gguf":
        path.write_text("this is a text file someone named .gguf\n")
    elif case == "unknown-arch":
        tiny_gguf(path, arch="mamba")
    elif case == "unsupported-type":
        tiny_gguf(path, qtype=gguf.GGMLQuantizationType.IQ3_S, d=256)
    else:
        tiny_gguf(path, tokenizer=False)
    before = sorted(tmp_path.iterdir())
    result = cli("export", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode != 0
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(tmp_path.iterdir()) == before  # nothing written, nothing removed
    if case in ("not-gguf", "truncated"):  # as --model: refused before an export is announced
        result = cli("generate", "x", "--model", str(path),
                     env={"EDGESPEC_CACHE": str(tmp_path / "cache")})
        assert_user_error(result, expected)
        assert not (tmp_path / "cache" / "bundles").exists()  # the hash memo at most


def test_a_retrained_shipped_head_makes_the_cache_export_again(tmp_path, monkeypatch):
    """A head retrained for the same model has the same size; the cached default export
    must still change with it, so --model picks up the new head."""
    from edgespec.export import draft_head
    from edgespec.model_cache import cache_key

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(draft_head, "SHIPPED", tmp_path / "drafts")
    (tmp_path / "drafts").mkdir()
    head = tmp_path / "drafts" / "model.npz"
    head.write_bytes(b"\0" * 64)
    before = cache_key("content", {})
    head.write_bytes(b"\1" * 64)
    os.utime(head, ns=(1, 1))  # a new mtime, as a reinstalled package has
    assert cache_key("content", {}) != before
    assert cache_key("content", {"precision": "int8"}) != cache_key("content", {})


def test_ctrl_c_during_generate_json_still_prints_the_answer(bundles):
    """Counting continues for thousands of tokens; Ctrl-C ends it and the JSON says so."""
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli", "generate",
                             "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "--json", "--mode", "ar",
                             "--max-new-tokens", "4000", "--model", str(bundles / "smollm2")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tasks = Path(f"/proc/{proc.pid}/task")
    deadline = time.time() + 120
    while len(list(tasks.iterdir())) < 2 and time.time() < deadline:  # ONNX Runtime's pool
        time.sleep(0.1)
    time.sleep(3)  # decoding by now, and far from 4,000 tokens
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    result = json.loads(out)
    assert result["finish_reason"] == "cancelled"
    assert 0 < result["stats"]["new_tokens"] < 4000 and result["text"].startswith(" 11")
