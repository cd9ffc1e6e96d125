"""Decode speed on ONNX Runtime's shared thread pool against a pool per session.

The choice is made once per process (edgespec.runtimes.pool), so each round runs one
process of each kind in turn, the order alternating (this machine drifts), every
process generating the same prompts greedily in AR and the bundle's default mode; the
ratio is taken within each round.

    python tools/ab_pools.py BUNDLE --category chat --prompts 6 --new 128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

KINDS = ("shared", "own")


def run(bundle: str, kind: str, category: str, prompts: int, new: int, threads: int) -> dict:
    """In this process: tokens/s and the head's and the target's ms a pass."""
    from edgespec.runtimes import pool

    if kind == "shared":
        pool.share_threads()
    import edgespec
    from edgespec.bench_sets import load_set

    engine = edgespec.load(bundle, device="cpu", threads=threads)
    sums = {"ar": [0, 0.0], "default": [0, 0.0]}
    draft_s = verify_s = draft_passes = verify_passes = 0
    texts = []
    for p in [q for q in load_set("real") if q["category"] == category][:prompts]:
        ids = engine.tokenizer.encode_chat(p["messages"])
        for mode in ("ar", None):
            g = engine.generate(ids, max_new_tokens=new, temperature=0, mode=mode)
            s = g.stats
            sums[mode or "default"][0] += len(g.token_ids)
            sums[mode or "default"][1] += s.wall_s - s.prefill_s
            texts.append(g.token_ids)
            if mode is None:
                draft_s += s.draft_s
                verify_s += s.verify_s
                draft_passes += s.draft_passes
                verify_passes += s.target_passes - 1  # the prefill's is not a verify pass
    return {"tok_s": {m: n / w for m, (n, w) in sums.items()},
            "draft_ms": 1e3 * draft_s / max(draft_passes, 1),
            "verify_ms": 1e3 * verify_s / max(verify_passes, 1),
            "same_text": all(a == b for a, b in zip(texts[::2], texts[1::2], strict=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--category", default="chat")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(run(a.bundle, a.worker, a.category, a.prompts, a.new, a.threads)))
        return
    rounds = []
    for r in range(a.rounds):
        got = {}
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            out = subprocess.run([sys.executable, __file__, a.bundle, "--worker", kind,
                                  "--category", a.category, "--prompts", str(a.prompts),
                                  "--new", str(a.new), "--threads", str(a.threads)],
                                 capture_output=True, text=True, check=True)
            got[kind] = json.loads(out.stdout.splitlines()[-1])
        rounds.append(got)
        print(json.dumps({"round": r, **got}), file=sys.stderr)
    report = {"bundle": str(Path(a.bundle)), "category": a.category, "rounds": a.rounds}
    for mode in ("ar", "default"):
        ratio = [g["shared"]["tok_s"][mode] / g["own"]["tok_s"][mode] for g in rounds]
        report[mode] = {kind: round(float(np.median([g[kind]["tok_s"][mode] for g in rounds])), 1)
                        for kind in KINDS}
        report[mode]["shared_vs_own"] = round(float(np.median(ratio)), 3)
        report[mode]["range"] = [round(min(ratio), 3), round(max(ratio), 3)]
    for part in ("draft_ms", "verify_ms"):
        report[part] = {kind: round(float(np.median([g[kind][part] for g in rounds])), 3)
                        for kind in KINDS}
    report["same_text"] = all(g[k]["same_text"] for g in rounds for k in KINDS)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
