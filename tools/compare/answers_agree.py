"""How often a quantized bundle's greedy chat answers equal its reference's, token for token.

The 16 chat prompts of edgespec's real-model benchmark set (edgespec/assets/bench/
chat.json), each chat-formatted, answered greedily (AR) for `--tokens` tokens by every
bundle; an answer agrees when all its tokens equal the reference's. Also reported: the
mean number of leading tokens an answer shares with the reference's (its first
divergence), which moves before whole answers do.

    python tools/compare/answers_agree.py REFERENCE_BUNDLE BUNDLE... [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
from importlib.resources import files
from pathlib import Path

import edgespec


def answers(bundle: Path, prompts: list[list[dict]], tokens: int) -> list[list[int]]:
    engine = edgespec.load(bundle, device="cpu")
    out = []
    for messages in prompts:
        ids = engine.tokenizer.encode_chat(messages)
        out.append(engine.generate(ids, max_new_tokens=tokens, mode="ar").token_ids)
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    chat = json.loads((files("edgespec") / "assets" / "bench" / "chat.json").read_text())
    prompts = [p["messages"] for p in chat["prompts"]]
    ref = answers(a.reference, prompts, a.tokens)
    report = {}
    for bundle in a.bundles:
        got = answers(bundle, prompts, a.tokens)
        same = sum(g == r for g, r in zip(got, ref, strict=True))
        shared = [next((i for i, (x, y) in enumerate(zip(g, r, strict=False)) if x != y),
                       min(len(g), len(r))) for g, r in zip(got, ref, strict=True)]
        report[str(bundle)] = {"agree": f"{same}/{len(prompts)}",
                               "mean_shared_prefix": round(sum(shared) / len(shared), 1)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
