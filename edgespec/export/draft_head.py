"""EAGLE-style draft heads: one decoder layer that drafts from the target's own features.

A head reads the target's final-norm state h_j at position j and the embedding of the
token after it, e(t_{j+1}), fuses them (fc: [e; h] -> d), runs one Llama-style layer with
its own KV cache and ends in a norm whose output h'_{j+1} stands in for the target's next
state; the target's LM head, cut to the kept tokens (VocabTrim), scores it. Drafting
further feeds h' back with the drafted token (EAGLE, Li et al. 2024).

A trained head is a small `.npz` file (edgespec/train writes it): its layer, fusion and
norm weights, the kept token ids, its shape as JSON, and a *fingerprint* of the target it
was trained on. The fingerprint is a random projection of some embedding rows, so a
target is recognised by its weights, whatever file or precision they come in
(`matches`), which is how a bundle gets the shipped head for its target by default.
The embedding and LM head themselves are the target's, taken at export: nothing of the
target is stored twice in the head file.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.export.architectures import DecoderSpec, LayerWeights, Weight
from edgespec.quant.blockwise import QuantizedWeight, dequantize

if TYPE_CHECKING:
    import onnx

FORMAT = "edgespec-eagle-head"
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "drafts"
FINGERPRINT_ROWS = 256  # embedding rows projected into a fingerprint
FINGERPRINT_DIMS = 16
MATCH = 0.98  # correlation of two fingerprints of the same weights, any 4-bit or better


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @classmethod
    def for_target(cls, spec: DecoderSpec, intermediate_size: int | None = None
                   ) -> HeadConfig:
        """A head as wide as the target, with heads of 64 (what GQA's kernel likes)."""
        heads = max(1, spec.hidden_size // 64)
        return cls(hidden_size=spec.hidden_size,
                   intermediate_size=intermediate_size or spec.intermediate_size,
                   num_heads=heads, num_kv_heads=heads, head_dim=spec.hidden_size // heads,
                   rms_norm_eps=spec.rms_norm_eps)

    def spec(self, target: DecoderSpec) -> DecoderSpec:
        """The head as a one-layer decoder the graph builder knows."""
        half = self.head_dim // 2
        inv_freq = 1.0 / self.rope_theta ** (np.arange(half, dtype=np.float64) / half)
        return DecoderSpec(
            architecture="eagle-head", vocab_size=target.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_positions=target.max_positions, tie_embeddings=False,
            inv_freq=inv_freq.astype(np.float32), embed_scale=target.embed_scale,
            final_softcap=target.final_softcap)


LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "input_norm", "mlp_norm")


@dataclass
class DraftHead:
    config: HeadConfig
    weights: dict[str, np.ndarray]  # fusion, layer.*, norm: float32, HF [out, in] layout
    kept: np.ndarray  # token ids of the head's LM head rows
    fingerprint: np.ndarray
    card: dict[str, Any]  # how it was trained: data, steps, time, acceptance

    def layer(self) -> LayerWeights:
        w = {k: self.weights[f"layer.{k}"] for k in LAYER}
        return LayerWeights(
            qkv=np.concatenate([w["q_proj"], w["k_proj"], w["v_proj"]]), o=w["o_proj"],
            gate_up=np.concatenate([w["gate_proj"], w["up_proj"]]), down=w["down_proj"],
            input_norm=w["input_norm"], mlp_norm=w["mlp_norm"])

    @property
    def params(self) -> int:
        return sum(int(v.size) for v in self.weights.values())

    def save(self, path: Path) -> None:
        """Written whole or not at all (a temporary file renamed into place)."""
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "wb") as f:
            np.savez(f, format=np.array(FORMAT),
                     config=np.array(json.dumps(vars(self.config))),
                     card=np.array(json.dumps(self.card)), kept=self.kept.astype(np.int64),
                     fingerprint=self.fingerprint.astype(np.float32),
                     **{f"w.{k}": v.astype(np.float16) for k, v in self.weights.items()})
        tmp.replace(path)


def shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, as the head's config says: what a file must hold."""
    d, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
             "gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i),
             "input_norm": (d,), "mlp_norm": (d,)}
    return {"fusion": (d, 2 * d), "norm": (d,), **{f"layer.{k}": v for k, v in layer.items()}}


