"""Hugging Face checkpoint(s) -> an edgespec bundle (graphs, tokenizer, manifest)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import platform
import shutil
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgespec import __version__, kernels
from edgespec.bundle import PRECISIONS, Manifest, ModelEntry, source_scratch, write_bundle
from edgespec.errors import EdgespecError, WriteError
from edgespec.export.architectures import Weight, adapter_for, takes_rotations
from edgespec.export.calibrate import add_stat_outputs, second_moments
from edgespec.export.draft_head import (
    build_head_graph,
    check_fits,
    is_head_file,
    load_head,
    shipped_head,
)
from edgespec.export.graph import RotatedTable, build_decoder, kv_head_dim, rows_of
from edgespec.export.kv_quant import calibrate_target, kv_scales
from edgespec.export.requant import Requantizer
from edgespec.export.rotation import rotate
from edgespec.export.shared_data import share_weights
from edgespec.export.source import Source, open_source
from edgespec.export.vocab_trim import (
    check_trim_source,
    corpus_counts,
    default_prompts,
    special_ids,
    target_counts,
)
from edgespec.quality import DEFAULT_TEXT, chunks_of, compare
from edgespec.quant.blockwise import QuantizedWeight
from edgespec.quant.vocab_trim import kept_tokens
from edgespec.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
EXPORTED_PRECISIONS = ("fp32", "fp16", "int8", "int4", "int2")
# compute dtype per EP profile: CUDA's GQA has only fp16/bf16 kernels; the CPU's fp16
# kernels are slow or missing, so the CPU computes in fp32 whatever the weights are
PROFILE_DTYPE = {"cpu": np.float32, "cuda": np.float16, "dml": np.float16}
KV_CACHES = ("auto", "float", "float16", "int8")  # export's kv_cache
# DirectML's GQA cannot verify several tokens against a cache and takes no bias
PROFILE_ATTENTION = {"cpu": "gqa", "cuda": "gqa", "dml": "mha"}
KV_LAYOUT = {"gqa": "gqa-shared-buffer", "mha": "mha-concat"}


def _vocab(path: Path) -> dict[str, int]:
    spec = json.loads((path / "tokenizer.json").read_text())
    model = spec["model"]
    vocab = dict(model["vocab"]) if isinstance(model["vocab"], dict) else {
        tok: i for i, (tok, _) in enumerate(model["vocab"])}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    return vocab


NESTED_PROFILES = ("--draft nested works with the cpu and cuda profiles; leave out "
                   "--ep-profile dml or choose another draft.")


def check_tokenizer(src: Source) -> None:
    """What would otherwise fail only when the bundle runs: a tokenizer that cannot be read
    (exported as it was, and exported so again), or one making ids past the model's
    embedding (ONNX Runtime's Gather failed on the first such token of a prompt)."""
    tokenizer = Tokenizer.from_dir(src.tokenizer_dir,
                                   remedy=f"fix {src.label}'s tokenizer or download it again")
    rows = src.config.get("vocab_size")
    if isinstance(rows, int) and tokenizer.vocab_size > rows:
        raise EdgespecError(f"{src.label}'s tokenizer has {tokenizer.vocab_size} tokens but its "
                            f"embedding only {rows} rows (vocab_size), so text could reach ids it "
                            "has no row for; use the tokenizer the model was trained with.")


def check_same_vocab(target: Path, draft: Path) -> None:
    """Speculation compares token ids, so both models must mean the same thing by each id."""
    for p in (target, draft):
        if not (p / "tokenizer.json").is_file():
            raise EdgespecError(f"{p} has no tokenizer.json; edgespec needs a fast tokenizer.")
    t, d = _vocab(target), _vocab(draft)
    if t == d:
        return
    t_by_id = {i: s for s, i in t.items()}
    d_by_id = {i: s for s, i in d.items()}
    diffs = [f"id {i}: target {t_by_id.get(i)!r} vs draft {d_by_id.get(i)!r}"
             for i in sorted(set(t_by_id) | set(d_by_id)) if t_by_id.get(i) != d_by_id.get(i)]
    raise EdgespecError(f"the draft's tokenizer differs from the target's ({len(diffs)} ids "
                        f"differ, first: {'; '.join(diffs[:3])}); pick a draft from the "
                        "same model family.")


def dml_refusal(precision: str, draft_precision: str | None) -> str | None:
    """Why the dml profile cannot take these precisions, or None where it can."""
    wrong = [f"{flag} {p}" for flag, p in (("--precision", precision),
                                           ("--draft-precision", draft_precision))
             if p in ("int2", "int8")]
    if not wrong:
        return None
    return ("the dml profile supports fp32, fp16 and int4 weights (DirectML's MatMulNBits "
            "needs zero points, which 8-bit codes cannot carry, and has no 2-bit kernel); "
            f"instead of {' and '.join(wrong)}, pass int4 or fp16.")


def uses_recipe(quant: str, precision: str, ep_profile: str, nested: bool) -> bool:
    """Whether a model's float weights take the GGUF recipe (quant.recipe): int4 and int8
    with quant "k", except for BitNest (its own nested codes) and the dml profile (its
    MatMulNBits wants zero points, which minimums and 8-bit codes cannot carry)."""
    return quant == "k" and precision in ("int4", "int8") and not nested and ep_profile != "dml"


QUANTS = ("auto", "k", "sym", "asym", "rot")


def chosen_quant(quant: str, target: Source, draft: Source | None, precision: str,
                 draft_precision: str, ep_profile: str, accuracy_level: int, nested: bool,
                 requantize: bool) -> str:
    """"auto" is "rot" wherever it can run on edgespec's kernels, else "k". Rotated int8 on
    RowQMatMul verifies several tokens for the least (SmolLM2-135M, Intel host, five runs:
    S=17 1.6-2.0x S=1 against int8 blocks' 2.0-2.8x) with a cheaper one-token step (5.4-7.0
    against 6.7-7.6 ms) at about the same fidelity (KL 0.0035 against 0.0033, calibrated);
    it needs float weights (a GGUF file keeps its codes unless requantized), int8
    everywhere, the cpu profile with int8 activations, and architectures without norms on
    their branch outputs (not Gemma 2/3)."""
    if quant != "auto":
        return quant
    floats = all(src.kind != "gguf" or requantize for src in (target, draft) if src)
    rot = (floats and precision == "int8" and draft_precision == "int8" and not nested
           and ep_profile == "cpu" and accuracy_level == 4 and kernels.for_export()
           and all(takes_rotations(src.config) for src in (target, draft) if src))
    return "rot" if rot else "k"


class Built(NamedTuple):
    """An exported model's manifest entry, and the embedding and LM head its graph holds
    as built (requantized where the recipe ran): a draft head gathers and scores with the
    very same codes, so its bundle keeps one copy. When rotated, the embedding is the
    rotated table (turned back in the head's graph) and the head the unrotated float one
    (the head scores in the model's own basis, its kept rows a copy either way)."""

    entry: ModelEntry
    tables: tuple[Weight | RotatedTable, Weight]


def _export_model(source: Source, role: str, out: Path, precision: str, block_size: int,
                  accuracy_level: int, ep_profile: str, quant: str,
                  progress: Progress, head_rows: np.ndarray | None = None,
                  nested: str | None = None,
                  draft_head_rows: np.ndarray | None = None,
                  kv_scales: list[tuple[np.ndarray, np.ndarray]] | None = None,
                  hidden_output: bool = False, stats: bool = False,
                  hessians: dict[str, np.ndarray] | None = None,
                  kv_half: bool | None = False) -> Built:
    """One model's graph and weights at `out/role.onnx`. `quant`: "k" (the GGUF recipe
    where it applies), "sym", "asym" or "rot" (rotated); k and rot take GPTQ's codes
    where `hessians` has the input's XᵀX (calibrate); `stats` adds calibrate's XᵀX
    outputs to a float graph. `kv_half`: float16 caches (None: where edgespec's kernels
    run the whole graph, build_decoder)."""
    task = progress.add_task(f"{role}: loading {source.label}", total=None)
    ckpt = source.load()
    adapter = adapter_for(ckpt)
    spec = adapter.spec
    attention = PROFILE_ATTENTION[ep_profile]
    if attention == "mha" and (spec.attn_softcap or any(spec.sliding_window)
                               or spec.local_inv_freq is not None):
        raise EdgespecError(f"{source.name}: the dml profile cannot express attention "
                            "soft-capping or sliding windows yet; export with --ep-profile "
                            "cpu or cuda.")
    params = adapter.ckpt.num_params()
    if nested:  # BitNest: the target is the 8-bit nest, the draft its 4-bit base
        precision = "int4" if nested == "draft" else "int8"
    progress.update(task, total=spec.num_layers + 1, completed=0,
                    description=f"{role}: building {precision} graph")
    recipe = uses_recipe(quant, precision, ep_profile, bool(nested))
    if recipe:
        requant = Requantizer(adapter, precision, hessians)
        progress.update(task, description=f"{role}: quantizing {precision} (GGUF recipe)")
        embeddings, head = requant.embeddings_and_head()
        layers = requant.layers()
    else:
        embeddings, head, layers = adapter.embeddings(), adapter.lm_head(), adapter.layers()
    final_norm, rotated = adapter.final_norm(), None
    tables: tuple[Weight | RotatedTable, Weight] = (embeddings, head)
    if quant == "rot":
        progress.update(task, description=f"{role}: rotating")
        rotated = rotate(spec, embeddings, list(layers), final_norm, head)
        tables = (RotatedTable(rotated.embeddings, rotated.unrotate,
                               rowwise=embeddings is head and precision == "int8"), head)
        embeddings, head, layers = rotated.embeddings, rotated.lm_head, rotated.layers
        final_norm = np.ones_like(final_norm)
    if head_rows is not None:
        head = head.rows(head_rows) if isinstance(head, QuantizedWeight) else head[head_rows]
    model = build_decoder(spec, embeddings, layers, final_norm, head, precision, block_size,
                          accuracy_level,
                          dtype=PROFILE_DTYPE[ep_profile], attention=attention,
                          symmetric=quant != "asym", nested=nested,
                          draft_head_rows=draft_head_rows, kv_scales=kv_scales,
                          on_layer=lambda i: progress.advance(task),
                          hidden_output=hidden_output, rotation=rotated, hessians=hessians,
                          kv_half=kv_half)
    if stats:
        add_stat_outputs(model)
    progress.update(task, description=f"{role}: writing {role}.onnx")
    _save(model, out, role)
    progress.update(task, completed=spec.num_layers + 1, description=f"{role}: done")
    if getattr(ckpt, "keep_codes", False) and ckpt.quantized and not nested and not rotated:
        precision = "gguf"  # every quantized tensor kept its own GGUF type
    return Built(ModelEntry(
        graph=f"{role}.onnx", data_files=[f"{role}.onnx.data"],
        architecture=spec.architecture, precision=precision,
        block_size=(None if precision in ("fp32", "fp16", "gguf") or recipe or rotated
                    else block_size),
        kv_dtype=kv_dtype_of(model),
        compute_dtype=np.dtype(PROFILE_DTYPE[ep_profile]).name, kv_layout=KV_LAYOUT[attention],
        vocab_size=rows_of(head), hidden_size=spec.hidden_size, num_layers=spec.num_layers,
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        head_dim=kv_head_dim(spec, attention),
        max_positions=spec.max_positions, params=params, source=source.name,
        nested="target" if nested == "shared" else ""), tables)


def kv_dtype_of(model: onnx.ModelProto) -> str:
    """The element type of a decoder graph's KV cache, as numpy names it."""
    past = next(i for i in model.graph.input if i.name == "past_key_0")
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(past.type.tensor_type.elem_type)).name


