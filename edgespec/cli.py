"""The `edgespec` command line: export, generate, chat, serve, bench, plan, doctor."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from edgespec.errors import EdgespecError
from edgespec.runtimes import pool
from edgespec.runtimes.providers import DEVICES
from edgespec.spec.logprobs import MAX_TOP_LOGPROBS

err = Console(stderr=True, highlight=False, soft_wrap=True)

model_option = click.option(
    "--model", "model",
    help="A bundle, a .gguf file, a Hugging Face checkpoint directory or a Hub id (exported "
         "once into the cache; default: the embedded demo bundle).")


def open_model(model: str | None, runtime: dict, chat_refused: str | None = None,
               default_mode: bool = True) -> Any:
    """The engine for what --model names (see edgespec.model_cache). `chat_refused`: the
    sentence for a model without a chat template, said of a GGUF file before it is
    exported (Gemma 3 270M's export took a minute, and then it was refused).
    `default_mode`: the command decodes in the engine's default mode (no --mode), so a
    default that leaves the bundle's draft idle is worth a note."""
    from edgespec import load
    from edgespec.model_cache import open_cached

    def templated(source: Path) -> None:
        from edgespec.export.source import is_gguf

        if is_gguf(source):
            from edgespec.export.gguf_reader import field, open_reader

            template = field(open_reader(source), "tokenizer.chat_template")
        else:
            from edgespec.tokenizer import Tokenizer

            template = Tokenizer.from_dir(source).chat_template
        if not template:
            raise EdgespecError(chat_refused)

    engine = open_cached(model, lambda bundle: load(bundle, **runtime), err,
                         templated if chat_refused else None)
    if chat_refused and not engine.tokenizer.chat_template:
        raise EdgespecError(chat_refused)
    if default_mode and engine.draft is not None and not engine.exact:
        err.print(f"[yellow]note:[/yellow] this bundle was exported for the "
                  f"{engine.manifest.ep_profile} profile and runs on the CPU here, where only "
                  "--mode ar is exact, so its draft is not used; re-export it with "
                  "--ep-profile cpu to speculate on the CPU.")
    return engine


def _named_path(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    """A path option that names something: an empty one would otherwise be Path("."),
    and be refused as the current directory, which the user never typed."""
    if not value:
        raise click.BadParameter("is empty; name the path to write.")
    return Path(value)


def _memory(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:  # the planner brings onnx (0.4 s): only for a budget to read
        return None
    from edgespec.runtimes.planner import parse_bytes

    try:
        size = parse_bytes(value)
    except EdgespecError as e:
        if param.name == "bandwidth":  # a rate, written like a size per second
            raise click.BadParameter(f"cannot read {value!r} as bytes per second; write "
                                     "e.g. 25GB.") from None
        raise click.BadParameter(str(e)) from None
    if size == 0:
        raise click.BadParameter("must be more than 0.")
    return size


device_option = click.option("--device", type=click.Choice(DEVICES), default="auto",
                             show_default=True, help="Execution provider to run on.")
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
threads_option = click.option("--threads", default=0, show_default=True,
                              type=click.IntRange(0, CORES or 1),
                              help="CPU threads of the pool the sessions share (0: one per "
                                   "core; at most the cores this process may use).")
GPU_MEMORY_HELP = ("GPU memory the model may use, e.g. 6GiB (default: what the GPU reports "
                   "free, less 10%)")
gpu_memory_option = click.option(
    "--gpu-memory", callback=_memory,
    help=f"{GPU_MEMORY_HELP}; a bigger target is offloaded as `edgespec plan` shows.")


def runtime_options(command: Callable) -> Callable:
    """--device, --draft-device, --gpu-memory and --threads, handed to the command as one
    `runtime` dict of load() arguments."""

    @functools.wraps(command)
    def wrapper(*args: Any, device: str, draft_device: str | None, gpu_memory: int | None,
                threads: int, **kwargs: Any) -> Any:
        runtime = dict(device=device, draft_device=draft_device, gpu_memory=gpu_memory,
                       threads=threads)
        return command(*args, runtime=runtime, **kwargs)

    draft_device = click.option("--draft-device", type=click.Choice(DEVICES[1:]),
                                help="Run the draft on another provider than the target.")
    for option in (threads_option, gpu_memory_option, draft_device, device_option):
        wrapper = option(wrapper)
    return wrapper
MODE_IDS = ("ar", "chain", "adaptive", "tree", "lookup", "default")  # edgespec.bench.MODES
mode_option = click.option("--mode", type=click.Choice(["ar", "spec", "lookup"]),
                           help="ar: target alone; spec: draft model speculation (the "
                                "default when the bundle has a draft, else ar); "
                                "lookup: prompt-lookup drafting.")


def report_console() -> Console:
    """Where tables go: a terminal's width, or in a file or pipe wide enough that no
    column is cut (rich takes 80 there, and cut the bench table's names to `summari…`)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _counted(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _stats_line(stats: dict) -> str:
    n = stats["new_tokens"]
    speed = f"{stats['tokens_per_second']:.1f} tok/s, " if n > 1 else ""  # none from one
    passes = _counted(stats["target_passes"], "target pass", "target passes")
    line = (f"{_counted(n, 'token', 'tokens')}, {speed}{passes}, "
            f"{stats['tokens_per_target_pass']:.2f} tokens/pass")
    if stats["mode"] != "ar":
        line += f", acceptance {stats['acceptance_rate']:.0%}"
    return escape(line + f" [{stats['mode']}, {stats['device']}]")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgespec")
def cli() -> None:
    """Lossless speculative decoding for LLMs with ONNX Runtime."""


@cli.command()
@click.argument("target")
@click.option("--draft", help="Draft .gguf file, checkpoint directory or Hub id (same "
                             "tokenizer); a draft head (.npz, from train-draft); 'nested': "
                             "BitNest, the 4-bit base of the target's own codes; 'none'. "
                             "Default: the shipped head trained on this target, if any.")
@click.option("--nest", type=click.Choice(["4+4"]), default="4+4", show_default=True,
              help="With --draft nested: base bits + residual bits.")
@click.option("--out", required=True, type=click.Path(), callback=_named_path,
              help="Bundle directory to create.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "int4", "int2"]),
              default="int8", show_default=True,
              help="Target weight precision (a GGUF file's quantized tensors keep their own "
                   "types unless --requantize).")
@click.option("--draft-precision", type=click.Choice(["fp32", "fp16", "int8", "int4", "int2"]),
              help="Draft weight precision (default: --precision; a draft head's own "
                   "layer follows the target's, int8 beside a GGUF file).")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128"]), default="32",
              show_default=True, help="Quantization block size along the input dimension "
              "(the cuda and dml profiles run 4-bit codes in blocks of 16).")
@click.option("--ep-profile", type=click.Choice(["cpu", "cuda", "dml"]), default="cpu",
              show_default=True, help="Execution provider the graphs are built for.")
@click.option("--accuracy-level", type=click.Choice(["0", "4"]), default="4",
              show_default=True,
              help="Quantized matmuls: 4 = int8 activations (fast on CPU), 0 = fp32.")
@click.option("--quant", type=click.Choice(["auto", "k", "sym", "asym", "rot"]),
              default="auto", show_default=True,
              help="rot: int8 with rotated weights and the exact integer GEMM, whose "
                   "multi-token passes cost least (cpu profile); k: int4/int8 as llama.cpp's "
                   "Q4_K_M/Q8_0 recipe (its types and error search; calibrated: "
                   "importance-weighted, GPTQ codes; --block-size does not apply); sym/asym: "
                   "plain blocks of --block-size, asym with a zero point each (int2 and "
                   "--draft nested always); auto: rot where edgespec's kernels run it "
                   "(int8 float weights on the cpu profile, not Gemma 2/3), else k.")
@click.option("--calibration", default="self", show_default=True,
              help="What --quant k and rot measure each layer's inputs on (importance "
                   "weights, GPTQ): 'self' (the model's own generations), a text file, or "
                   "'none' (round to nearest).")
@click.option("--vocab-trim", type=click.IntRange(min=1),
              help="Keep only the K most frequent tokens in the draft's LM head.")
@click.option("--trim-source", default="target", show_default=True,
              help="Where frequencies come from: 'target' (its own generations) or "
                   "'corpus:PATH' (a text file or a folder).")
@click.option("--kv-cache", type=click.Choice(["auto", "float", "float16", "int8"]),
              default="auto", show_default=True,
              help="float16: KV cache as IEEE halves (half the memory, faster at long "
                   "context; auto picks it where edgespec's kernels run the graph with int8 "
                   "activations, float otherwise); int8: codes with calibrated per-channel "
                   "scales (a quarter of fp32's memory).")
@click.option("--requantize", is_flag=True,
              help="GGUF: dequantize every tensor and quantize it anew to --precision.")
@click.option("--trust-remote-code", is_flag=True, help="Allow downloading model code files.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle at --out.")
def export(target: str, draft: str | None, nest: str, out: Path, precision: str,
           draft_precision: str | None, block_size: str, ep_profile: str, accuracy_level: str,
           quant: str, calibration: str, vocab_trim: int | None, trim_source: str,
           kv_cache: str,
           requantize: bool, trust_remote_code: bool, overwrite: bool) -> None:
    """Export a TARGET (a .gguf file, a Hugging Face checkpoint directory or a Hub id) and
    a draft into a bundle."""
    from edgespec.export import export as run_export
    from edgespec.export.source import is_gguf

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("precision", "quant", "block_size")
             if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT]
    gguf_codes = (is_gguf(Path(target)) and not requantize  # rot and BitNest: recoded
                  and quant != "rot" and draft != "nested")
    if ep_profile == "dml" and "--precision" not in given:
        precision = "fp16"  # not int8: DirectML's MatMulNBits takes no 8-bit codes
    _check_export_options(target, draft, precision, draft_precision, vocab_trim, requantize,
                          ep_profile, quant)
    if is_gguf(Path(target)) and draft == "nested":
        err.print(f"note: --draft nested re-quantizes {target}'s weights into int8 4+4 codes "
                  "(BitNest), so they do not keep their GGUF types and the bundle is about "
                  "twice the file; the default draft keeps them.", highlight=False)
    if gguf_codes:
        said = [f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to its "
                "float tensors only"] if given else []
        if ctx.get_parameter_source("calibration") != click.core.ParameterSource.DEFAULT:
            said.append("--calibration is not used")
        if said:
            err.print(f"note: {target}'s quantized tensors keep their GGUF types; "
                      f"{'; '.join(said)} (add --requantize to quantize every tensor to "
                      f"{precision}).", highlight=False)
    for source in (target, draft):
        if source and out.exists() and Path(source).exists() and \
                Path(source).resolve().is_relative_to(out.resolve()):
            what = f"is the {'folder' if out.is_dir() else 'file'}" if \
                Path(source).resolve() == out.resolve() else f"holds {source}, which"
            raise EdgespecError(f"--out {out} {what} this export reads; choose another "
                                "--out.")
    run_export(target, out, draft=draft, precision=precision,
               draft_precision=draft_precision, block_size=int(block_size),
               ep_profile=ep_profile, accuracy_level=int(accuracy_level),
               quant=quant,  # a GGUF file's codes are kept: the note above, and no check
               calibration=None if calibration == "none" or gguf_codes else calibration,
               vocab_trim=vocab_trim, trim_source=trim_source,
               kv_cache=kv_cache, overwrite=overwrite, requantize=requantize,
               trust_remote_code=trust_remote_code, console=err)


@cli.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--reference", required=True,
              help="What the bundle should follow: a bundle, checkpoint directory or .gguf "
                   "file (exported in fp32 for the purpose).")
@click.option("--text", type=click.Path(path_type=Path),
              help="Text to score (default: Python's fractions.py, held out of training and "
                   "calibration).")
@click.option("--ctx", type=click.IntRange(min=8), default=256, show_default=True,
              help="Tokens per chunk; the second half of each is scored.")
@click.option("--chunks", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def quality(bundle: Path, reference: str, text: Path | None, ctx: int, chunks: int,
            as_json: bool) -> None:
    """KL, top-1 agreement and perplexity of BUNDLE against its reference model, as
    llama-perplexity --kl-divergence reports them."""
    from edgespec.quality import measure, table

    q = measure(bundle, Path(reference), text, ctx, chunks, console=err)
    if as_json:
        click.echo(json.dumps(q.as_dict()))
    else:
        report_console().print(table(q, f"{bundle} vs {reference}"))


@cli.command("train-draft")
@click.argument("target")
@click.option("--out", required=True, type=click.Path(), callback=_named_path,
              help="The draft head file to write (.npz).")
@click.option("--work", type=click.Path(path_type=Path),
              help="Where answers and checkpoints are kept (default: OUT's name + .work); "
                   "an interrupted run resumes from it.")
@click.option("--prompts", type=click.Path(path_type=Path, dir_okay=False),
              help="Prompts the target answers, one per line (default: built-in ones).")
@click.option("--steps", default=600, show_default=True, type=click.IntRange(1))
@click.option("--unroll", default=3, show_default=True, type=click.IntRange(1, 8),
              help="Draft positions trained per chain.")
@click.option("--kept", default=8192, show_default=True, type=click.IntRange(16),
              help="Tokens the head can propose (VocabTrim).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(8))
@click.option("--greedy-only", is_flag=True, help="Learn from greedy answers only.")
@click.option("--text", "texts", multiple=True, type=click.Path(path_type=Path),
              help="A text file, or a directory of them, that the target reads too: "
                   "its states along any text are training data, several times cheaper "
                   "per token than answers (repeatable).")
@click.option("--text-tokens", default=150_000, show_default=True, type=click.IntRange(16),
              help="Tokens of --text to read, in windows drawn at random.")
@click.option("--synthesize", default=0, show_default=True, type=click.IntRange(0),
              help="Conversations the target writes itself, request and answer (a chat "
                   "model; in float, in batches), and then reads.")
@click.option("--tasks", default=0, show_default=True, type=click.IntRange(0),
              help="Task requests the target answers too: complete or explain a "
                   "standard-library function, summarize or answer from documentation "
                   "(Python's own, and --text), none overlapping the benchmark prompts.")
@click.option("--task-chars", default=8000, show_default=True, type=click.IntRange(100),
              help="Leave out task requests longer than this many characters.")
@click.option("--init", type=click.Path(path_type=Path, dir_okay=False),
              help="A trained head for this target (.npz) to start from: its shape, tokens "
                   "(--kept is then its own) and weights, trained further on this run's data "
                   "(your documents, more conversations).")
@click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Peak learning rate (one warm-up-and-decay cycle over --steps).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: the float model answers and reads in batches on the GPU (its states "
                   "stand in for the exported target's) and the head trains there.")
@click.option("--gen-batch", default=64, show_default=True, type=click.IntRange(1),
              help="Conversations the float model writes (and on a GPU reads) at once.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threads", default=0, type=click.IntRange(0), help="PyTorch threads.")
def train_draft(target: str, out: Path, work: Path | None, prompts: Path | None, steps: int,
                unroll: int, kept: int, max_new_tokens: int, greedy_only: bool,
                texts: tuple[Path, ...], text_tokens: int, synthesize: int, tasks: int,
                task_chars: int, init: Path | None,
                lr: float, device: str, gen_batch: int, seed: int, threads: int) -> None:
    """Train an EAGLE draft head for TARGET (a .gguf file or checkpoint directory) from
    the target alone; `edgespec export TARGET --draft OUT` then speculates with it."""

    try:
        import torch

        from edgespec.train.data import read_prompts, read_texts
        from edgespec.train.trainer import TrainOptions
        from edgespec.train.trainer import train_draft as run
    except ImportError as e:
        raise EdgespecError(f"train-draft needs PyTorch and transformers ({e.name} is "
                            "missing); pip install 'edgespec[export]'.") from None
    from edgespec.bundle import source_scratch
    from edgespec.export.draft_head import load_head
    from edgespec.export.source import open_source

    if out.suffix != ".npz":
        raise EdgespecError(f"{out}: a draft head is written as .npz; name it so.")
    if out.is_dir():  # found after the whole training, when the head is moved into place
        raise EdgespecError(f"{out} is a folder; name the head's file with --out.")
    if threads:
        torch.set_num_threads(threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise EdgespecError("--device cuda needs PyTorch with CUDA and a GPU, and this one has "
                            "none; leave --device out to train on the CPU.")
    if init is not None:  # a file that is no head is refused before any work
        kept = len(load_head(init).kept)  # the head's own tokens, as its card will say
    opts = TrainOptions(steps=steps, unroll=unroll, kept=kept, max_new_tokens=max_new_tokens,
                        sampled=not greedy_only, seed=seed, text_tokens=text_tokens,
                        synthesize=synthesize, tasks=tasks, task_chars=task_chars, lr=lr,
                        init=str(init) if init else None,
                        device=device, reader="float" if device == "cuda" else "exported",
                        gen_batch=gen_batch)
    text = read_texts(list(texts)) if texts else None
    work = work or out.with_name(out.stem + ".work")
    try:
        with source_scratch() as scratch:
            source = open_source(target, scratch)
            head = run(source, out, work, read_prompts(prompts) if prompts else None, opts,
                       console=err, texts=text)
    except KeyboardInterrupt:
        if work.is_dir():  # what it made is kept there
            err.print(f"stopped; the same command resumes from what {work} keeps.")
        raise
    err.print(f"wrote {out}: {head.params / 1e6:.2f} M parameters, {len(head.kept)} tokens; "
              f"card in {out.with_suffix('.json')}.")


def _check_export_options(target: str, draft: str | None, precision: str,
                          draft_precision: str | None, vocab_trim: int | None,
                          requantize: bool, ep_profile: str, quant: str) -> None:
    """Options that would be silently ignored in this combination are refused instead,
    before any note about what the export will do."""
    from edgespec.export.pipeline import NESTED_PROFILES, dml_refusal
    from edgespec.export.source import is_gguf

    ctx = click.get_current_context()
    given = ctx.get_parameter_source("trim_source")
    draft_shapers = " and ".join(name for name, value in (("--vocab-trim", vocab_trim), (
        "--draft-precision", draft_precision)) if value)
    dml = dml_refusal(precision, draft_precision) if ep_profile == "dml" else None
    conflicts = [
        (draft == "nested" and ep_profile == "dml", NESTED_PROFILES),
        (bool(dml), dml),
        (ctx.get_parameter_source("nest") != click.core.ParameterSource.DEFAULT
         and draft != "nested",
         "--nest sets the codes of --draft nested, which this export does not make; add "
         "--draft nested or leave --nest out."),
        (vocab_trim and not draft,
         "--vocab-trim trims a draft model's LM head, and no --draft model was given (a "
         "draft head, as the one shipped for a model, keeps the tokens it was trained on); "
         "add --draft or leave --vocab-trim out."),
        (draft == "none" and draft_shapers,
         f"{draft_shapers} shape{'s' if ' and ' not in draft_shapers else ''} the draft, but "
         f"--draft none makes none; leave {'them' if ' and ' in draft_shapers else 'it'} "
         "out."),
        (given != click.core.ParameterSource.DEFAULT and not vocab_trim,
         "--trim-source chooses what --vocab-trim counts; add --vocab-trim K or leave it "
         "out."),
        (draft == "nested" and precision != "int8",
         "--draft nested builds an int8 target (4+4 codes); leave out --precision or give "
         "int8."),
        (draft == "nested" and draft_precision not in (None, "int4"),
         "--draft nested drafts with the 4-bit half of the target's codes; leave out "
         "--draft-precision."),
        (requantize and not is_gguf(Path(target)),
         "--requantize re-quantizes a GGUF file's tensors, and this target is not one; "
         "leave it out."),
    ]
    for conflict, message in conflicts:
        if conflict:
            raise EdgespecError(message)


@cli.command("vocab-trim")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--k", "k", required=True, type=click.IntRange(min=1),
              help="Tokens to keep in the draft's LM head.")
@click.option("--trim-source", default="target", show_default=True,
              help="'target' (its own generations) or 'corpus:PATH'.")
def vocab_trim(bundle: Path, k: int, trim_source: str) -> None:
    """Re-trim an exported BUNDLE's draft head to the K most frequent tokens (in place)."""
    from edgespec.export.vocab_trim import retrim_bundle

    m = retrim_bundle(bundle, k, trim_source)
    err.print(f"{bundle}: the draft now proposes among {m.draft.vocab_size} of "
              f"{m.target.vocab_size} tokens.")


@cli.command()
@click.argument("prompt", required=False)
@model_option
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True,
              type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
              help="0 = off.")
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), help="Seed for sampling.")
@click.option("--stop", multiple=True, help="End the text at this string (repeatable).")
@mode_option
@click.option("--draft-tokens", type=click.IntRange(1, 64),
              help="Tokens drafted per target pass (chains) [default: 1 with a draft head, "
                   "else 4].")
