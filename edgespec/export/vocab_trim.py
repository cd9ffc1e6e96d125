"""Counting token frequencies for VocabTrim: on the target's own generations, or a corpus.

VocabTrim (arXiv 2506.22694) found target-generated text the best source: the draft
should cover what the target says, not what a corpus says. The exported target runs here
through edgespec's own runtime, sampling continuations of a prompt set.
"""

from __future__ import annotations

import json
import shutil
from importlib.resources import files
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edgespec.bundle import Manifest, ModelEntry, read_manifest, write_bundle
from edgespec.errors import EdgespecError
from edgespec.export.blockq_ops import kept_rows
from edgespec.kernels import DOMAIN
from edgespec.quant.vocab_trim import count_tokens, kept_tokens
from edgespec.runtimes import DecoderSession
from edgespec.spec import GenerationStats, SamplingParams, ar_decode
from edgespec.tokenizer import Tokenizer


def default_prompts() -> list[str]:
    return [line for line in (files("edgespec") / "assets" / "trim_prompts.txt")
            .read_text().splitlines() if line.strip()]


def target_counts(graph: Path, entry: ModelEntry, tokenizer: Tokenizer, prompts: list[str],
                  new_tokens: int = 128, seed: int = 0) -> np.ndarray:
    """Frequencies of the tokens the target samples (T=0.8) after each prompt."""
    session = DecoderSession(graph, entry, ["CPUExecutionProvider"],
                             max_len=min(entry.max_positions, 4096))
    rng = np.random.default_rng(seed)
    sequences = []
    for prompt in prompts:
        ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}])
               if tokenizer.chat_template else tokenizer.encode(prompt))
        ids = ids[:session.max_len // 2]
        session.cache.reset()
        out: list[int] = []
        steps = ar_decode(session, ids, SamplingParams(0.8), rng, GenerationStats("ar"))
        for tokens in steps:
            out += tokens
            if len(out) >= min(new_tokens, session.max_len - len(ids) - 1):
                break
        steps.close()
        sequences.append(out)
    return count_tokens(sequences, entry.vocab_size)


def check_trim_source(source: str) -> None:
    """'target' or 'corpus:PATH' of an existing path, said before any work is done."""
    if source == "target":
        return
    if not source.startswith("corpus:"):
        raise EdgespecError(f"trim source '{source}' is neither 'target' nor 'corpus:PATH'.")
    if not source.removeprefix("corpus:"):
        raise EdgespecError("--trim-source corpus: names no path; write corpus:PATH.")
    if not Path(source.removeprefix("corpus:")).exists():
        raise EdgespecError(f"the trim corpus {source.removeprefix('corpus:')} does not exist; "
                            "name a text file or a folder of them, or leave --trim-source out "
                            "to count the target's own answers.")


def corpus_counts(path: Path, tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """Frequencies over a text file, or every .txt/.md/.py/.json file under a folder
    (check_trim_source has seen that it exists)."""
    paths = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".py", ".json"))
    if not paths:
        raise EdgespecError(f"the trim corpus {path} holds no .txt/.md/.py/.json files.")
    counts = count_tokens((tokenizer.encode(p.read_text(errors="replace"),
                                            add_special_tokens=False) for p in paths),
                          vocab_size)
    if not counts.any():  # trimming on no evidence would keep arbitrary rows, for good
        raise EdgespecError(f"the trim corpus {path} holds no text; give files with text "
                            "the model should write.")
    return counts


