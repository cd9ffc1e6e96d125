"""edgespec's own attention op (edgespec.Attention, edgespec/kernels/attend.c).

Oracles: numpy's float64 attention over the same rotated keys and the same mask; the op's
own one-token passes, which every row of a chain and every node on a branch of a token
tree must equal bitwise; its portable C path, which the AVX2 one must equal bitwise.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgespec import kernels
from edgespec.runtimes.decoder import NEG_INF, causal_bias
from edgespec.spec.tree import DraftTree
from tests.test_kernels import every_path

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernel library not built")

H, HK, D, MAX, POSITIONS = 6, 2, 32, 64, 80


# the caches' kinds: op, ONNX element type, numpy dtype
CACHES = {"float": ("Attention", TensorProto.FLOAT, np.float32),
          "int8": ("AttentionInt8", TensorProto.INT8, np.int8),
          "half": ("AttentionHalf", TensorProto.FLOAT16, np.float16)}


def session(packed: bool = False, softcap: float = 0.0, threads: int = 2,
            d: int = D, kind: str = "float") -> ort.InferenceSession:
    """One Attention op (AttentionInt8: int8 caches, k_scale and v_scale; AttentionHalf:
    float16 caches)."""
    f = TensorProto.FLOAT
    op, cache, _ = CACHES[kind]
    names = ["q", "k", "v", "past_key", "past_value", "cos", "sin", "position_ids", "bias"]
    names += ["k_scale", "v_scale"] if kind == "int8" else []
    shapes = {"q": [1, "S", (H + 2 * HK) * d if packed else H * d], "k": [1, "S", HK * d],
              "v": [1, "S", HK * d], "past_key": [1, HK, MAX, d], "past_value": [1, HK, MAX, d],
              "cos": [POSITIONS, "half"], "sin": [POSITIONS, "half"], "position_ids": [1, "S"],
              "bias": [1, 1, "S", "T"], "k_scale": [HK, 1, d], "v_scale": [HK, 1, d]}
    types = {"position_ids": TensorProto.INT64, "past_key": cache, "past_value": cache}
    used = [n for n in names if not (packed and n in ("k", "v"))]
    inputs = [helper.make_tensor_value_info(n, types.get(n, f), shapes[n]) for n in used]
    node = helper.make_node(op,
                            ["" if packed and n in ("k", "v") else n for n in names],
                            ["out", "present_key", "present_value"], domain=kernels.DOMAIN,
                            num_heads=H, kv_num_heads=HK, scale=d ** -0.5,
                            **({"softcap": softcap} if softcap else {}))
    outputs = [helper.make_tensor_value_info("out", f, [1, "S", H * d]),
               helper.make_tensor_value_info("present_key", cache, [1, HK, MAX, d]),
               helper.make_tensor_value_info("present_value", cache, [1, HK, MAX, d])]
    return kernels.op_session(helper.make_graph([node], "g", inputs, outputs), threads)


def tables(half: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(POSITIONS)[:, None] * (10000.0 ** (-np.arange(half) / half))[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotated(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [S, heads, d] rotated half-split at positions pos (float64)."""
    half = cos.shape[1]
    c, s = cos[pos][:, None].astype(np.float64), sin[pos][:, None].astype(np.float64)
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:2 * half].astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], -1)