@click.option("--tree-budget", default=0, show_default=True, type=click.IntRange(0, 1024),
              help="Spec mode: verify a draft token tree of this many nodes (0: a chain).")
@click.option("--adaptive/--fixed", default=False, show_default=True,
              help="Tune the chain length per pass (up to --draft-tokens) from measurements; "
                   "with a draft head, choose per pass between copying, the head and a plain "
                   "step.")
@click.option("--stop-rule", type=click.Choice(["none", "confidence", "entropy"]),
              default="none", show_default=True,
              help="End a chain early when the draft is unsure (confidence < 0.4, or SVIP).")
@runtime_options
@click.option("--chat", "as_chat", is_flag=True,
              help="PROMPT is a user message: answer it through the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--logprobs", type=click.IntRange(0, MAX_TOP_LOGPROBS),
              help="With --json: each token's target log-probability and its K best "
                   "alternatives.")
def generate(prompt: str | None, model: str | None, max_new_tokens: int, temperature: float,
             top_p: float, top_k: int, seed: int | None, stop: tuple[str, ...], mode: str,
             draft_tokens: int | None,
             tree_budget: int, adaptive: bool, stop_rule: str, runtime: dict,
             as_chat: bool, as_json: bool, logprobs: int | None) -> None:
    """Continue PROMPT (or stdin) with the model, or answer it (--chat)."""
    from edgespec.engine import GenerationConfig
    from edgespec.tokenizer import NO_TEMPLATE

    if logprobs is not None and not as_json:
        raise EdgespecError("--logprobs goes with --json, which prints them; add --json.")
    if prompt is None:
        if sys.stdin.isatty():
            raise EdgespecError("give a prompt as an argument or on stdin.")
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise EdgespecError(f"stdin is not UTF-8 text (byte {e.start}); give the prompt "
                                "as text.") from None
    engine = open_model(model, runtime, chat_refused=f"{NO_TEMPLATE}; leave out --chat to "
                        "have it continue the prompt." if as_chat else None,
                        default_mode=mode is None)
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, stop=list(stop), mode=mode,
                              draft_tokens=draft_tokens, tree_budget=tree_budget,
                              adaptive=adaptive, stop_rule=stop_rule, logprobs=logprobs)
    config = engine.settings(config)
    # a prompt that cannot run is refused before it is echoed
    ids = engine.encode_prompt(engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
                               if as_chat else prompt)
    if as_json:  # Ctrl-C ends the answer, which is still printed (finish_reason "cancelled")
        previous = signal.signal(signal.SIGINT, lambda *_: engine.cancel())
        try:
            result = engine.generate(ids, config)
        finally:
            signal.signal(signal.SIGINT, previous)
        click.echo(json.dumps(result.to_dict()))
        if result.finish_reason == "cancelled":
            sys.exit(130)
        return
    if not as_chat:
        click.echo(prompt, nl=False)
    record = None
    for record in engine.records(ids, config):
        click.echo(record.text, nl=False)
        sys.stdout.flush()
    click.echo()
    if record is not None:
        err.print(f"[dim]{_stats_line(record.stats.to_dict())}[/dim]")