def special_ids(tokenizer_dir: Path, eos_ids: list[int]) -> list[int]:
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    return [t["id"] for t in added if t.get("special", True)] + list(eos_ids)


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of a tensor computed from initializers alone (a head's scales are stored
    in a compact dtype and layout and cast/reshaped in the graph)."""
    from onnx.reference import ReferenceEvaluator

    inits = {t.name: t for t in model.graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name])
    producers = {o: n for n in model.graph.node for o in n.output}
    nodes, needed, todo = [], set(), [name]
    while todo:
        t = todo.pop()
        if t in inits or t in needed or not t:
            continue
        needed.add(t)
        nodes.append(producers[t])
        todo += list(producers[t].input)
    graph = onnx.helper.make_graph(
        [n for n in model.graph.node if n in nodes], "constant", [],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)],
        [inits[i] for n in nodes for i in n.input if i in inits])
    sub = onnx.helper.make_model(graph, opset_imports=model.opset_import)
    return ReferenceEvaluator(sub).run(None, {})[0]


def _slice_head(model: onnx.ModelProto, rows: np.ndarray) -> None:
    """Keep `rows` of the graph's LM head, whatever precision and layout it was exported in.

    The head's inputs may be shared (a tied embedding gathers rows from the head's own
    codes and scales), so the head node gets sliced copies of its own and the originals
    stay for whatever else reads them."""
    node = next(n for n in model.graph.node if n.name == "lm_head")

    def sliced(name: str, values: np.ndarray) -> str:
        model.graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(values), f"{name}.kept"))
        return f"{name}.kept"

    if node.op_type == "MatMul":  # stored transposed, [hidden, rows]
        node.input[1] = sliced(node.input[1], _constant(model, node.input[1])[:, rows])
    elif node.domain == DOMAIN:  # the own kernel's tiles of 16 rows
        a = {a.name: a for a in node.attribute}
        codes, *tables = (_constant(model, name) for name in node.input[1:])
        if node.op_type == "RowQMatMul":  # 8-bit, a scale per output row, in order (not lanes)
            bits, scale = 8, tables.pop()[rows]
            kept = (*kept_rows(codes, a["K"].i, bits, rows),
                    np.concatenate([scale, np.zeros(-len(rows) % 16, scale.dtype)]))
        else:
            bits = a["bits"].i
            kept = kept_rows(codes, a["K"].i, bits, rows, *tables)
        done: dict[str, str] = {}  # a K-quant op may read one table twice (μ = σ)
        for i, (name, table) in enumerate(zip(node.input[1:], kept, strict=True), start=1):
            if name not in done:
                done[name] = sliced(name, table)
            node.input[i] = done[name]
        a["N"].i = len(kept[0]) * 8 // bits // a["K"].i
        if a["N"].i != len(rows):  # padded to whole tiles: keep the real rows' logits
            _cut_last_axis(model, node, len(rows))
    elif node.op_type == "MatMulIntegerToFloat":  # codes [K, N], a scale per column
        for i, cut in ((1, lambda v: v[:, rows]), (3, lambda v: v[rows])):
            node.input[i] = sliced(node.input[i], cut(_constant(model, node.input[i])))
    else:  # MatMulNBits: packed blocks, scales (and zero points) per output row, maybe flat
        n = next(a for a in node.attribute if a.name == "N")
        for i, name in enumerate(node.input[1:4], start=1):
            v = _constant(model, name) if name else None
            if v is not None and v.size % n.i == 0:
                shape = (len(rows), *v.shape[1:]) if v.shape[0] == n.i else (-1,)
                node.input[i] = sliced(name, v.reshape(n.i, -1)[rows].reshape(shape))
        n.i = len(rows)
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[2].dim_value = len(rows)
    _drop_unread(model.graph)


def _cut_last_axis(model: onnx.ModelProto, node: onnx.NodeProto, size: int) -> None:
    """Keep the first `size` entries of `node`'s output's last axis, under the same name."""
    out = node.output[0]
    node.output[0] = f"{out}.padded"
    bounds = [numpy_helper.from_array(np.array(v, np.int64), f"{out}.cut.{what}")
              for what, v in (("starts", [0]), ("ends", [size]), ("axes", [-1]))]
    model.graph.initializer.extend(bounds)
    cut = onnx.helper.make_node("Slice", [node.output[0], *(b.name for b in bounds)], [out],
                                f"{node.name}.cut")
    model.graph.node.insert(list(model.graph.node).index(node) + 1, cut)


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the graph's nodes read, in their subgraphs (If branches) too."""
    return {i for n in graph.node for i in n.input} | {
        name for n in graph.node for a in n.attribute
        if a.type == onnx.AttributeProto.GRAPH for name in _reads(a.g)}


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Remove the nodes and initializers that nothing reads any more (the full head)."""
    while True:
        read = _reads(graph) | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    for t in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(t)


def retrim_bundle(bundle: Path, k: int, source: str = "target",
                  prompts: list[str] | None = None) -> Manifest:
    """Re-trim an exported bundle's draft head to K tokens, in place (atomically).

    Rows already trimmed away cannot come back: K may only shrink the kept set.
    """
    from edgespec.export import vocab_counts  # the same counting as export

    m = read_manifest(bundle)
    if m.draft is None:
        raise EdgespecError(f"{bundle} has no draft model to trim.")
    if m.draft.nested:
        raise EdgespecError(f"{bundle}'s draft is nested in the target's graph; re-export "
                            "with --draft nested --vocab-trim K to trim its head.")
    if m.draft.kind == "eagle":
        raise EdgespecError(f"{bundle}'s draft is a head, which keeps the tokens it was "
                            "trained on; train one with `edgespec train-draft --kept K` "
                            "to draft among fewer.")
    current = (np.load(bundle / m.vocab_map) if m.vocab_map
               else np.arange(m.draft.vocab_size))
    vocab = m.target.vocab_size
    if k >= vocab:
        raise EdgespecError(f"--k {k} is at or past the vocabulary's {vocab} tokens; give a K "
                            f"below {len(current)} (the tokens the draft's LM head keeps now) "
                            "to trim it.")
    if k == len(current):
        raise EdgespecError(f"the draft's LM head already keeps {k} tokens; nothing to trim.")
    if k > len(current):
        raise EdgespecError(f"the draft's LM head already keeps {len(current)} tokens; "
                            f"re-export from the checkpoint to keep {k}.")
    check_trim_source(source)
    counts = vocab_counts(bundle / m.target.graph, m.target, bundle, source, prompts)
    counts_in_head = np.full_like(counts, -1)
    counts_in_head[current] = counts[current]  # only rows the head still has
    try:
        kept = kept_tokens(counts_in_head, k, special_ids(bundle, m.eos_token_ids))
    except ValueError as e:
        raise EdgespecError(f"--k: {e}; choose a larger K.") from None
    rows = np.searchsorted(current, kept)
    draft = onnx.load(bundle / m.draft.graph)
    _slice_head(draft, rows)
    with write_bundle(bundle, overwrite=True) as (tmp, finish):
        rewritten = {m.draft.graph, m.draft.data_files[0], m.vocab_map}
        for name in m.files:
            if name not in rewritten:
                shutil.copy2(bundle / name, tmp / name)
        onnx.save_model(draft, tmp / m.draft.graph, save_as_external_data=True,
                        all_tensors_to_one_file=True, location=m.draft.data_files[0],
                        size_threshold=1024)
        np.save(tmp / "draft_vocab.npy", kept)
        m.draft.vocab_size = len(kept)
        m.vocab_map = "draft_vocab.npy"
        m.provenance["vocab_trim"] = {"k": k, "source": source, "retrimmed": True}
        return finish(m)
