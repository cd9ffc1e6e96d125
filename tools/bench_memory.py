"""What an engine costs in memory and time to open: resident memory after loading and after
a short generation, and the seconds each took, each model in a fresh process (a process's
heap only grows with what ran before it in the same one). Linux (/proc/self/status).

    python tools/bench_memory.py --model /tmp/models/gemma-3-270m-q4_k_m.gguf SMOL.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """import json, sys, time
import edgespec
from edgespec.errors import EdgespecError
from edgespec.model_cache import resolve_model

def mib(field):
    status = open("/proc/self/status").read()
    return int(status.split(field + ":")[1].split()[0]) >> 10

try:  # exported first if need be, outside the figures
    path = str(resolve_model(sys.argv[1]))
except EdgespecError as e:
    sys.exit(str(e))
start, t0 = mib("VmRSS"), time.perf_counter()
engine = edgespec.load(path, threads=int(sys.argv[2]))
loaded, t1 = mib("VmRSS"), time.perf_counter()
engine.generate("Tell me about the sea.", max_new_tokens=64)
print(json.dumps({"load_s": round(t1 - t0, 2), "rss_after_load_mib": loaded - start,
                  "rss_after_64_tokens_mib": mib("VmRSS") - start,
                  "peak_rss_mib": mib("VmHWM") - start}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", required=True, help="bundles or .gguf files")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for model in a.model:
        out = subprocess.run([sys.executable, "-c", CHILD, model, str(a.threads)],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{model}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
        rows.append({"model": model, **json.loads(out.stdout.splitlines()[-1])})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