def _read_line(prompt: str) -> str | None:
    """One line typed after `prompt` (or piped), or None at the end of input.

    A terminal is read through readline where Python has it (not on Windows) and both
    ends are terminals: line editing and history, and no 4095-byte cut (the terminal's own
    line mode silently drops the rest of a longer line, a pasted document's end); Ctrl-D
    on an empty line leaves. Otherwise a terminal hands over one line per read, or what
    Ctrl-D flushed: text without its newline, which means leave too, never "send what is
    typed so far". Piped input's last line counts without its newline. A line that is not
    UTF-8 is skipped with a sentence.
    """
    terminal = sys.stdin.isatty()
    try:
        if terminal and sys.stdout.isatty():
            try:
                import readline  # noqa: F401  (input() then edits the line with it)
            except ImportError:
                pass
            try:
                line = input(prompt)
            except EOFError:
                return None
            # undecodable bytes came as lone surrogates: the line's own bytes tell which
            return line.encode("utf-8", "surrogateescape").decode("utf-8")
        click.echo(prompt, nl=False)
        sys.stdout.flush()
        if terminal:
            data = os.read(sys.stdin.fileno(), 1 << 16)
            return data.decode("utf-8")[:-1] if data.endswith(b"\n") else None
        text = sys.stdin.buffer.readline().decode("utf-8")
    except UnicodeDecodeError as e:
        err.print(f"that line is not UTF-8 text (byte {e.start}), so it was skipped.")
        return ""
    return text.removesuffix("\n") if text else None


