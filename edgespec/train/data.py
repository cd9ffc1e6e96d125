"""What a draft head learns from: the target's own answers, text the user gives, and the
target's states along both.

The target runs as edgespec exports it (the same graph the head will draft for, its
final-norm states read from the graph as output `hidden`) and answers the built-in
prompts, or a user's, through its chat template: a draft head must predict what *this*
target says, from the states *this* target hands it. Greedy answers first; sampled ones
(T=0.7) too when asked. The states of the prompt and answer tokens are recorded while
generating (spec.decode's AR loop), so no second pass is needed.

Answers cost a target step per token, so a few hundred prompts give a head only some
50k tokens to learn from, and it learns them by heart (SmolLM2: 61% top-1 on its
training answers, 30% on held-out ones). Plain text is EAGLE's own recipe: the target
reads it in one pass per window (a prefill, several times cheaper per token than
answering), and the head learns the target's next state along it all the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

    def last(self, n: int) -> Conversation:
        """Its last `n` tokens and their states."""
        return Conversation(self.tokens[-n:], self.states[-n:])


def with_hidden_output(path: Path) -> bytes:
    """The target graph at `path` with its final-norm states as output `hidden`: those of
    the pass's own tokens (a one-token pass carries a copy of its token, export.exact_rows)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if not any(o.name == "hidden" for o in graph.output):
        graph.initializer.extend([helper.make_tensor("hidden.start", TensorProto.INT64, [1], [0]),
                                  helper.make_tensor("hidden.axis", TensorProto.INT64, [1], [1])])
        graph.node.extend([
            helper.make_node("Shape", ["input_ids"], ["hidden.rows"], start=1, end=2),
            helper.make_node("Slice", ["final.norm", "hidden.start", "hidden.rows",
                                       "hidden.axis"], ["hidden.real"]),
            helper.make_node("Cast", ["hidden.real"], ["hidden"], to=TensorProto.FLOAT)])
        graph.output.append(helper.make_tensor_value_info(
            "hidden", TensorProto.FLOAT, [1, "sequence", "hidden"]))
    return model.SerializeToString()


READ_POSITIONS = 4096  # the longest conversation the exported target answers and reads


def _target(bundle: Path, threads: int):
    """The bundle's target with its `hidden` output, its tokenizer and manifest."""
    from edgespec.bundle import read_manifest
    from edgespec.runtimes import DecoderSession, resolve_providers
    from edgespec.runtimes.decoder import open_session

    m = read_manifest(bundle)
    path = bundle / m.target.graph
    providers = resolve_providers("cpu")
    session = open_session(path, providers, threads, with_hidden_output(path))
    return m, Tokenizer.from_dir(bundle), DecoderSession(
        path, m.target, providers, max_len=READ_POSITIONS, threads=threads, shared=session)


def check_lengths(tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int,
                  positions: int) -> None:
    """Every prompt and its answer fit the positions the target is read at: one that did
    not failed the run after the answers before it, naming neither it nor the limit."""
    limit = min(positions, READ_POSITIONS)
    for i, prompt in enumerate(prompts):
        n = len(prompt_ids(tokenizer, prompt))
        if n + max_new_tokens > limit:
            raise EdgespecError(
                f"prompt {i + 1} ({prompt[:40]!r}...) is {n} tokens, and with "
                f"--max-new-tokens {max_new_tokens} it passes the {limit} positions the "
                "target is read at; shorten it or leave it out.")


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A prompt as the target reads it: a user turn through its chat template, or plain
    text for a base model."""
    if tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def generate(bundle: Path, prompts: list[str], max_new_tokens: int, temperature: float,
             seed: int, threads: int, on_prompt: Callable[[], None]) -> list[Conversation]:
    """The bundle's target answers each prompt (AR); its states come with the tokens."""
    from edgespec.spec import GenerationStats, SamplingParams, ar_decode

    m, tokenizer, target = _target(bundle, threads)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature)
    eos = set(m.eos_token_ids)
    out = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt)
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


TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".rs", ".go", ".js", ".ts",
                 ".java", ".html", ".json", ".yaml", ".toml", ".sh", ".tex"}


