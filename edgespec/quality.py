"""How closely a bundle follows its reference model: KL, top-1 agreement, perplexity.

As `llama-perplexity --kl-divergence` measures a quantized file: the text is cut into
chunks of `ctx` tokens, each fed as one pass to both models, and the second half of
every chunk is scored (the first half is context): KL(reference ‖ bundle) of the
next-token distributions, how often both pick the same top token, and each model's
perplexity on the text's actual next tokens.

The default text is Python's own `fractions.py` (on every Python install, held out of
the demo target's training and of calibration, which uses the model's generations).
"""

from __future__ import annotations

import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgespec.bundle import MANIFEST, ModelEntry, read_manifest
from edgespec.errors import EdgespecError
from edgespec.tokenizer import Tokenizer

DEFAULT_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "fractions.py"


@dataclass
class Quality:
    kl: float  # mean KL(reference ‖ bundle) per scored token, nats
    kl_p99: float  # its 99th percentile
    top1: float  # share of scored tokens where both models' most likely token agree
    ppl: float  # the bundle's perplexity on the scored tokens
    reference_ppl: float
    tokens: int  # scored tokens

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def chunks_of(ids: list[int], ctx: int, count: int) -> list[list[int]]:
    """Up to `count` chunks of `ctx` tokens spread evenly over the text."""
    if len(ids) < ctx:
        raise EdgespecError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}; "
                            "pass a longer --text or a smaller --ctx.")
    step = max(ctx, (len(ids) - ctx) // max(count - 1, 1))
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, step)][:count]


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def scored_logprobs(graph: Path, entry: ModelEntry, chunks: list[list[int]]
                    ) -> list[np.ndarray]:
    """Log-probabilities after each scored position (the second half of every chunk,
    predicting the chunk's next token), one [ctx/2, V] array per chunk."""
    from edgespec.runtimes import DecoderSession

    session = DecoderSession(graph, entry, ["CPUExecutionProvider"],
                             max_len=max(len(c) for c in chunks))
    out = []
    for ids in chunks:
        session.cache.reset()
        half = len(ids) // 2
        out.append(log_softmax(session.forward(ids)[half - 1:len(ids) - 1]))
    return out


def check_vocab(model: int, reference: int | None) -> None:
    if reference is not None and model != reference:
        raise EdgespecError(f"the bundle's vocabulary ({model} tokens) differs from the "
                            f"reference's ({reference}); compare a bundle with the model it "
                            "was exported from.")


def declared_vocab(reference: Path) -> int | None:
    """The vocabulary a GGUF file or checkpoint folder declares, read without its weights
    (None where it declares none): a wrong reference is refused before it is exported."""
    from edgespec.export.source import is_gguf

    if is_gguf(reference):
        from edgespec.export.gguf_reader import open_reader, read_metadata

        return read_metadata(open_reader(reference), reference)[1]["vocab_size"]
    if (reference / "config.json").is_file():
        from edgespec.export.checkpoint import json_object

        vocab = json_object(reference / "config.json").get("vocab_size")
        return vocab if isinstance(vocab, int) else None
    return None


def compare(model: tuple[Path, ModelEntry], reference: tuple[Path, ModelEntry],
            chunks: list[list[int]]) -> Quality:
    """The figures of `model` (graph, entry) against `reference` on `chunks`."""
    check_vocab(model[1].vocab_size, reference[1].vocab_size)
    return figures(scored_logprobs(*reference, chunks), scored_logprobs(*model, chunks),
                   chunks)


def figures(ref: list[np.ndarray], got: list[np.ndarray], chunks: list[list[int]]) -> Quality:
    """The figures of log-probabilities `got` against `ref` (scored_logprobs' layout:
    one [ctx/2, V] array per chunk) on `chunks`, whichever runtime computed them."""
    targets = np.concatenate([np.asarray(c[len(c) // 2:]) for c in chunks])
    ref, got = np.concatenate(ref), np.concatenate(got)
    kl = (np.exp(ref) * (ref - got)).sum(-1)
    rows = np.arange(len(targets))
    return Quality(kl=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)),
                   top1=float((ref.argmax(-1) == got.argmax(-1)).mean()),
                   ppl=float(np.exp(-got[rows, targets].mean())),
                   reference_ppl=float(np.exp(-ref[rows, targets].mean())),
                   tokens=int(len(targets)))


def _target(bundle: Path) -> tuple[Path, ModelEntry]:
    m = read_manifest(bundle)
    return bundle / m.target.graph, m.target


def measure(bundle: Path, reference: Path, text: Path | None = None, ctx: int = 256,
            chunks: int = 8, console=None) -> Quality:
    """`bundle`'s target against `reference`: a bundle, or a checkpoint directory or
    GGUF file, exported here in fp32 (a GGUF file's weights dequantized) for the purpose."""
    model = _target(bundle)
    fits(model, ctx, "the model")
    text = text or DEFAULT_TEXT
    if not text.is_file():
        raise EdgespecError(f"the text {text} is not a file; pass --text FILE.")
    tokenizer = Tokenizer.from_dir(bundle)
    try:
        words = text.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise EdgespecError(f"{text} is not UTF-8 text (byte {e.start}); pass a text file "
                            "with --text.") from None
    pieces = chunks_of(tokenizer.encode(words), ctx, chunks)
    if len(pieces) < chunks and console is not None:
        console.print(f"note: the text holds {len(pieces)} chunks of {ctx} tokens, fewer "
                      f"than the {chunks} asked; scoring those.", highlight=False)
    if (reference / MANIFEST).is_file():
        return compare(model, fits(_target(reference), ctx, "the reference"), pieces)
    if not reference.exists():
        raise EdgespecError(f"the reference {reference} does not exist; pass a bundle, a "
                            "checkpoint directory or a .gguf file.")
    check_vocab(model[1].vocab_size, declared_vocab(reference))
    from edgespec.export import export

    with tempfile.TemporaryDirectory(prefix="edgespec-reference-") as tmp:
        export(reference, Path(tmp) / "fp32", precision="fp32", requantize=True,
               console=console, summary=False)
        return compare(model, fits(_target(Path(tmp) / "fp32"), ctx, "the reference"), pieces)


def fits(model: tuple[Path, ModelEntry], ctx: int, which: str) -> tuple[Path, ModelEntry]:
    """`model`, once a chunk of `ctx` tokens is known to fit its context."""
    if ctx > model[1].max_positions:
        raise EdgespecError(f"--ctx {ctx} is longer than {which}'s context of "
                            f"{model[1].max_positions} tokens; give a smaller --ctx.")
    return model


def table(q: Quality, title: str):
    """The figures as a rich table."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("KL mean", "KL p99", "top-1", "PPL", "reference PPL", "tokens"):
        t.add_column(col, justify="right")
    t.add_row(f"{q.kl:.5f}", f"{q.kl_p99:.4f}", f"{q.top1:.1%}", f"{q.ppl:.3f}",
              f"{q.reference_ppl:.3f}", str(q.tokens))
    return t