def _save(model: onnx.ModelProto, out: Path, role: str) -> None:
    # onnx appends external data to an existing file: a graph built again (calibrated KV,
    # a trimmed nested head) must not carry its first version's weights along
    (out / f"{role}.onnx.data").unlink(missing_ok=True)
    onnx.save_model(model, out / f"{role}.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location=f"{role}.onnx.data",
                    size_threshold=1024)


def _export_head(head_path: Path, source: Source, target: Built, out: Path, precision: str,
                 block_size: int, accuracy_level: int, ep_profile: str,
                 progress: Progress, hessians: dict[str, np.ndarray] | None) -> ModelEntry:
    """An EAGLE draft head (export.draft_head) around the target's embedding and head, as
    the target's graph holds them. `hessians`: the target's, whose XᵀX of the LM head's
    input chose a rotated tied head's codes, which the embedding rows are gathered from."""
    task = progress.add_task(f"draft head: {head_path.name}", total=None)
    head = load_head(head_path)
    adapter = adapter_for(source.load())
    embeddings, lm_head = target.tables
    rotated = isinstance(embeddings, RotatedTable)
    check_fits(head, adapter.spec, adapter.embeddings() if rotated else embeddings, head_path)
    if precision == "gguf" or precision not in EXPORTED_PRECISIONS:
        precision = "int8"  # the head's own float weights; the target's codes stay theirs
    table_hessian = (hessians or {}).get("lm_head") if rotated else None
    model = build_head_graph(head, adapter.spec, embeddings, lm_head, precision,
                             block_size=block_size, accuracy_level=accuracy_level,
                             dtype=PROFILE_DTYPE[ep_profile],
                             attention=PROFILE_ATTENTION[ep_profile],
                             hessians=None if table_hessian is None else {
                                 "embed": table_hessian})
    _save(model, out, "draft")
    data_files = share_weights(out, "draft.onnx", "target.onnx")  # the embedding, once
    np.save(out / "draft_vocab.npy", head.kept)
    progress.update(task, total=1, completed=1, description="draft head: done")
    c = head.config
    return ModelEntry(
        graph="draft.onnx", data_files=data_files, architecture="eagle-head",
        precision=precision, block_size=None if precision in ("fp32", "fp16") else block_size,
        kv_dtype=np.dtype(PROFILE_DTYPE[ep_profile]).name,
        compute_dtype=np.dtype(PROFILE_DTYPE[ep_profile]).name,
        kv_layout=KV_LAYOUT[PROFILE_ATTENTION[ep_profile]], vocab_size=len(head.kept),
        hidden_size=c.hidden_size, num_layers=1, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_positions=adapter.spec.max_positions, params=head.params, source=str(head_path),
        kind="eagle", proposal_scale=float(head.card.get("proposal_scale", 1.0)))


