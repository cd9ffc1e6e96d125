"""What lives on the GPU, what is offloaded, and how big a draft tree each pass verifies.

The plan follows SpecExec: the parts every pass needs and that are small or hot stay
resident (the target's LM head, the draft, the KV caches), then as many leading target
layers as the budget holds; the rest is offloaded. An offloaded layer is either streamed
(its weights copied over PCIe each pass: a cost independent of the pass's token count) or
computed by the CPU (llama.cpp's -ngl: a cost growing with the token count); the cost
model picks the faster for the pass size it plans for. Since an offloaded pass costs
nearly the same for 1 or hundreds of tokens, the planned tree budget is the largest whose
pass stays within `slack` of a one-token pass.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from edgespec.bundle import ModelEntry
from edgespec.errors import EdgespecError
from edgespec.runtimes.decoder import STEP_INPUTS, step_inputs
from edgespec.runtimes.pool import session_options
from edgespec.runtimes.providers import PROVIDER, nvidia_smi
from edgespec.runtimes.segments import (
    UNSPLITTABLE,
    Placement,
    Segment,
    check_splittable,
    tensor_bytes,
)

GiB = 1 << 30
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
         "mib": 1 << 20, "g": GiB, "gb": 10**9, "gib": GiB, "t": GiB << 10, "tb": 10**12,
         "tib": GiB << 10}
BUDGETS = tuple(2 ** i for i in range(11))  # tree budgets the planner considers, 1..1024


def head_needs_whole_target(need: str = "") -> str:
    """Why a bundle with a draft head is not offloaded; `need`: what the whole costs."""
    return ("this bundle's draft head reads the target's final states, which an offloaded "
            f"target does not hand over; give it GPU memory for the whole target"
            f"{f' ({need})' if need else ''}, or export it with --draft none to offload it.")


def parse_bytes(text: str) -> int:
    """'6GiB', '512MB', '8g', '1.5 GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise EdgespecError(f"cannot read '{text}' as a memory size; write e.g. 6GiB or "
                            "512MB.")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def free_gpu_bytes(margin: float = 0.1) -> int | None:
    """What the first NVIDIA GPU reports free, less a margin for ONNX Runtime's own
    workspace; None when no driver answers."""
    try:
        rows = nvidia_smi("memory.free")
    except OSError:
        return None
    mib = re.match(r"\s*(\d+)", rows[0]) if rows else None
    return int(int(mib.group(1)) * (1 << 20) * (1 - margin)) if mib else None


