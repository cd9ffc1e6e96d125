"""`edgespec train-draft`: an EAGLE head for a target, from the target alone.

1. The exported target answers the prompts (greedy, and T=0.7 unless told otherwise),
its states recorded along each conversation, and reads the user's text, if any, in random
windows (train.data); 2. the kept vocabulary is the K tokens most frequent in those
conversations and windows (VocabTrim); 3. the head learns, unrolled
over `unroll` draft positions, to predict the target's next state (smooth L1) and its
next-token distribution over the kept tokens (cross-entropy against the target's own,
soft); 4. the head is written with a model card.

With `synthesize`, step 1 also has the target write conversations itself, request and
answer (self_written), and read them. Step 1 is cached in the work directory, the
self-written conversations a batch at a time, and training checkpoints itself there, so
an interrupted run resumes where it stopped (`resume=True`). Everything is seeded.

With `reader="float"` (a GPU: `device`), the float model answers and reads in batches
and its states stand in for the exported target's (FloatTarget), and the head trains on
the device: what takes the CPU hours takes a GPU minutes.

With `init`, step 3 starts from a trained head (its kept tokens, shape and weights)
instead of a fresh one, so new data (the user's documents, more conversations) teaches it
for the price of this run's steps alone.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from edgespec.bundle import sha256
from edgespec.errors import EdgespecError
from edgespec.export.architectures import adapter_for
from edgespec.export.draft_head import DraftHead, HeadConfig, check_fits, fingerprint, load_head
from edgespec.export.graph import as_float
from edgespec.export.source import Source
from edgespec.model_cache import cached_bundle
from edgespec.quant.vocab_trim import kept_tokens
from edgespec.tokenizer import Tokenizer
from edgespec.train import data
from edgespec.train.model import EagleHead
from edgespec.train.tasks import task_requests


@dataclass
class TrainOptions:
    steps: int = 600  # optimizer steps
    unroll: int = 3  # draft positions trained per chain (training-time test)
    batch_tokens: int = 512
    seq_len: int = 256  # conversations are cut into windows of this many tokens
    lr: float = 1e-3
    kept: int = 8192  # VocabTrim: tokens the head can propose
    intermediate_size: int | None = None  # default: twice the width
    max_new_tokens: int = 128
    sampled: bool = True  # also learn from T=0.7 answers (besides greedy ones)
    ce_weight: float = 0.1  # EAGLE's: features carry the signal, the CE aligns the ranking
    ce_rows: int = 128  # positions per step scored over the kept vocabulary (the costly part)
    noise: float = 0.05  # relative uniform noise on the true input states (EAGLE)
    seed: int = 0
    gen_batch: int = 64  # conversations the float model writes at once (synthesize)
    text_tokens: int = 150_000  # most tokens of --text the target reads
    synthesize: int = 0  # conversations the target writes itself (data.self_requests)
    tasks: int = 0  # task requests the target answers too (train.tasks)
    task_chars: int = 8000  # longer task requests are left out
    task_tail: int = 384  # a task conversation trains on its last tokens (the answer)
    init: str | None = None  # a trained head to start from (its shape, tokens, weights)
    device: str = "cpu"  # where the head trains and, with reader "float", the model runs
    reader: str = "exported"  # whose states: "exported" (the bundle's target) or "float"


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()[:16]


# each part of a work directory: the files it is kept in, and what it depends on (None:
# all of it): the target and its data (claim_work's digests), and options
WORK_PARTS = {
    "answers": (("conversations.npz", "answers"), ("target", "prompts"),
                ("max_new_tokens", "sampled", "seed", "reader", "gen_batch")),
    "text": (("text.npz",), ("target", "text"), ("seq_len", "text_tokens", "seed", "reader")),
    "self-written": (("synthesized.npz", "synthesized_requests.json", "synthesized_ids.npz"),
                     ("target",), ("synthesize", "max_new_tokens", "seed", "reader",
                                   "gen_batch")),
    "checkpoint": (("head.pt",), None, None),
}


def claim_work(work: Path, data: dict[str, object], opts: TrainOptions) -> list[str]:
    """Make `work` this run's, or check that what it keeps was made for this run: each
    part (answers, text states, self-written conversations, the checkpoint) depends on
    the target, its data and some of the options, and a part made for others is refused,
    naming what differs, before it is reused (a second model trained to the same --out
    once got the first's head, and a changed --text went unread). `data`: digests of the
    target and of what it reads; the parts' own keys say which of them they depend on.

    A checkpoint made with other options (more --steps, another --lr) is dropped, not
    refused: the answers it was trained on, the costly part, still serve. Returns what
    was dropped, in a sentence each."""
    dropped = []
    record = work / "work.json"
    if record.is_file():
        try:
            made = json.loads(record.read_text())
        except (OSError, ValueError):
            made = None
        if not isinstance(made, dict):
            raise EdgespecError(f"{record} is damaged; delete {work} or pass another --work "
                                "directory.")
    elif work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise EdgespecError(f"{work} is {'a file' if not work.is_dir() else 'not empty'} and "
                            "has no work.json (not a work directory of this train-draft); "
                            "pass another --work.")
    else:
        made = {}
    # the head started from counts by its content (data's "init"), not by where it lies
    options = {k: v for k, v in asdict(opts).items() if k != "init"}
    for part, (files, reads, keys) in WORK_PARTS.items():
        identity = {**{k: data[k] for k in reads or data},
                    **{k: options[k] for k in keys or options}}
        kept = made.get(part)
        if kept is not None and any((work / f).exists() for f in files):
            differ = [k for k in {**kept, **identity} if kept.get(k) != identity.get(k)]
            if differ and part == "checkpoint" and all(k in options for k in differ):
                for f in files:
                    (work / f).unlink(missing_ok=True)
                dropped.append(f"the checkpoint in {work} was made with other options "
                               f"({', '.join(differ)}), so the head trains from the start "
                               "on the data kept there")
            elif differ:
                raise EdgespecError(f"{work} keeps {part} made for another target, data or "
                                    f"options ({', '.join(differ)}); pass the same ones, or "
                                    "another --work directory to start afresh.")
        made[part] = identity
    work.mkdir(parents=True, exist_ok=True)
    _write_json(record, made)
    return dropped


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console)


def _load_joined(path: Path, *keys: str) -> list[list[np.ndarray]]:
    """Per key, the sequences _save_joined wrote end to end into `path`."""
    try:
        with np.load(path, allow_pickle=False) as z:
            cuts = np.cumsum(z["lengths"])[:-1]
            return [np.split(z[key], cuts) for key in keys]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise EdgespecError(f"{path} is damaged ({type(e).__name__}); delete it to make it "
                            "again.") from None


def _save_joined(path: Path, **parts: list[np.ndarray]) -> None:
    """Sequences of every key joined end to end, with their lengths; written whole (to a
    temporary name, then renamed) so an interrupted run never finds half a file."""
    first = next(iter(parts.values()))
    tmp = path.with_suffix(".part.npz")
    np.savez(tmp, lengths=np.array([len(x) for x in first]),
             **{key: np.concatenate(seqs) for key, seqs in parts.items()})
    tmp.replace(path)


def _write_json(path: Path, value: object) -> None:
    """Written whole (to a temporary name, then renamed): a run stopped midway leaves the
    previous file or none, never half of one."""
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(value, ensure_ascii=False, indent=1))
    tmp.replace(path)


def _save_convs(path: Path, convs: list[data.Conversation]) -> None:
    _save_joined(path, tokens=[c.tokens for c in convs], states=[c.states for c in convs])


def _reused(cache: Path, what: str, console: Console | None) -> list[data.Conversation]:
    """The sequences kept in `cache` (said on `console`, if one is given)."""
    tokens, states = _load_joined(cache, "tokens", "states")
    convs = [data.Conversation(t, s) for t, s in zip(tokens, states, strict=True)]
    if console is not None:
        console.print(f"reusing {len(convs)} {what} from {cache}")
    return convs


def _cached(cache: Path, what: str, console: Console,
            make: Callable[[], list[data.Conversation]]) -> list[data.Conversation]:
    """`make()`'s sequences, or those it made on an earlier run (kept in `cache`)."""
    if cache.is_file():
        return _reused(cache, what, console)
    convs = make()
    _save_convs(cache, convs)
    return convs


class ExportedTarget:
    """The target as edgespec exports it, run on the CPU: the states a head is trained on
    are the very ones it will read. It answers a prompt at a time, recording its states
    as it generates, and reads a sequence at a time."""

    def __init__(self, source: Source, console: Console):
        self.source = source
        self.bundle = cached_bundle(source.name, console)
        self.tokenizer = Tokenizer.from_dir(self.bundle)

    def writer(self):
        """The float model that writes conversations (data.self_requests), on the CPU."""
        return data.float_model(self.source.name, self.source.kind)

    def answer(self, prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
               advance: Callable[[int], None]) -> list[data.Conversation]:
        return data.generate(self.bundle, prompts, max_new_tokens, temperature, seed,
                             torch.get_num_threads(), lambda: advance(1))

    def read_windows(self, texts: list[str], window: int, max_tokens: int, seed: int,
                     advance: Callable[[int], None]) -> list[data.Conversation]:
        return data.read_along(self.bundle, texts, window, max_tokens, seed,
                               torch.get_num_threads(), advance)

    def read(self, seqs: list[list[int]], advance: Callable[[int], None]
             ) -> list[data.Conversation]:
        return data.read_sequences(self.bundle, seqs, torch.get_num_threads(), advance)


class FloatTarget:
    """The float model on `device` (a GPU), answering and reading `batch` sequences at a
    time; its states stand in for the exported target's (data.float_states: on 64
    held-out SmolLM2 conversations a head's top-1 was the same on either, 58.9%)."""

    def __init__(self, source: Source, device: str, batch: int):
        self.source, self.device, self.batch = source, device, batch
        self.tokenizer = Tokenizer.from_dir(source.tokenizer_dir)
        self._model = None

    def writer(self):
        if self._model is None:
            self._model = data.float_model(self.source.name, self.source.kind).to(self.device)
        return self._model

    def answer(self, prompts: list[str], max_new_tokens: int, temperature: float, seed: int,
               advance: Callable[[int], None]) -> list[data.Conversation]:
        torch.manual_seed(seed)
        seqs: list[list[int]] = []
        for convs in data.answered(self.writer(), self.tokenizer, self.source.eos_ids, prompts,
                                   max_new_tokens, self.batch, temperature):
            seqs += convs
            advance(len(convs))
        return self.read(seqs, lambda n: None)

    def read_windows(self, texts: list[str], window: int, max_tokens: int, seed: int,
                     advance: Callable[[int], None]) -> list[data.Conversation]:
        return self.read(data.windows_of(self.tokenizer, texts, window, max_tokens, seed),
                         advance)

    def read(self, seqs: list[list[int]], advance: Callable[[int], None]
             ) -> list[data.Conversation]:
        out = []
        for ids, states in zip(seqs, data.float_states(self.writer(), seqs, self.batch),
                               strict=True):
            out.append(data.Conversation(np.array(ids, dtype=np.int64), states))
            advance(len(ids))
        return out


Target = ExportedTarget | FloatTarget


def conversations(target: Target, prompts: list[str], opts: TrainOptions, work: Path,
                  console: Console) -> list[data.Conversation]:
    """The target's answers and states, cached in `work` (conversations.npz). They are
    answered a block of prompts at a time (a GPU's batch, else 32), each block kept in a
    file of its own (answers/), so an interrupted run loses one block at most."""
    final, blocks = work / "conversations.npz", work / "answers"
    if final.is_file():
        return _reused(final, "conversations", console)
    size = getattr(target, "batch", 32)
    convs: list[data.Conversation] = []
    blocks.mkdir(exist_ok=True)
    with _progress(console) as progress:
        for i, temperature in enumerate([0.0, 0.7] if opts.sampled else [0.0]):
            task = progress.add_task(f"target answers (T={temperature})", total=len(prompts))
            for start in range(0, len(prompts), size):
                block = blocks / f"{i}-{start:06d}.npz"
                if block.is_file():
                    made = _reused(block, "", None)
                    progress.advance(task, len(made))
                else:
                    made = target.answer(prompts[start:start + size], opts.max_new_tokens,
                                         temperature, opts.seed + i + 1000 * start,
                                         lambda n, t=task: progress.advance(t, n))
                    _save_convs(block, made)
                convs += made
    _save_convs(final, convs)
    shutil.rmtree(blocks)
    return convs


def tails(convs: list[data.Conversation], prompts: int, tasks: int, keep: int
          ) -> list[data.Conversation]:
    """Each task conversation cut to its last `keep` tokens: a head learns the answer and
    the document's end, not whole documents (conversations come a block per temperature,
    each block the prompts' answers, then the tasks')."""
    block = prompts + tasks
    return [c if i % block < prompts else c.last(keep) for i, c in enumerate(convs)]


def read_text(target: Target, texts: list[str], opts: TrainOptions, work: Path,
              console: Console) -> list[data.Conversation]:
    """The target's states along the user's text, cached in `work` (text.npz)."""
    def read() -> list[data.Conversation]:
        with _progress(console) as progress:
            task = progress.add_task("target reads the text", total=opts.text_tokens)
            read = target.read_windows(texts, opts.seq_len + 1, opts.text_tokens, opts.seed,
                                       lambda n: progress.advance(task, n))
        if not read:
            raise EdgespecError("the --text files hold too little text for a window to "
                                "read (3 tokens at least); give more text or leave --text out.")
        return read

    return _cached(work / "text.npz", "text windows", console, read)


def self_written(source: Source, target: Target, opts: TrainOptions, work: Path,
                 console: Console) -> list[list[int]]:
    """The conversations the target writes itself (data.self_requests, data.answered),
    kept in `work` as they are made, so an interrupted run loses one batch at most: the
    requests (synthesized_requests.json), then the conversations answered so far
    (synthesized_ids.npz), rewritten after every batch."""
    work.mkdir(parents=True, exist_ok=True)
    asked, ids = work / "synthesized_requests.json", work / "synthesized_ids.npz"
    seqs = [t.tolist() for t in _load_joined(ids, "tokens")[0]] if ids.is_file() else []
    if asked.is_file():
        requests = json.loads(asked.read_text())
        if len(requests) != opts.synthesize:
            raise EdgespecError(f"{work} holds {len(requests)} self-written requests, not "
                                f"{opts.synthesize}; pass --synthesize {len(requests)}, or "
                                "another --work directory.")
        if len(seqs) == len(requests):
            return seqs
    model, tokenizer = target.writer(), target.tokenizer
    with _progress(console) as progress:
        if not asked.is_file():
            task = progress.add_task("the target writes requests", total=opts.synthesize)
            requests = data.self_requests(model, tokenizer, source.eos_ids, opts.synthesize,
                                          opts.seed, opts.gen_batch,
                                          lambda k: progress.advance(task, k))
            _write_json(asked, requests)
        task = progress.add_task("the target answers them", total=len(requests),
                                 completed=len(seqs))
        for convs in data.answered(model, tokenizer, source.eos_ids, requests[len(seqs):],
                                   opts.max_new_tokens, opts.gen_batch):
            seqs += convs
            _save_joined(ids, tokens=[np.array(t, np.int64) for t in seqs])
            progress.advance(task, len(convs))
    return seqs


def synthesized(source: Source, target: Target, opts: TrainOptions, work: Path,
                console: Console) -> list[data.Conversation]:
    """Self-written conversations and the target's states along them (read in one pass
    each), cached in `work` (synthesized.npz)."""
    def read() -> list[data.Conversation]:
        seqs = self_written(source, target, opts, work, console)
        with _progress(console) as progress:
            task = progress.add_task("target reads them", total=sum(map(len, seqs)))
            return target.read(seqs, lambda n: progress.advance(task, n))

    return _cached(work / "synthesized.npz", "self-written conversations", console, read)


def windows(convs: list[data.Conversation], seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for c in convs:
        for start in range(0, max(1, len(c.tokens) - 1), seq_len):
            t, s = c.tokens[start:start + seq_len + 1], c.states[start:start + seq_len + 1]
            if len(t) > 2:
                out.append((t, s))
    return out


def batch_of(items: list[tuple[np.ndarray, np.ndarray]], unroll: int, device: str = "cpu"):
    """Pairs (state j, token j+1) with targets state j+1+s for each unroll step s, on
    `device`.

    Each step's tokens and targets are the sequences shifted by one more position, so
    they are slices of one padded copy of the batch (zero where a chain has no next token
    or target state), made on the device: what crosses to a GPU is that copy in the
    states' own precision, not the unrolled float32 targets (for 64 windows of 256 on
    SmolLM2, 19 MB instead of 150)."""
    width = max(len(t) for t, _ in items) - 1
    b, d = len(items), items[0][1].shape[1]
    tokens = np.zeros((b, width + unroll), dtype=np.int64)
    full = np.zeros((b, width + unroll, d), dtype=items[0][1].dtype)
    for i, (t, s) in enumerate(items):
        tokens[i, :len(t)], full[i, :len(t)] = t, s
    tokens = torch.from_numpy(tokens).to(device)
    full = torch.from_numpy(full).to(device).float()
    chains = torch.tensor([len(t) - 1 for t, _ in items], device=device)[:, None]
    j = torch.arange(width, device=device)  # chains j < chains: states with a next token
    mask = j < chains
    valid = torch.stack([j < chains - k for k in range(unroll)], 1)
    ids = torch.stack([tokens[:, 1 + k:1 + k + width] for k in range(unroll)], 1)
    targets = torch.stack([full[:, 1 + k:1 + k + width] for k in range(unroll)], 1)
    zero = torch.zeros((), device=device)
    return (torch.where(valid, ids, 0), torch.where(mask[..., None], full[:, :width], zero),
            torch.where(valid[..., None], targets, zero), valid, mask)


def head_loss(head: EagleHead, batch: tuple[torch.Tensor, ...], opts: TrainOptions
              ) -> tuple[torch.Tensor, list[float]]:
    """EAGLE's loss over a batch (batch_of's tensors, on the head's device): per unroll
    step s, weighted 0.8^s, the predicted state's smooth L1 distance to the target's and
    the cross-entropy of its next-token distribution against the target's over
    `ce_rows` positions; with each step's top-1 agreement on those rows."""
    ids, states, targets, valid, mask = batch
    noisy = states + (torch.rand_like(states) * 2 - 1) * opts.noise * \
        states.pow(2).mean(-1, keepdim=True).sqrt()
    losses, stats = [], []
    for k, predicted in enumerate(head.unrolled(ids, noisy, mask)):
        v = valid[:, k]
        p, target = predicted[v], targets[:, k][v]
        feature = F.smooth_l1_loss(p, target)
        rows = torch.randperm(len(p))[:opts.ce_rows].to(p.device)
        with torch.no_grad():
            soft = torch.softmax(head.logits(target[rows]), -1)
        logp = torch.log_softmax(head.logits(p[rows]), -1)
        ce = -(soft * logp).sum(-1).mean()
        losses.append(0.8 ** k * (feature + opts.ce_weight * ce))
        stats.append(float((logp.argmax(-1) == soft.argmax(-1)).float().mean()))
    return torch.stack(losses).sum(), stats


def starting_head(config: HeadConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                  embed_scale: float | None, start: DraftHead | None) -> EagleHead:
    """A head to train (`lm_head`: the kept rows): `start`'s weights, or a fresh one whose
    fusion begins as the identity on the state half (h' ≈ h), so it first drafts what the
    target's own state says."""
    head = EagleHead(config, embed, lm_head, embed_scale)
    if start is not None:
        head.load_weights(start.weights)
    else:
        with torch.no_grad():
            head.fusion.weight.zero_()
            head.fusion.weight[:, config.hidden_size:] = torch.eye(config.hidden_size)
    return head


def train_draft(source: Source, out: Path, work: Path, prompts: list[str] | None = None,
                opts: TrainOptions | None = None, resume: bool = True,
                console: Console | None = None,
                texts: list[str] | None = None) -> DraftHead:
    """`texts`: what the target reads besides answering (data.read_texts)."""
    console = console or Console(stderr=True)
    opts = opts or TrainOptions()
    torch.manual_seed(opts.seed)
    rng = np.random.default_rng(opts.seed)
    started = time.time()
    adapter = adapter_for(source.load())
    spec = adapter.spec
    embeddings = adapter.embeddings()
    start = load_head(opts.init) if opts.init else None
    if start is not None:  # before any work: a head for another model is refused
        check_fits(start, spec, embeddings, Path(opts.init))
    tokenizer = Tokenizer.from_dir(source.tokenizer_dir)
    if opts.synthesize:  # before the target is exported (a minute) and --work is made
        data.check_chat(tokenizer)
    if prompts:
        data.check_lengths(tokenizer, prompts, opts.max_new_tokens, spec.max_positions)
    prompts = prompts or data.builtin_prompts()
    asked = task_requests(opts.seed, opts.tasks, texts or (), opts.task_chars) \
        if opts.tasks else []
    for dropped in claim_work(work, {
            "target": _digest(fingerprint(embeddings).round(3).tolist()),
            "prompts": _digest(prompts + asked), "text": _digest(texts or []),
            "init": opts.init and sha256(Path(opts.init))[:16]}, opts):
        console.print(f"note: {dropped}.")
    target = (FloatTarget(source, opts.device, opts.gen_batch) if opts.reader == "float"
              else ExportedTarget(source, console))
    convs = conversations(target, prompts + asked, opts, work, console)
    convs = tails(convs, len(prompts), len(asked), opts.task_tail)
    read = read_text(target, texts, opts, work, console) if texts else []
    written = synthesized(source, target, opts, work, console) if opts.synthesize else []
    convs = convs + read + written
    del target  # a float model on a GPU leaves the head its memory
    answers = np.concatenate([c.tokens for c in convs])
    if start is not None:  # its tokens and shape, whatever this data's counts say
        kept, config = start.kept, start.config
    else:
        counts = np.bincount(answers, minlength=spec.vocab_size)
        kept = kept_tokens(counts, min(opts.kept, spec.vocab_size), source.eos_ids)
        config = HeadConfig.for_target(spec, opts.intermediate_size or 2 * spec.hidden_size)
    # a float file's table is a read-only view of it, which torch warns about sharing
    head = starting_head(config, torch.from_numpy(np.require(as_float(embeddings), None, "W")),
                         torch.from_numpy(as_float(adapter.lm_head())[kept]), spec.embed_scale,
                         start).to(opts.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=0.0)
    # warm up over 5% of the steps, at least 2 (OneCycleLR divides by pct_start·steps - 1)
    warmup = 0.3 if opts.steps <= 3 else max(0.05, 2 / opts.steps)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, opts.lr, total_steps=opts.steps,
                                                   pct_start=warmup)
    step, history = 0, []
    checkpoint = work / "head.pt"
    if resume and checkpoint.is_file():
        try:
            saved = torch.load(checkpoint, weights_only=False, map_location=opts.device)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise EdgespecError(f"{checkpoint} cannot be read ({str(e).splitlines()[0]}); "
                                "delete it to train from the start.") from None
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        step, history = saved["step"], saved["history"]
        rng = saved["rng"]
        if "torch_rng" in saved:  # the states' noise, as it would have gone on
            torch.set_rng_state(saved["torch_rng"])
            if saved["cuda_rng"] is not None:
                torch.cuda.set_rng_state_all(saved["cuda_rng"])
        console.print(f"resuming the head's training at step {step} of {opts.steps}")
    items = windows(convs, opts.seq_len)
    per_batch = max(1, opts.batch_tokens // opts.seq_len)
    saved_at = time.monotonic()
    with _progress(console) as progress:
        task = progress.add_task("training the head", total=opts.steps, completed=step)
        while step < opts.steps:
            pick = rng.choice(len(items), min(per_batch, len(items)), replace=False)
            batch = batch_of([items[i] for i in pick], opts.unroll, opts.device)
            loss, stats = head_loss(head, batch, opts)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            history.append([loss.item(), *stats])
            progress.update(task, advance=1, description=(
                f"training the head (loss {np.mean([h[0] for h in history[-20:]]):.3f}, "
                f"top-1 " + "/".join(f"{np.mean([h[1 + k] for h in history[-20:]]):.2f}"
                                     for k in range(opts.unroll)) + ")"))
            # a checkpoint every 100 steps or 30 s: a slow CPU run loses half a minute
            if step % 100 == 0 or step == opts.steps or time.monotonic() - saved_at > 30:
                saved_at = time.monotonic()
                tmp = work / "head.part.pt"
                torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                            "schedule": schedule.state_dict(), "step": step,
                            "history": history, "rng": rng,
                            "torch_rng": torch.get_rng_state(),
                            "cuda_rng": torch.cuda.get_rng_state_all()
                            if opts.device.startswith("cuda") else None}, tmp)
                tmp.replace(checkpoint)
    recent = np.mean(history[-50:], axis=0)
    card = {
        "target": Path(source.name).name, "prompts": len(prompts), "tasks": len(asked),
        "conversations": len(convs) - len(read) - len(written), "tokens": int(len(answers)),
        "self_written": {"conversations": len(written),
                         "tokens": int(sum(len(c.tokens) for c in written))},
        "text": {"files": len(texts or []), "windows": len(read),
                 "tokens": int(sum(len(c.tokens) for c in read))},
        "options": asdict(opts), "seconds": round(time.time() - started, 1),
        "final_loss": round(float(recent[0]), 4),
        "train_top1_by_step": [round(float(x), 4) for x in recent[1:]],
    }
    if start is not None:  # what the head learnt before this run
        card["init"] = {"file": Path(opts.init).name, "card": start.card}
    result = DraftHead(config, {k: v.numpy() for k, v in head.export_weights().items()},
                       kept, fingerprint(embeddings), card)
    half = float(np.finfo(np.float16).max)  # the head is saved in float16
    if not all(np.isfinite(v).all() and np.abs(v).max() <= half for v in result.weights.values()):
        raise EdgespecError(f"the training diverged (loss {recent[0]:.3g}): the head's weights "
                            f"are not finite in float16, so {out} was not written; train again "
                            f"with a lower --lr than {opts.lr:g} and another --work.")
    result.save(out)
    (out.with_suffix(".json")).write_text(json.dumps(card, indent=2) + "\n")
    return result
