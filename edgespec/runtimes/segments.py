"""A target cut into segment graphs at layer boundaries, each segment on its own device.

This is how a model bigger than the GPU runs (SpecExec, llama.cpp's -ngl): the first layers
stay resident on the GPU, the rest are either computed by the CPU provider or *streamed*:
their weights stay in host memory and become graph inputs that ONNX Runtime copies to the
device for each pass. The bundle keeps its single decoder graph; segments are cut from it
at load time, so any split the planner picks works on any bundle.

Units: unit 0 is the embedding, unit i + 1 is layer i, unit L + 1 the final norm and LM
head. Keeping the embedding apart lets an offloaded plan leave the table in host memory:
a pass gathers only S rows. A cut after a layer passes two tensors, the residual stream
and the layer's output, because every later norm is fused with the residual add
(SkipSimplifiedLayerNormalization): they are the first two inputs of the next unit's norm.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import AttributeProto, helper, numpy_helper

from edgespec.bundle import ModelEntry
from edgespec.errors import EdgespecError
from edgespec.runtimes.decoder import (
    STEP_INPUTS,
    HostOutput,
    KVCache,
    open_session,
    scored_from,
    step_inputs,
)
from edgespec.runtimes.providers import PROVIDER, check_session

STREAM_MIN_BYTES = 4096  # smaller layer constants (norm weights, biases) stay in the graph


@dataclass(frozen=True)
class Placement:
    """Units [start, stop) of the target on `device`; `streamed`: their weights live in
    host memory and are copied to the device for every pass."""

    start: int
    stop: int
    device: str = "cpu"
    streamed: bool = False


def _boundary(graph: onnx.GraphProto, unit: int, num_layers: int) -> list[str]:
    """The tensors entering `unit` (>= 1): the embedded tokens for layer 0, else the
    residual stream and the previous layer's output."""
    name = "final.norm" if unit == num_layers + 1 else f"layers.{unit - 1}.norm1"
    node = next((n for n in graph.node if n.name == name), None)
    width = 1 if unit == 1 else 2
    if node is None or len(node.input) < width or not all(node.input[:width]):
        raise EdgespecError(f"this graph cannot be cut before unit {unit} (no norm "
                            f"'{name}'); re-export the bundle with this edgespec.")
    return list(node.input[:width])


UNSPLITTABLE = ("offload cannot split a BitNest (--draft nested) or dml-profile bundle; "
                "export the target with --ep-profile cuda and a separate draft.")


def splittable(entry: ModelEntry) -> bool:
    """Offload cuts GroupQueryAttention graphs of one model; a BitNest graph (two models)
    or a DirectML one (concatenated KV) cannot be cut."""
    return entry.kv_layout == "gqa-shared-buffer" and not entry.nested


def check_splittable(entry: ModelEntry) -> None:
    if not splittable(entry):
        raise EdgespecError(UNSPLITTABLE)


def layers_of(placement: Placement, num_layers: int) -> range:
    """The decoder layers among a placement's units."""
    return range(max(placement.start, 1) - 1, min(placement.stop, num_layers + 1) - 1)


