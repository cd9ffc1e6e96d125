"""The Engine: a bundle's sessions, its tokenizer, and the decoding loops over them.

Generation is a generator of records (the tokens one target pass committed, and the text
they complete), so streaming is the default and `generate` is just "consume the stream".
Every mode runs the same target session, which is what makes the comparison with the
autoregressive mode meaningful: greedy speculative output must equal it token for token.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field, fields, replace
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgespec.bundle import ModelEntry, read_manifest
from edgespec.errors import EdgespecError
from edgespec.model_cache import open_cached
from edgespec.runtimes import DecoderSession, pool, resolve_providers
from edgespec.runtimes.decoder import SharedKVCache, release_freed_heap
from edgespec.runtimes.providers import PROVIDER, check_providers
from edgespec.spec import (
    GenerationStats,
    HeadDrafter,
    HeadTreeDrafter,
    HybridDrafter,
    LookupDrafter,
    ModelDrafter,
    SamplingParams,
    TreeDrafter,
    ar_decode,
    chain_decode,
    tree_decode,
)
from edgespec.spec.adaptive import STOP_RULES, GammaController, HybridController
from edgespec.spec.drafters import TrimmedModel
from edgespec.spec.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, log_softmax, token_logprob
from edgespec.stops import StopStrings, check_stops
from edgespec.tokenizer import Tokenizer

if TYPE_CHECKING:  # offload reads graphs with onnx: imported only by bundles that need it
    from edgespec.runtimes.planner import Plan
    from edgespec.runtimes.segments import Placement

MODES = ("ar", "spec", "lookup")
OPTIONAL = ("seed", "draft_tokens", "lookup_tokens", "logprobs")  # None: chosen elsewhere
CLOSED = "this engine was closed; load the bundle again."
# On a thread pool of its own (not runtimes.pool.share_threads), a draft this small runs on
# one CPU thread: its pass takes a fraction of a millisecond, a pool only adds hand-offs,
# and its workers slow the target's (demo pair on 2 cores: 1.3-1.9x the tokens/s in every
# mode, AR included, with 1 thread).
SMALL_DRAFT = 20_000_000
DEFAULT_CONTEXT = 8192  # 128k-context models would otherwise reserve gigabytes of KV


def _draft_threads(draft: ModelEntry, threads: int) -> int:
    """One thread for a small draft on its own pool (SMALL_DRAFT); on the shared pool the
    setting is moot: every session runs on the pool the first one sized."""
    return 1 if draft.params < SMALL_DRAFT and not pool.shared() else threads


def demo_bundle() -> Path:
    """The demo bundle shipped inside the package."""
    return Path(str(files("edgespec") / "assets" / "demo"))


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    mode: str | None = None  # None: the best lossless mode the bundle has (Engine.default_mode)
    # γ, the chain length per target pass (the maximum if adaptive); None: the drafter's
    # own (Engine.resolve)
    draft_tokens: int | None = None
    # with a draft head: where the last 2+ tokens occurred before, propose up to this many
    # of the tokens that followed them instead (HybridDrafter); None: 4 with a head, 0
    # otherwise
    lookup_tokens: int | None = None
    # tune γ per pass from measured acceptance and costs; with a head and lookup_tokens,
    # choose each pass's source too (HybridController)
    adaptive: bool = False
    stop_rule: str = "none"  # "confidence" or "entropy": end a chain when the draft is unsure
    stop_threshold: float = 0.4
    stop: list[str] = field(default_factory=list)  # end (and cut) the text at these strings
    tree_budget: int = 0  # > 0: spec mode drafts a token tree of this many nodes instead
    tree_depth: int = 4
    tree_top_k: int = 3
    tree_best_first: bool = False  # SpecExec-style growth, for budgets of hundreds
    tree_lookup: int = 0  # graft this many prompt-lookup tokens as an extra branch
    logprobs: int | None = None  # report each token's target logprob and this many others

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):  # one stop string, not its characters
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)

    def validate(self, has_draft: bool) -> None:
        for name in ("temperature", "top_p", "stop_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise EdgespecError(f"{name} must be a finite number, not {value!r}.")
        for name in ("max_new_tokens", "top_k", "seed", "draft_tokens", "lookup_tokens",
                     "tree_budget", "tree_depth", "tree_top_k", "tree_lookup", "logprobs"):
            value = getattr(self, name)
            whole = not isinstance(value, bool) and isinstance(value, (int, np.integer))
            if not whole and (value is not None or name not in OPTIONAL):
                raise EdgespecError(f"{name} must be a whole number, not {value!r}.")
        for name in ("adaptive", "tree_best_first"):
            if not isinstance(getattr(self, name), bool):
                raise EdgespecError(f"{name} must be True or False, not "
                                    f"{getattr(self, name)!r}.")
        if self.mode is not None and self.mode not in MODES:  # None: Engine.default_mode
            raise EdgespecError(f"unknown mode '{self.mode}'; choose one of {', '.join(MODES)}.")
        if self.mode == "spec" and not has_draft:
            raise EdgespecError("this model has no draft, so --mode spec cannot run; use "
                                "--mode ar or lookup, or export it with --draft (a smaller "
                                "model of the same family, or 'nested').")
        checks = [(self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
                  (self.stop_rule in STOP_RULES,
                   f"stop_rule must be one of {', '.join(STOP_RULES)}"),
                  (self.temperature >= 0, "temperature must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.top_k >= 0, "top_k must be >= 0"),
                  (self.draft_tokens is None or 1 <= self.draft_tokens <= 64,
                   "draft_tokens must be between 1 and 64"),
                  (self.lookup_tokens is None or 0 <= self.lookup_tokens <= 64,
                   "lookup_tokens must be between 0 and 64"),
                  (0 <= self.tree_budget <= 1024, "tree_budget must be between 0 and 1024"),
                  (1 <= self.tree_depth <= 32, "tree_depth must be between 1 and 32"),
                  (1 <= self.tree_top_k <= 32, "tree_top_k must be between 1 and 32"),
                  (0 <= self.tree_lookup <= 64, "tree_lookup must be between 0 and 64"),
                  (0 < self.stop_threshold <= 1,
                   "stop_threshold must be in (0, 1] (the draft's top probability)"),
                  (self.seed is None or self.seed >= 0, "the seed must be >= 0"),
                  (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                   f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}"),
                  (check_stops(self.stop) is None, check_stops(self.stop))]
        for ok, message in checks:
            if not ok:
                raise EdgespecError(f"{message}.")

    def unread(self, head: bool) -> list[str]:
        """The drafting settings given here that this config's mode would not read (mode
        resolved, `head`: the draft is a head): a setting that changes nothing is refused,
        so `--mode ar --adaptive` does not pass for adaptive decoding."""
        if self.mode == "ar":
            reads: set[str] = set()
        elif self.mode == "lookup":
            reads = {"draft_tokens", "adaptive"}
        elif self.tree_budget:
            reads = {"tree_budget", "tree_depth", "tree_top_k", "tree_lookup"}
            reads |= set() if head else {"tree_best_first"}
        else:
            reads = {"draft_tokens", "adaptive", "stop_rule"}
            reads |= {"lookup_tokens"} if head else set()
            reads |= {"stop_threshold"} if self.stop_rule != "none" else set()
        return [name for name, neutral in DRAFT_SETTINGS.items()
                if name not in reads and getattr(self, name) not in neutral]

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


# each drafting setting and the values that leave it off (GenerationConfig.unread)
DRAFT_SETTINGS: dict[str, tuple[Any, ...]] = {
    "draft_tokens": (None,), "lookup_tokens": (None, 0), "adaptive": (False,),
    "stop_rule": ("none",), "stop_threshold": (GenerationConfig.stop_threshold,),
    "tree_budget": (0,), "tree_depth": (GenerationConfig.tree_depth,),
    "tree_top_k": (GenerationConfig.tree_top_k,), "tree_best_first": (False,),
    "tree_lookup": (0,)}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    # "stop" (EOS or a stop string), "length" (max_new_tokens or context), "cancelled"
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] | None = None  # one per token id, with `logprobs=K`

    def to_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob,
                                "top": [[t, lp] for t, lp in e.top]} for e in self.logprobs]
        return out


@dataclass
class _Record:
    """What one step of a decoding loop committed."""

    tokens: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for


class Engine:
    """A loaded bundle, ready to generate. Generations from several threads are
    serialized: they share one KV cache."""

    def __init__(self, path: Path | str | None = None, device: str = "auto",
                 providers: list[str] | None = None, verify: bool = True, threads: int = 0,
                 context: int | None = None, gpu_memory: int | None = None,
                 draft_device: str | None = None,
                 placements: list[Placement] | None = None, allow_inexact: bool = False):
        """`context` caps the tokens a conversation may hold (default: the model's own
        limit, at most DEFAULT_CONTEXT): the KV cache is allocated for it up front.

        On CUDA, a target that does not fit `gpu_memory` (default: what the GPU reports
        free, less 10%) is offloaded as the planner decides (`self.plan`); `placements`
        gives the target's segments explicitly instead. `draft_device` runs the draft on
        another provider than the target.

        A GPU profile's bundle run by the CPU EP (where no GPU answers) is not exact there:
        ONNX Runtime's one-row kernels make a multi-token pass's rows differ from one-token
        steps at the last bits, so a near-tie can go another way. Its default mode is then
        AR, and the others are refused unless `allow_inexact` (for exercising a GPU
        profile's code paths on a CPU)."""
        if context is not None and (isinstance(context, bool) or not isinstance(
                context, (int, np.integer)) or context < 2):
            raise EdgespecError(f"context must be a whole number of at least 2 tokens, not "
                                f"{context!r}.")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise EdgespecError(f"threads must be a whole number >= 0 (0: one per core), not "
                                f"{threads!r}.")
        self.path = Path(path) if path is not None else demo_bundle()
        self.manifest = read_manifest(self.path, verify=verify)
        self.tokenizer = Tokenizer.from_dir(self.path)
        providers = check_providers(providers) if providers is not None \
            else resolve_providers(device)
        m = self.manifest
        max_len = int(context or DEFAULT_CONTEXT)
        target_path = self.path / m.target.graph
        self.plan: Plan | None = None
        if providers[0] != PROVIDER["cuda"] and gpu_memory is not None:
            raise EdgespecError("--gpu-memory plans a CUDA GPU's memory, but this run does "
                                "not use CUDA; add --device cuda or leave it out.")
        if placements is None and providers[0] == PROVIDER["cuda"]:
            placements = self._plan_offload(gpu_memory, max_len, threads)
        if placements:
            from edgespec.runtimes.segments import SegmentedDecoder

            self.target = SegmentedDecoder(target_path, m.target, placements, max_len, threads)
        else:
            self.target = DecoderSession(target_path, m.target, providers, device,
                                         max_len=max_len, threads=threads)
        self._context = self.target.max_len  # still known after close()
        shared = (self.target.session if m.draft and m.draft.graph == m.target.graph
                  and not placements else None)
        if shared and draft_device:
            raise EdgespecError("a nested (BitNest) draft runs inside the target's session; "
                                "--draft-device does not apply to it, leave it out.")
        if self.plan is not None and self.plan.draft_device == "cpu" and draft_device is None:
            draft_device = "cpu"  # the planner found no room for it on the GPU
        draft_providers = resolve_providers(draft_device) if draft_device else providers
        # BitNest: one graph, and one KV store too (the draft reads the target's entries)
        kv = SharedKVCache(self.target.cache) if shared else None
        self.head = m.draft is not None and m.draft.kind == "eagle"
        if self.head and not hasattr(self.target, "features"):
            from edgespec.runtimes.planner import head_needs_whole_target

            raise EdgespecError(head_needs_whole_target())
        self.draft = (DecoderSession(self.path / m.draft.graph, m.draft, draft_providers,
                                     draft_device or device, max_len=self.target.max_len,
                                     threads=_draft_threads(m.draft, threads),
                                     shared=shared, cache=kv, ranked=not self.head)
                      if m.draft else None)
        self._sessions = [s for s in (self.target, self.draft) if s is not None]
        self.exact = m.ep_profile == "cpu" or self.target.device != "cpu"
        self.allow_inexact = allow_inexact
        # what actually runs, as the sessions report it: "cpu", "cuda", "cuda+cpu, draft cpu"
        self.devices = self.target.device
        if self.draft is not None and self.draft.device != self.target.device:
            self.devices += f", draft {self.draft.device}"
        if self.draft is not None and m.vocab_map:
            kept = np.load(self.path / m.vocab_map)
            if kept.shape != (m.draft.vocab_size,) or kept.max() >= m.target.vocab_size:
                raise EdgespecError(f"{self.path / m.vocab_map} does not match the draft's "
                                    "head; re-export the bundle.")
            self.kept = kept
            if not self.head:  # a head maps its rows itself (spec.drafters.HeadDrafter)
                self.draft = TrimmedModel(self.draft, kept, m.target.vocab_size)
        release_freed_heap()
        self.eos_ids = set(m.eos_token_ids)
        self._active = threading.Event()  # the running generation's cancel flag
        self._busy = threading.Lock()  # one generation at a time: they share the KV cache
        self._owner: int | None = None  # the thread whose generation holds _busy
        self._closed = False
        # _owner, _active and _closed change together under it: close() and a generation
        # starting or ending agree on which of them releases the sessions
        self._state = threading.Lock()
        self._cached: list[int] = []  # tokens whose KV the target cache holds, in order

    def _plan_offload(self, gpu_memory: int | None, max_len: int,
                      threads: int) -> list[Placement] | None:
        """Segments for a target too big for the GPU budget; None when it fits (or when
        no budget is known), and then nothing is measured."""
        from edgespec.runtimes.planner import ModelSizes, free_gpu_bytes, make_plan, measure_costs

        budget = gpu_memory if gpu_memory is not None else free_gpu_bytes()
        if budget is None:
            return None
        m = self.manifest
        sizes = ModelSizes.of(self.path / m.target.graph, m.target)
        context = min(max_len, m.target.max_positions)
        draft = ModelSizes.of(self.path / m.draft.graph, m.draft) if m.draft else None
        need = sizes.total + sizes.kv_per_token * context
        if draft is not None and m.draft.graph != m.target.graph:
            need += draft.total + draft.kv_per_token * context
        if need <= budget:
            return None
        costs, _ = measure_costs(self.path / m.target.graph, m.target, gpu=True,
                                 threads=threads)
        self.plan = make_plan(sizes, budget, context, costs, draft)
        return self.plan.placements if self.plan.offload != "none" else None

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def closed(self) -> bool:
        """close() was called: generations still running end cancelled, new ones raise."""
        return self._closed

    def cancel(self) -> None:
        """Stop the running generation after its current pass (safe from any thread)."""
        self._active.set()

    def reset(self) -> None:
        """Forget the previous conversation: the next prompt is prefilled in full."""
        self._cached = []

    def close(self) -> None:
        """Release the ONNX Runtime sessions and their KV buffers, without waiting. An open
        generation (running, or a stream paused in any thread) is cancelled and lets them
        go when it ends: after its current pass, or when its stream is resumed or closed;
        queued ones raise. Waiting instead would hang behind a stream nobody reads."""
        with self._state:
            self._closed = True  # a generation still waiting for the lock will not start
            self._active.set()
            if self._owner is None:  # none open: release them now
                self._release()

    def _release(self) -> None:
        self.target = self.draft = None  # type: ignore[assignment]
        self._sessions = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def default_mode(self) -> str:
        """The mode every surface uses unless told otherwise: speculation with the bundle's
        draft where it has one, else the target alone (the same output either way)."""
        return "spec" if self.draft is not None and self.exact else "ar"

    def resolve(self, config: GenerationConfig) -> GenerationConfig:
        """`config` with what it leaves open filled in: the mode (default_mode) and γ. A
        draft head's fixed chains default to γ = 1: each draft past the first costs a head
        step and a row of the verify pass for a token accepted less often (SmolLM2's
        shipped head, greedy chat and code, with copies: γ = 1 1.29× AR, γ = 2 1.27×,
        γ = 3 1.17×; γ = 2 1.03× γ = 1 over chat, code and multi-turn in a later run; see
        README "Draft heads"); other drafters and adaptive chains to 4.
        A head's chains copy up to 4 tokens where the text repeats (HybridDrafter); adaptive
        ones choose per pass between a copy, head tokens and a plain step
        (HybridController)."""
        mode = self.default_mode if config.mode is None else config.mode
        if mode == "spec" and not config.tree_budget and self.plan is not None \
                and self.plan.tree_budget:
            # an offloaded pass costs about the same for one token or hundreds: verify
            # the large best-first tree the planner sized, deep enough to use it (SpecExec)
            config = replace(config, tree_budget=self.plan.tree_budget, tree_best_first=True,
                             tree_depth=max(config.tree_depth, 16))
        chains = mode == "lookup" or (mode == "spec" and not config.tree_budget)
        head_chains = bool(self.head) and chains and mode == "spec"
        gamma = config.draft_tokens
        if gamma is None and chains:
            gamma = 1 if head_chains and not config.adaptive else 4
        copies = config.lookup_tokens
        if copies is None:
            copies = 4 if head_chains else 0
        return replace(config, mode=mode, draft_tokens=gamma, lookup_tokens=copies)

    def _head_drafter(self, config: GenerationConfig) -> HeadDrafter:
        return HeadDrafter(self.draft, self.target, self.kept, self.manifest.target.vocab_size,
                           config.stop_rule, config.stop_threshold,
                           proposal_scale=self.manifest.draft.proposal_scale)

    def settings(self, config: GenerationConfig) -> GenerationConfig:
        """`config` resolved (Engine.resolve) and checked against this engine: what every
        surface runs. Raises EdgespecError for settings it cannot run losslessly."""
        if self._closed:
            raise EdgespecError(CLOSED)
        config = self.resolve(config)
        config.validate(self.draft is not None)
        unread = config.unread(bool(self.head))
        if "tree_best_first" in unread and self.head and config.tree_budget:
            raise EdgespecError("tree_best_first is for a draft model's trees; this bundle "
                                "drafts with a head, whose trees grow from its chain: leave "
                                "it out.")
        if unread:
            one = len(unread) == 1
            tree = " with a tree" if config.mode == "spec" and config.tree_budget else ""
            raise EdgespecError(
                f"{' and '.join(unread)} {'does' if one else 'do'} nothing in mode "
                f"{config.mode}{tree}; leave {'it' if one else 'them'} out, or choose a mode "
                f"that uses {'it' if one else 'them'}.")
        if config.mode != "ar" and not self.exact and not self.allow_inexact:
            raise EdgespecError(
                f"this bundle was exported for the {self.manifest.ep_profile} profile, and on "
                f"the CPU its multi-token passes are not bitwise one-token steps, so --mode "
                f"{config.mode} could change the output; run it on its GPU, re-export it "
                "with --ep-profile cpu, or use --mode ar.")
        return config

    def _config(self, config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
        if config is not None and not isinstance(config, GenerationConfig):
            raise EdgespecError(f"config must be a GenerationConfig, not "
                                f"{type(config).__name__}; GenerationConfig(**settings) "
                                "makes one, or pass the settings as keywords.")
        if config is not None and kwargs:
            raise EdgespecError("pass a GenerationConfig or keyword settings, not both; "
                                "dataclasses.replace(config, ...) changes a config.")
        if config is None:
            unknown = set(kwargs) - {f.name for f in fields(GenerationConfig)}
            if unknown:
                raise EdgespecError(f"unknown setting {', '.join(sorted(unknown))}; the "
                                    "settings are GenerationConfig's fields.")
            config = GenerationConfig(**kwargs)
        return self.settings(config)

    def encode_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text, or the given ids once checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if prompt else []
        items = (list(prompt) if hasattr(prompt, "__iter__")
                 and not isinstance(prompt, (bytes, bytearray)) else None)
        if items is None or any(isinstance(i, bool) or not isinstance(i, (int, np.integer))
                                for i in items):
            raise EdgespecError("a prompt is text (str) or a list of token ids (ints).")
        ids = [int(i) for i in items]
        vocab = self.manifest.target.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise EdgespecError(f"token ids must be between 0 and {vocab - 1} (this model's "
                                "vocabulary).")
        return ids

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.encode_ids(prompt)
        if not ids:
            raise EdgespecError("the prompt is empty after tokenization; give some text.")
        if len(ids) >= self.context_length:
            raise EdgespecError(f"the prompt is {len(ids)} tokens but the model's context "
                                f"holds {self.context_length}; shorten the prompt.")
        return ids

    def records(self, prompt: str | list[int], config: GenerationConfig | None = None,
                **kwargs: Any) -> Iterator[_Record]:
        """The core generator: one record per target pass.

        Generations from several threads are serialized (they share the KV cache): a
        second one waits until the first finishes or is cancelled.
        """
        return self._serialized(prompt, self._config(config, kwargs), threading.Event())

    def _serialized(self, prompt: str | list[int], config: GenerationConfig,
                    cancel: threading.Event) -> Iterator[_Record]:
        if self._owner == threading.get_ident():  # waiting would wait for itself forever
            raise EdgespecError("this thread has a generation open (a stream not read to "
                                "its end); finish or close it before starting another.")
        with self._busy:
            with self._state:
                if self._closed:  # maybe while this one waited
                    raise EdgespecError(CLOSED)
                self._owner, self._active = threading.get_ident(), cancel
            try:
                if cancel.is_set():  # cancelled while it waited: nothing is run
                    yield _Record([], "", GenerationStats(mode=config.mode,
                                                          device=self.devices),
                                  "cancelled", None)
                    return
                yield from self._records(prompt, config, cancel)
            finally:
                with self._state:
                    self._owner = None
                    if self._closed:  # close() came while this one held the sessions
                        self._release()

    def submit(self, prompt: str | list[int], on_text: Callable[[str], None] | None = None,
               on_done: Callable[[GenerationResult], None] | None = None,
               config: GenerationConfig | None = None,
               on_error: Callable[[BaseException], None] | None = None,
               **kwargs: Any) -> Job:
        """Generate in a worker thread, for GUIs: `on_text` gets each chunk, `on_done` the
        result, `on_error` what the generation raised instead (all called from the worker:
        hand them to your UI thread's queue). Bad settings and prompts raise here, so a
        UI waiting for one of the callbacks hears from one unless submit raised. The
        returned Job can be cancelled and waited for."""
        for name, callback in (("on_text", on_text), ("on_done", on_done),
                               ("on_error", on_error)):
            if callback is not None and not callable(callback):
                hint = "; pass settings as config=" if isinstance(
                    callback, GenerationConfig) else ""
                raise EdgespecError(f"{name} must be a function or None, not "
                                    f"{type(callback).__name__}{hint}.")
        job = Job()
        config = self._config(config, kwargs)
        ids = self.encode_prompt(prompt)

        def work() -> None:
            try:
                job._result = self._collect(self._serialized(ids, config, job._cancel), on_text)
                callback, arg = on_done, job._result
            except BaseException as e:  # the caller sees it through Job.result()
                job._error, callback, arg = e, on_error, e
            try:
                if callback:
                    callback(arg)
            except BaseException as e:  # a failing callback fails its job, not the worker
                job._error = job._error or e
            finally:
                job._finished.set()

        job._thread = threading.Thread(target=work, name="edgespec-generate", daemon=True)
        job._thread.start()
        return job

    def _records(self, prompt: str | list[int], config: GenerationConfig,
                 cancel: threading.Event) -> Iterator[_Record]:
        ids = self.encode_prompt(prompt)
        # a prompt extending the previous conversation reuses its KV cache (chat turns)
        reuse = 0
        for a, b in zip(ids[:-1], self._cached, strict=False):
            if a != b:
                break
            reuse += 1
        self.target.cache.trim(self.target.cache.length - reuse)
        self._cached = []  # unknown until this generation finishes
        stats = GenerationStats(mode=config.mode, prompt_tokens=len(ids), reused_tokens=reuse,
                                device=self.devices)
        rng = np.random.default_rng(config.seed)
        detok = self.tokenizer.detokenizer(skip_special_tokens=True)
        start = time.perf_counter()
        budget = min(config.max_new_tokens, self.context_length - len(ids))
        rows: list[np.ndarray] = []  # log-softmax of the target rows, per step
        on_logits = ((lambda r: rows.append(log_softmax(r)))
                     if config.logprobs is not None else None)
        if config.mode == "ar":
            steps = ar_decode(self.target, ids, config.sampling, rng, stats, on_logits)
        elif config.mode == "spec" and config.tree_budget:
            drafter = (HeadTreeDrafter(self._head_drafter(config), config.tree_top_k,
                                       config.tree_depth, config.tree_lookup) if self.head
                       else TreeDrafter(self.draft, config.tree_top_k, config.tree_depth,
                                        config.tree_best_first, config.tree_lookup))
            steps = tree_decode(self.target, drafter, ids, config.sampling, config.tree_budget,
                                rng, stats, on_logits, limit=budget)
        else:
            vocab = self.manifest.target.vocab_size
            if config.mode == "lookup":
                drafter = LookupDrafter(vocab)
            elif self.head:
                drafter = self._head_drafter(config)
            else:
                drafter = ModelDrafter(self.draft, config.stop_rule, config.stop_threshold)
            if self.head and config.mode == "spec" and config.lookup_tokens:
                controller = (HybridController(config.lookup_tokens, config.draft_tokens)
                              if config.adaptive else None)
                drafter = HybridDrafter(drafter, config.lookup_tokens, controller=controller)
            else:
                controller = GammaController(config.draft_tokens) if config.adaptive else None
            steps = chain_decode(self.target, drafter, ids, config.sampling,
                                 config.draft_tokens, rng, stats, controller, on_logits,
                                 limit=budget)
        stop = StopStrings(config.stop)
        produced: list[int] = []  # every token committed (and so fed, but the last)
        # a token is handed out once its text begins in the text handed out: where a stop
        # string may be starting, its tokens wait with their text, and those wholly in
        # the stop string are dropped with it (token ids and logprobs match the text)
        waiting: list[tuple[int, int, TokenLogprob | None]] = []  # token, text offset, lp
        decoded = emitted = handed = 0  # characters decoded and handed out, tokens
        target, sessions = self.target, self._sessions  # close() may drop the attributes
        runtime0 = sum(m.run_s for m in sessions)
        transfer0 = target.transfer_s
        for step_tokens in steps:
            tokens: list[int] = []
            offsets: list[int] = []
            text, finish = "", None
            for tok in step_tokens:
                stats.committed += 1
                if tok in self.eos_ids:
                    finish = "stop"
                    break
                tokens.append(tok)
                offsets.append(decoded)
                piece = detok.add(tok)
                decoded += len(piece)
                text += stop.feed(piece)
                if stop.hit:
                    finish = "stop"
                    break
                if len(produced) + len(tokens) >= budget:
                    finish = "length"
                    break
            produced += tokens
            logprobs = ([token_logprob(row, tok, config.logprobs)
                         for row, tok in zip(rows.pop(), tokens, strict=False)]
                        if on_logits else [None] * len(tokens))
            waiting += zip(tokens, offsets, logprobs, strict=True)
            if finish is None and cancel.is_set():
                finish = "cancelled"
            if finish:
                text += stop.flush(detok.flush() if not stop.hit else "")
                # every emitted token but the last has surely been fed to the target
                self._cached = ids + produced[:-1]
            emitted += len(text)
            ready = len(waiting) if finish and not stop.hit else sum(
                offset < emitted for _, offset, _ in waiting)
            out, waiting = waiting[:ready], [] if finish else waiting[ready:]
            handed += len(out)
            stats.new_tokens = handed
            stats.wall_s = time.perf_counter() - start
            stats.runtime_s = sum(m.run_s for m in sessions) - runtime0
            stats.transfer_s = target.transfer_s - transfer0
            yield _Record([t for t, _, _ in out], text, stats, finish,
                          [lp for _, _, lp in out] if on_logits else None)
            if finish:
                return

    def stream(self, prompt: str | list[int], config: GenerationConfig | None = None,
               **kwargs: Any) -> Iterator[str]:
        """Text chunks as they are decided; each is valid UTF-8 (no split characters). Bad
        settings raise here, as in records(), not at the first chunk."""
        records = self.records(prompt, config, **kwargs)
        return (record.text for record in records if record.text)

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None,
                 **kwargs: Any) -> GenerationResult:
        """Generate a continuation of `prompt` (text, or token ids)."""
        return self._collect(self.records(prompt, config, **kwargs))

    @staticmethod
    def _collect(records: Iterator[_Record],
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        record = None
        with closing(records):  # a callback that raises still lets the engine go
            for record in records:
                token_ids += record.tokens
                text.append(record.text)
                logprobs += record.logprobs or []
                if on_text and record.text:
                    on_text(record.text)
        assert record is not None
        return GenerationResult("".join(text), token_ids, record.stats,
                                record.finish_reason or "length",
                                logprobs if record.logprobs is not None else None)


class Job:
    """A generation running in a worker thread (see Engine.submit)."""

    def __init__(self):
        self._cancel = threading.Event()
        self._finished = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def cancel(self) -> None:
        """Stop after the current target pass (or right away if it has not started);
        the result then says "cancelled"."""
        self._cancel.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the result; re-raises what the generation raised."""
        if not self._finished.wait(timeout):
            raise TimeoutError("the generation is still running")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def load(path: Path | str | None = None, providers: list[str] | None = None,
         device: str = "auto", verify: bool = True, context: int | None = None,
         threads: int = 0, gpu_memory: int | None = None, draft_device: str | None = None,
         placements: list[Placement] | None = None, allow_inexact: bool = False) -> Engine:
    """Open a bundle, or a .gguf file, checkpoint directory or Hub id as `--model` takes
    them (exported once into the user cache); the embedded demo when `path` is None.
    `threads` sets ONNX Runtime's intra-op threads (0: one per core; 1 is faster on a busy
    machine; one pool for the whole process after runtimes.pool.share_threads()); see
    Engine for offload (`gpu_memory`, `placements`), `draft_device` and `allow_inexact`."""
    return open_cached(path, lambda bundle: Engine(
        bundle, device=device, providers=providers, verify=verify, context=context,
        threads=threads, gpu_memory=gpu_memory, draft_device=draft_device,
        placements=placements, allow_inexact=allow_inexact))