CHAT_HELP = ("commands: /help, /reset (new conversation), /stats (last answer's numbers), "
             "/mode ar|spec|lookup, /temp T, /statsline (toggle the line after answers), "
             "/exit or /quit; Ctrl-C stops an answer, Ctrl-D leaves")


@cli.command()
@model_option
@runtime_options
@mode_option
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--no-stats", is_flag=True, help="Do not print a stats line after each answer.")
def chat(model: str | None, runtime: dict, mode: str, temperature: float,
         max_new_tokens: int, no_stats: bool) -> None:
    """Chat in the terminal with the bundle's chat template.

    Each turn re-renders the conversation, and the engine reuses the KV cache of
    everything the previous turns already fed, so only the new text is prefilled.

    \b
    In the chat: /reset starts a new conversation, /stats shows the last answer's
    numbers, /mode ar|spec|lookup and /temp T change how answers are drawn, /statsline
    toggles the line after each answer, /exit or /quit (or Ctrl-D) leaves; Ctrl-C stops
    an answer.
    """
    from edgespec.engine import MODES, GenerationConfig
    from edgespec.tokenizer import NO_TEMPLATE

    engine = open_model(model, runtime, chat_refused=f"{NO_TEMPLATE}, so it cannot chat; have "
                        "it continue a text with edgespec generate PROMPT instead.",
                        default_mode=mode is None)
    mode = mode or engine.default_mode
    history: list[dict[str, str]] = []
    settings = {"mode": mode, "temperature": temperature, "statsline": not no_stats}
    last = None
    err.print(f"[dim]edgespec chat ({mode}, {engine.devices}). {CHAT_HELP}[/dim]")
    while True:
        try:
            line = _read_line(">>> ")
        except KeyboardInterrupt:
            click.echo()
            continue
        if line is None:
            click.echo()
            return
        command, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            history.clear()
            engine.reset()
            last = None
            err.print("[dim]new conversation.[/dim]")
            continue
        if command == "/stats":
            err.print(escape(json.dumps(last, indent=1)) if last else "no answer yet.")
            continue
        if command == "/statsline":
            settings["statsline"] = not settings["statsline"]
            err.print(f"[dim]stats line {'on' if settings['statsline'] else 'off'}.[/dim]")
            continue
        if command == "/mode":
            if arg not in MODES or (arg == "spec" and engine.draft is None):
                err.print(f"modes: {', '.join(MODES)} (spec needs a draft); now "
                          f"{settings['mode']}.")
            else:
                settings["mode"] = arg
                err.print(f"[dim]mode {arg}.[/dim]")
            continue
        if command == "/temp":
            try:
                value = float(arg)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < 0:
                err.print("usage: /temp T, T a number >= 0 (0: greedy), e.g. /temp 0.7")
            else:
                settings["temperature"] = value
                err.print(f"[dim]temperature {value:g}.[/dim]")
            continue
        if command.startswith("/"):
            unknown = "" if command == "/help" else f"unknown command {escape(command)}; "
            err.print(unknown + CHAT_HELP)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        config = GenerationConfig(max_new_tokens=max_new_tokens, mode=settings["mode"],
                                  temperature=settings["temperature"])
        reply, record = [], None
        previous = signal.signal(signal.SIGINT, lambda *_: engine.cancel())
        try:
            ids = engine.tokenizer.encode_chat(history)
            if len(ids) >= engine.context_length and len(history) > 1:
                raise EdgespecError(f"the conversation ({len(ids)} tokens) no longer fits the "
                                    f"model's context of {engine.context_length}")
            for record in engine.records(ids, config):
                reply.append(record.text)
                click.echo(record.text, nl=False)
                sys.stdout.flush()
        except EdgespecError as e:  # e.g. the conversation outgrew the context
            history.pop()
            hint = " (/reset starts over)" if history else ""  # nothing to start over
            err.print(f"[red]error:[/red] {escape(str(e))}{hint}")
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
        click.echo()
        history.append({"role": "assistant", "content": "".join(reply)})
        if record is not None:
            last = record.stats.to_dict()
            if settings["statsline"]:
                err.print(f"[dim]{_stats_line(last)}[/dim]")
            if record.finish_reason == "cancelled":
                err.print("[dim](stopped)[/dim]")
            elif record.finish_reason == "length" and \
                    last["prompt_tokens"] + last["new_tokens"] >= engine.context_length:
                err.print("[dim](the answer reached the end of the model's context; /reset "
                          "starts over)[/dim]")


