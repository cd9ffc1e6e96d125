"""One decoder graph as an ONNX Runtime session with a KV cache that lives across steps.

The cache is a fixed [1, kv_heads, max_len, head_dim] buffer per layer and tensor, bound
through IOBinding as both `past_*` and `present_*`: GroupQueryAttention writes new entries
in place, so no step copies the cache. Rolling back (speculation rejected some tokens) is
just lowering `length`; the stale slots are overwritten by the next pass.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec import kernels
from edgespec.bundle import ModelEntry
from edgespec.errors import EdgespecError
from edgespec.runtimes import pool
from edgespec.runtimes.pool import session_options
from edgespec.runtimes.providers import check_session

NEG_INF = np.finfo(np.float32).min


class KVCache:
    """Per-layer key/value buffers of fixed size, written in place by GQA.

    The same OrtValue is bound as `past_*` and `present_*`; the graph writes the S new
    entries after `length` and the buffer is never copied.
    """

    def __init__(self, entry: ModelEntry, max_len: int, device: str = "cpu",
                 layers: range | None = None):
        """`layers`: the layers whose KV this cache holds (all by default; a segment of
        an offloaded target holds its own)."""
        self.layers = range(entry.num_layers) if layers is None else layers
        # one spare slot: exact graphs write a pass's padding row after its tokens
        # (edgespec.export.exact_rows)
        shape = [1, entry.num_kv_heads, max_len + 1, entry.head_dim]
        dtype = np.dtype(entry.kv_dtype)
        self.device, self.dtype = device, dtype
        if device == "cuda":
            self.buffers = [
                (ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda"),
                 ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda"))
                for _ in self.layers]
        else:
            # CPU OrtValues wrapping numpy arrays share their memory: the arrays are the cache
            self.arrays = [(np.zeros(shape, dtype), np.zeros(shape, dtype))
                           for _ in self.layers]
            self.buffers = [(ort.OrtValue.ortvalue_from_numpy(k),
                             ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self.arrays]
        self.max_len = max_len
        self.length = 0
        # arrays indexed by slot on their first axis that compact() moves with the entries
        # (a target's final states, which a draft head reads by slot)
        self.riders: list[np.ndarray] = []

    def trim(self, n: int) -> None:
        """Forget the last `n` positions (speculative rollback, chat edits)."""
        self.length = max(0, self.length - n)

    def reset(self) -> None:
        self.length = 0

    def compact(self, start: int, slots: list[int]) -> None:
        """Move the entries at `slots` (ascending, none before `start`) to start, start+1,
        ... and cut the cache there: the verified path of a token tree, made contiguous."""
        if list(slots) != list(range(start, start + len(slots))):
            if not hasattr(self, "arrays"):
                raise EdgespecError("only a CPU KV cache can be compacted.")
            for k, v in self.arrays:
                k[:, :, start:start + len(slots)] = k[:, :, slots]
                v[:, :, start:start + len(slots)] = v[:, :, slots]
            for rider in self.riders:
                rider[start:start + len(slots)] = rider[slots]
        self.length = start + len(slots)

    def bind(self, binding: ort.IOBinding) -> None:
        for i, (k, v) in zip(self.layers, self.buffers, strict=True):
            binding.bind_ortvalue_input(f"past_key_{i}", k)
            binding.bind_ortvalue_input(f"past_value_{i}", v)
            binding.bind_ortvalue_output(f"present_key_{i}", k)
            binding.bind_ortvalue_output(f"present_value_{i}", v)

    def before_run(self, binding: ort.IOBinding) -> None:
        """Nothing to do: the buffers stay bound."""

    def after_run(self, binding: ort.IOBinding, length: int) -> None:
        self.length = length


class SharedKVCache(KVCache):
    """A BitNest draft's view of the target's KV cache: no buffers of its own.

    The draft attends over the K/V the target wrote for the committed prefix (computed
    with the full W8 weights) and writes its own speculative entries only past the
    target's length, where the target's next pass overwrites them: the target's cache is
    never touched below its length, so verification stays exact. Its length is its own,
    but never less than the target's: what the target holds, the draft need not feed.
    """

    def __init__(self, owner: KVCache):
        self.__dict__.update({k: v for k, v in vars(owner).items() if k != "length"})
        self.owner = owner
        self._length = 0

    @property
    def length(self) -> int:
        return max(self._length, self.owner.length)

    @length.setter
    def length(self, value: int) -> None:
        self._length = value

    def reset(self) -> None:
        self._length = 0


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
        outputs = binding.get_outputs()[-2 * self.layers:]  # the presents come last
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


def open_session(path: Path, providers: list[str], threads: int = 0,
                 model: bytes | None = None, spin: bool = True) -> ort.InferenceSession:
    """A session on the graph at `path`, or on `model` (a segment cut from it, or the
    graph with ranked outputs) whose external weights ONNX Runtime then reads from path's
    directory.

    Segments run one after another; on pools of their own (not runtimes.pool.share_threads)
    their idle threads must not spin (`spin=False`) waiting for work while the next one
    runs."""
    opts = session_options(threads)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if model is not None:
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                      str(path.parent.resolve()))
    if not spin and not pool.shared():
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    kernels.register(opts)
    try:
        return ort.InferenceSession(model if model is not None else str(path), opts,
                                    providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        if f"{kernels.DOMAIN}:" in str(e) and not kernels.available():
            raise EdgespecError(
                f"{path} runs on edgespec's own CPU kernels, which this installation lacks "
                "(it was installed without a C compiler); reinstall edgespec where gcc or "
                "MSVC is available, or re-export the bundle here.") from None
        raise EdgespecError(f"ONNX Runtime cannot load {path} ({str(e).splitlines()[0]}); "
                            "re-export the bundle.") from None


def release_freed_heap() -> None:
    """Give the system back the heap that loading freed. ONNX Runtime folds a bundle's
    constant tables at session load (kernel layouts, rotary tables: export.blockq_ops,
    export.graph) through several copies of each, and tokenizers parses Gemma 3's 14 MB
    tokenizer.json through ~0.3 GB; glibc keeps the freed chunks for reuse, so an engine
    on Gemma 3 270M held 1.2-1.3 GB after 64 tokens, 0.7 GB trimmed. Called once everything
    is loaded: trimming after each part made the next fault in fresh pages for what it
    would have reused (0.35 s more to load Gemma 3). malloc_trim is glibc's; other
    systems' allocators return memory their own way."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # a C library without it (it is glibc's)
            pass


