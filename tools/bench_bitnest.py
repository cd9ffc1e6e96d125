"""BitNest benchmark: memory and speed of a draft nested inside the target.

For one checkpoint, three bundles: the nested one (one graph, one session: target W8 =
base + residual, draft = base), a plain int8 target alone, and a plain int8 target with a
separate int4 draft of the same weights. Each is loaded in a fresh process that reports
its resident memory (RSS) after loading and warming up, then greedy AR and speculative
tokens/s (side by side in that process) and the acceptance.

    python tools/bench_bitnest.py tools/demo_pair/target
    python tools/bench_bitnest.py /tmp/qwen05b --new 48 --prompts 3 --block-size 128

RSS counts file-backed pages too (the bundle's data, which ONNX Runtime may map); the
anonymous part (Linux RssAnon) is the memory that cannot simply be dropped. Probes run
with MALLOC_ARENA_MAX=1 and measure after malloc_trim: otherwise whether glibc happens to
serve the first pass from a second arena moved either bundle's figure by ~96 MiB from run
to run (0.5B shape), more than the difference being measured.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from edgespec.export import export

PROBE = r"""
import ctypes, json, sys, psutil, edgespec
engine = edgespec.load(sys.argv[1])
prompts = ["def quicksort(items):", "import os\nimport sys\n", "class Stack:\n",
           "def parse(line):\n", "for i in range(10):\n"][:int(sys.argv[3])]
engine.generate(prompts[0], max_new_tokens=4, mode="ar")
ctypes.CDLL("libc.so.6").malloc_trim(0)
rss = psutil.Process().memory_info().rss
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
anon = int(status.get("RssAnon", "0 kB").split()[0]) * 1024  # Linux: not file-backed
out = {"rss_MiB": round(rss / 2**20, 1), "anon_MiB": round(anon / 2**20, 1)}
modes = {"ar": dict(mode="ar")}
if engine.draft is not None:
    modes["spec"] = dict(mode="spec", draft_tokens=4)
for name, kw in modes.items():
    stats = [engine.generate(p, max_new_tokens=int(sys.argv[2]), **kw).stats for p in prompts]
    decode = sum(s.wall_s - s.prefill_s for s in stats)
    out[f"{name}_tokens_per_s"] = round(sum(s.new_tokens - 1 for s in stats) / decode, 1)
    if name == "spec":
        out["acceptance"] = round(sum(s.accepted for s in stats) / sum(s.drafted for s in stats), 3)
        out["tokens_per_target_pass"] = round(sum(s.new_tokens - 1 for s in stats)
                                              / sum(s.target_passes - 1 for s in stats), 2)
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()
    quiet = Console(file=io.StringIO())
    work = Path(tempfile.mkdtemp())
    bundles = {
        "nested (target W8 + draft = its 4-bit base, one session)":
            dict(draft="nested"),
        "int8 target alone": dict(),
        "int8 target + separate int4 draft": dict(draft=args.checkpoint,
                                                  draft_precision="int4"),
    }
    report = {}
    for name, kwargs in bundles.items():
        out = work / str(len(report))
        export(args.checkpoint, out, precision="int8", block_size=args.block_size,
               console=quiet, **kwargs)
        size = sum(p.stat().st_size for p in out.iterdir())
        probe = subprocess.run([sys.executable, "-c", PROBE, str(out), str(args.new),
                                str(args.prompts)], capture_output=True, text=True, check=True,
                               env={**os.environ, "MALLOC_ARENA_MAX": "1"})
        report[name] = {"bundle_MiB": round(size / 2**20, 1), **json.loads(probe.stdout)}
        print(json.dumps({name: report[name]}), flush=True)
    print(json.dumps({"checkpoint": str(args.checkpoint), "results": report}, indent=1))


if __name__ == "__main__":
    main()