@cli.command()
@model_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", envvar="EDGESPEC_API_KEY", show_envvar=True,
              help="Require this Bearer token (better from the environment variable: "
                   "command lines are visible to every user in `ps`).")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="Also answer requests whose Host is this name (repeatable; '*': any). "
                   "IP addresses and localhost are always answered.")
@runtime_options
def serve(model: str | None, host: str, port: int, api_key: str | None,
          allowed_hosts: tuple[str, ...], runtime: dict) -> None:
    """Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) and a
    chat page at /."""
    import ipaddress

    from edgespec.http_guard import check_api_key
    from edgespec.server import listen
    from edgespec.server import serve as run_server

    if api_key is None and os.environ.get("EDGESPEC_API_KEY") == "":
        api_key = ""  # set but empty: refused below rather than silently keyless
    check_api_key(api_key)
    sock = listen(host, port)
    source = click.get_current_context().get_parameter_source("api_key")
    if api_key is not None and source == click.core.ParameterSource.COMMANDLINE:
        err.print("[yellow]note:[/yellow] --api-key on the command line is visible to "
                  "other users (ps); set EDGESPEC_API_KEY instead.")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and api_key is None:
        err.print(f"[yellow]warning:[/yellow] {escape(host)} is reachable from other "
                  "machines and no API key is set: anyone who can reach this port can use "
                  "the model; set EDGESPEC_API_KEY.")
    engine = open_model(model, runtime)
    model_id = Path(model).resolve().name if model else "edgespec-demo"  # --model . too
    err.print(f"serving {model_id} on http://{host}:{port}/ (chat page) and /v1 "
              f"({engine.devices})")
    run_server(engine, model_id, sock, api_key, allowed_hosts)