class Stream:
    """Random queries, keys and values for a sequence, and the op fed them in passes."""

    def __init__(self, n: int, seed: int = 0, half: int = D // 2, d: int = D,
                 kind: str = "float"):
        rng = np.random.default_rng(seed)
        self.d = d
        self.q = rng.standard_normal((n, H, d)).astype(np.float32)
        self.k = rng.standard_normal((n, HK, d)).astype(np.float32)
        self.v = rng.standard_normal((n, HK, d)).astype(np.float32)
        self.cos, self.sin = tables(half)
        self.cache = [np.zeros((1, HK, MAX, d), CACHES[kind][2]) for _ in range(2)]
        # per KV head and channel, as export.kv_quant calibrates them on what the cache
        # holds (rotated keys): peak * 1.1 / 127
        keys = rotated(self.k, np.arange(n), self.cos, self.sin)
        self.scales = [(np.abs(a).max(0)[:, None, :] * 1.1 / 127).astype(np.float32)
                       for a in (keys, self.v)] if kind == "int8" else None
        self.past = 0

    def feed(self, run: ort.InferenceSession, tokens: list[int], positions: list[int],
             bias: np.ndarray, packed: bool = False) -> np.ndarray:
        """Tokens (indices into the stream) at `positions`; returns out [S, H, d] and
        appends their keys and values to the cache at slots past..past+S-1."""
        s = len(tokens)
        q, k, v = (a[tokens].reshape(1, s, -1) for a in (self.q, self.k, self.v))
        feeds = {"past_key": self.cache[0], "past_value": self.cache[1], "cos": self.cos,
                 "sin": self.sin, "position_ids": np.array([positions], np.int64), "bias": bias}
        if self.scales:
            feeds["k_scale"], feeds["v_scale"] = self.scales
        if packed:
            feeds["q"] = np.concatenate([q, k, v], -1)
        else:
            feeds.update(q=q, k=k, v=v)
        out, *self.cache = run.run(None, feeds)
        self.past += s
        return out.reshape(s, H, self.d)


