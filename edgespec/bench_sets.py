"""The prompt sets `edgespec bench` ships, and how a prompt becomes token ids.

Two sets: "demo" (edgespec/assets/bench_prompts.json: Python-code prompts cut from the
standard-library files the demo pair never trained on, for the demo's 512-token context)
and "real" (edgespec/assets/bench/*.json: chat instructions, multi-turn, code completion,
summarization and RAG with long context, for real instruction-tuned models). Both are
held out from any draft's training data (tests/test_bench_prompts.py).
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

from edgespec.errors import EdgespecError
from edgespec.tokenizer import Tokenizer

SETS = ("demo", "real")
REAL_CATEGORIES = ("chat", "multi-turn", "code", "summarization", "rag")


def load_set(name: str) -> list[dict[str, Any]]:
    """Every prompt of set `name`, each with a "category" and "messages" or "prompt"."""
    assets = files("edgespec") / "assets"
    if name == "demo":
        return json.loads((assets / "bench_prompts.json").read_text())["prompts"]
    if name != "real":
        raise EdgespecError(f"unknown prompt set '{name}'; choose one of {', '.join(SETS)}.")
    prompts = []
    for category in REAL_CATEGORIES:
        data = json.loads((assets / "bench" / f"{category}.json").read_text())
        prompts += [{**p, "category": data["category"]} for p in data["prompts"]]
    return prompts


def select(prompts: list[dict[str, Any]], categories: tuple[str, ...] = (),
           limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` prompts of each of `categories` (all categories when empty)."""
    known = list(dict.fromkeys(p["category"] for p in prompts))
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise EdgespecError(f"this prompt set has no category {', '.join(unknown)}; choose "
                            f"among {', '.join(known)}.")
    taken: dict[str, int] = {}
    chosen = []
    for p in prompts:
        c = p["category"]
        if (not categories or c in categories) and (limit is None or taken.get(c, 0) < limit):
            taken[c] = taken.get(c, 0) + 1
            chosen.append(p)
    return chosen


def plain_text(messages: list[dict[str, str]]) -> str:
    """A conversation for a model without a chat template (a base model): labelled turns
    and an open assistant turn, the way such models are usually prompted."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


def prompt_text(tokenizer: Tokenizer, item: dict[str, Any]) -> str:
    """A prompt as the text prompt_ids encodes, for runtimes that take text (llama.cpp)."""
    if "messages" not in item:
        return item["prompt"]
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(item["messages"])
    return plain_text(item["messages"])


def prompt_ids(tokenizer: Tokenizer, item: dict[str, Any]) -> list[int]:
    """A prompt's ids: a conversation through the chat template (as plain text when the
    model has none), a plain prompt as it is."""
    if "messages" not in item:
        return tokenizer.encode(item["prompt"])
    if tokenizer.chat_template:
        return tokenizer.encode_chat(item["messages"])
    return tokenizer.encode(plain_text(item["messages"]))
