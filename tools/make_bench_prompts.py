"""Build edgespec/assets/bench_prompts.json: a Spec-Bench-style prompt set for the demo's
domain (Python), cut deterministically from the standard library files the demo pair
never trained on (the held-aside files named in its model card).

Categories: completion (continue a function from its signature and docstring),
editing (a whole function, then a request to rewrite it: long context, heavy copying),
docstring (write the docstring of a shown function), chat (multi-turn, chat template),
summarization (a module's source followed by a summary comment to complete).

    python tools/make_bench_prompts.py
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE.parent / "edgespec" / "assets" / "bench_prompts.json"
CARD = HERE / "demo_pair" / "model_card.json"
PER_CATEGORY = 10


def functions(path: Path) -> list[tuple[ast.FunctionDef, str]]:
    source = path.read_text(encoding="utf-8", errors="replace")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.end_lineno and \
                4 <= node.end_lineno - node.lineno <= 30 and len(node.name.strip("_")) >= 3:
            found.append((node, "\n".join(lines[node.lineno - 1:node.end_lineno])))
    return found


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    card = json.loads(CARD.read_text())
    files = [stdlib / f for f in card["held_aside_files"]]
    rng = random.Random(0)
    pool = [(p, node, src) for p in files for node, src in functions(p)]
    rng.shuffle(pool)
    prompts = []
    documented = [x for x in pool if ast.get_docstring(x[1])]
    for _, node, src in documented[:PER_CATEGORY]:
        body_start = node.body[1].lineno - node.lineno if len(node.body) > 1 else 1
        head = "\n".join(src.splitlines()[:body_start]) + "\n"
        prompts.append({"category": "completion", "prompt": head})
    for _, node, src in pool[PER_CATEGORY:2 * PER_CATEGORY]:
        first = src.splitlines()[0].replace(f"def {node.name}(", f"def {node.name}_v2(", 1)
        prompts.append({"category": "editing", "prompt": (
            f"{src}\n\n\n# The same function, renamed to {node.name}_v2 and with "
            f"clearer variable names:\n{first}\n")})
    undocumented = [x for x in pool if not ast.get_docstring(x[1])]
    for _, node, src in undocumented[:PER_CATEGORY]:
        lines = src.splitlines()
        first_body = lines[node.body[0].lineno - node.lineno]
        indent = first_body[:len(first_body) - len(first_body.lstrip())]
        signature = "\n".join(lines[:node.body[0].lineno - node.lineno])
        prompts.append({"category": "docstring", "prompt": f'{signature}\n{indent}"""'})
    for _, node, src in documented[PER_CATEGORY:2 * PER_CATEGORY]:
        doc = ast.get_docstring(node).splitlines()[0]
        prompts.append({"category": "chat", "messages": [
            {"role": "user", "content": f"Write a Python function `{node.name}`: {doc}"},
            {"role": "assistant", "content": src},
            {"role": "user", "content": f"Write a Python function `{node.name}_checked` "
                                        "that does the same but validates its arguments."},
        ]})
    for path in files[:PER_CATEGORY]:
        text = path.read_text(encoding="utf-8", errors="replace")[:1000]  # demo context 512
        prompts.append({"category": "summarization",
                        "prompt": f"{text}\n\n\n# Summary of the code above, in plain "
                                  "words:\n#"})
    OUT.write_text(json.dumps({"source": "held-aside stdlib files of the demo model card",
                               "prompts": prompts}, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(prompts)} prompts -> {OUT}")


if __name__ == "__main__":
    main()
