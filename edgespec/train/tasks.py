"""Task requests: work of the kinds people give a chat model (complete or explain code,
summarize a document, answer from documents), written from the running Python's own
standard library and documentation (pydoc_data.topics), for a draft head to learn the
target's answers to.

A chat target's self-written requests (data.self_requests) are short questions; its
answers to them teach a head little about what it says when it copies from a document or
finishes a function, where most speculative tokens are won. These requests fill that gap
with text every Python installation has, so a GPU machine with nothing else on it writes
them too. None of them may overlap the benchmark's held-out prompts (the same 13-word
test tests/test_bench_prompts.py applies to the shipped training files): the phrasings
differ from the benchmark's, and a request sharing a run of words with a benchmark prompt
is dropped, which keeps out the sections and functions the benchmark is made of.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from edgespec.bench_sets import load_set

CONTEXT = 8000  # characters of documents a question comes with, when three or four
RUN = 13  # words: a shared run this long counts as overlap (GPT-3's contamination study)
SHORT, SHORT_RUN = 40, 6  # a prompt under SHORT words: a shared run of SHORT_RUN counts

COMPLETE = ("Finish this Python function so that it does what its docstring says.",
            "Implement the function below and show the complete code.",
            "Write the body of this function:",
            "Here is a signature and a docstring. Write the Python code for it.")
EXPLAIN = ("What does this Python function do? Explain it step by step.",
           "Explain the following code to a beginner.",
           "Review this function: describe what it does and any edge cases it handles.")
SUMMARIZE = ("Give a short summary of the text below.",
             "Summarize this part of the documentation in three sentences.",
             "What are the main points of the following text? List them.",
             "Write a one-paragraph summary of this documentation.")
ASK = ("Read the documents and answer the question at the end.",
       "Use the documents below to answer.")
QUESTIONS = ("What does the documentation say about {}?", "Explain {} using the documents.",
             "According to the documents, how does {} work?")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _runs(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def clear_of_bench() -> Callable[[str], bool]:
    """Whether a text shares no 13-word run with a benchmark prompt, nor a 6-word run with
    a short one (under 40 words): the held-out rule of tests/test_bench_prompts.py."""
    turns = [_words(m["content"]) for p in load_set("real") for m in p.get("messages", [])]
    long_runs = set().union(*(_runs(t, RUN) for t in turns))
    short_runs = set().union(*(_runs(t, SHORT_RUN) for t in turns if len(t) < SHORT))

    def clear(text: str) -> bool:
        words = _words(text)
        return not (_runs(words, RUN) & long_runs or _runs(words, SHORT_RUN) & short_runs)

    return clear


def _module(path: Path) -> tuple[str, ast.Module] | None:
    """A standard-library file's source and syntax tree (None where it does not parse)."""
    try:
        source = path.read_text(encoding="utf-8")
        return source, ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _functions(source: str, tree: ast.Module) -> list[tuple[str, str]]:
    """(signature + docstring, whole source) of each documented function of 6-40 lines."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and \
                len(node.body) > 1 and node.end_lineno and \
                6 <= node.end_lineno - node.lineno <= 40:
            head = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[1].lineno - 1]))
            whole = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
            found.append((head.rstrip(), whole.rstrip()))
    return found


def _sections(text: str, low: int, high: int) -> list[str]:
    """The text cut at blank lines into pieces of `low` to `high` characters."""
    pieces, current = [], ""
    for para in re.split(r"\n\s*\n", text.strip()):
        if current and len(current) + len(para) > high:
            if len(current) >= low:
                pieces.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if len(current) >= low:
        pieces.append(current[:high])
    return pieces


def _code(text: str) -> str:
    return f"```python\n{text}\n```"


def _subject(text: str) -> str | None:
    """What a section is about when it opens with a heading (a short first line)."""
    first = re.sub(r"[#*=`\-]+", " ", text.lstrip().splitlines()[0]).strip()
    heading = 0 < len(first) <= 50 and re.search("[A-Za-z]", first)
    return first if heading and not first.endswith((".", ":", ",")) else None


def task_requests(seed: int, limit: int | None = None, texts: Sequence[str] = (),
                  max_chars: int | None = None) -> list[str]:
    """Requests of four kinds, shuffled (seeded): complete a documented standard-library
    function from its signature, explain one, summarize a documentation section, and
    answer a question from two to four sections; the documents are pydoc's topics, the
    standard library's module docstrings and `texts` (a corpus: data.read_texts). None
    overlaps a benchmark prompt (clear_of_bench), none is longer than `max_chars`."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [m for path in sorted(stdlib.glob("*.py")) if (m := _module(path))]
    functions = [f for source, tree in modules for f in _functions(source, tree)]
    documents = [text for _, text in sorted(topics.items())] + list(texts)
    documents += [doc for _, tree in modules if (doc := ast.get_docstring(tree))]
    sections = [(_subject(s), s) for text in documents for s in _sections(text, 600, 4000)]
    requests = [f"{rng.choice(COMPLETE)}\n\n{_code(head)}" for head, _ in functions]
    requests += [f"{rng.choice(EXPLAIN)}\n\n{_code(whole)}" for _, whole in functions
                 if len(whole) < 2500]
    requests += [f"{s}\n\n{rng.choice(SUMMARIZE)}" if rng.random() < 0.3 else
                 f"{rng.choice(SUMMARIZE)}\n\n{s}" for _, s in sections for _ in range(3)]
    for _ in range(2 * len(sections)):
        picked = rng.sample(sections, rng.randint(2, 4))
        while sum(len(s) for _, s in picked) > CONTEXT and len(picked) > 2:
            picked.pop()
        about = rng.randrange(len(picked))
        subject = picked[about][0] or f"what Document {about + 1} describes"
        requests.append(rng.choice(ASK) + "\n\n" + "\n\n".join(
            f"Document {i + 1}:\n{s}" for i, (_, s) in enumerate(picked))
            + "\n\nQuestion: " + rng.choice(QUESTIONS).format(subject))
    clear = clear_of_bench()
    kept = list(dict.fromkeys(r for r in requests
                              if (max_chars is None or len(r) <= max_chars) and clear(r)))
    rng.shuffle(kept)
    return kept[:limit]