def _span(a: int, b: int) -> str:
    return f"layer {a}" if a == b else f"layers {a}-{b}"


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _initializers(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    """All of a graph's constants, those of its subgraphs (BitNest's If branches) too."""
    found = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found += _initializers(attr.g)
    return found


@dataclass
class ModelSizes:
    """Weight bytes of a decoder graph by part, read off its initializers."""

    embed: int
    head: int  # final norm + LM head
    layers: list[int]
    shared: int  # constants every segment holds (RoPE tables, small shapes)
    kv_per_token: int  # KV bytes per position, all layers

    @property
    def total(self) -> int:
        return self.embed + self.head + sum(self.layers) + self.shared

    @classmethod
    def of(cls, path: Path, entry: ModelEntry) -> ModelSizes:
        graph = onnx.load(str(path), load_external_data=False).graph
        layers = [0] * entry.num_layers
        embed = head = shared = 0
        # a tied float head reads the embedding table through a transpose that ONNX
        # Runtime folds into a copy of its own (export.graph): the head holds one too
        tied = {n.input[0] for n in graph.node if n.name == "lm_head.tied"}
        for t in _initializers(graph):
            n = tensor_bytes(t)
            m = re.match(r"layers\.(\d+)\.", t.name)
            head += n if t.name in tied else 0
            if m:
                layers[int(m.group(1))] += n
            elif t.name.startswith("embed."):
                embed += n
            elif t.name.startswith(("lm_head", "final")):
                head += n
            else:
                shared += n
        kv = (2 * entry.num_layers * entry.num_kv_heads * entry.head_dim
              * np.dtype(entry.kv_dtype).itemsize)
        return cls(embed, head, layers, shared, kv)


@dataclass
class Costs:
    """The cost model's rates: host->device bandwidth, and per-layer compute time as
    a + b * tokens on each side (measured at start-up, or given to simulate)."""

    bandwidth: float  # bytes/s
    cpu_layer: tuple[float, float]  # seconds: fixed, per token
    # assumed when no GPU is here to time one: ~50 us per layer launch, 0.2 us per token
    gpu_layer: tuple[float, float] = (5e-5, 2e-7)
    overlap: bool = True  # copies of the next streamed layer overlap this layer's compute

    def cpu(self, tokens: int) -> float:
        return self.cpu_layer[0] + self.cpu_layer[1] * tokens

    def gpu(self, tokens: int) -> float:
        return self.gpu_layer[0] + self.gpu_layer[1] * tokens

    def streamed(self, nbytes: int, tokens: int) -> float:
        copy = nbytes / self.bandwidth
        return max(copy, self.gpu(tokens)) if self.overlap else copy + self.gpu(tokens)


@dataclass
class Item:
    what: str
    nbytes: int
    where: str  # "gpu", "cpu" or "streamed"


@dataclass
class Plan:
    budget: int
    items: list[Item]
    placements: list[Placement]
    resident_layers: int
    offload: str  # "none", "streamed" or "cpu"
    tree_budget: int  # 0: no tree (nothing offloaded, or no draft to grow one)
    pass_s: dict[int, float] = field(default_factory=dict)  # target pass time by tokens
    draft_device: str | None = None  # None: no draft of its own
    context: int = 0  # tokens of KV cache planned for

    @property
    def gpu_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.where == "gpu")

    def summary(self) -> str:
        if self.offload == "none" and self.draft_device == "cpu":
            return (f"the whole target on the GPU ({fmt_bytes(self.gpu_bytes)}), the draft "
                    "on the CPU")
        if self.offload == "none":
            return f"everything on the GPU ({fmt_bytes(self.gpu_bytes)})"
        n, layers = self.resident_layers, self.placements[-1].start - 1  # head: unit L+1
        rest = f"the rest {self.offload}" if n < layers else "the embedding in host memory"
        tree = f"; tree budget {self.tree_budget}" if self.tree_budget else ""
        return f"{n} target layer{'s' * (n != 1)} resident, {rest}{tree}"


def expected_tokens(budget: int, acceptance: float) -> float:
    """Tokens a target pass commits when verifying a best-first tree of `budget` nodes:
    modelled as a chain as deep as a balanced binary tree of that size. A deliberately
    modest estimate (SpecExec measures more); it only ranks the options."""
    depth = int(np.log2(budget)) + 1 if budget > 0 else 0
    return float((1 - acceptance ** (depth + 1)) / (1 - acceptance))


def _merge(placements: list[Placement]) -> list[Placement]:
    """Fuse neighbours on the same device with resident weights: fewer sessions to run."""
    out: list[Placement] = []
    for p in placements:
        if out and out[-1].device == p.device and not (out[-1].streamed or p.streamed):
            out[-1] = Placement(out[-1].start, p.stop, p.device)
        else:
            out.append(p)
    return out