def reference(st: Stream, order: list[int], positions: list[int], bias: np.ndarray,
              softcap: float = 0.0) -> np.ndarray:
    """float64 attention of the last len(bias rows) of `order` over all of `order`'s keys."""
    s = bias.shape[2]
    pos = np.array(positions)
    keys = rotated(st.k[order], pos, st.cos, st.sin)
    queries = rotated(st.q[order[-s:]], pos[-s:], st.cos, st.sin)
    values = st.v[order].astype(np.float64)
    group = H // HK
    out = np.zeros((s, H, st.d))
    for h in range(H):
        scores = queries[:, h] @ keys[:, h // group].T * st.d ** -0.5
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        scores = scores + np.where(bias[0, 0] <= -1e30, -np.inf, bias[0, 0])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ values[:, h // group]
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_attention_is_numpys(packed, softcap):
    run = session(packed, softcap)
    st = Stream(20, half=D // 4)  # partial rotary: half the dimensions turn
    out = st.feed(run, list(range(12)), list(range(12)), causal_bias(0, 12), packed)
    assert np.abs(out - reference(st, list(range(12)), list(range(12)), causal_bias(0, 12),
                                  softcap)).max() < 1e-5
    bias = causal_bias(12, 8)
    bias[0, 0, 5:, :3] = NEG_INF  # a window closing the oldest keys for the last rows
    out = st.feed(run, list(range(12, 20)), list(range(12, 20)), bias, packed)
    assert np.abs(out - reference(st, list(range(20)), list(range(20)), bias, softcap)
                  ).max() < 1e-5
    # the caches hold the rotated keys and the values at their slots
    keys = rotated(st.k[:20], np.arange(20), st.cos, st.sin)
    assert np.abs(st.cache[0][0, :, :20].transpose(1, 0, 2) - keys).max() < 1e-6
    assert np.array_equal(st.cache[1][0, :, :20].transpose(1, 0, 2), st.v[:20])


def decoy_tree(depth: int) -> tuple[DraftTree, list[int]]:
    """A tree whose path root -> 1 -> 2 -> ... has a decoy sibling before every node."""
    tree, parent, path = DraftTree(), -1, []
    for t in range(1, depth + 1):
        tree.add(100 + t, parent, 0.0)
        parent = tree.add(t, parent, 0.0)
        path.append(parent)
    return tree, path


@pytest.mark.parametrize("threads,kind", [(1, "float"), (2, "float"), (2, "int8"),
                                          (2, "half")])
def test_a_token_attends_the_same_alone_in_a_chain_and_on_a_tree_branch(threads, kind):
    """Bitwise: tokens 10..26 after a 10-token prefix, fed one at a time, in chains of 5
    and 17, and as the path of a tree whose decoy siblings sit between the path's nodes."""
    run = session(threads=threads, kind=kind)
    prefix = list(range(10))

    def after_prefix() -> Stream:
        st = Stream(60, seed=1, kind=kind)
        st.feed(run, prefix, prefix, causal_bias(0, 10))
        return st
    st = after_prefix()
    alone = np.stack([st.feed(run, [t], [t], causal_bias(t, 1))[0] for t in range(10, 27)])
    for size in (5, 17):
        st = after_prefix()
        chain = st.feed(run, list(range(10, 10 + size)), list(range(10, 10 + size)),
                        causal_bias(10, size))
        assert np.array_equal(chain, alone[:size])
    tree, path = decoy_tree(8)
    ids, positions, bias = tree.verify_inputs(0, 10)
    # node i is stream token ids[i] - 100 + 40 for decoys, the path's nodes are tokens 11..18
    order = [10] + [10 + t if t < 100 else 40 + t - 100 for t in ids[1:]]
    st = after_prefix()
    out = st.feed(run, order, positions.tolist(), bias)
    assert np.array_equal(out[[0, *(1 + n for n in path)]], alone[:9])


@pytest.mark.parametrize("d,kind", [(32, "float"), (40, "float"), (40, "int8"), (40, "half")])
@pytest.mark.parametrize("window", [0, 20])
def test_a_long_pass_attends_each_row_as_if_fed_alone(d, kind, window):
    """A pass longer than a block of rows (32) is attended block after block, a head of
    5 x 8 dimensions ends on an 8-wide slice of values, and under a sliding window a row
    sees a run of keys that starts past the block's first: each row equals its token fed
    alone (bitwise), and numpy's attention."""
    run, n = session(d=d, kind=kind), 50

    def bias(past: int, s: int) -> np.ndarray:
        b = causal_bias(past, s)
        for row in range(s):
            b[0, 0, row, :max(0, past + row + 1 - window) if window else 0] = NEG_INF
        return b
    st = Stream(n, seed=3, half=d // 2, d=d, kind=kind)
    whole = st.feed(run, list(range(n)), list(range(n)), bias(0, n))
    st = Stream(n, seed=3, half=d // 2, d=d, kind=kind)
    alone = np.stack([st.feed(run, [t], [t], bias(t, 1))[0] for t in range(n)])
    assert np.array_equal(whole, alone)
    if kind == "float":
        assert np.abs(whole - reference(st, list(range(n)), list(range(n)), bias(0, n))
                      ).max() < 1e-5


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("d", [32, 40])
def test_every_path_gives_the_same_bits(kind, d):
    """The portable, AVX2 and AVX-512 paths (as far as this CPU has them); 40 dimensions
    end on a half-width vector."""
    bias = causal_bias(0, 30)
    bias[0, 0, 20:, 2:9] = NEG_INF
    results, caches = [], []
    for _, _path in every_path():
        st = Stream(30, seed=2, kind=kind, d=d, half=d // 2)
        results.append(st.feed(session(kind=kind, d=d), list(range(30)), list(range(30)),
                               bias))
        caches.append(st.cache)
    assert len(results) == kernels.path() + 1
    for r, c in zip(results[1:], caches[1:], strict=True):
        assert np.array_equal(r, results[0])
        assert all(np.array_equal(a, b) for a, b in zip(c, caches[0], strict=True))
    if kind == "float":
        assert np.abs(results[0] - reference(Stream(30, seed=2, d=d, half=d // 2),
                                             list(range(30)), list(range(30)), bias)
                      ).max() < 1e-5


def test_int8_caches_hold_the_codes_and_attend_with_them():
    """Codes round(x / scale) half to even per KV head and channel; the output is the float
    attention over the dequantized keys and values."""
    run = session(kind="int8")
    st = Stream(20, seed=5, kind="int8")
    bias = causal_bias(0, 20)
    out = st.feed(run, list(range(20)), list(range(20)), bias)
    ks, vs = (s[:, 0].astype(np.float64) for s in st.scales)
    keys = rotated(st.k, np.arange(20), st.cos, st.sin)
    assert np.abs(st.cache[0][0, :, :20].transpose(1, 0, 2) - np.rint(keys / ks)).max() <= 1
    assert np.array_equal(st.cache[1][0, :, :20].transpose(1, 0, 2),
                          np.rint(st.v / vs).astype(np.int8))
    # the float reference over the dequantized cache: keys as stored, queries rotated
    deq = Stream(20, seed=5)
    deq.k = (st.cache[0][0, :, :20].transpose(1, 0, 2) * ks).astype(np.float32)
    deq.v = (st.cache[1][0, :, :20].transpose(1, 0, 2) * vs).astype(np.float32)
    deq.cos, deq.sin = np.ones_like(st.cos), np.zeros_like(st.sin)  # keys come rotated
    queries = rotated(st.q, np.arange(20), st.cos, st.sin).astype(np.float32)
    deq.q = queries
    want = reference(deq, list(range(20)), list(range(20)), bias)
    assert np.abs(out - want).max() < 1e-4


def test_half_caches_hold_the_rounded_values_and_attend_with_them():
    """Keys (rotated) and values stored as numpy's float16 of them (nearest even), those
    past 65504 saturated rather than infinite, on every path; the output is the float
    attention over what the caches hold."""
    run = session(kind="half")
    bias = causal_bias(0, 20)
    for _ in every_path():
        st = Stream(20, seed=6, kind="half")
        st.v[3, 1, :4] = [70000.0, -1e6, 65519.0, 65520.0]  # saturated, the rounding edge
        st.v[4, 0, 8:12] = [np.nan, 3e-6, -7e-8, 1e-9]  # NaN (no payload), subnormal halves
        st.feed(run, list(range(20)), list(range(20)), bias)
        keys = rotated(st.k, np.arange(20), st.cos, st.sin).astype(np.float32)
        held_keys = st.cache[0][0, :, :20].transpose(1, 0, 2)
        held_values = st.cache[1][0, :, :20].transpose(1, 0, 2)
        assert np.array_equal(held_keys, keys.astype(np.float16))
        want_values = np.clip(st.v, -65504, 65504).astype(np.float16)
        assert np.array_equal(held_values.view(np.uint16), want_values.view(np.uint16))
        assert list(held_values[3, 1, :4]) == [65504, -65504, 65504, 65504]
    st.v[3, 1, :4] = st.v[4, 0, 8:12] = 0.0  # the float reference over ordinary values
    held = Stream(20, seed=6)
    held.k, held.v = held_keys.astype(np.float32), st.v.astype(np.float16).astype(np.float32)
    held.cos, held.sin = np.ones_like(st.cos), np.zeros_like(st.sin)  # keys come rotated
    held.q = rotated(st.q, np.arange(20), st.cos, st.sin).astype(np.float32)
    fresh = Stream(20, seed=6, kind="half")
    fresh.v[3, 1, :4] = fresh.v[4, 0, 8:12] = 0.0
    out = fresh.feed(run, list(range(20)), list(range(20)), bias)
    assert np.abs(out - reference(held, list(range(20)), list(range(20)), bias)).max() < 1e-5


def test_the_cache_is_written_in_place_when_bound_as_past_and_present():
    run = session()
    st = Stream(8, seed=3)
    key, value = (np.zeros((1, HK, MAX, D), np.float32) for _ in range(2))
    binding = run.io_binding()
    for name, array in (("past_key", key), ("past_value", value)):
        value_ = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, value_)
        binding.bind_ortvalue_output(name.replace("past", "present"), value_)
    s = 8
    for name, array in (("q", st.q.reshape(1, s, -1)), ("k", st.k.reshape(1, s, -1)),
                        ("v", st.v.reshape(1, s, -1)), ("cos", st.cos), ("sin", st.sin),
                        ("position_ids", np.arange(s)[None]), ("bias", causal_bias(0, s))):
        binding.bind_cpu_input(name, np.ascontiguousarray(array))
    binding.bind_output("out")
    run.run_with_iobinding(binding)
    assert np.array_equal(value[0, :, :s].transpose(1, 0, 2), st.v)
    assert not value[0, :, s:].any()
    keys = rotated(st.k, np.arange(s), st.cos, st.sin)
    assert np.abs(key[0, :, :s].transpose(1, 0, 2) - keys).max() < 1e-6


def test_bad_shapes_are_refused_with_the_reason():
    st = Stream(4)
    with pytest.raises(Exception, match="attention_bias must be"):
        st.feed(session(), [0, 1], [0, 1], causal_bias(0, 3))
    with pytest.raises(Exception, match="position 90 is outside"):
        st.feed(session(), [0], [90], causal_bias(0, 1))