def _consumed(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads, including outer-scope names used by its subgraphs (If)."""
    names = list(node.input)
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            inner = attr.g
            made = {o for n in inner.node for o in n.output} | {
                t.name for t in inner.initializer}
            names += [t for n in inner.node for t in _consumed(n) if t not in made]
    return names


def _array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An initializer's value, memory-mapped from the bundle's data file when external."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(folder / info["location"], dtype=dtype, mode="r",
                     offset=int(info.get("offset", 0)), shape=tuple(tensor.dims))


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return int({e.key: e.value for e in tensor.external_data}["length"])
    return len(tensor.raw_data) or numpy_helper.to_array(tensor).nbytes


def cut(model: onnx.ModelProto, entry: ModelEntry, placement: Placement
        ) -> tuple[onnx.ModelProto, list[str], list[str], list[onnx.TensorProto]]:
    """The segment graph for `placement`, its hidden inputs and outputs, and (streamed)
    the weights it takes as inputs instead of constants."""
    g, layers = model.graph, entry.num_layers
    start, stop = placement.start, placement.stop
    hidden_in = _boundary(g, start, layers) if start > 0 else []
    hidden_out = ["logits"] if stop == layers + 2 else _boundary(g, stop, layers)
    own = layers_of(placement, layers)
    kv_out = [f"present_{kind}_{i}" for i in own for kind in ("key", "value")]
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    inits = {t.name: t for t in g.initializer}
    boundary = set(hidden_in) | {t.name for t in g.input}
    keep, seen, todo = set(), set(), [*hidden_out, *kv_out]
    while todo:
        name = todo.pop()
        if not name or name in seen or name in boundary or name in inits:
            continue
        seen.add(name)
        keep.add(producer[name])
        todo += _consumed(g.node[producer[name]])
    nodes = [g.node[i] for i in sorted(keep)]
    used = {t for n in nodes for t in _consumed(n)}
    streamed = [t for name, t in inits.items() if name in used and placement.streamed
                and name.startswith("layers.") and tensor_bytes(t) >= STREAM_MIN_BYTES]
    streamed_names = {t.name for t in streamed}
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(entry.activation_dtype))

    def hidden(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, [1, "sequence", entry.hidden_size])

    inputs = [*(hidden(n) for n in hidden_in), *(i for i in g.input if i.name in used),
              *(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                for t in streamed)]
    declared = {o.name: o for o in g.output}
    outputs = [declared[n] if n in declared else hidden(n) for n in [*hidden_out, *kv_out]]
    graph = helper.make_graph(
        nodes, f"{g.name}.units{start}-{stop}", inputs, outputs,
        initializer=[t for name, t in inits.items()
                     if name in used and name not in streamed_names])
    segment = helper.make_model(graph, opset_imports=model.opset_import,
                                ir_version=model.ir_version)
    return segment, hidden_in, hidden_out, streamed


class Segment:
    """One segment's session, binding and KV cache."""

    def __init__(self, path: Path, model: onnx.ModelProto, entry: ModelEntry,
                 placement: Placement, max_len: int, threads: int):
        graph, self.hidden_in, self.hidden_out, streamed = cut(model, entry, placement)
        providers = [PROVIDER[placement.device]]
        if placement.device != "cpu":
            providers.append(PROVIDER["cpu"])
        self.session = open_session(path, providers, threads, graph.SerializeToString(),
                                    spin=False)
        self.device = check_session(self.session, placement.device, providers)
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.weights = {t.name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(
            _array(t, path.parent))) for t in streamed}
        self.weight_bytes = sum(tensor_bytes(t) for t in streamed)
        self.cache = KVCache(entry, max_len, self.device,
                             layers_of(placement, entry.num_layers))
        self.binding = self.session.io_binding()
        self.logits = None
        if self.hidden_out == ["logits"]:
            self.logits = HostOutput(self.session, self.binding, "logits")
        else:  # first, so that get_outputs() starts with them
            for name in self.hidden_out:
                self.binding.bind_output(name, self.device)
        self.cache.bind(self.binding)

    def bind_weights(self) -> float:
        """Hand the streamed weights to ONNX Runtime, which copies them to the device;
        returns the seconds it took (the transfer, on a GPU)."""
        t0 = time.perf_counter()
        self.cache.bind(self.binding)  # inputs were cleared after the previous pass
        for name, value in self.weights.items():
            self.binding.bind_ortvalue_input(name, value)
        return time.perf_counter() - t0

    def release_weights(self) -> None:
        """Drop the device copies of the streamed weights until the next pass."""
        self.binding.clear_binding_inputs()


