"""Which ONNX Runtime CPU linear kernels are bitwise batch invariant, and what they cost by S.

Builds, per kernel, a stack of SmolLM2-135M's linears (per layer qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576, chained; then the 49,152-row head) with random
weights, and feeds S = 1, 5, 17 rows. Invariance: every row of an S-row pass against the
same row fed alone (max |difference|; 0.0 = bitwise). Cost: median ms per pass, kernels
and S interleaved in one run (the machine drifts), with the range over rounds.

    python tools/probe_batch_invariance.py                  # all kernels, 30 layers
    python tools/probe_batch_invariance.py --bundle B ...   # also whole bundles' targets

With --bundle, each bundle's target is probed the same way through edgespec's runtime
(runtimes/exactness: alone vs 5/17-token chains and decoy trees).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgespec.export import linear_ops
from edgespec.export.graph import MS, OPSET, GraphBuilder
from edgespec.quant.blockwise import quantize_blockwise
from edgespec.runtimes.pool import session_options

D, FF, QKV, VOCAB = 576, 1536, 960, 49152
Linear = Callable[[GraphBuilder, str, np.ndarray, str], str]


def nbits(bits: int, block: int, level: int) -> Linear:
    def build(g: GraphBuilder, x: str, w: np.ndarray, name: str) -> str:
        q = quantize_blockwise(w, bits, block, True)
        return g.node("MatMulNBits", [x, g.const(f"{name}.q", q.packed),
                                      g.fconst(f"{name}.s", q.scales)], [f"{name}.y"], name,
                      domain=MS, K=q.k, N=q.n, bits=bits, block_size=block,
                      accuracy_level=level)[0]
    return build


def fp32(g: GraphBuilder, x: str, w: np.ndarray, name: str) -> str:
    return g.node("MatMul", [x, g.fconst(f"{name}.w", w.T.copy())], [f"{name}.y"], name)[0]


def dynamic_per_tensor(g: GraphBuilder, x: str, w: np.ndarray, name: str) -> str:
    """com.microsoft.DynamicQuantizeMatMul: one activation scale for the whole pass."""
    scale = np.abs(w).max(axis=1) / 127
    q = np.rint(w / scale[:, None]).astype(np.int8)
    return g.node("DynamicQuantizeMatMul", [x, g.const(f"{name}.q", q.T.copy()),
                                            g.fconst(f"{name}.s", scale)],
                  [f"{name}.y"], name, domain=MS)[0]


def grouped_int8(group: int) -> Linear:
    """Activation scales per row and per group of `group` inputs (closer to MatMulNBits'
    per-block int8 than one scale per row): the groups become a batch of
    MatMulIntegerToFloat (A [K/g, S, g], B [K/g, g, N]) summed by ReduceSum."""
    def build(g: GraphBuilder, x: str, w: np.ndarray, name: str) -> str:
        n, k = w.shape
        codes, scale = linear_ops.quantize_rows_u8(w)
        xg = g.node("Reshape", [x, g.const(f"groups{group}.{k}", np.array([-1, k // group, group],
                                                                          np.int64))],
                    [f"{name}.xg"], f"{name}.xg")[0]
        xq, peak = linear_ops.row_scale(g, g.node("Transpose", [xg], [f"{name}.xt"],
                                                  f"{name}.xt", perm=[1, 0, 2])[0], name)
        zp = g.const("linear.zp", np.array(128, np.uint8))
        y = g.node("MatMulIntegerToFloat", [xq, g.const(f"{name}.b", codes.reshape(-1, group, n)),
                                            peak, g.fconst(f"{name}.cs", scale / 127), zp, zp],
                   [f"{name}.parts"], f"{name}.parts", domain=MS)[0]
        return g.node("ReduceSum", [y, g.const("axis0", np.array([0], np.int64))],
                      [f"{name}.y"], f"{name}.y", keepdims=1)[0]
    return build


def rowwise_hi_lo(g: GraphBuilder, x: str, w: np.ndarray, name: str) -> str:
    """~16-bit activations from two int8 rows per token: the row's codes and the codes of
    what they miss, fed as 2S rows of one MatMulIntegerToFloat and summed."""
    codes, scale = linear_ops.quantize_rows_u8(w)
    zp = g.const("linear.zp", np.array(128, np.uint8))
    hi, hi_peak = linear_ops.row_scale(g, x, f"{name}.hi")
    back = g.node("Mul", [g.node("DequantizeLinear", [hi, g.fconst("linear.step", 1 / 127), zp],
                                 [f"{name}.dq"], f"{name}.dq")[0], hi_peak],
                  [f"{name}.back"], f"{name}.back")[0]
    lo, lo_peak = linear_ops.row_scale(g, g.node("Sub", [x, back], [f"{name}.miss"],
                                                 f"{name}.miss")[0], f"{name}.lo")
    both = [g.node("Concat", pair, [f"{name}.{tag}"], f"{name}.{tag}", axis=1)[0]
            for tag, pair in (("codes", [hi, lo]), ("peaks", [hi_peak, lo_peak]))]
    y = g.node("MatMulIntegerToFloat", [both[0], g.const(f"{name}.rowcodes", codes), both[1],
                                        g.fconst(f"{name}.colscale", scale / 127), zp, zp],
               [f"{name}.y2"], name, domain=MS)[0]
    y = g.node("Reshape", [y, g.const(f"hilo.{w.shape[0]}", np.array([1, 2, -1, w.shape[0]],
                                                                     np.int64))],
               [f"{name}.y4"], f"{name}.y4")[0]
    return g.node("ReduceSum", [y, g.const("axis1", np.array([1], np.int64))], [f"{name}.y"],
                  f"{name}.sum", keepdims=0)[0]


def rowwise_outliers(count: int) -> Linear:
    """Per-row int8 with `count` fixed input channels (an export would pick them on
    calibration data: the largest activations) taken out and computed in fp32."""
    def build(g: GraphBuilder, x: str, w: np.ndarray, name: str) -> str:
        channels = np.sort(np.random.default_rng(len(name)).choice(w.shape[1], count, False))
        keep = np.ones(w.shape[1], np.float32)
        keep[channels] = 0
        y = linear_ops.rowwise_int8(g, g.node("Mul", [x, g.fconst(f"{name}.keep", keep)],
                                              [f"{name}.xk"], f"{name}.xk")[0], w, name)
        xo = g.node("Gather", [x, g.const(f"{name}.ch", channels.astype(np.int64))],
                    [f"{name}.xo"], f"{name}.xo", axis=2)[0]
        yo = g.node("MatMul", [xo, g.fconst(f"{name}.wo", w[:, channels].T.copy())],
                    [f"{name}.yo"], f"{name}.yo")[0]
        return g.node("Add", [y, yo], [f"{name}.y"], f"{name}.add")[0]
    return build


KERNELS: dict[str, Linear] = {
    "nbits4 b32 acc4": nbits(4, 32, 4), "nbits4 b16 acc4": nbits(4, 16, 4),
    "nbits8 b32 acc4": nbits(8, 32, 4), "nbits4 b32 acc0": nbits(4, 32, 0),
    "rowwise int8 (MatMulIntegerToFloat)": linear_ops.rowwise_int8,
    "DynamicQuantizeMatMul (per tensor)": dynamic_per_tensor, "fp32 MatMul": fp32,
    "int8 per row and 64 inputs (batched)": grouped_int8(64),
    "int8 per row, hi + lo rows": rowwise_hi_lo,
    "int8 per row + 16 fp32 channels": rowwise_outliers(16),
}


def stack(kernel: Linear, layers: int, head: bool, seed: int = 0) -> ort.InferenceSession:
    """The linears of `layers` decoder layers chained (Slices keep the widths), then the
    head; random weights with the fan-in's variance so values stay in range."""
    rng = np.random.default_rng(seed)
    g = GraphBuilder("int8", 32, 4)

    def w(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def cut(x: str, width: int, name: str) -> str:
        return g.node("Slice", [x, g.const("zero", np.array([0], np.int64)),
                                g.const(f"w{width}", np.array([width], np.int64)),
                                g.const("last", np.array([-1], np.int64))], [name], name)[0]

    x = "x"
    for i in range(layers):
        x = cut(kernel(g, x, w(QKV, D), f"l{i}.qkv"), D, f"l{i}.q")
        x = kernel(g, x, w(D, D), f"l{i}.o")
        x = cut(kernel(g, x, w(2 * FF, D), f"l{i}.gate_up"), FF, f"l{i}.up")
        x = kernel(g, x, w(D, FF), f"l{i}.down")
    if head:
        x = kernel(g, x, w(VOCAB, D), "head")
    g.node("Identity", [x], ["y"], "out")
    graph = helper.make_graph(g.nodes, "stack", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, "S", D])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], initializer=g.inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
    opts = session_options(2)
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def invariance(session: ort.InferenceSession, x: np.ndarray) -> dict[int, float]:
    """max |row of an S-row pass - the row alone| for each S."""
    alone = np.concatenate([session.run(None, {"x": x[:, i:i + 1]})[0]
                            for i in range(x.shape[1])], axis=1)
    return {s: float(np.abs(session.run(None, {"x": x[:, :s]})[0] - alone[:, :s]).max())
            for s in (2, 5, x.shape[1])}