@cli.command()
@model_option
@runtime_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--prompts", "prompt_set", type=click.Choice(["auto", "demo", "real"]),
              default="auto", show_default=True,
              help="demo: Python-code prompts for the demo pair; real: chat, multi-turn, "
                   "code, summarization and RAG prompts for real models (auto: demo for the "
                   "demo bundle, else real).")
@click.option("--category", "categories", multiple=True,
              help="Only this category (repeatable).")
@click.option("--limit", type=click.IntRange(min=1),
              help="Use only the first N prompts of each category.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(list(MODE_IDS)),
              help="Only this mode (repeatable; AR always runs, the ratios need it).")
@click.option("--gamma", "gammas", multiple=True, type=click.IntRange(min=1, max=16),
              help="Also run a chain of this many draft tokens per pass (repeatable).")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=2))
@click.option("--temperature", "temperatures", multiple=True, type=click.FloatRange(min=0),
              help="Repeatable; 0: greedy (outputs checked against AR), > 0: seeded "
                   "sampling [default: 0 and 0.7].")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(min=1),
              help="Run the whole set this many times, interleaved (ratios get a range).")
def bench(model: str | None, runtime: dict, as_json: bool, prompt_set: str,
          categories: tuple[str, ...], limit: int | None, modes: tuple[str, ...],
          gammas: tuple[int, ...], max_new_tokens: int, temperatures: tuple[float, ...],
          rounds: int) -> None:
    """Benchmark every decoding mode the model has on a shipped prompt set, per category,
    greedy and sampled, interleaved in one run."""
    from rich.progress import Progress

    from edgespec.bench import DEFAULT_TEMPERATURES, print_table, run_bench
    from edgespec.bench_sets import load_set, select

    if prompt_set == "auto":
        prompt_set = "demo" if model is None else "real"
    prompts = select(load_set(prompt_set), categories, limit)
    engine = open_model(model, runtime, default_mode=False)  # its modes are named
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("benchmarking", total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)
            if not err.is_terminal:  # no bar to draw (a log, a pipe): a line a prompt
                err.print(f"benchmarking: {done} of {total} prompt runs done", highlight=False)

        report = run_bench(engine, prompts, max_new_tokens,
                           temperatures or DEFAULT_TEMPERATURES, rounds, modes,
                           progress=advance, gammas=gammas)
    report.update(model=model or "demo", prompt_set=prompt_set,
                  threads=runtime["threads"] or CORES)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        print_table(report, report_console())


