"""A copy of a draft head that proposes from the target's whole vocabulary, to measure
what VocabTrim saves: the same trained weights, `kept` = every token id.

A head scores its predicted state with the target's LM head cut to its kept rows; on a
large vocabulary that product is most of a draft step (Gemma 3: 262,144 rows of 640).
Export the target once with each head and compare the draft step and the end-to-end
speed:

    python tools/full_vocab_head.py HEAD.npz --vocab 262144 --out FULL.npz
    edgespec export TARGET --draft HEAD.npz --out TRIMMED
    edgespec export TARGET --draft FULL.npz --out FULL
    python tools/bench_verify_cost.py --model TRIMMED FULL --tokens 1 --rounds 5
    edgespec bench --model TRIMMED ...; edgespec bench --model FULL ...
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from edgespec.export.draft_head import load_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", type=Path)
    ap.add_argument("--vocab", type=int, required=True, help="the target's vocabulary size")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    head = load_head(a.head)
    card = {**head.card, "kept_from": f"{a.head.name}, widened to all {a.vocab} tokens"}
    dataclasses.replace(head, kept=np.arange(a.vocab), card=card).save(a.out)


if __name__ == "__main__":
    main()
