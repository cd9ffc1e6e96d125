"""What a draft head learns from: the target's own answers and its states along them.

The target runs as edgespec exports it (the same graph the head will draft for, its
final-norm states read from the graph as output `hidden`) and answers the built-in
prompts, or a user's, through its chat template: a draft head must predict what *this*
target says, from the states *this* target hands it. Greedy answers first; sampled ones
(T=0.7) too when asked. The states of the prompt and answer tokens are recorded while
generating (spec.decode's AR loop), so no second pass is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.tokenizer import Tokenizer

PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "draft_train" / "prompts.txt"


def builtin_prompts() -> list[str]:
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()
    return [line.replace("\\n", "\n").replace("\\\\", "\\") for line in lines if line]


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; a literal \\n inside a line is a line break."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EdgespecError(f"cannot read prompts from {path} ({e}); pass a UTF-8 text file "
                            "with one prompt per line.") from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise EdgespecError(f"{path} holds no prompts; write one prompt per line.")
    return prompts


@dataclass
class Conversation:
    tokens: np.ndarray  # int64 [T]: prompt (through the chat template) and answer
    states: np.ndarray  # float16 [T, d]: the target's final-norm state after each token


def with_hidden_output(path: Path) -> bytes:
    """The target graph at `path` with its final-norm states as output `hidden`."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    if not any(o.name == "hidden" for o in model.graph.output):
        model.graph.node.append(helper.make_node("Cast", ["final.norm"], ["hidden"],
                                                 to=TensorProto.FLOAT))
        model.graph.output.append(helper.make_tensor_value_info(
            "hidden", TensorProto.FLOAT, [1, "sequence", "hidden"]))
    return model.SerializeToString()


def generate(bundle: Path, prompts: list[str], max_new_tokens: int, temperature: float,
             seed: int, threads: int, on_prompt: Callable[[], None]) -> list[Conversation]:
    """The bundle's target answers each prompt (AR); its states come with the tokens."""
    from edgespec.bundle import read_manifest
    from edgespec.runtimes import DecoderSession, resolve_providers
    from edgespec.runtimes.decoder import open_session
    from edgespec.spec import GenerationStats, SamplingParams, ar_decode

    m = read_manifest(bundle)
    tokenizer = Tokenizer.from_dir(bundle)
    path = bundle / m.target.graph
    providers = resolve_providers("cpu")
    session = open_session(path, providers, threads, with_hidden_output(path))
    target = DecoderSession(path, m.target, providers, max_len=4096, threads=threads,
                            shared=session)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature)
    eos = set(m.eos_token_ids)
    out = []
    for prompt in prompts:
        ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}])
               if tokenizer.chat_template else tokenizer.encode(prompt))  # a base model
        target.cache.reset()
        answer: list[int] = []
        for step in ar_decode(target, ids, params, rng, GenerationStats("ar")):
            answer += step
            if step[-1] in eos or len(answer) >= max_new_tokens:
                break
        tokens = ids + answer[:-1]  # the states of all tokens the target was fed
        out.append(Conversation(np.array(tokens, dtype=np.int64),
                                target.features[:len(tokens)].astype(np.float16)))
        on_prompt()
    return out