def costs(sessions: dict[str, ort.InferenceSession], x: np.ndarray, sizes: list[int],
          rounds: int, calls: int) -> dict[str, dict[int, list[float]]]:
    """Median ms per pass per round, kernels and S interleaved."""
    out: dict[str, dict[int, list[float]]] = {k: {s: [] for s in sizes} for k in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            for s in sizes:
                feed = {"x": x[:, :s]}
                session.run(None, feed)
                times = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    session.run(None, feed)
                    times.append(time.perf_counter() - t0)
                out[name][s].append(float(np.median(times) * 1e3))
    return out


def probe_bundles(paths: list[str]) -> dict[str, dict]:
    import edgespec
    from edgespec.runtimes.exactness import measure

    rng = np.random.default_rng(1)
    result = {}
    for path in paths:
        engine = edgespec.load(path, device="cpu")
        vocab = engine.target.vocab
        prefix, tokens = (rng.integers(3, vocab, n).tolist() for n in (40, 17))
        r = measure(engine.target, prefix, tokens)
        result[path] = {"chain": r.chain, "tree": r.tree, "prefill": r.prefill,
                        "exact": r.exact}
        engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--no-head", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS))
    ap.add_argument("--bundle", nargs="*", default=[])
    ap.add_argument("--json", action="store_true", help="also the whole report as JSON")
    a = ap.parse_args()
    x = np.random.default_rng(2).standard_normal((1, 17, D)).astype(np.float32)
    sessions = {k: stack(KERNELS[k], a.layers, not a.no_head) for k in a.kernels}
    report = {"invariance": {k: invariance(s, x) for k, s in sessions.items()}}
    sizes = [1, 5, 17]
    ms = costs(sessions, x, sizes, a.rounds, a.calls)
    report["cost_ms"] = {k: {s: [round(float(np.median(v)), 2), round(min(v), 2),
                                 round(max(v), 2)] for s, v in by_s.items()}
                         for k, by_s in ms.items()}
    print(f"{'kernel':38s} {'max|alone - in pass| S=2/5/17':>30s}  "
          f"{'ms S=1 [range]':>20s} {'S=5/S=1':>8s} {'S=17/S=1':>9s}")
    for k in a.kernels:
        inv, by_s = report["invariance"][k], ms[k]
        ratio = [float(np.median(np.array(by_s[s]) / np.array(by_s[1]))) for s in (5, 17)]
        print(f"{k:38s} {' / '.join(f'{v:.1e}' for v in inv.values()):>30s}  "
              f"{np.median(by_s[1]):7.2f} [{min(by_s[1]):.2f}-{max(by_s[1]):.2f}] "
              f"{ratio[0]:8.2f} {ratio[1]:9.2f}")
    if a.bundle:
        report["bundles"] = probe_bundles(a.bundle)
        for path, r in report["bundles"].items():
            print(f"{path}: chain {r['chain']} tree {r['tree']} exact={r['exact']}")
    if a.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
