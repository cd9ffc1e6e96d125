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
- `hilo:KIND`: per-row everywhere, but ~16-bit (two int8 codes) for KIND;
- `rotate` / `rotate:B` (QuaRot, arXiv 2404.00456): per-row after orthogonal rotations that
  an export can fold into the weights: the residual stream by one random orthogonal matrix
  (the norms' weights folded into the linears that read them), each attention head's
  values by a Hadamard matrix (folded into v_proj and o_proj), and down_proj's input by a
  block-diagonal Hadamard of size B (default 64), the one rotation a graph runs online;
  `rotate:B:KIND` leaves KIND's inputs (`all`: every input) in float;
- `…:gptq` (any variant, e.g. `rotate:128:gptq`): the same int8 weights (one scale per
  output channel, codes in [-127, 127]) chosen by GPTQ (edgespec.quant.gptq) instead of
  round-to-nearest, under each linear's input Hessian on the calibration text as that
  variant transforms it (divided by the folded norm gain, rotated); `gptq-mse` also
  searches each channel's clip range, `gptq-noact` quantizes columns in natural order.

    python tools/fake_quant_kl.py MODEL.gguf row row:qkv smooth0.5 outliers16
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from edgespec.export.rotation import block_diagonal, hadamard
from edgespec.quant.gptq import gptq_int8

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


def block_hadamard(block: int, n: int) -> torch.Tensor:
    """The exporter's block-diagonal Hadamard matrix (edgespec.export.rotation)."""
    return torch.from_numpy(block_diagonal(hadamard(block), n)).float()


def norm_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The RMSNorm weight each linear's input was scaled by, by the linear's name."""
    found = {}
    for name, _ in model.named_modules():
        layer, _, leaf = name.rpartition(".")
        if leaf in ("q_proj", "k_proj", "v_proj"):
            found[name] = model.get_submodule(layer.rpartition(".")[0]).input_layernorm.weight
        elif leaf in ("gate_proj", "up_proj"):
            found[name] = model.get_submodule(
                layer.rpartition(".")[0]).post_attention_layernorm.weight
    return found


def hi_lo(x: torch.Tensor) -> torch.Tensor:
    hi = per_row(x)
    return hi + per_row(x - hi)


class FakeQuant:
    """Hooks that quantize every linear's weight and input as one variant says."""

    def __init__(self, model: torch.nn.Module, calibration: list[int], hessians: bool = False,
                 window: int = 1024):
        self.model = model
        head = model.get_output_embeddings()  # untied: its weights are rotated, not the table's
        head.weight = torch.nn.Parameter(head.weight.data.clone(), requires_grad=False)
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.weights = {m: m.weight.data.clone() for m in self.linears.values()}
        self.peak: dict[torch.nn.Module, torch.Tensor] = {}
        self.hessian: dict[torch.nn.Module, torch.Tensor] = {}  # Σ xᵀx of the raw input
        self.gptq_seconds = 0.0
        self.norms = norm_weights(model)
        self.norms[next(n for n in self.linears if kind(n) == "head")] = \
            model.get_submodule("model.norm").weight
        d = model.config.hidden_size
        self.residual = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator()
                                                    .manual_seed(0)))[0]
        self.head_dim = getattr(model.config, "head_dim", None) or \
            d // model.config.num_attention_heads

        def record(module: torch.nn.Module, args: tuple) -> None:
            x = args[0].abs().amax((0, 1))
            self.peak[module] = torch.maximum(self.peak.get(module, x), x)
            if hessians:
                rows = args[0].reshape(-1, args[0].shape[-1]).double()
                h = self.hessian.get(module)
                self.hessian[module] = rows.T @ rows if h is None else h + rows.T @ rows
        hooks = [m.register_forward_pre_hook(record) for m in self.linears.values()]
        with torch.no_grad():
            for i in range(0, len(calibration), window):
                model(torch.tensor([calibration[i:i + window]]))
        for h in hooks:
            h.remove()

    def apply(self, variant: str) -> list:
        """Install the variant's hooks; returns them for removal."""
        flags = {"gptq", "gptq-mse", "gptq-noact"}
        parts = variant.split(":")
        gptq = [p for p in parts if p in flags]
        name, _, arg = ":".join(p for p in parts if p not in flags).partition(":")
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
            rotation, gain = None, torch.ones(module.in_features)
            if name == "rotate":
                block, _, floating = arg.partition(":")
                if floating in (k, "all"):
                    quant = None
                if full in self.norms:
                    rotation, gain = self.residual, self.norms[full].detach()
                elif k == "o":
                    rotation = block_hadamard(self.head_dim, module.in_features)
                elif k == "down":
                    rotation = block_hadamard(int(block or 64), module.in_features)
            w = self.weights[module] * smooth * gain
            if rotation is not None:
                w = w @ rotation
            if gptq:
                # the input this weight multiplies is (x / smooth / gain) @ rotation
                d = 1 / (smooth * gain).double()
                h = d[:, None] * self.hessian[module] * d[None, :]
                if rotation is not None:
                    r = rotation.double()
                    h = r.T @ h @ r
                start = time.perf_counter()
                codes, scale = gptq_int8(w.numpy(), h.numpy(),
                                         clip="mse" if "gptq-mse" in gptq else "absmax",
                                         act_order="gptq-noact" not in gptq)
                self.gptq_seconds += time.perf_counter() - start
                module.weight.data = torch.from_numpy(
                    codes.astype(np.float32) * scale[:, None])
            else:
                scale = w.abs().amax(1, keepdim=True) / 127
                module.weight.data = torch.round(w / scale).clamp(-127, 127) * scale

            def pre(_m, args, quant=quant, smooth=smooth, keep=keep, rotation=rotation,
                    gain=gain):
                x = args[0] / smooth / gain
                if rotation is not None:
                    x = x @ rotation
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
    ap.add_argument("--calibration", type=Path, nargs="+",
                    default=[Path(inspect.getfile(json.decoder))],
                    help="text files, concatenated (never the evaluation --text)")
    ap.add_argument("--calibration-tokens", type=int, default=1024,
                    help="how many calibration tokens, run in windows of 1024")
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
    if any(a.text.resolve() == c.resolve() for c in a.calibration):
        ap.error("calibrating on the evaluation text would flatter every variant")
    calibration = tok("\n".join(c.read_text() for c in a.calibration))["input_ids"]
    fq = FakeQuant(model, calibration[:a.calibration_tokens],
                   hessians=any("gptq" in v for v in a.variants))
    report = {}
    for variant in a.variants:
        fq.gptq_seconds = 0.0
        hooks = fq.apply(variant)
        got = logprobs(model, chunks)
        fq.restore(hooks)
        kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(reference, got, strict=True)])
        top1 = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(reference, got,
                                                                       strict=True)])
        report[variant] = {"kl": round(float(kl.mean()), 5),
                           "top1": round(float(top1.double().mean()), 4)}
        if fq.gptq_seconds:
            report[variant]["gptq_s"] = round(fq.gptq_seconds, 1)
        print(json.dumps({variant: report[variant]}), flush=True)


if __name__ == "__main__":
    main()