def default_head(source: Source) -> Path | None:
    """The shipped head trained on this very target, recognised by its weights."""
    return shipped_head(adapter_for(source.load()).embeddings())


def _hessians(tmp: Path, graph: ModelEntry, source: Source, calibration: str | Path,
              progress: Progress) -> dict[str, np.ndarray]:
    """XᵀX of every linear's input, measured with `graph` (a float graph built with
    calibrate's statistics outputs) on `calibration`: "self" (the model's own answers to
    the built-in prompts) or a text file."""
    prompts = default_prompts()
    text = None if calibration == "self" else Path(calibration)
    task = progress.add_task("calibrating: " + ("the model's own generations" if text is None
                                                else text.name),
                             total=None if text else len(prompts))
    try:
        return second_moments(tmp / graph.graph, graph, Tokenizer.from_dir(source.tokenizer_dir),
                              text, prompts, advance=lambda: progress.advance(task))
    finally:
        progress.update(task, visible=False)


def _rotated_hessians(tmp: Path, source: Source, calibration: str | Path,
                      progress: Progress) -> dict[str, np.ndarray]:
    """_hessians on the rotated float model, whose inputs are what `--quant rot`'s int8
    weights multiply; the calibration graph is removed afterwards."""
    graph = _export_model(source, "calibration", tmp, "fp32", 32, 0, "cpu", "rot", progress,
                          stats=True).entry
    try:
        return _hessians(tmp, graph, source, calibration, progress)
    finally:
        for name in (graph.graph, *graph.data_files):
            (tmp / name).unlink(missing_ok=True)