@cli.command()
@click.argument("bundle", required=False, type=click.Path(path_type=Path))
@click.option("--gpu-memory", callback=_memory, help=f"{GPU_MEMORY_HELP}.")
@click.option("--context", default=8192, show_default=True, type=click.IntRange(min=2),
              help="Tokens of KV cache to reserve.")
@click.option("--bandwidth", callback=_memory,
              help="Host->GPU bytes per second, e.g. 25GB (default: measured on a CUDA "
                   "GPU, else 16GB assumed).")
@threads_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def plan(bundle: Path | None, gpu_memory: int | None, context: int, bandwidth: int | None,
         threads: int, as_json: bool) -> None:
    """Show where BUNDLE's parts would live under a GPU memory budget (BUNDLE: anything
    --model takes, a .gguf file too; default: the demo)."""
    from edgespec.engine import demo_bundle
    from edgespec.model_cache import open_cached
    from edgespec.plan import plan_bundle, plan_dict, print_plan

    result, assumed = open_cached(bundle, lambda path: plan_bundle(
        path or demo_bundle(), gpu_memory, context, bandwidth, threads), err)
    if as_json:
        click.echo(json.dumps(plan_dict(result, assumed), indent=1))
    else:
        print_plan(result, assumed, report_console(), limited=result.context < context)


@cli.command()
def doctor() -> None:
    """Report versions, the execution providers that really run here, and the demo bundle."""
    from edgespec.doctor import report

    report(Console(highlight=False))


def main() -> None:
    """Entry point: user errors become one red sentence and exit code 1, not a traceback.
    The process is edgespec's own, so its sessions share one thread pool (runtimes.pool)."""
    pool.share_threads()
    try:
        code = cli.main(prog_name="edgespec", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except click.exceptions.Abort:
        err.print("aborted.")
        sys.exit(130)
    except click.UsageError as e:  # click's own is three lines: usage, a hint, the error
        where = e.ctx.command_path if e.ctx else "edgespec"
        err.print(f"[red]error:[/red] {escape(e.format_message().rstrip('.'))} "
                  f"(see '{where} --help').")
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except EdgespecError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
