"""The second moment XᵀX of every linear layer's input, measured on the float model.

Its diagonal is llama.cpp's imatrix, the mean squared activation entering each column of
a weight: weighting the quantization error by it spends the codes' precision where the
layer's output feels it (quant.kquants). The whole matrix is what GPTQ (quant.gptq)
needs to choose codes whose errors cancel in the layer's output. The text is the
model's own generations after the built-in prompts (offline, from the model alone) or a
user's file.

The float graph runs in edgespec's own runtime with one extra output per MatMul,
`stat.<node>` = XᵀX of its input over the pass's tokens, so the statistics are those of
exactly the computation being quantized, for every architecture the exporter supports
(for `--quant rot` the rotated graph, whose inputs are what the int8 weights multiply).
A model too large for all its XᵀX at once (GRAM_BUDGET) gets the diagonal only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgespec.bundle import ModelEntry
from edgespec.errors import EdgespecError
from edgespec.runtimes import DecoderSession
from edgespec.runtimes.decoder import HostOutput
from edgespec.spec import GenerationStats, SamplingParams, ar_decode
from edgespec.tokenizer import Tokenizer

MAX_LEN = 512  # positions per calibration sequence
PREFIX = "stat."
# XᵀX of every linear's input at once: ~1.2 GB for SmolLM2-135M, 15 GB for a 1B model,
# whose export then calibrates importance weights only (the diagonal)
GRAM_BUDGET = 4 << 30


def add_stat_outputs(model: onnx.ModelProto, budget: int | None = None) -> bool:
    """Give every MatMul over a weight initializer [K, N] an output `stat.<its name>`:
    XᵀX of its input over the pass's tokens, [1, K, K], when all of them fit in `budget`
    bytes (the outputs in float32 and their sums in float64), else only its diagonal, the
    sum of the input squared, [1, K] (importance weights without GPTQ). Returns whether
    the whole matrices are measured. `budget` None: GRAM_BUDGET."""
    graph = model.graph
    widths = {t.name: t.dims[0] for t in graph.initializer if len(t.dims) == 2}
    linears = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in widths]
    gram = sum(widths[n.input[1]] ** 2 for n in linears) * 12 <= (
        GRAM_BUDGET if budget is None else budget)
    if not gram:
        graph.initializer.append(helper.make_tensor("stat.axes", TensorProto.INT64, [1], [1]))
    for node in linears:
        x, out, k = node.input[0], PREFIX + node.name, widths[node.input[1]]
        if gram:  # [1, S, K] -> [1, K, K]
            graph.node.extend([
                helper.make_node("Transpose", [x], [f"{out}.xt"], name=f"{out}.xt",
                                 perm=[0, 2, 1]),
                helper.make_node("MatMul", [f"{out}.xt", x], [out], name=out)])
        else:
            graph.node.extend([
                helper.make_node("Mul", [x, x], [f"{out}.sq"], name=f"{out}.sq"),
                helper.make_node("ReduceSum", [f"{out}.sq", "stat.axes"], [out], name=out,
                                 keepdims=0)])
        graph.output.append(helper.make_tensor_value_info(
            out, TensorProto.FLOAT, [1, k, k] if gram else [1, k]))
    return gram


def own_generations(session: DecoderSession, tokenizer: Tokenizer, prompts: list[str],
                    new_tokens: int, advance: Callable[[], None]) -> list[list[int]]:
    """Each prompt (chat-formatted where the model has a template) and the model's own
    continuation, sampled at T=0.8 (seed 0): the text it will meet."""
    rng = np.random.default_rng(0)
    sequences = []
    new_tokens = min(new_tokens, session.max_len // 2)  # a short context holds less
    for prompt in prompts:
        ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}])
               if tokenizer.chat_template else tokenizer.encode(prompt))
        ids = ids[:session.max_len - new_tokens - 1]
        session.cache.reset()
        out: list[int] = []
        steps = ar_decode(session, ids, SamplingParams(0.8), rng, GenerationStats("ar"))
        for tokens in steps:
            out += tokens
            if len(out) >= new_tokens:
                break
        steps.close()
        sequences.append(ids + out[:new_tokens])
        advance()
    return sequences


def text_chunks(path: Path, tokenizer: Tokenizer, length: int,
                limit: int = 64) -> list[list[int]]:
    """A user's calibration text as up to `limit` chunks of `length` tokens."""
    try:
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as e:
        raise EdgespecError(f"cannot read the calibration text {path} ({e.strerror or e}); "
                            "pass a readable text file.") from None
    if len(ids) < 16:
        raise EdgespecError(f"the calibration text {path} has only {len(ids)} tokens; give "
                            "it at least a paragraph.")
    return [ids[i:i + length] for i in range(0, len(ids), length)][:limit]


def second_moments(graph: Path, entry: ModelEntry, tokenizer: Tokenizer,
                   text: Path | None, prompts: list[str], new_tokens: int = 64,
                   advance: Callable[[], None] = lambda: None) -> dict[str, np.ndarray]:
    """XᵀX per token [K, K] of every MatMul's input in the float `graph` (built with
    add_stat_outputs; its diagonal [K] where the graph measures only that), keyed by node
    name with a part index dropped ("qkv0" -> "qkv": the parts of a weight share its
    input)."""
    session = DecoderSession(graph, entry, ["CPUExecutionProvider"],
                             max_len=min(entry.max_positions, MAX_LEN))
    sequences = (text_chunks(text, tokenizer, session.max_len) if text
                 else own_generations(session, tokenizer, prompts, new_tokens, advance))
    stats = [HostOutput(session.session, session.binding, o.name)
             for o in session.session.get_outputs() if o.name.startswith(PREFIX)]
    for stat in stats:  # bound once: every pass writes into the same buffers
        stat.bind(tuple(next(o.shape for o in session.session.get_outputs()
                             if o.name == stat.name)))
    sums: dict[str, np.ndarray] = {}
    tokens = 0
    for ids in sequences:
        session.cache.reset()
        session.forward(ids)
        for stat in stats:
            sums[stat.name] = sums.get(stat.name, 0) + stat.read().astype(np.float64)
        tokens += len(ids)
        if text:
            advance()
    out: dict[str, np.ndarray] = {}
    for name, total in sums.items():
        key = name.removeprefix(PREFIX).rstrip("0123456789")
        out[key] = (total / tokens).astype(np.float32)
    return out