def _quality(tmp: Path, target: ModelEntry, reference: ModelEntry, ep_profile: str,
             tokenizer_dir: Path, progress: Progress) -> dict | None:
    """The quantized target against its float graph on edgespec quality's default text
    (cpu profile only: other profiles' graphs are not for this machine); the float graph
    is removed either way."""
    task = progress.add_task("quality: KL against the float model", total=None)
    try:
        if ep_profile != "cpu":
            return None
        ids = Tokenizer.from_dir(tokenizer_dir).encode(DEFAULT_TEXT.read_text())
        return compare((tmp / target.graph, target), (tmp / reference.graph, reference),
                       chunks_of(ids, min(256, target.max_positions), 8)).as_dict()
    finally:
        for name in (reference.graph, *reference.data_files):
            (tmp / name).unlink(missing_ok=True)
        progress.update(task, visible=False)


def vocab_counts(graph: Path, target: ModelEntry, tokenizer_dir: Path, source: str,
                 prompts: list[str] | None) -> np.ndarray:
    """Token frequencies for VocabTrim from the target's generations or a corpus."""
    check_trim_source(source)
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    if source == "target":
        return target_counts(graph, target, tokenizer, prompts or default_prompts())
    return corpus_counts(Path(source.removeprefix("corpus:")), tokenizer, target.vocab_size)


