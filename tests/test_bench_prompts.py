"""The real-model bench prompt sets: shipped, well-formed, and held out from every draft's
training prompts (edgespec/assets/draft_train/): no bench prompt may appear in a training
file or share a 13-word run with one (the n-gram length of GPT-3's contamination study)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from edgespec.bench_sets import (
    REAL_CATEGORIES,
    load_set,
    plain_text,
    prompt_ids,
    prompt_text,
    select,
)
from edgespec.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "edgespec" / "assets"
N = 13
SHORT, N_SHORT = 40, 6


def strings(value: object) -> Iterator[str]:
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def training_texts(folder: Path) -> Iterator[tuple[Path, str]]:
    """The text of every file under `folder`: JSON and JSON lines by their strings, other
    text files as they are; binary files (weights, arrays) have no prompts to check."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        try:
            yield path, "\n".join(strings(json.loads(raw)))
        except ValueError:
            lines = []
            for line in raw.splitlines():
                try:
                    lines += strings(json.loads(line))
                except ValueError:
                    lines.append(line)
            yield path, "\n".join(lines)


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def overlaps(prompts: list[dict], texts: list[tuple[Path, str]]) -> list[str]:
    """'prompt id ~ file' for every bench prompt found in, or sharing an n-gram with, a
    training text."""
    found = []
    for path, text in texts:
        grams, short, flat = ngrams(text), ngrams(text, N_SHORT), " ".join(words(text))
        for p in prompts:
            for m in p["messages"]:
                mine = words(m["content"])
                if (mine and " ".join(mine) in flat) or ngrams(m["content"]) & grams or \
                        (len(mine) < SHORT and ngrams(m["content"], N_SHORT) & short):
                    found.append(f"{p['id']} ~ {path.name}")
                    break
    return found


def test_real_set_is_shipped_with_every_category():
    prompts = load_set("real")
    by_category = {c: [p for p in prompts if p["category"] == c] for c in REAL_CATEGORIES}
    assert all(len(ps) >= 8 for ps in by_category.values()), {c: len(v) for c, v in
                                                               by_category.items()}
    assert len({p["id"] for p in prompts}) == len(prompts)
    for p in prompts:
        roles = [m["role"] for m in p["messages"]]
        assert roles[-1] == "user" and roles[::2] == ["user"] * len(roles[::2])
    assert all(len(p["messages"]) >= 3 for p in by_category["multi-turn"])
    # long context: every summarization / RAG prompt is thousands of words
    for category in ("summarization", "rag"):
        assert min(len(words(p["messages"][-1]["content"])) for p in
                   by_category[category]) > 700


def test_select_takes_the_first_n_of_each_category():
    prompts = load_set("real")
    chosen = select(prompts, ("chat", "rag"), 3)
    assert [p["id"] for p in chosen] == [f"chat-{i:02d}" for i in range(3)] + \
        [f"rag-{i:02d}" for i in range(3)]


def test_plain_text_rendering_for_models_without_a_template():
    text = plain_text([{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."},
                       {"role": "user", "content": "Bye"}])
    assert text == "User: Hi\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:"


def test_prompt_text_is_what_prompt_ids_encode_with_and_without_a_template(demo_target):
    """What text runtimes (llama.cpp in tools/compare) are given: the chat template's
    rendering, or for a base model the labelled plain text whose ids edgespec runs."""
    chat = Tokenizer.from_dir(demo_target)
    base = Tokenizer.from_dir(demo_target)
    base.chat_template = None  # as a base model's GGUF file has it (Gemma 3 270m)
    for item in select(load_set("real"), ("chat", "multi-turn"), 2):
        assert prompt_text(chat, item) == chat.apply_chat_template(item["messages"])
        assert prompt_text(base, item) == plain_text(item["messages"])
        assert base.encode(prompt_text(base, item)) == prompt_ids(base, item)
    assert prompt_text(chat, {"prompt": "def f(x):"}) == "def f(x):"


def test_the_overlap_check_finds_a_copied_prompt_and_a_shared_run(tmp_path):
    """The oracle for the held-out test below: planted contamination is found, in every
    file form the training folder may hold, and clean text is not."""
    prompts = load_set("real")
    chat = next(p for p in prompts if p["id"] == "chat-03")["messages"][0]["content"]
    rag = next(p for p in prompts if p["id"] == "rag-02")["messages"][0]["content"]
    run = " ".join(words(rag)[400:400 + N])  # 13 words from inside a long document
    (tmp_path / "copied.json").write_text(json.dumps({"prompts": [{"text": chat.upper()}]}))
    (tmp_path / "shared.jsonl").write_text(json.dumps({"p": f"Intro. {run} outro"}) + "\n")
    (tmp_path / "clean.txt").write_text("Write a limerick about a sleepy owl.\n" * 20)
    # six words of a short instruction, in a sentence of its own
    short = " ".join(words(chat)[2:2 + N_SHORT])
    (tmp_path / "short.txt").write_text(f"Please, {short}, thanks.\n")
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)))
    found = overlaps(prompts, list(training_texts(tmp_path)))
    assert "chat-03 ~ copied.json" in found
    assert any(f.endswith("~ shared.jsonl") and f.startswith("rag-") for f in found)
    assert "chat-03 ~ short.txt" in found
    assert not any("clean.txt" in f for f in found)


def test_bench_prompts_are_held_out_from_draft_training_prompts():
    """Against whatever the draft-training folder holds now (and the vocab-trim corpus,
    the other text a draft's head is shaped by)."""
    texts = [(ASSETS / "trim_prompts.txt", (ASSETS / "trim_prompts.txt").read_text())]
    folder = ASSETS / "draft_train"
    if folder.is_dir():
        texts += training_texts(folder)
    assert overlaps(load_set("real"), texts) == []


def test_task_requests_are_held_out_from_the_bench():
    """train.tasks writes requests of the bench's kinds from documents (here a corpus
    holding a bench document beside a clean one): all it keeps is clear of the bench by
    the oracle above, the clean document is summarized and asked about, and there are
    requests to complete and to explain functions."""
    from edgespec.train.tasks import task_requests

    rag = next(p for p in load_set("real") if p["id"] == "rag-02")["messages"][0]["content"]
    planted = rag[rag.index("Document 1:"):rag.index("Document 2:")]
    clean = "Lighthouse keeping\n\n" + "\n\n".join(
        f"Keeper {i} trimmed the wick at dusk, logged ship number {i * 7} and the wind, "
        f"and climbed the {i + 90} steps twice before dawn to wind the clockwork." * 3
        for i in range(12))
    requests = task_requests(0, texts=[planted, clean])
    # checked fifty at a time: a run across two requests can only add a finding
    assert overlaps(load_set("real"), [(Path(f"requests {i}+"), "\n\n".join(requests[i:i + 50]))
                                       for i in range(0, len(requests), 50)]) == []
    assert not any(planted[40:200] in r for r in requests)
    with_clean = [r for r in requests if "Keeper 3 trimmed the wick" in r]
    assert any("summary" in r.lower() or "summarize" in r.lower() for r in with_clean)
    assert any("Question: " in r and "Lighthouse keeping" in r for r in with_clean)
    assert sum(r.startswith(("Finish this", "Implement", "Write the body", "Here is a"))
               for r in requests) > 100
    assert sum("```python\ndef " in r and "Explain" in r for r in requests) > 100
    assert requests == task_requests(0, texts=[planted, clean])  # seeded
