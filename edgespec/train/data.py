"""What a draft head learns from: the target's own answers and its states along them.

The target (in PyTorch, through transformers: its own GGUF loading for a .gguf file)
answers the built-in prompts, or a user's, through its chat template, greedily and
sampled at T=0.7: a draft head must predict what *this* target says. Then each
conversation is read once more, teacher-forced, for the final-norm states the exported
target hands its head at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import EdgespecError
from edgespec.export.source import Source
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


def load_target(source: Source):
    """The target as a float32 transformers model (the independent implementation)."""
    from transformers import AutoModelForCausalLM

    path = Path(source.name)
    kwargs = dict(dtype=torch.float32)
    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.tokenizer_dir, **kwargs)
    return model.eval()


@dataclass
class Conversation:
    tokens: np.ndarray  # int64 [T]: prompt (through the chat template) and answer
    states: np.ndarray  # float16 [T, d]: the target's final-norm state after each token


def generate(model, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int,
             temperature: float, seed: int, batch: int, eos_ids: list[int],
             on_batch: Callable[[int], None]) -> list[Conversation]:
    """The target's answers, `batch` prompts at a time (left-padded), with the states
    generation computed anyway (the last layer's, after the final norm): reading each
    conversation again would cost as much as a third of generating it."""
    torch.manual_seed(seed)
    out = []
    pad = eos_ids[0] if eos_ids else 0
    for start in range(0, len(prompts), batch):
        encoded = [tokenizer.encode_chat([{"role": "user", "content": p}])
                   if tokenizer.chat_template else tokenizer.encode(p)  # a base model
                   for p in prompts[start:start + batch]]
        width = max(map(len, encoded))
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(encoded):
            ids[i, width - len(e):] = torch.tensor(e)
            mask[i, width - len(e):] = 1
        with torch.no_grad():
            result = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                do_sample=temperature > 0, temperature=temperature or None, top_p=None,
                top_k=None, eos_token_id=eos_ids or None, pad_token_id=pad,
                output_hidden_states=True, return_dict_in_generate=True)
        # one entry per fed step: the prompt, then each token fed after it
        states = torch.cat([step[-1] for step in result.hidden_states], dim=1)
        for i, e in enumerate(encoded):
            seq = result.sequences[i, width - len(e):].tolist()
            ends = [k for k in range(len(e), len(seq)) if seq[k] in eos_ids]
            n = min(ends[0] + 1 if ends else len(seq), states.shape[1] - width + len(e))
            out.append(Conversation(np.array(seq[:n], dtype=np.int64),
                                    states[i, width - len(e):width - len(e) + n].numpy()
                                    .astype(np.float16)))
        on_batch(len(encoded))
    return out


def lm_head_weight(model) -> torch.Tensor:
    return model.get_output_embeddings().weight.detach().float()


def embedding_weight(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach().float()


def embed_scale(model) -> float | None:
    """Gemma scales its embeddings by sqrt(d) inside the embedding module."""
    scale = getattr(model.get_input_embeddings(), "embed_scale", None)
    return float(scale) if scale is not None else None