def _vocab_to_keep(tmp: Path, target_dir: Path, target: ModelEntry, eos_ids: list[int],
                   k: int, source: str, prompts: list[str] | None,
                   progress: Progress) -> np.ndarray:
    """The draft head's rows to keep (export refused a K covering the whole vocabulary)."""
    task = progress.add_task(f"vocab trim: counting tokens ({source})", total=None)
    counts = vocab_counts(tmp / target.graph, target, target_dir, source, prompts)
    progress.update(task, total=1, completed=1, description=f"vocab trim: keeping {k} tokens")
    try:
        return kept_tokens(counts, k, special_ids(target_dir, eos_ids))
    except ValueError as e:
        raise EdgespecError(f"--vocab-trim: {e}; choose a larger K.") from None


@contextlib.contextmanager
def _readers_forgotten() -> Iterator[None]:
    """The GGUF readers an export kept (gguf_reader.open_reader) go with it."""
    try:
        yield
    finally:
        from edgespec.export.gguf_reader import forget_readers

        forget_readers()


def export(target: str | Path, out: str | Path, draft: str | Path | None = None,
           precision: str = "int8", draft_precision: str | None = None, block_size: int = 32,
           ep_profile: str = "cpu", accuracy_level: int = 4, quant: str = "auto",
           calibration: str | Path | None = "self", vocab_trim: int | None = None,
           trim_source: str = "target",
           trim_prompts: list[str] | None = None, kv_cache: str = "auto",
           overwrite: bool = False, requantize: bool = False,
           trust_remote_code: bool = False, console: Console | None = None,
           summary: bool = True) -> Manifest:
    """Export a target (and optionally a draft) checkpoint into a bundle at `out`.

    `accuracy_level` is MatMulNBits' activation precision. 4 (default) quantizes
    activations to int8 blockwise on the CPU: measured on the demo target, 1.3 ms per
    step against 25 ms with 0, which keeps activations in fp32 but has no fast 8-bit
    kernel. Losslessness is unaffected: speculation is exact w.r.t. the graph that runs.
    `quant="auto"` (default) is "rot" where it runs on edgespec's kernels (chosen_quant),
    else "k". "rot" quantizes int8 per row on rotated weights (export.rotation) for the
    exact integer GEMM, calibrated with GPTQ on `calibration`.
    `quant="k"` quantizes int4/int8 weights with llama.cpp's Q4_K_M/Q8_0
    recipe (quant.recipe: its types, bits per weight and error search; a tied embedding
    stored once), calibrated on `calibration`: "self" (the target's own generations after
    built-in prompts), a text file, or None (round to nearest, unweighted). Calibration
    measures each linear's input XᵀX: its diagonal weights the blocks' error search and
    GPTQ chooses the codes on those blocks.
    "sym"/"asym" are the plain blockwise codes of `block_size` (asym: a zero point per
    block; int8 stays symmetric: ONNX Runtime's CPU kernel takes no 8-bit zero points);
    int2, BitNest and the dml profile always take those.
    `draft="nested"` makes the draft BitNest-style: the 4-bit base of the target's own
    nested 4+4 codes (the LM head read whole), the target computing with exactly base +
    residual (W8).
    `vocab_trim=K` keeps only K rows of the draft's LM head, the tokens most frequent in
    the target's own generations (`trim_source="target"`, prompts from `trim_prompts`
    or a built-in set) or in a corpus (`trim_source="corpus:PATH"`).
    `kv_cache="int8"` stores both models' KV caches as int8 codes with per-channel scales
    calibrated on the built-in prompts and the target's own continuations; "float16" as
    IEEE halves on the cpu profile (the cuda and dml profiles' float caches are float16
    already): half the memory, and half the bytes a step reads at long context, where the
    caches outweigh the weights. "auto" (default): float16 where edgespec's kernels run the
    graph, linears with int8 activations and attention (measured on SmolLM2's Q4_1 file:
    the same KL against its float weights as float caches, 0.0029), float otherwise (fp32
    and fp16 exports, accuracy_level 0 and BitNest stay float references). A draft head's
    one-layer cache stays float.
    A GGUF file (target or draft) keeps every quantized tensor's own type, encoded so the
    effective weights are exactly llama.cpp's; its float tensors follow `precision`.
    `requantize=True` dequantizes them instead and quantizes everything to `precision`.
    `summary=False` leaves out the table of written files.
    """
    console = console or Console(stderr=True)
    if ep_profile in ("cuda", "dml") and "fp32" in (precision, draft_precision):
        # stored as what the graph computes in, and said so, not labelled fp32
        console.print(f"note: the {ep_profile} profile computes in float16, so float weights "
                      "are stored as fp16.", highlight=False)
        precision, draft_precision = ("fp16" if p == "fp32" else p
                                      for p in (precision, draft_precision))
    head_precision = draft_precision  # a draft head's own, else the target's
    draft_precision = draft_precision or precision
    for p in (precision, draft_precision):
        if p not in EXPORTED_PRECISIONS:
            known = f"; known precisions are {', '.join(PRECISIONS)}" if p in PRECISIONS else ""
            raise EdgespecError(f"precision '{p}' cannot be exported yet{known}; use one of "
                                f"{', '.join(EXPORTED_PRECISIONS)}.")
    if ep_profile not in PROFILE_DTYPE:
        raise EdgespecError(f"EP profile '{ep_profile}' is not one of "
                            f"{', '.join(PROFILE_DTYPE)}.")
    if ep_profile == "dml" and (refusal := dml_refusal(precision, head_precision)):
        raise EdgespecError(refusal)
    if quant not in QUANTS:
        raise EdgespecError(f"quantization '{quant}' is none of {', '.join(QUANTS)}.")
    if quant == "rot" and ({precision, draft_precision} - {"int8", "fp32"}
                           or ep_profile != "cpu" or draft == "nested"):
        raise EdgespecError("--quant rot (rotated weights, the exact int8 GEMM) exports int8 "
                            "or fp32 for the cpu profile, without --draft nested.")
    if calibration not in (None, "self") and not Path(calibration).is_file():
        raise EdgespecError(f"the calibration text {calibration} is not a file; pass a text "
                            "file, 'self' (the model's own generations) or 'none'.")
    if block_size not in (16, 32, 64, 128, 256):
        raise EdgespecError(f"block size {block_size} is not supported; use 32, 64 or 128.")
    start = time.time()
    nested = draft == "nested"
    head = Path(draft) if draft is not None and is_head_file(draft) else None
    if draft is not None and str(draft).endswith(".npz") and head is None:
        raise EdgespecError(f"the draft head {draft} does not exist; pass a head (.npz, from "
                            "`edgespec train-draft`), a draft model, 'nested' or 'none'.")
    if head is not None and vocab_trim:
        raise EdgespecError("a draft head keeps the tokens it was trained on; leave out "
                            "--vocab-trim.")
    if vocab_trim:
        check_trim_source(trim_source)
    shipped = draft is None  # the shipped head for this target, if one was trained on it
    if draft == "none" or head is not None:
        draft = None
    if nested and ep_profile == "dml":
        raise EdgespecError(NESTED_PROFILES)
    if kv_cache not in KV_CACHES:
        raise EdgespecError(f"KV cache '{kv_cache}' is not one of {', '.join(KV_CACHES)}.")
    if kv_cache == "float16" and ep_profile == "cpu" and not kernels.for_export():
        raise EdgespecError("a float16 KV cache on the cpu profile needs edgespec's kernel "
                            "library (built at install where a C compiler is found; see "
                            "`edgespec doctor`); export with --kv-cache float.")
    if kv_cache == "int8" and ep_profile == "dml":
        raise EdgespecError("an int8 KV cache needs GroupQueryAttention: use the cpu or cuda "
                            "profile.")
    with source_scratch() as scratch, _readers_forgotten():
        target_src = open_source(target, scratch / "target", trust_remote_code,
                                 keep_codes=not requantize)
        draft_src = (open_source(draft, scratch / "draft", trust_remote_code,
                                 keep_codes=not requantize) if draft and not nested else None)
        for src in (target_src, draft_src):
            if src:
                check_tokenizer(src)
        if draft_src:
            check_same_vocab(target_src.tokenizer_dir, draft_src.tokenizer_dir)
        vocab = target_src.config.get("vocab_size")
        if vocab_trim and isinstance(vocab, int) and vocab_trim >= vocab:
            raise EdgespecError(f"--vocab-trim {vocab_trim} keeps every one of the target's "
                                f"{vocab} tokens, so it trims nothing; give a K below {vocab} "
                                "or leave it out.")
        if shipped and not nested:
            head = default_head(target_src)
        quant = chosen_quant(quant, target_src, draft_src, precision, draft_precision,
                             ep_profile, accuracy_level, nested, requantize)
        if quant == "rot" and target_src.kind == "gguf":
            console.print(f"note: --quant rot re-quantizes {target}'s weights into rotated "
                          "int8 (calibrated in float first, which takes minutes), so they do "
                          "not keep their GGUF types.", highlight=False)
        manifest, sizes = _write(target_src, draft_src, out, precision, draft_precision,
                                 block_size, ep_profile, accuracy_level, quant, nested,
                                 vocab_trim, trim_source, trim_prompts, kv_cache, overwrite,
                                 console, head, calibration,
                                 floats=target_src.kind != "gguf" or requantize,
                                 head_precision=head_precision)
    if summary:  # the table of files; an export into the cache only shows its progress
        _summary(console, manifest, sizes, time.time() - start, Path(out))
    return manifest