def read_texts(paths: list[Path]) -> list[str]:
    """The text of each file given and of each text file under each directory given;
    a file that is not UTF-8 text is skipped inside a directory and refused when named."""
    out = []
    for path in paths:
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file()
                           and f.suffix.lower() in TEXT_SUFFIXES)
        elif path.is_file():
            files = [path]
        else:
            raise EdgespecError(f"{path} does not exist; pass text files or directories "
                                "holding them to --text.")
        for f in files:
            try:
                out.append(f.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                if f is path:
                    raise EdgespecError(f"cannot read {f} as text ({e}); pass UTF-8 text "
                                        "files to --text.") from None
    if not any(text.strip() for text in out):
        if out:
            raise EdgespecError("--text found only blank files in " + ", ".join(map(str, paths))
                                + "; give it files with text.")
        raise EdgespecError("--text found no text in " + ", ".join(map(str, paths)) +
                            "; pass UTF-8 files (" + " ".join(sorted(TEXT_SUFFIXES)) +
                            ") or directories holding them.")
    return out


def read_along(bundle: Path, texts: list[str], window: int, max_tokens: int, seed: int,
               threads: int, on_window: Callable[[int], None]) -> list[Conversation]:
    """The target reads windows_of the texts, each from an empty cache, so its states are
    those of reading the window alone."""
    _, tokenizer, target = _target(bundle, threads)
    return _read(target, windows_of(tokenizer, texts, window, max_tokens, seed), on_window)


def windows_of(tokenizer: Tokenizer, texts: list[str], window: int, max_tokens: int,
               seed: int) -> list[list[int]]:
    """Windows of `window` tokens cut from the texts, in a seeded random order, until
    `max_tokens` are taken. The texts are tokenized in a random order too, and only until
    they hold four times the budget: a big corpus costs what is drawn from it."""
    rng = np.random.default_rng(seed)
    pieces: list[list[int]] = []
    held = 0
    for i in rng.permutation(len(texts)):
        ids = tokenizer.encode(texts[i])
        pieces += [ids[start:start + window] for start in range(0, len(ids) - 2, window)]
        held += len(ids)
        if held >= 4 * max_tokens:
            break
    order = [pieces[i] for i in rng.permutation(len(pieces))]
    budget, taken = max_tokens, []
    for piece in order:
        if budget < 3 or len(piece) < 3:
            break
        taken.append(piece[:budget])
        budget -= len(taken[-1])
    return taken


def _read(target, sequences: list[list[int]], on_read: Callable[[int], None]
          ) -> list[Conversation]:
    """The target's states along each sequence, read in one pass from an empty cache
    (whose logits are not wanted: the LM head scores the last rows only)."""
    out = []
    for ids in sequences:
        target.cache.reset()
        target.forward(ids, last=True)
        out.append(Conversation(np.array(ids, dtype=np.int64),
                                target.features[:len(ids)].astype(np.float16)))
        on_read(len(ids))
    return out


def read_sequences(bundle: Path, sequences: list[list[int]], threads: int,
                   on_read: Callable[[int], None]) -> list[Conversation]:
    """The exported target's states along token sequences written elsewhere."""
    _, _, target = _target(bundle, threads)
    return _read(target, sequences, on_read)


def float_model(name: str, kind: str):
    """The source's weights in float32 as a transformers model (a GGUF file dequantized
    by transformers itself), for writing text in batches."""
    import torch
    from transformers import AutoModelForCausalLM

    from edgespec.export.hub import resolve_checkpoint

    if kind == "gguf":
        path = Path(name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolve_checkpoint(name)),
                                                     dtype=torch.float32)
    return model.eval()


def check_chat(tokenizer: Tokenizer) -> None:
    """Only a chat model writes requests: refuse a base model before any work is done."""
    if not tokenizer.chat_template:
        raise EdgespecError("--synthesize needs a chat model (one with a chat template): a "
                            "base model writes no requests; give it --text instead.")


def _continue(model, rows: list[list[int]], eos_ids: list[int], temperature: float,
              limit: int, drop_cut: bool = False) -> list[list[int]]:
    """Continue each row (left-padded into one batch), greedy at temperature 0, until an
    end token or `limit` tokens; with `drop_cut` a row that reached no end token is
    dropped (empty)."""
    import torch

    stop = int(eos_ids[0])
    width = max(map(len, rows))
    ids = torch.tensor([[stop] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows],
                        device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=temperature > 0,
                             temperature=temperature or None, top_p=None, top_k=None,
                             max_new_tokens=limit, eos_token_id=list(eos_ids),
                             pad_token_id=stop)
    written = []
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        written.append(row[:ends[0] + 1] if ends else [] if drop_cut else row)
    return written