def load_head(path: Path | str) -> DraftHead:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != FORMAT:
                raise EdgespecError(f"{path} is not an edgespec draft head; train one with "
                                    "`edgespec train-draft`.")
            head = DraftHead(
                config=HeadConfig(**json.loads(str(z["config"]))),
                weights={k[2:]: z[k].astype(np.float32) for k in z.files
                         if k.startswith("w.")},
                kept=z["kept"], fingerprint=z["fingerprint"],
                card=json.loads(str(z["card"])))
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        why = ("not a numpy archive" if "pickle" in str(e) or not str(e)  # not numpy's hint
               else str(e))
        raise EdgespecError(f"cannot read the draft head {path} ({why}); pass a file "
                            "written by `edgespec train-draft`.") from None
    want = shapes(head.config)
    wrong = sorted(k for k in want.keys() | head.weights.keys()
                   if k not in head.weights or head.weights[k].shape != want.get(k))
    if wrong or head.kept.ndim != 1 or not np.issubdtype(head.kept.dtype, np.integer):
        what = f"its {', '.join(wrong)} do not have the shapes its config gives" if wrong \
            else "its kept tokens are not a list of token ids"
        raise EdgespecError(f"the draft head {path} is damaged ({what}); pass a file written "
                            "by `edgespec train-draft`.")
    if not all(np.isfinite(w).all() for w in head.weights.values()):
        raise EdgespecError(f"the draft head {path} holds weights that are not finite (its "
                            "training diverged); train it again with a lower --lr.")
    return head


def is_head_file(path: str | Path) -> bool:
    return str(path).endswith(".npz") and Path(path).is_file()


def fingerprint(embeddings: Weight) -> np.ndarray:
    """A few embedding rows through a fixed random projection: the same for any faithful
    copy of the weights (4-bit or better), unrelated for another model."""
    rows = embeddings.shape[0] if isinstance(embeddings, np.ndarray) else embeddings.n
    pick = np.random.default_rng(0).choice(rows, min(FINGERPRINT_ROWS, rows), replace=False)
    pick.sort()
    if isinstance(embeddings, QuantizedWeight):
        table = dequantize(embeddings.rows(pick))
    else:
        table = np.asarray(embeddings[pick], np.float32)
    projection = np.random.default_rng(1).standard_normal((table.shape[1], FINGERPRINT_DIMS))
    return (table @ projection).astype(np.float32).ravel()


def matches(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and float(np.corrcoef(a, b)[0, 1]) > MATCH


def shipped_head(embeddings: Weight) -> Path | None:
    """The shipped head trained for this very target, if there is one."""
    if not SHIPPED.is_dir():
        return None
    mine = fingerprint(embeddings)
    for path in sorted(SHIPPED.glob("*.npz")):
        with np.load(path, allow_pickle=False) as z:
            if matches(mine, z["fingerprint"]):
                return path
    return None


def check_fits(head: DraftHead, spec: DecoderSpec, embeddings: Weight, path: Path) -> None:
    """A head drafts only for the target it was trained on: same width, same weights."""
    if head.config.hidden_size != spec.hidden_size:
        raise EdgespecError(f"the draft head {path} was trained for a model of width "
                            f"{head.config.hidden_size}, not this target's "
                            f"{spec.hidden_size}; train one with `edgespec train-draft`.")
    if head.kept.max() >= spec.vocab_size:
        raise EdgespecError(f"the draft head {path} keeps token {head.kept.max()}, past this "
                            f"target's vocabulary of {spec.vocab_size}; train one with "
                            "`edgespec train-draft`.")
    if not matches(fingerprint(embeddings), head.fingerprint):
        raise EdgespecError(f"the draft head {path} was trained on another model (its "
                            "fingerprint does not match this target's weights); train one "
                            "with `edgespec train-draft`.")


def build_head_graph(head: DraftHead, spec: DecoderSpec, embeddings: Weight, lm_head: Weight,
                     precision: str, **options: Any) -> onnx.ModelProto:
    """The head as an ONNX graph: the target's embedding (its own codes, gathered) and
    the kept rows of its LM head around the head's fusion and layer. `options` go to
    graph.build_decoder (block size, accuracy level, dtype, attention)."""
    from edgespec.export.graph import build_decoder

    rows = (lm_head.rows(head.kept) if isinstance(lm_head, QuantizedWeight)
            else np.asarray(lm_head)[head.kept])
    return build_decoder(head.config.spec(spec), embeddings, [head.layer()],
                         head.weights["norm"], rows, precision,
                         draft_head_rows=None, hidden_output=True, last_logits=True,
                         fusion=head.weights["fusion"], **options)
