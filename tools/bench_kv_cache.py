"""GroupQueryAttention alone, one query token, by KV cache format: fp32, int8, packed int4.

What ONNX Runtime (1.32, CPU) lets the KV cache be: the cache is bound once as past and
present (written in place) and GQA quantizes/dequantizes itself with per-channel scales.
Shapes of Qwen2.5-0.5B's attention (14 heads, 2 KV heads, 64 dims).

    python tools/bench_kv_cache.py --positions 128 2048
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgespec.runtimes.pool import session_options

H, KV, D = 14, 2, 64
FORMATS = {"fp32": (TensorProto.FLOAT, np.float32, D, None),
           "int8": (TensorProto.INT8, np.int8, D, 8),
           "int4": (TensorProto.UINT8, np.uint8, D // 2, 4)}


def model(kind: str, max_len: int) -> bytes:
    elem, _, width, bits = FORMATS[kind]
    vi = helper.make_tensor_value_info
    inputs = [vi("q", TensorProto.FLOAT, [1, 1, H * D]), vi("k", TensorProto.FLOAT, [1, 1, KV * D]),
              vi("v", TensorProto.FLOAT, [1, 1, KV * D]), vi("pk", elem, [1, KV, max_len, width]),
              vi("pv", elem, [1, KV, max_len, width]), vi("sl", TensorProto.INT32, [1]),
              vi("tl", TensorProto.INT32, [])]
    names, attrs = ["q", "k", "v", "pk", "pv", "sl", "tl"], {}
    if bits:
        inputs += [vi(n, TensorProto.FLOAT, [KV, 1, D]) for n in ("ks", "vs")]
        names += ["", "", "", "", "", "ks", "vs"]
        attrs = dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                     kv_cache_bit_width=bits)
    node = helper.make_node("GroupQueryAttention", names, ["o", "pko", "pvo"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=KV, **attrs)
    outputs = [vi("o", TensorProto.FLOAT, None), vi("pko", elem, None), vi("pvo", elem, None)]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def step_ms(kind: str, past: int, max_len: int, steps: int = 200) -> float:
    _, dtype, width, bits = FORMATS[kind]
    session = ort.InferenceSession(model(kind, max_len), session_options(),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    k, v = (ort.OrtValue.ortvalue_from_numpy(np.zeros((1, KV, max_len, width), dtype))
            for _ in range(2))
    b = session.io_binding()
    for name, n in (("q", H), ("k", KV), ("v", KV)):
        b.bind_cpu_input(name, rng.standard_normal((1, 1, n * D)).astype(np.float32))
    b.bind_ortvalue_input("pk", k)
    b.bind_ortvalue_input("pv", v)
    b.bind_ortvalue_output("pko", k)
    b.bind_ortvalue_output("pvo", v)
    b.bind_cpu_input("sl", np.array([past], np.int32))
    b.bind_cpu_input("tl", np.array(past + 1, np.int32))
    if bits:
        for name in ("ks", "vs"):
            b.bind_cpu_input(name, np.full((KV, 1, D), 0.05, np.float32))
    b.bind_output("o")
    for _ in range(5):
        session.run_with_iobinding(b)
    t0 = time.perf_counter()
    for _ in range(steps):
        session.run_with_iobinding(b)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--max-len", type=int, default=4096)
    a = ap.parse_args()
    rows = [{"cache": kind, "positions": past,
             "ms_per_step": round(step_ms(kind, past, a.max_len), 3),
             "MiB_per_layer": round(2 * KV * a.max_len * FORMATS[kind][2]
                                    * np.dtype(FORMATS[kind][1]).itemsize / 2**20, 2)}
            for kind in FORMATS for past in a.positions]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
