"""One-shot CUDA check for a lent GPU machine (not run in CI: no GPU there).

Exports the demo pair with the cuda profile, then on the CUDA execution provider:
1. says which provider each session really got;
2. compares logits with the CPU fp32 export on the same tokens (fp16: ~1e-2);
3. checks greedy speculative output == greedy AR output (chains);
4. reports AR vs speculative tokens/s measured side by side.

    pip install torch==2.13.0 ".[test]" onnxruntime-gpu && python tools/gpu_check.py
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console

import edgespec
from edgespec.export import export

HERE = Path(__file__).parent
PAIR = HERE / "demo_pair"


def main() -> None:
    quiet = Console(file=io.StringIO())
    tmp = Path(tempfile.mkdtemp())
    report: dict = {}
    export(PAIR / "target", tmp / "cpu", draft=PAIR / "draft", precision="fp32",
           console=quiet)
    cpu = edgespec.load(tmp / "cpu", device="cpu")
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 4096, 64)]
    ref = cpu.target.forward(ids)
    for precision in ("fp16", "int4"):
        out = tmp / f"cuda-{precision}"
        export(PAIR / "target", out, draft=PAIR / "draft", precision=precision,
               ep_profile="cuda", console=quiet)
        engine = edgespec.load(out, device="cuda")
        row = {"providers": engine.target.session.get_providers(),
               "device": engine.target.device}
        got = engine.target.forward(ids)
        row["max_abs_logit_diff_vs_cpu_fp32"] = float(np.abs(got - ref).max())
        row["top1_agreement_vs_cpu_fp32"] = float((got.argmax(-1) == ref.argmax(-1)).mean())
        engine.target.cache.reset()
        prompts = ["def quicksort(items):", "import os\nimport sys\n", "class Stack:\n"]
        speeds: dict[str, list] = {"ar": [], "chain": []}  # trees need a host KV cache
        same = True
        for prompt in prompts:
            ar = engine.generate(prompt, max_new_tokens=128, mode="ar")
            chain = engine.generate(prompt, max_new_tokens=128, mode="spec")
            speeds["ar"].append(ar.stats.tokens_per_second)
            speeds["chain"].append(chain.stats.tokens_per_second)
            same &= chain.token_ids == ar.token_ids
        row["greedy_chain_equals_ar"] = same
        row["tokens_per_s"] = {k: round(float(np.mean(v)), 1) for k, v in speeds.items() if v}
        report[precision] = row
        print(json.dumps({precision: row}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