class SegmentCache:
    """The KV caches of all segments, moved together (trim, reset, tree compaction)."""

    def __init__(self, parts: list[KVCache]):
        self.parts = parts

    @property
    def length(self) -> int:
        return self.parts[0].length

    @length.setter
    def length(self, value: int) -> None:
        for part in self.parts:
            part.length = value

    def trim(self, n: int) -> None:
        for part in self.parts:
            part.trim(n)

    def reset(self) -> None:
        for part in self.parts:
            part.reset()


class SegmentedDecoder:
    """The target as a chain of segment sessions; drives like a DecoderSession.

    Hidden states pass between segments as OrtValues on the producing segment's device
    (ONNX Runtime copies them when the next segment runs elsewhere). While one segment
    runs, the next streamed segment's weights are already being copied (`overlap`), so at
    most two segments' weights are on the device at once.
    """

    def __init__(self, path: Path, entry: ModelEntry, placements: list[Placement],
                 max_len: int | None = None, threads: int = 0, overlap: bool = True):
        units = entry.num_layers + 2
        spans = [(p.start, p.stop) for p in placements]
        if (not placements or spans[0][0] != 0 or spans[-1][1] != units
                or any(a[1] != b[0] for a, b in zip(spans, spans[1:], strict=False))
                or any(p.stop <= p.start for p in placements)):
            raise EdgespecError(f"a segment plan must cover units 0..{units} in order without "
                                f"gaps (got {spans}).")
        check_splittable(entry)
        model = onnx.load(str(path), load_external_data=False)
        self.entry = entry
        self.max_len = min(max_len or entry.max_positions, entry.max_positions)
        self.segments = [Segment(path, model, entry, p, self.max_len, threads)
                         for p in placements]
        self.cache = SegmentCache([s.cache for s in self.segments])
        self.vocab = entry.vocab_size
        self.device = "+".join(dict.fromkeys(s.device for s in self.segments))
        self.run_s = 0.0
        self.transfer_s = 0.0  # of run_s: handing streamed weights to the device
        self._pool = ThreadPoolExecutor(1, "edgespec-prefetch") if overlap else None

    def forward(self, ids: list[int] | np.ndarray, positions: np.ndarray | None = None,
                bias: np.ndarray | None = None, last: bool = False) -> np.ndarray:
        """As DecoderSession.forward, one segment after another."""
        past = self.cache.length
        feeds = dict(zip(STEP_INPUTS, step_inputs(ids, positions, bias, past, self.max_len),
                         strict=True))
        s = feeds["input_ids"].shape[1]
        rows = s
        if "logits_from" in self.segments[-1].inputs:
            feeds["logits_from"] = np.array([scored_from(s, last)], np.int64)
            rows = s - scored_from(s, last)
        streamed = [seg for seg in self.segments if seg.weights]
        pending: dict[int, Future[float]] = {}
        hidden: list[ort.OrtValue] = []
        for seg in self.segments:
            if seg.weights:  # before any other binding: the prefetch thread uses this one
                future = pending.pop(id(seg), None)
                took = future.result() if future else seg.bind_weights()
                self.transfer_s += took
                self.run_s += took
                after = streamed[streamed.index(seg) + 1:]
                if after and self._pool is not None:
                    pending[id(after[0])] = self._pool.submit(after[0].bind_weights)
            for name, value in feeds.items():
                if name in seg.inputs:
                    seg.binding.bind_cpu_input(name, value)
            for name, value in zip(seg.hidden_in, hidden, strict=True):
                seg.binding.bind_ortvalue_input(name, value)
            if seg.logits is not None:
                seg.logits.bind((1, rows, self.entry.vocab_size))
            for name in seg.hidden_out if seg.logits is None else ():
                seg.binding.bind_output(name, seg.device)  # fresh: the shape follows S
            t0 = time.perf_counter()
            seg.session.run_with_iobinding(seg.binding)
            self.run_s += time.perf_counter() - t0
            if seg.logits is None:
                hidden = seg.binding.get_outputs()[:len(seg.hidden_out)]
            if seg.weights:
                seg.release_weights()
        self.cache.length = past + s
        return self.segments[-1].logits.read()
