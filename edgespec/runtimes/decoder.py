"""One decoder graph as an ONNX Runtime session with a KV cache that lives across steps.

The cache is a fixed [1, kv_heads, max_len, head_dim] buffer per layer and tensor, bound
through IOBinding as both `past_*` and `present_*`: GroupQueryAttention writes new entries
in place, so no step copies the cache. Rolling back (speculation rejected some tokens) is
just lowering `length`; the stale slots are overwritten by the next pass.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec.bundle import ModelEntry
from edgespec.errors import EdgespecError
from edgespec.runtimes.providers import check_session

NEG_INF = np.finfo(np.float32).min


class KVCache:
    """Per-layer key/value buffers of fixed size, written in place by GQA.

    The same OrtValue is bound as `past_*` and `present_*`; the graph writes the S new
    entries after `length` and the buffer is never copied.
    """

    def __init__(self, entry: ModelEntry, max_len: int, device: str = "cpu"):
        shape = [1, entry.num_kv_heads, max_len, entry.head_dim]
        dtype = np.dtype(entry.kv_dtype)
        if device == "cuda":
            self.buffers = [
                (ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda"),
                 ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda"))
                for _ in range(entry.num_layers)]
        else:
            # CPU OrtValues wrapping numpy arrays share their memory, so the cache can be
            # edited in place from numpy (compacting a verified tree path, for one)
            self.arrays = [(np.zeros(shape, dtype), np.zeros(shape, dtype))
                           for _ in range(entry.num_layers)]
            self.buffers = [(ort.OrtValue.ortvalue_from_numpy(k),
                             ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays]
        self.max_len = max_len
        self.length = 0

    def trim(self, n: int) -> None:
        """Forget the last `n` positions (speculative rollback, chat edits)."""
        self.length = max(0, self.length - n)

    def reset(self) -> None:
        self.length = 0

    def compact(self, start: int, slots: list[int]) -> None:
        """Move the entries at `slots` to start, start+1, ... and cut the cache there
        (the verified path of a token tree, made contiguous again)."""
        if not hasattr(self, "arrays"):
            raise EdgespecError("token trees need the KV cache in host memory in this "
                                "version; use chain speculation on this device.")
        for k, v in self.arrays:
            k[:, :, start:start + len(slots)] = k[:, :, slots]
            v[:, :, start:start + len(slots)] = v[:, :, slots]
        self.length = start + len(slots)

    def bind(self, binding: ort.IOBinding) -> None:
        for i, (k, v) in enumerate(self.buffers):
            binding.bind_ortvalue_input(f"past_key_{i}", k)
            binding.bind_ortvalue_input(f"past_value_{i}", v)
            binding.bind_ortvalue_output(f"present_key_{i}", k)
            binding.bind_ortvalue_output(f"present_value_{i}", v)

    def before_run(self, binding: ort.IOBinding) -> None:
        """Nothing to do: the buffers stay bound."""

    def after_run(self, binding: ort.IOBinding, length: int) -> None:
        self.length = length


class ConcatKVCache(KVCache):
    """The DirectML layout: present = concat(past, new), one tensor per step.

    Costs a copy of the cache per step (DirectML's attention offers nothing better);
    rolling back slices the stored tensors down to `length` before the next run.
    """

    def __init__(self, entry: ModelEntry, max_len: int, device: str = "cpu"):
        self.device = device
        self.dtype = np.dtype(entry.kv_dtype)
        self.shape = [1, entry.num_heads, 0, entry.head_dim]
        self.layers = entry.num_layers
        self.max_len = max_len
        self.reset()

    def reset(self) -> None:
        self.length = 0
        empty = np.zeros(self.shape, self.dtype)
        self.values = [(ort.OrtValue.ortvalue_from_numpy(empty),
                        ort.OrtValue.ortvalue_from_numpy(empty)) for _ in range(self.layers)]

    def bind(self, binding: ort.IOBinding) -> None:
        self.before_run(binding)

    def compact(self, start: int, slots: list[int]) -> None:
        moved = []
        keep = list(range(start)) + list(slots)
        for k, v in self.values:
            k, v = k.numpy(), v.numpy()
            moved.append(tuple(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(
                t[:, :, keep])) for t in (k, v)))
        self.values = moved
        self.length = start + len(slots)

    def before_run(self, binding: ort.IOBinding) -> None:
        stored = self.values[0][0].shape()[2]
        for i, (k, v) in enumerate(self.values):
            if stored > self.length:
                k, v = (ort.OrtValue.ortvalue_from_numpy(
                    np.ascontiguousarray(t.numpy()[:, :, :self.length])) for t in (k, v))
                self.values[i] = (k, v)
            binding.bind_ortvalue_input(f"past_key_{i}", k)
            binding.bind_ortvalue_input(f"past_value_{i}", v)
            binding.bind_output(f"present_key_{i}", self.device)
            binding.bind_output(f"present_value_{i}", self.device)

    def after_run(self, binding: ort.IOBinding, length: int) -> None:
        outputs = binding.get_outputs()[1:]  # logits first, then the presents in order
        self.values = [(outputs[2 * i], outputs[2 * i + 1]) for i in range(self.layers)]
        self.length = length


def causal_bias(past: int, s: int) -> np.ndarray:
    """The bias of a left-to-right chunk: token i sees the past and new tokens 0..i.

    The bias carries the whole mask: GQA also masks causally by itself (harmlessly
    twice), MultiHeadAttention relies on it alone.
    """
    bias = np.zeros((1, 1, s, past + s), dtype=np.float32)
    if s > 1:
        bias[0, 0, :, past:] = np.triu(np.full((s, s), NEG_INF, dtype=np.float32), 1)
    return bias


def open_session(path: Path, providers: list[str], threads: int = 0) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise EdgespecError(f"ONNX Runtime cannot load {path} ({str(e).splitlines()[0]}); "
                            "re-export the bundle.") from None


class DecoderSession:
    """Drive one exported decoder graph step by step.

    Several DecoderSessions may share one InferenceSession (`shared`), each with its own
    IOBinding and KV cache: a BitNest bundle's draft and target are one graph whose
    `use_residual` input picks the 4-bit base or the full 8-bit weights, so the weights
    are held once.
    """

    def __init__(self, path: Path, entry: ModelEntry, providers: list[str],
                 device: str = "auto", max_len: int | None = None, threads: int = 0,
                 shared: ort.InferenceSession | None = None):
        self.session = shared or open_session(path, providers, threads)
        self.run_s = 0.0  # seconds spent inside ONNX Runtime, for overhead accounting
        self.device = check_session(self.session, device, providers)
        self.entry = entry
        self.max_len = min(max_len or entry.max_positions, entry.max_positions)
        layout = ConcatKVCache if entry.kv_layout == "mha-concat" else KVCache
        self.cache = layout(entry, self.max_len, self.device)
        self.binding = self.session.io_binding()
        self.binding.bind_output("logits", "cpu")  # first, so it is get_outputs()[0]
        self.vocab = self.session.get_outputs()[0].shape[-1]
        self._buffers: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}
        self.cache.bind(self.binding)
        if entry.nested:  # BitNest: this view computes with the base, or base + residual
            self.binding.bind_cpu_input("use_residual", np.array(entry.nested == "target"))

    def forward(self, ids: list[int] | np.ndarray, positions: np.ndarray | None = None,
                bias: np.ndarray | None = None) -> np.ndarray:
        """Append `ids` after the cached prefix and return their logits [S, V].

        `positions` and `bias` default to a left-to-right chunk; a token tree passes node
        depths and a [1,1,S,past+S] bias with -inf for non-ancestors.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        s, past = ids.shape[1], self.cache.length
        if past + s > self.max_len:
            raise EdgespecError(f"the sequence needs {past + s} positions but the model's "
                                f"context holds {self.max_len}; shorten the prompt or "
                                "max_new_tokens.")
        if positions is None:
            positions = np.arange(past, past + s, dtype=np.int64)
        if bias is None:
            bias = causal_bias(past, s)
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("position_ids",
                                    np.asarray(positions, dtype=np.int64).reshape(1, -1))
        self.binding.bind_cpu_input("attention_bias", np.ascontiguousarray(bias, np.float32))
        out = self._logits_buffer(s)
        self.cache.before_run(self.binding)
        t0 = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        self.run_s += time.perf_counter() - t0
        self.cache.after_run(self.binding, past + s)
        if out is None:
            return self.binding.get_outputs()[0].numpy()[0]
        return out[0].copy()

    def _logits_buffer(self, s: int) -> np.ndarray | None:
        """Bind logits to a reused host buffer for the small S of decoding steps, which
        spares ONNX Runtime an allocation and Python the wrapping of every output."""
        if s > 64 or isinstance(self.cache, ConcatKVCache):
            self.binding.bind_output("logits", "cpu")  # fresh: its shape follows S
            return None
        if s not in self._buffers:
            array = np.empty((1, s, self.vocab), dtype=np.float32)
            self._buffers[s] = (array, ort.OrtValue.ortvalue_from_numpy(array))
        array, value = self._buffers[s]
        self.binding.bind_ortvalue_output("logits", value)
        return array