def make_plan(sizes: ModelSizes, budget: int, context: int, costs: Costs | None,
              draft: ModelSizes | None = None, slack: float = 0.25,
              acceptance: float = 0.8, group_bytes: int | None = None) -> Plan:
    """Place the target (and draft) in `budget` bytes of GPU memory.

    Order of residency: the target's LM head and the per-segment constants, the draft
    with its KV cache (unless only leaving it out keeps the whole target on the GPU: an
    offloaded layer costs more than a draft on the CPU), then (when not everything fits)
    the target's KV cache for every
    layer the GPU computes, two buffers for streamed weights, and target layers from the
    first on. An offloaded plan leaves the embedding table in host memory (a pass gathers
    S rows of it). Offloaded layers are streamed in groups of about `group_bytes`
    (default: 512 MiB, at most an eighth of the layers' weights) or computed by the CPU,
    as the cost model decides.
    """
    items: list[Item] = []
    free = budget

    def take(what: str, nbytes: int) -> bool:
        nonlocal free
        fits = nbytes <= free
        items.append(Item(what, nbytes, "gpu" if fits else "cpu"))
        free -= nbytes if fits else 0
        return fits

    layers = len(sizes.layers)
    head = Placement(layers + 1, layers + 2, "cuda")
    if not take("target LM head + final norm", sizes.head + sizes.shared):
        raise EdgespecError(f"a GPU budget of {fmt_bytes(budget)} cannot even hold the "
                            f"target's LM head and the constants every segment shares "
                            f"({fmt_bytes(sizes.head + sizes.shared)}); give more GPU "
                            "memory, or run the model on the CPU.")
    kv = sizes.kv_per_token * context
    whole = sizes.embed + sum(sizes.layers) + kv
    draft_device = None
    if draft is not None:
        need = draft.total + draft.kv_per_token * context
        if whole <= free < whole + need:
            items.append(Item("draft model + its KV cache", need, "cpu"))
            draft_device = "cpu"
        else:
            draft_device = "cuda" if take("draft model + its KV cache", need) else "cpu"
    if whole <= free:
        take("target KV cache", kv)
        take("target embedding + all layers", sizes.embed + sum(sizes.layers))
        pass_s = {t: layers * costs.gpu(t) for t in BUDGETS} if costs else {}
        return Plan(budget, items, [Placement(0, layers + 2, "cuda")], layers, "none", 0,
                    pass_s, draft_device, context)
    if costs is None:  # measure_costs cannot cut such a bundle's graph
        raise EdgespecError(UNSPLITTABLE)

    # streaming keeps every layer's KV and two groups' buffers on the GPU; CPU layers
    # keep their KV in host memory
    largest = max(sizes.layers)
    if group_bytes is None:
        group_bytes = min(512 << 20, sum(sizes.layers) // 8)
    per_group = max(1, min(layers, group_bytes // max(largest, 1)))
    buffers = 2 * per_group * largest
    kv_layer = kv // layers

    def resident_layers(room: int, kv_each: int) -> int:
        r, used = 0, 0
        while r < layers and used + sizes.layers[r] + kv_each <= room:
            used += sizes.layers[r] + kv_each
            r += 1
        return r

    options = {"cpu": resident_layers(free, kv_layer)}
    if kv + buffers <= free:
        options["streamed"] = resident_layers(free - kv - buffers, 0)
    scores = {}
    for mode, resident in options.items():
        offloaded = sizes.layers[resident:]

        def pass_time(t: int, mode: str = mode, resident: int = resident,
                      offloaded: list[int] = offloaded) -> float:
            off = sum(costs.streamed(b, t) if mode == "streamed" else costs.cpu(t)
                      for b in offloaded)
            return resident * costs.gpu(t) + off

        pass_s = {t: pass_time(t) for t in BUDGETS}
        tree = max(t for t in BUDGETS if pass_s[t] <= (1 + slack) * pass_s[1])
        scores[mode] = (expected_tokens(tree, acceptance) / pass_s[tree], tree, pass_s)
    offload = max(scores, key=lambda m: scores[m][0])
    _, tree, pass_s = scores[offload]
    resident = options[offload]
    streamed = offload == "streamed"
    if streamed:
        take("target KV cache", kv)
        take("streaming buffers (2 layer groups)", buffers)
    elif resident:
        take(f"target KV cache ({_span(0, resident - 1)})", kv_layer * resident)
    items.append(Item("target embedding", sizes.embed, "cpu"))
    placements = [Placement(0, 1, "cpu")]
    if resident:
        take(f"target {_span(0, resident - 1)}", sum(sizes.layers[:resident]))
        placements.append(Placement(1, resident + 1, "cuda"))
    for first in range(resident, layers, per_group):
        stop = min(first + per_group, layers)
        items.append(Item(f"target {_span(first, stop - 1)}", sum(sizes.layers[first:stop]),
                          offload))
        placements.append(Placement(first + 1, stop + 1, "cuda" if streamed else "cpu",
                                    streamed))
    return Plan(budget, items, _merge([*placements, head]), resident, offload, tree, pass_s,
                draft_device, context)


ASSUMED_BANDWIDTH = 16e9  # PCIe 4.0 x16 as measured in practice, when no GPU is here to ask


def _time_layer(path: Path, model: onnx.ModelProto, entry: ModelEntry, device: str,
                tokens: int, threads: int, repeats: int = 5) -> float:
    """Seconds one target layer takes on `device` for a pass of `tokens` tokens."""
    unit = min(2, entry.num_layers)  # a layer after the first: the usual two inputs
    seg = Segment(path, model, entry, Placement(unit, unit + 1, device), tokens + 1,
                  threads)
    rng = np.random.default_rng(0)
    dtype = np.dtype(entry.activation_dtype)
    feeds = dict(zip(STEP_INPUTS, step_inputs(np.zeros(tokens), None, None, 0, tokens),
                     strict=True))
    best = float("inf")
    for _ in range(repeats):
        seg.cache.reset()
        for name in seg.hidden_in:
            seg.binding.bind_cpu_input(name, rng.standard_normal(
                (1, tokens, entry.hidden_size)).astype(dtype))
        for name, value in feeds.items():
            if name in seg.inputs:
                seg.binding.bind_cpu_input(name, value)
        for name in seg.hidden_out:
            seg.binding.bind_output(name, seg.device)
        t0 = time.perf_counter()
        seg.session.run_with_iobinding(seg.binding)
        best = min(best, time.perf_counter() - t0)
    return best


def _bandwidth(threads: int, nbytes: int = 64 << 20) -> float:
    """Host->GPU bytes/s as ONNX Runtime moves a bound host input to the CUDA provider."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.UINT8, ["n"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, ["n"])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])],
                                                "copy", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                   providers=[PROVIDER["cuda"]])
    if session.get_providers()[0] != PROVIDER["cuda"]:
        raise EdgespecError("ONNX Runtime could not start the cuda execution provider to "
                            "measure the GPU's bandwidth; check the CUDA libraries, or use "
                            "--device cpu.")
    host = np.ones(nbytes, np.uint8)
    best = float("inf")
    for _ in range(5):
        binding = session.io_binding()
        t0 = time.perf_counter()
        binding.bind_cpu_input("x", host)
        binding.bind_output("y", "cuda")
        session.run_with_iobinding(binding)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure_costs(path: Path, entry: ModelEntry, gpu: bool, threads: int = 0,
                  bandwidth: float | None = None) -> tuple[Costs, list[str]]:
    """The cost model measured here: one layer timed on the CPU (and the GPU) at 1 and
    32 tokens, and the host->GPU bandwidth. Returns the costs and what was assumed."""
    check_splittable(entry)
    model = onnx.load(str(path), load_external_data=False)

    def fit(device: str) -> tuple[float, float]:
        one, many = (_time_layer(path, model, entry, device, t, threads) for t in (1, 32))
        per_token = max(many - one, 0.0) / 31
        return max(one - per_token, 0.0), per_token

    assumed = []
    cpu = fit("cpu")
    if gpu:
        costs = Costs(bandwidth or _bandwidth(threads), cpu, fit("cuda"))
    else:
        assumed.append("GPU layer times (no GPU here)")
        costs = Costs(bandwidth or ASSUMED_BANDWIDTH, cpu)
    if bandwidth is None and not gpu:
        assumed.append(f"bandwidth {ASSUMED_BANDWIDTH / 1e9:.0f} GB/s")
    return costs, assumed
