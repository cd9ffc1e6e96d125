"""`edgespec plan`: where each part of a bundle would live under a GPU memory budget.

The same planner the engine runs on CUDA, shown before anything is loaded: so a user
with a 6 GiB card sees which layers stay resident, which are streamed or computed by the
CPU, and the tree budget the offloaded passes make worth verifying.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import onnxruntime as ort
from rich.console import Console
from rich.table import Table

from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.runtimes.planner import (
    BUDGETS,
    ModelSizes,
    Plan,
    fmt_bytes,
    free_gpu_bytes,
    head_needs_whole_target,
    make_plan,
    measure_costs,
)
from edgespec.runtimes.providers import PROVIDER
from edgespec.runtimes.segments import splittable


def plan_bundle(path: Path, gpu_memory: int | None, context: int,
                bandwidth: float | None = None, threads: int = 0
                ) -> tuple[Plan, list[str]]:
    """The plan for `path`, and which of the cost model's inputs were assumed."""
    m = read_manifest(path)
    free = free_gpu_bytes()
    budget = gpu_memory if gpu_memory is not None else free
    if budget is None:
        raise EdgespecError("no NVIDIA GPU answered here, so there is no memory to plan; "
                            "give the budget with --gpu-memory, e.g. --gpu-memory 6GiB.")
    gpu = free is not None and PROVIDER["cuda"] in ort.get_available_providers()
    context = min(context, m.target.max_positions)
    costs, assumed = (measure_costs(path / m.target.graph, m.target, gpu, threads, bandwidth)
                      if splittable(m.target) else (None, []))  # planned if all of it fits
    sizes = ModelSizes.of(path / m.target.graph, m.target)
    draft = (ModelSizes.of(path / m.draft.graph, m.draft)
             if m.draft and m.draft.graph != m.target.graph else None)
    plan = make_plan(sizes, budget, context, costs, draft)
    if m.draft is None:  # no drafter grows a tree: the budget would only mislead
        plan = replace(plan, tree_budget=0)
    if m.draft is not None and m.draft.kind == "eagle" and plan.offload != "none":
        whole = make_plan(sizes, 1 << 62, context, costs, draft).gpu_bytes
        raise EdgespecError(head_needs_whole_target(
            f"{fmt_bytes(whole)} at a context of {context} tokens"))
    return plan, assumed


def plan_dict(plan: Plan, assumed: list[str]) -> dict[str, Any]:
    return {"gpu_memory": plan.budget, "gpu_bytes": plan.gpu_bytes, "context": plan.context,
            "offload": plan.offload,
            "resident_layers": plan.resident_layers, "tree_budget": plan.tree_budget,
            "draft_device": plan.draft_device, "assumed": assumed,
            "items": [vars(i) for i in plan.items],
            "segments": [vars(p) for p in plan.placements],
            "pass_ms": {t: round(s * 1e3, 4) for t, s in plan.pass_s.items()}}


def print_plan(plan: Plan, assumed: list[str], console: Console, limited: bool = False
               ) -> None:
    """The plan's tables; `limited`: the context asked for was cut to the model's own."""
    table = Table(title=f"plan for {fmt_bytes(plan.budget)} of GPU memory: {plan.summary()}")
    for column in ("part", "size", "where"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for item in plan.items:
        style = {"gpu": "green", "streamed": "yellow", "cpu": "cyan"}[item.where]
        table.add_row(item.what, fmt_bytes(item.nbytes), f"[{style}]{item.where}[/{style}]")
    console.print(table)
    if plan.pass_s:  # none for a bundle offload cannot cut (and so does not time)
        passes = Table(title="target pass time by tokens verified (cost model)")
        passes.add_column("tokens")
        passes.add_column("pass ms", justify="right")
        for t in BUDGETS:
            mark = " <- tree budget" if t == plan.tree_budget else ""
            passes.add_row(str(t), f"{plan.pass_s[t] * 1e3:.2f}{mark}")
        console.print(passes)
    draft = f"; draft on {plan.draft_device}" if plan.draft_device else ""
    cut = " (the model's limit)" if limited else ""
    console.print(f"GPU memory used: {fmt_bytes(plan.gpu_bytes)}{draft}; KV cache for "
                  f"{plan.context} tokens{cut}")
    if assumed:
        console.print(f"[yellow]assumed, not measured: {', '.join(assumed)}[/yellow]")