def with_ranked_outputs(path: Path) -> bytes:
    """The decoder graph at `path` that also ranks its next-token distribution: inputs
    `temperature` (scalar) and `top_k` ([1]), outputs `top_logprobs` and `top_ids`
    ([1, S, k], best first) = top-k of log_softmax(logits / temperature), and for the last
    fed token `last_probs` = softmax(logits / temperature) ([1, V]) and its running sum
    in float64, `last_cdf`.

    A tree drafter scores every node it expands by the ranking, a sampling chain draws
    from the last row's CDF. Done in numpy outside the graph, either costs ~100-150 µs
    per draft pass on a 4,096-token vocabulary (several passes over the vocabulary), most
    of a small draft's own run time; inside, ONNX Runtime does it in tens of µs."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    graph.input.extend([helper.make_tensor_value_info("temperature", TensorProto.FLOAT, []),
                        helper.make_tensor_value_info("top_k", TensorProto.INT64, [1])])
    graph.node.extend([
        helper.make_node("Cast", ["logits"], ["rank_logits"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["rank_logits", "temperature"], ["rank_scaled"]),
        helper.make_node("LogSoftmax", ["rank_scaled"], ["rank_logprobs"], axis=-1),
        helper.make_node("TopK", ["rank_logprobs", "top_k"], ["top_logprobs", "top_ids"],
                         axis=-1),
        helper.make_node("Constant", [], ["rank_last"], value=helper.make_tensor(
            "rank_last", TensorProto.INT64, [], [-1])),
        helper.make_node("Gather", ["rank_scaled", "rank_last"], ["rank_last_z"], axis=1),
        helper.make_node("Softmax", ["rank_last_z"], ["last_probs"], axis=-1),
        helper.make_node("Cast", ["last_probs"], ["rank_probs64"], to=TensorProto.DOUBLE),
        helper.make_node("CumSum", ["rank_probs64", "rank_last"], ["last_cdf"])])
    graph.output.extend([
        helper.make_tensor_value_info("top_logprobs", TensorProto.FLOAT, [1, "S", "k"]),
        helper.make_tensor_value_info("top_ids", TensorProto.INT64, [1, "S", "k"]),
        helper.make_tensor_value_info("last_probs", TensorProto.FLOAT, [1, "V"]),
        helper.make_tensor_value_info("last_cdf", TensorProto.DOUBLE, [1, "V"])])
    return model.SerializeToString()


class DecoderSession:
    """Drive one exported decoder graph step by step.

    Several DecoderSessions may share one InferenceSession (`shared`), each with its own
    IOBinding: a BitNest bundle's draft and target are one graph whose `use_residual`
    input picks the 4-bit base or the full 8-bit weights, so the weights are held once,
    and the draft's `cache` can be a SharedKVCache over the target's.

    A `ranked` session (a draft of its own, not shared) also offers `forward_ranked`,
    the top-k of its warped log-probabilities computed in the graph, and `forward_sample`,
    the last token's warped distribution and its CDF (`samples` says it can).
    """

    def __init__(self, path: Path, entry: ModelEntry, providers: list[str],
                 device: str = "auto", max_len: int | None = None, threads: int = 0,
                 shared: ort.InferenceSession | None = None, cache: KVCache | None = None,
                 ranked: bool = False):
        self.ranked = self.samples = ranked and shared is None
        self.session = shared or open_session(
            path, providers, threads, with_ranked_outputs(path) if self.ranked else None)
        self.run_s = 0.0  # seconds spent inside ONNX Runtime, for overhead accounting
        self.transfer_s = 0.0  # of run_s, moving weights to the device: none, all resident
        self.device = check_session(self.session, device, providers)
        self.entry = entry
        self.max_len = min(max_len or entry.max_positions, entry.max_positions)
        layout = ConcatKVCache if entry.kv_layout == "mha-concat" else KVCache
        self.cache = cache or layout(entry, self.max_len, self.device)
        self.binding = self.session.io_binding()
        self.vocab = entry.vocab_size  # a nested draft's trimmed head is narrower
        self.logits = HostOutput(self.session, self.binding, "logits")
        # a target read by an EAGLE head keeps its final states by cache slot, the head
        # reads the target's (`hidden_in`) and returns its own (edgespec.export.draft_head)
        outputs = {o.name for o in self.session.get_outputs()}
        self.hidden = (HostOutput(self.session, self.binding, "hidden")
                       if "hidden" in outputs else None)
        self.is_head = "hidden_in" in {i.name for i in self.session.get_inputs()}
        # a head graph scores its last row only (export.graph's last_logits); older ones all
        logits_rows = next(o.shape[1] for o in self.session.get_outputs() if o.name == "logits")
        self.last_logits = logits_rows == 1
        # other graphs score rows from `logits_from` on (older ones: all of them)
        self.scores_from = "logits_from" in {i.name for i in self.session.get_inputs()}
        if self.hidden is not None and not self.is_head:
            self.features = np.zeros((self.max_len + 1, entry.hidden_size), np.float32)
            if hasattr(self.cache, "riders"):
                self.cache.riders.append(self.features)
        # a tree pass's rows bitwise its chain's (edgespec's own attention), on a cache
        # that can be compacted: tree decoding then needs one pass a step (tree_decode)
        self.exact_trees = (self.session.get_modelmeta().custom_metadata_map.get(
            kernels.EXACT_TREES) == "1" and hasattr(self.cache, "arrays"))
        self.cache.bind(self.binding)  # the presents are bound last, in every binding
        if entry.nested:  # BitNest: this view computes with the base, or base + residual
            self.binding.bind_cpu_input("use_residual", np.array(entry.nested == "target"))
        if self.ranked:  # plain forwards feed neutral values to the ranking inputs
            self.binding.bind_cpu_input("temperature", np.ones((), np.float32))
            self.binding.bind_cpu_input("top_k", np.ones(1, np.int64))
            self.ranked_binding = self.session.io_binding()
            self._ranking: tuple[int, float] | None = None
            self.top = [HostOutput(self.session, self.ranked_binding, name)
                        for name in ("top_logprobs", "top_ids")]
            self.cache.bind(self.ranked_binding)
            self.sample_binding = self.session.io_binding()
            self.sample_binding.bind_cpu_input("top_k", np.ones(1, np.int64))
            self.last = [HostOutput(self.session, self.sample_binding, name)
                         for name in ("last_probs", "last_cdf")]
            for out in self.last:
                out.bind((1, self.vocab))
            self.cache.bind(self.sample_binding)

    def forward(self, ids: list[int] | np.ndarray, positions: np.ndarray | None = None,
                bias: np.ndarray | None = None, last: bool = False) -> np.ndarray:
        """Append `ids` after the cached prefix and return their logits [S, V].

        `positions` and `bias` default to a left-to-right chunk; a token tree passes node
        depths and a [1,1,S,past+S] bias with -inf for non-ancestors. `last`: only the
        last row is wanted (a prefill), so a graph that can skips scoring the others and
        returns the last two rows (export.graph's `logits_from`).
        """
        past, s = self._feed(self.binding, ids, positions, bias, last)
        reuse = not isinstance(self.cache, ConcatKVCache)
        self.logits.bind((1, self.scored(s, last), self.vocab), reuse=reuse)
        if self.hidden is not None:
            self.hidden.bind((1, s, self.entry.hidden_size), reuse=reuse)
        self._run(self.binding, past + s)
        if self.hidden is not None:
            self.features[past:past + s] = self.hidden.read()
        return self.logits.read()

    def forward_head(self, ids: list[int] | np.ndarray, hidden: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """An EAGLE head's pass: tokens and the states that precede them ([S, d]) in,
        logits over the kept tokens (of the last token only, [1, K], for a head graph
        that scores its last row) and the head's own next states ([S, d]) out."""
        past, s = self._feed(self.binding, ids, None, None)
        self.binding.bind_cpu_input("hidden_in", np.ascontiguousarray(
            hidden, np.float32).reshape(1, s, -1))
        self.logits.bind((1, 1 if self.last_logits else s, self.vocab))
        self.hidden.bind((1, s, self.entry.hidden_size))
        self._run(self.binding, past + s)
        return self.logits.read(), self.hidden.read()

    def forward_ranked(self, ids: list[int] | np.ndarray, k: int, temperature: float,
                       positions: np.ndarray | None = None, bias: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Like `forward`, but return the k most likely next tokens after each fed token
        and their log-probabilities under softmax(logits / temperature): ([S, k], [S, k])
        (spec.tree.top_logprobs is the same in numpy)."""
        binding = self.ranked_binding
        past, s = self._feed(binding, ids, positions, bias)
        k = min(k, self.vocab)
        if (k, temperature) != self._ranking:  # a tree keeps them for all its passes
            self._ranking = k, temperature
            binding.bind_cpu_input("temperature", np.array(temperature, np.float32))
            binding.bind_cpu_input("top_k", np.array([k], np.int64))
        for out in self.top:
            out.bind((1, s, k))
        self._run(binding, past + s)
        return self.top[0].read(), self.top[1].read()

    def forward_sample(self, ids: list[int] | np.ndarray, temperature: float
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Like `forward`, but return the distribution after the last fed token,
        softmax(logits / temperature) [V], and its running sum in float64 [V]: a sampling
        chain's q row and what to draw from (spec.sampling.sample_cdf)."""
        binding = self.sample_binding
        past, s = self._feed(binding, ids, None, None, last=True)
        binding.bind_cpu_input("temperature", np.array(temperature, np.float32))
        self._run(binding, past + s)
        return self.last[0].read(), self.last[1].read()

    def scored(self, s: int, last: bool) -> int:
        """How many rows of logits a pass of `s` tokens returns."""
        return s - scored_from(s, last) if self.scores_from else s

    def _feed(self, binding: ort.IOBinding, ids: list[int] | np.ndarray,
              positions: np.ndarray | None, bias: np.ndarray | None, last: bool = False
              ) -> tuple[int, int]:
        past = self.cache.length
        feeds = step_inputs(ids, positions, bias, past, self.max_len)
        for name, value in zip(STEP_INPUTS, feeds, strict=True):
            binding.bind_cpu_input(name, value)
        s = feeds[0].shape[1]
        if self.scores_from:
            binding.bind_cpu_input("logits_from", np.array([scored_from(s, last)], np.int64))
        return past, s

    def _run(self, binding: ort.IOBinding, length: int) -> None:
        self.cache.before_run(binding)
        t0 = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.run_s += time.perf_counter() - t0
        self.cache.after_run(binding, length)


STEP_INPUTS = ("input_ids", "position_ids", "attention_bias")


def scored_from(s: int, last: bool) -> int:
    """The first row a pass of `s` tokens scores: all rows, or the last two when only the
    last is wanted (two, so the LM head's rows take its multi-row kernel, see
    export.exact_rows)."""
    return max(0, s - 2) if last else 0


def step_inputs(ids: list[int] | np.ndarray, positions: np.ndarray | None,
                bias: np.ndarray | None, past: int, max_len: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The graph contract's per-step inputs, a left-to-right chunk unless told otherwise;
    a sequence the KV cache cannot hold is the user's error, said before any work."""
    ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    s = ids.shape[1]
    if past + s > max_len:
        raise EdgespecError(f"the sequence needs {past + s} positions but the model's "
                            f"context holds {max_len}; shorten the prompt or "
                            "max_new_tokens.")
    if positions is None:
        positions = np.arange(past, past + s, dtype=np.int64)
    if bias is None:
        bias = causal_bias(past, s)
    return (ids, np.asarray(positions, dtype=np.int64).reshape(1, -1),
            np.ascontiguousarray(bias, np.float32))


ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(double)": np.float64, "tensor(int64)": np.int64}


class HostOutput:
    """A graph output bound to a host buffer that is reused while its shape recurs
    (decoding steps come in a few shapes), which spares ONNX Runtime an allocation and
    Python the wrapping of every output; a binding that would not change is not redone.
    Outputs taller than `rows` (prefills), or all of them with `reuse=False`, get a
    buffer of their own."""

    def __init__(self, session: ort.InferenceSession, binding: ort.IOBinding, name: str,
                 rows: int = 64):
        self.binding, self.name, self.rows = binding, name, rows
        kind = next(o.type for o in session.get_outputs() if o.name == name)
        self.dtype = ORT_TYPES[kind]  # the graph's own output type
        self._buffers: dict[tuple[int, ...], tuple[np.ndarray, ort.OrtValue]] = {}
        self._bound: np.ndarray | None = None
        self._owned = False  # a fresh buffer, replaced at the next bind: read() hands it over
        binding.bind_output(name, "cpu")  # now, so that the KV presents come after it

    def bind(self, shape: tuple[int, ...], reuse: bool = True) -> None:
        self._owned = not reuse or shape[-2] > self.rows  # [.., tokens fed, width]
        if self._owned:
            array = np.empty(shape, self.dtype)
            value = ort.OrtValue.ortvalue_from_numpy(array)
        else:
            if shape not in self._buffers:
                array = np.empty(shape, self.dtype)
                self._buffers[shape] = array, ort.OrtValue.ortvalue_from_numpy(array)
            array, value = self._buffers[shape]
        if array is not self._bound:
            self._bound = array
            self.binding.bind_ortvalue_output(self.name, value)

    def read(self) -> np.ndarray:
        """The last run's value without its batch axis, the caller's to keep."""
        out = self._bound[0]
        return out if self._owned else out.copy()
