"""`edgespec doctor`: what this machine can really run.

Providers are probed by creating a session on a one-node graph and reading back
`get_providers()`, because "available" only means the library was built with it.
"""

from __future__ import annotations

import platform

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgespec import __version__, kernels
from edgespec.engine import demo_bundle
from edgespec.errors import EdgespecError
from edgespec.runtimes.pool import session_options
from edgespec.runtimes.providers import PROVIDER, nvidia_smi


def _probe_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()


def probe_providers() -> dict[str, str]:
    """device -> 'works' or why not, for every provider this onnxruntime knows."""
    available = ort.get_available_providers()
    result = {}
    for device, name in PROVIDER.items():
        if name not in available:
            result[device] = "not in this onnxruntime build"
            continue
        try:
            session = ort.InferenceSession(_probe_model(), session_options(), providers=[name])
            session.run(None, {"x": np.ones(2, np.float32)})
            got = session.get_providers()[0]
            result[device] = "works" if got == name else f"falls back to {got}"
        except Exception as e:  # a provider failing to start is what we are probing for
            result[device] = f"fails: {str(e).splitlines()[0][:80]}"
    return result


def gpu_memory() -> str:
    """Free/total memory of NVIDIA GPUs as nvidia-smi reports it, where it can."""
    try:
        rows = nvidia_smi("name,memory.free,memory.total")
    except OSError as e:
        return f"unknown ({e})"
    return "; ".join(rows) or "no GPU listed"


def report(console: Console) -> None:
    table = Table(title="edgespec doctor", show_header=False)
    table.add_column("item")
    table.add_column("value")
    table.add_row("edgespec", __version__)
    table.add_row("python", platform.python_version())
    table.add_row("onnxruntime", f"{ort.__version__} ({ort.get_device()})")
    table.add_row("onnx", onnx.__version__)
    table.add_row("edgespec CPU kernels", escape(kernels.describe()))
    for device, state in probe_providers().items():
        style = "green" if state == "works" else "yellow"
        table.add_row(f"provider {device}", f"[{style}]{escape(state)}[/{style}]")
    table.add_row("GPU memory (free, total)", escape(gpu_memory()))
    try:
        from edgespec.bundle import read_manifest

        m = read_manifest(demo_bundle())
        draft = f" + draft {m.draft.params / 1e6:.1f} M" if m.draft else ""
        state = (f"[green]ok[/green]: target {m.target.params / 1e6:.1f} M "
                 f"{m.target.precision}{draft}, {len(m.files)} files verified")
    except EdgespecError as e:
        state = f"[red]{escape(str(e))}[/red]"
    table.add_row("demo bundle", state)
    console.print(table)
