"""edgespec's CPU kernel alone: a model's linears on BlockQMatMul, timed by rows per pass.

A graph of one BlockQMatMulHalf per linear of a decoder shaped like SmolLM2-135M by default
(per layer q/k/v fused, o, gate/up fused, down; then the LM head), random 4-bit codes (the
head 8-bit), every product fed the same input: what the kernel costs a pass without the
rest of the graph. Sizes interleaved per round, median over rounds.

    python tools/bench_kernel.py --tokens 1 2 5 17 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgespec import kernels
from edgespec.export.blockq_ops import tiled_codes


def stack(hidden: int, ffn: int, kv: int, layers: int, vocab: int, threads: int,
          seed: int = 0) -> ort.InferenceSession:
    rng = np.random.default_rng(seed)
    shapes = [(hidden, hidden + 2 * kv, 4), (hidden, hidden, 4), (hidden, 2 * ffn, 4),
              (ffn, hidden, 4)] * layers + [(hidden, vocab, 8)]
    nodes, inits, outputs = [], [], []
    for i, (k, n, bits) in enumerate(shapes):
        codes = tiled_codes(rng.integers(0, 2 ** bits, (n, k), dtype=np.uint8), bits)
        table = (rng.random(n * k // 32) * 1e-2).astype(np.float16)
        inits += [helper.make_tensor(f"c{i}", TensorProto.UINT8, [codes.size], codes.tobytes(),
                                     raw=True),
                  helper.make_tensor(f"t{i}", TensorProto.FLOAT16, [table.size],
                                     table.tobytes(), raw=True)]
        nodes.append(helper.make_node("BlockQMatMulHalf", ["x" if k == hidden else "x_ffn",
                                                           f"c{i}", f"t{i}", f"t{i}"],
                                      [f"y{i}"], domain=kernels.DOMAIN, K=k, N=n, bits=bits))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, "S", width])
              for name, width in (("x", hidden), ("x_ffn", ffn))]
    return kernels.op_session(helper.make_graph(nodes, "kernel", inputs, outputs,
                                                initializer=inits), threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 5, 17])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--kv", type=int, default=192, help="width of k (and of v)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    a = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"edgespec's kernels: {kernels.describe()}")
    session = stack(a.hidden, a.ffn, a.kv, a.layers, a.vocab, a.threads)
    rng = np.random.default_rng(1)
    times: dict[int, list[float]] = {s: [] for s in a.tokens}
    for _ in range(a.rounds):
        for s in a.tokens:
            feed = {"x": rng.standard_normal((1, s, a.hidden)).astype(np.float32),
                    "x_ffn": rng.standard_normal((1, s, a.ffn)).astype(np.float32)}
            session.run(None, feed)
            best = float("inf")
            for _ in range(a.repeats):
                start = time.perf_counter()
                session.run(None, feed)
                best = min(best, time.perf_counter() - start)
            times[s].append(best * 1000)
    ms = {s: round(float(np.median(v)), 2) for s, v in times.items()}
    print(json.dumps({"path": kernels.PATHS[kernels.path()], "threads": a.threads, "ms": ms,
                      "x_one": {s: round(ms[s] / ms[min(ms)], 2) for s in ms}}, indent=1))


if __name__ == "__main__":
    main()