def _write(target_src: Source, draft_src: Source | None, out: str | Path, precision: str,
           draft_precision: str, block_size: int, ep_profile: str, accuracy_level: int,
           quant: str, nested: bool, vocab_trim: int | None, trim_source: str,
           trim_prompts: list[str] | None, kv_cache: str, overwrite: bool,
           console: Console, head: Path | None = None,
           calibration: str | Path | None = None, floats: bool = True,
           head_precision: str | None = None) -> tuple[Manifest, dict[str, int]]:
    """Build every graph and file of the bundle in a temporary directory, then move it
    into place (write_bundle). `floats`: the target's weights are floats (not a GGUF
    file's kept codes), so the float model is at hand to calibrate and compare with.
    `head_precision`: a draft head's weights (default: the target's precision)."""
    target_dir, eos_ids = target_src.tokenizer_dir, target_src.eos_ids
    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    if ep_profile != "cpu":  # its floats are halves already
        kv_half: bool | None = False
    elif kv_cache == "auto":  # halves where edgespec's kernels run it all (build_decoder)
        kv_half = None
    else:
        kv_half = kv_cache == "float16"
    try:
        with write_bundle(out, overwrite) as (tmp, finish), Progress(  # no bar, no line
                *columns, console=console, transient=True,  # left in a log
                disable=not console.is_terminal) as progress:
            reference = hessians = None
            recipe = floats and uses_recipe(quant, precision, ep_profile, nested)
            if recipe or quant == "rot" and precision != "fp32":
                # the recipe calibrates on the reference itself (statistics outputs)
                reference = _export_model(target_src, "reference", tmp, "fp32", 32, 0, "cpu",
                                          "sym", progress,
                                          stats=recipe and bool(calibration)).entry
            if calibration and recipe:
                hessians = _hessians(tmp, reference, target_src, calibration, progress)
            elif calibration and quant == "rot" and precision == "int8":
                hessians = _rotated_hessians(tmp, target_src, calibration, progress)
            target = _export_model(target_src, "target", tmp, precision, block_size,
                                   accuracy_level, ep_profile, quant, progress,
                                   nested="shared" if nested else None,
                                   hidden_output=head is not None, hessians=hessians,
                                   kv_half=kv_half)
            target_entry = target.entry
            kept = (_vocab_to_keep(tmp, target_dir, target_entry, eos_ids, vocab_trim,
                                   trim_source, trim_prompts, progress)
                    if (draft_src or nested) and vocab_trim else None)
            if draft_src and draft_src.config["vocab_size"] != target_entry.vocab_size:
                # one tokenizer, its embedding padded to other sizes (Qwen2.5 0.5B and 7B):
                # the draft scores the ids both have, and q = 0 for the rest is lossless
                both = min(draft_src.config["vocab_size"], target_entry.vocab_size)
                kept = np.arange(both) if kept is None else kept[kept < both]
            if kept is not None:
                np.save(tmp / "draft_vocab.npy", kept)
            sequences = target_scales = None
            if kv_cache == "int8":  # calibrated on the float graph, then built again
                task = progress.add_task("int8 KV cache: calibrating", total=None)
                sequences, target_scales = calibrate_target(
                    tmp / target_entry.graph, target_entry, Tokenizer.from_dir(target_dir),
                    default_prompts())
                progress.update(task, total=1, completed=1)
            if target_scales is not None or (kept is not None and nested):
                target = _export_model(target_src, "target", tmp, precision, block_size,
                                       accuracy_level, ep_profile, quant, progress,
                                       nested="shared" if nested else None,
                                       draft_head_rows=kept if nested else None,
                                       kv_scales=target_scales,
                                       hidden_output=head is not None,
                                       hessians=hessians, kv_half=kv_half)
                target_entry = target.entry
            quality = None
            if reference:
                quality = _quality(tmp, target_entry, reference, ep_profile, target_dir,
                                   progress)
            draft_entry = None
            if head is not None:
                draft_entry = _export_head(head, target_src, target, tmp,
                                           head_precision or target_entry.precision,
                                           block_size, accuracy_level, ep_profile, progress,
                                           hessians)
            if draft_src:
                draft_entry = _export_model(draft_src, "draft", tmp, draft_precision,
                                            block_size, accuracy_level, ep_profile, quant,
                                            progress, head_rows=kept, kv_half=kv_half).entry
            # the draft meets the target's text; a head's one-layer cache stays float
            if draft_src and sequences is not None:
                draft_entry = _export_model(
                    draft_src, "draft", tmp, draft_precision, block_size, accuracy_level,
                    ep_profile, quant, progress, head_rows=kept,
                    kv_scales=kv_scales(tmp / draft_entry.graph, draft_entry, sequences)).entry
            if nested:  # the same graph and weights, read without the residual
                draft_entry = dataclasses.replace(
                    target_entry, precision="int4", nested="draft",
                    vocab_size=target_entry.vocab_size if kept is None else len(kept))
            tok_files = [f for f in TOKENIZER_FILES if (target_dir / f).is_file()]
            for f in tok_files:
                shutil.copy2(target_dir / f, tmp / f)
            manifest = finish(Manifest(
                target=target_entry, draft=draft_entry, ep_profile=ep_profile,
                tokenizer_files=tok_files, eos_token_ids=eos_ids,
                vocab_map="draft_vocab.npy" if kept is not None or head else None,
                bos_token_id=target_src.bos_id,
                provenance={"edgespec": __version__, "onnx": onnx.__version__,
                            "onnxruntime": onnxruntime.__version__,
                            "python": platform.python_version(),
                            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "target": target_src.name,
                            "draft": draft_src.name if draft_src else (
                                "nested" if nested else head.name if head else None),
                            "source_format": target_src.kind,
                            "nested": "4+4" if nested else None,
                            "accuracy_level": accuracy_level, "quant": quant,
                            "calibration": calibration and (
                                "self" if calibration == "self" else Path(calibration).name),
                            "kv_cache": kv_cache, "quality": quality,
                            "vocab_trim": vocab_trim and {"k": vocab_trim,
                                                          "source": trim_source}}))
            sizes = {name: (tmp / name).stat().st_size for name in manifest.files}
    except OSError as e:  # disk full, permissions, a vanished directory
        full = e.errno == errno.ENOSPC
        raise WriteError(f"could not write the bundle {out} ({e.strerror or e}); nothing "
                         f"was left behind, {'free space or choose' if full else 'choose'} "
                         "another --out.", str(e.strerror or e), full) from None
    return manifest, sizes


def _summary(console: Console, manifest: Manifest, sizes: dict[str, int], seconds: float,
             out: Path) -> None:
    table = Table(title=f"bundle {out} ({seconds:.1f} s)")
    for col in ("file", "size", "model", "precision", "parameters"):
        table.add_column(col, justify="right" if col in ("size", "parameters") else "left")
    models = {"target": manifest.target, "draft": manifest.draft}
    for name, size in sizes.items():
        role = name.split(".")[0]
        entry = models.get(role) if name.endswith(".onnx") else None
        table.add_row(name, f"{size / 2**20:.2f} MiB", role if entry else "",
                      entry.precision if entry else "", f"{entry.params / 1e6:.2f} M" if entry
                      else "")
    console.print(table)
    q = (manifest.provenance or {}).get("quality")
    if q:  # what `edgespec quality BUNDLE --reference SOURCE` reports on its default text
        console.print(f"target vs the float model ({DEFAULT_TEXT.name}, {q['tokens']} tokens "
                      f"scored): KL {q['kl']:.4f}, top-1 {q['top1']:.1%}, perplexity "
                      f"{q['ppl']:.2f} (float {q['reference_ppl']:.2f})", highlight=False)