def self_requests(model, tokenizer: Tokenizer, eos_ids: list[int], n: int, seed: int,
                  batch: int, on_batch: Callable[[int], None],
                  max_request_tokens: int = 64) -> list[str]:
    """Requests a chat model writes itself (Magpie, arXiv 2406.08464): sampled at T=1
    after its chat template's open user turn, it writes requests of the kind it was tuned
    on; `n` distinct ones, in the order written.

    Built-in prompts run out (310 give a head ~50k tokens, which it learns by heart), and
    other text is not what a chat target says. The float model writes in batches (the
    exported graph answers one prompt at a time)."""
    import torch

    check_chat(tokenizer)
    mark = "\u2063edgespec\u2063"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": mark}], False)
    opening = tokenizer.encode(rendered[:rendered.index(mark)], add_special_tokens=False)
    torch.manual_seed(seed)
    requests: dict[str, None] = {}
    while len(requests) < n:
        written = len(requests)
        for request in _continue(model, [opening] * batch, eos_ids, 1.0, max_request_tokens,
                                 drop_cut=True):
            text = tokenizer.decode(request[:-1]).strip()
            if text and len(requests) < n:
                requests[text] = None
        if len(requests) == written:
            raise EdgespecError("the target wrote no new complete request in a whole batch; "
                                "--synthesize needs a chat model that ends its turns.")
        on_batch(len(requests) - written)
    return list(requests)


def answered(model, tokenizer: Tokenizer, eos_ids: list[int], requests: list[str],
             max_new_tokens: int, batch: int, temperature: float = 0.0,
             max_tokens: int | None = None) -> Iterator[list[list[int]]]:
    """Each request as the target reads it (prompt_ids), then the model's answer (greedy,
    or sampled at `temperature`) with its end-of-turn token, as token ids; yielded a
    batch at a time, so a caller keeps what is written. A batch holds `batch` requests
    at most, and with `max_tokens` as many as fit that many positions (rows times the
    longest prompt plus the answer: the KV cache a batch needs). The head then learns the
    exported target's own states along the text (read_sequences), or on a GPU the float
    model's (float_states): only the text is the float model's, and the two agree on most
    tokens (KL ~0.002 for SmolLM2's file)."""
    ids = [prompt_ids(tokenizer, t) for t in requests]
    for start, end in _batches([len(i) + max_new_tokens for i in ids], batch, max_tokens):
        rows = ids[start:end]
        yield [p + a for p, a in zip(rows, _continue(model, rows, eos_ids, temperature,
                                                     max_new_tokens), strict=True)]


def _batches(lengths: list[int], batch: int, max_tokens: int | None
             ) -> Iterator[tuple[int, int]]:
    """Consecutive ranges of at most `batch` items whose padded size (items times the
    longest) stays within `max_tokens` (a single item may exceed it)."""
    start = 0
    while start < len(lengths):
        end, longest = start + 1, lengths[start]
        while end < len(lengths) and end - start < batch:
            wider = max(longest, lengths[end])
            if max_tokens and (end + 1 - start) * wider > max_tokens:
                break
            end, longest = end + 1, wider
        yield start, end
        start = end


def float_states(model, sequences: list[list[int]], batch: int,
                 max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """The float model's final-norm states along each sequence (float16 [T, d]), read
    `batch` sequences at a time (fewer where `max_tokens` bounds the padded batch, as
    data.answered's): on a GPU the states come this way, since the exported
    graph runs there a sequence at a time on the CPU. They differ from the exported
    target's as its logits do (KL ~0.002 for SmolLM2's file), which a head trained with
    input noise does not notice."""
    import torch

    for start, end in _batches(list(map(len, sequences)), batch, max_tokens):
        rows = sequences[start:end]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=model.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows],
                            device=model.device)
        with torch.inference_mode():
            states = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        states = states.to(torch.float16).cpu().numpy()
        yield from (s[:len(r)] for s, r in zip(states, rows, strict=True))
