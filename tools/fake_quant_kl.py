"""Which activation quantization an exact integer GEMM could afford: KL to float32, in
PyTorch, before building any graph.

The exact int8 GEMM (linear_ops.rowwise_int8) needs one activation scale per row; ONNX
Runtime's MatMulNBits uses one per block of 32. This fake-quantizes a causal LM's linears
(weights symmetric int8 per output channel, as rowwise_int8 stores them) and their inputs
in a choice of ways, and scores KL(float32 ‖ variant) and top-1 the way
tools/kl_vs_reference.py does (chunks of a text, second halves scored). Variants:

- `weights`: weights only (the floor every int8 variant shares);
- `row`: one scale per row for every linear; `row:KIND`: for that kind only (qkv, o,
  gate_up, down, head), the others float;
- `block32`, `group64`: one scale per row and per 32/64 inputs;
- `smooth0.5` (any α): per-row after SmoothQuant's per-channel migration
  s = max|x|^α / max|w|^(1-α), fitted on calibration text;
- `outliers16` (any count): per-row with that many input channels per linear (the
  largest on calibration text) left in float;
- `hilo:KIND`: per-row everywhere, but ~16-bit (two int8 codes) for KIND.

    python tools/fake_quant_kl.py MODEL.gguf row row:qkv smooth0.5 outliers16
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import torch

KINDS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
         "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
Quantizer = Callable[[torch.Tensor], torch.Tensor]


def kind(name: str) -> str:
    return next((k for part, k in KINDS.items() if part in name), "head")


def per_row(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """Symmetric int8 with one scale per row (per row and `group` inputs if given)."""
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], -1, group)
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(x / scale).clamp(-127, 127) * scale).reshape(shape)


def hi_lo(x: torch.Tensor) -> torch.Tensor:
    hi = per_row(x)
    return hi + per_row(x - hi)


class FakeQuant:
    """Hooks that quantize every linear's weight and input as one variant says."""

    def __init__(self, model: torch.nn.Module, calibration: list[int]):
        self.model = model
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.weights = {m: m.weight.data.clone() for m in self.linears.values()}
        self.peak: dict[torch.nn.Module, torch.Tensor] = {}

        def record(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].abs().amax((0, 1))
            self.peak[module] = torch.maximum(self.peak.get(module, x), x)
        hooks = [m.register_forward_pre_hook(record) for m in self.linears.values()]
        with torch.no_grad():
            model(torch.tensor([calibration]))
        for h in hooks:
            h.remove()

    def apply(self, variant: str) -> list:
        """Install the variant's hooks; returns them for removal."""
        name, _, arg = variant.partition(":")
        hooks = []
        for full, module in self.linears.items():
            k = kind(full)
            quant: Quantizer | None = per_row
            smooth = torch.ones(module.in_features)
            keep = None
            if name == "weights" or (name == "row" and arg and arg != k):
                quant = None
            elif name == "block32":
                quant = lambda x: per_row(x, 32)  # noqa: E731
            elif name == "group64":
                quant = lambda x: per_row(x, 64)  # noqa: E731
            elif name == "hilo" and arg == k:
                quant = hi_lo
            elif name.startswith("smooth") and k != "head":
                a = float(name[len("smooth"):])
                w = self.weights[module].abs().amax(0).clamp(min=1e-5)
                smooth = self.peak[module].clamp(min=1e-5) ** a / w ** (1 - a)
            elif name.startswith("outliers"):
                keep = torch.zeros(module.in_features, dtype=torch.bool)
                keep[torch.topk(self.peak[module], int(name[len("outliers"):])).indices] = True
            w = self.weights[module] * smooth
            scale = w.abs().amax(1, keepdim=True) / 127
            module.weight.data = torch.round(w / scale).clamp(-127, 127) * scale

            def pre(_m, args, quant=quant, smooth=smooth, keep=keep):
                x = args[0] / smooth
                if quant is None:
                    return (x,)
                if keep is None:
                    return (quant(x),)
                return (torch.where(keep, x, quant(torch.where(keep, 0.0, x))),)
            hooks.append(module.register_forward_pre_hook(pre))
        return hooks

    def restore(self, hooks: list) -> None:
        for h in hooks:
            h.remove()
        for module, w in self.weights.items():
            module.weight.data = w.clone()


def logprobs(model: torch.nn.Module, chunks: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([c])).logits[0, len(c) // 2:].double(), -1)
                for c in chunks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a GGUF file or a checkpoint directory")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--text", type=Path, default=Path(argparse.__file__))
    ap.add_argument("--calibration", type=Path, default=Path(inspect.getfile(json.decoder)))
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = ({"pretrained_model_name_or_path": a.model.parent, "gguf_file": a.model.name}
             if a.model.is_file() else {"pretrained_model_name_or_path": a.model})
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    ids = tok(a.text.read_text())["input_ids"]
    step = max(a.tokens, (len(ids) - a.tokens) // a.chunks)
    chunks = [ids[i:i + a.tokens] for i in range(0, len(ids) - a.tokens, step)][:a.chunks]
    reference = logprobs(model, chunks)
    fq = FakeQuant(model, tok(a.calibration.read_text())["input_ids"][:1024])
    report = {}
    for variant in a.variants:
        hooks = fq.apply(variant)
        got = logprobs(model, chunks)
        fq.restore(hooks)
        kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(reference, got, strict=True)])
        top1 = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(reference, got,
                                                                       strict=True)])
        report[variant] = {"kl": round(float(kl.mean()), 5),
                           "top1": round(float(top1.double().mean()), 4)}
        print(json.dumps({variant: report[variant]}), flush=True)


if __name__ == "__main__":
    main()
