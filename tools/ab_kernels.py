"""Kernel libraries side by side: a bundle's pass costs with edgespec/kernels built from
several git revisions, all loaded in one process and timed in interleaved rounds.

This host drifts ±30% between runs (and between processes started a minute apart), so a
kernel change is judged by the ratio of passes timed moments apart in one process: each
revision's library is compiled from `git show REV:edgespec/kernels/*` with setup.py's
flags into a temporary directory, each bundle is opened once per library (ONNX Runtime
loads each file privately, so their symbols never mix) on the one thread pool they share
(pools of their own, left spinning, doubled each other's pass times), and every round times every
(library, model, S) like tools/bench_verify_cost.py does. Ratios are medians of the
per-round ratios to the first revision. `WORK` is the working tree's sources.

    python tools/ab_kernels.py BUNDLE --rev 05c8101 WORK --tokens 1 2 5 17 --rounds 10
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import edgespec
from edgespec import kernels
from edgespec.errors import EdgespecError
from edgespec.runtimes import pool

sys.path.insert(0, str(Path(__file__).parent))
from bench_verify_cost import pass_ms  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "edgespec/kernels"


def kernel_files(rev: str) -> list[str]:
    """The C sources and headers of edgespec/kernels at `rev` (the working tree's: WORK)."""
    if rev == "WORK":
        names = [p.name for p in (ROOT / KERNELS).iterdir()]
    else:
        listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"], cwd=ROOT,
                                capture_output=True, text=True)
        if listed.returncode:
            raise SystemExit(f"git has no {KERNELS} at revision '{rev}'; name a commit of "
                             "this repository that has the kernels, or WORK.")
        names = listed.stdout.split()
    return sorted(n for n in names if n.endswith((".c", ".h")))


def build(rev: str, out: Path) -> Path:
    """The kernel library of revision `rev` ("WORK": the working tree) in `out`."""
    src = out / rev
    src.mkdir()
    files = kernel_files(rev)
    for name in files:
        path = f"{KERNELS}/{name}"
        if rev == "WORK":
            text = (ROOT / path).read_bytes()
        else:
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT,
                                  capture_output=True, check=True).stdout
        (src / name).write_bytes(text)
    lib = src / "kernels.so"
    try:
        sources = [str(src / name) for name in files if name.endswith(".c")]
        built = subprocess.run(["gcc", "-O3", "-ffp-contract=off", "-std=c11", "-shared",
                                "-fPIC", *sources, "-o", str(lib), "-lm"],
                               capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit("gcc is not installed; install it to build the kernel libraries.") \
            from None
    if built.returncode:
        raise SystemExit(f"gcc could not build the kernels of '{rev}': "
                         f"{built.stderr.strip().splitlines()[0]}")
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--rev", nargs="+", default=["HEAD", "WORK"],
                    help="git revisions (the first is the baseline); WORK: the working tree")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 17])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=50, help="tokens cached before each pass")
    a = ap.parse_args()
    pool.share_threads()  # pools of their own, spinning, would slow one another
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for rev in a.rev:
            lib = build(rev, Path(tmp))
            kernels.library = lambda lib=lib: lib  # what every session of this engine loads
            try:
                engines[rev] = edgespec.load(a.bundle, device="cpu", threads=a.threads)
            except EdgespecError as e:
                raise SystemExit(str(e)) from None
        models = [(role, s) for role in ("target", "draft")
                  for s in (a.tokens if role == "target" else [1])
                  if getattr(engines[a.rev[0]], role) is not None]
        ms = {(rev, m): [] for rev in a.rev for m in models}
        for r in range(a.rounds):
            turn = r % len(a.rev)  # each revision in every place of the order in turn:
            for rev in a.rev[turn:] + a.rev[:turn]:  # the first of a round ran slower here
                engine = engines[rev]
                for role, s in models:
                    ms[(rev, (role, s))].append(
                        pass_ms(getattr(engine, role), s, a.repeats, a.context))
    base = a.rev[0]
    print(f"{a.bundle}: median ms over {a.rounds} rounds; ratio to {base} (median per round)")
    for m in models:
        cells = []
        for rev in a.rev:
            cell = f"{rev} {np.median(ms[(rev, m)]):.2f}"
            if rev != base:
                ratio = np.median(np.array(ms[(rev, m)]) / np.array(ms[(base, m)]))
                cell += f" ({ratio:.3f}x)"
            cells.append(cell)
        print(f"{m[0]} S={m[1]}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
