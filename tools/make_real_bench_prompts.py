"""Build the generated half of the real-model prompt sets in edgespec/assets/bench/:
code.json (complete a standard-library function from its signature and docstring),
summarization.json and rag.json (long context: sections of the Python language reference
as CPython ships them in pydoc_data.topics, PSF-licensed). chat.json and multi-turn.json
are hand-written and not touched here.

Every prompt is a conversation for the model's chat template, since these sets are for
instruction-tuned models; `edgespec bench` renders them as plain text for a model without
a template. The sources are fixed lists (below) so a draft's training data can stay clear
of them: tests/test_bench_prompts.py checks the sets against edgespec/assets/draft_train/.

    python tools/make_real_bench_prompts.py
"""

from __future__ import annotations

import ast
import json
import platform
import random
import sysconfig
import textwrap
from pathlib import Path
from pydoc_data.topics import topics

OUT = Path(__file__).resolve().parents[1] / "edgespec" / "assets" / "bench"
CODE_FILES = ("textwrap.py", "shlex.py", "calendar.py", "statistics.py", "heapq.py",
              "ipaddress.py", "fnmatch.py", "colorsys.py", "difflib.py", "netrc.py")
CODE_PROMPTS = 12
SUMMARIZED = ("execmodel", "strings", "import", "try", "calls", "sequence-types", "function",
              "naming")
# (the documents given, in this order; the question, answered by one of them)
RAG = [
    (("raise", "with", "for", "class"),
     "Which two methods does the with statement call on the context manager, and when?"),
    (("dict", "objects", "slicings", "exceptions"),
     "According to the documentation, which three things does every object have?"),
    (("in", "exceptions", "raise", "augassign"),
     "What does writing `from None` after a raise statement do?"),
    (("slicings", "augassign", "for", "subscriptions"),
     "When does the else clause of a for loop run, and when is it skipped?"),
    (("identifiers", "comparisons", "binary"),
     "How is a chained comparison such as a < b < c evaluated?"),
    (("subscriptions", "context-managers", "augassign", "dict"),
     "How does an augmented assignment like x += 1 differ from x = x + 1?"),
    (("objects", "async", "dict", "with"),
     "Which constructs may only be used inside the body of a coroutine function?"),
    (("class", "binary", "in", "identifiers"),
     "For a user-defined class, which special methods does the `in` operator try, and in "
     "what order?"),
]
HELD_OUT = ("never used to train or distil a draft; tests/test_bench_prompts.py checks them "
            "against edgespec/assets/draft_train/")
LICENSE = f"Python {platform.python_version()} standard library / documentation (PSF License)"


def documented_functions(path: Path) -> list[tuple[str, str]]:
    """(name, signature + docstring) of the public functions of 6-30 lines with a docstring."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and \
                ast.get_docstring(node) and node.end_lineno and len(node.body) > 1 and \
                6 <= node.end_lineno - node.lineno <= 30:
            head = lines[node.lineno - 1:node.body[1].lineno - 1]
            found.append((node.name, textwrap.dedent("\n".join(head)).rstrip()))
    return found


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def write(category: str, about: str, prompts: list[list[dict[str, str]]]) -> None:
    data = {"category": category, "about": about, "license": LICENSE, "held_out": HELD_OUT,
            "prompts": [{"id": f"{category}-{i:02d}", "messages": m}
                        for i, m in enumerate(prompts)]}
    path = OUT / f"{category}.json"
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(prompts)} prompts -> {path}")


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pool = [fn for name in CODE_FILES for fn in documented_functions(stdlib / name)]
    random.Random(0).shuffle(pool)
    write("code", "complete a function from its signature and docstring (stdlib: "
          + ", ".join(CODE_FILES) + ")",
          [user("Complete this Python function. Reply with the whole function in one code "
                f"block.\n\n```python\n{head}\n```") for _, head in pool[:CODE_PROMPTS]])
    write("summarization", "summarize a section of the Python language reference "
          "(pydoc_data.topics: " + ", ".join(SUMMARIZED) + ")",
          [user("Summarize the following section of the Python documentation in five "
                f"sentences.\n\n{topics[key].strip()}") for key in SUMMARIZED])
    write("rag", "answer a question from 3-4 sections of the Python language reference "
          "given as documents (pydoc_data.topics)",
          [user("Answer the question using only the documents below.\n\n"
                + "\n\n".join(f"Document {i + 1}:\n{topics[key].strip()}"
                              for i, key in enumerate(keys))
                + f"\n\nQuestion: {question}") for keys, question in RAG])


if __name__ == "__main__":
    main()
