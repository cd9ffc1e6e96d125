"""The Engine: a bundle's sessions, its tokenizer, and the decoding loops over them.

Generation is a generator of records (the tokens one target pass committed, and the text
they complete), so streaming is the default and `generate` is just "consume the stream".
Every mode runs the same target session, which is what makes the comparison with the
autoregressive mode meaningful: greedy speculative output must equal it token for token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.bundle import read_manifest
from edgespec.errors import EdgespecError
from edgespec.runtimes import DecoderSession, resolve_providers
from edgespec.spec import SamplingParams, sample, verify_chain, warp
from edgespec.spec.sampling import sample_probs
from edgespec.tokenizer import Tokenizer

MODES = ("ar", "spec", "lookup")


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
    mode: str = "spec"
    draft_tokens: int = 4  # γ, the chain length per target pass

    def validate(self, has_draft: bool) -> None:
        if self.mode not in MODES:
            raise EdgespecError(f"unknown mode '{self.mode}'; choose one of {', '.join(MODES)}.")
        if self.mode == "lookup":
            raise EdgespecError("mode 'lookup' (prompt-lookup drafting) is not implemented "
                                "in this version; use --mode spec or --mode ar.")
        if self.mode == "spec" and not has_draft:
            raise EdgespecError("this bundle has no draft model, so --mode spec cannot run; "
                                "use --mode ar or export with --draft.")
        checks = [(self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
                  (self.temperature >= 0, "temperature must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.top_k >= 0, "top_k must be >= 0"),
                  (1 <= self.draft_tokens <= 64, "draft_tokens must be between 1 and 64")]
        for ok, message in checks:
            if not ok:
                raise EdgespecError(f"{message}.")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class GenerationStats:
    mode: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    device: str = "cpu"

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        decode_passes = self.target_passes - 1  # the prefill pass commits only one token
        return (self.new_tokens - 1) / decode_passes if decode_passes > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        decode_s = self.wall_s - self.prefill_s
        return (self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate,
                 tokens_per_target_pass=self.tokens_per_target_pass,
                 tokens_per_second=self.tokens_per_second,
                 other_s=max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s))
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"  # "stop" (EOS), "length" (max_new_tokens or context)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


@dataclass
class _Record:
    """What one step of a decoding loop committed."""

    tokens: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """A loaded bundle, ready to generate. Not thread-safe: one generation at a time."""

    def __init__(self, path: Path | str | None = None, device: str = "auto",
                 providers: list[str] | None = None, verify: bool = True, threads: int = 0):
        self.path = Path(path) if path is not None else demo_bundle()
        self.manifest = read_manifest(self.path, verify=verify)
        self.tokenizer = Tokenizer.from_dir(self.path)
        providers = providers or resolve_providers(device)
        m = self.manifest
        self.target = DecoderSession(self.path / m.target.graph, m.target, providers, device,
                                     threads=threads)
        self.draft = (DecoderSession(self.path / m.draft.graph, m.draft, providers, device,
                                     max_len=self.target.max_len, threads=threads)
                      if m.draft else None)
        self.eos_ids = set(m.eos_token_ids)
        self._cancel = threading.Event()

    @property
    def context_length(self) -> int:
        return self.target.max_len

    def cancel(self) -> None:
        """Stop the running generation after its current pass (safe from any thread)."""
        self._cancel.set()

    def close(self) -> None:
        self.target = self.draft = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _config(self, config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
        config = config or GenerationConfig(**kwargs)
        config.validate(self.draft is not None)
        return config

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise EdgespecError("the prompt is empty after tokenization; give some text.")
        if len(ids) >= self.context_length:
            raise EdgespecError(f"the prompt is {len(ids)} tokens but the model's context "
                                f"holds {self.context_length}; shorten the prompt.")
        return ids

    def records(self, prompt: str | list[int], config: GenerationConfig | None = None,
                **kwargs: Any) -> Iterator[_Record]:
        """The core generator: one record per target pass."""
        config = self._config(config, kwargs)
        ids = self.encode_prompt(prompt)
        self._cancel.clear()
        stats = GenerationStats(mode=config.mode, prompt_tokens=len(ids),
                                device=self.target.device)
        rng = np.random.default_rng(config.seed)
        detok = self.tokenizer.detokenizer(skip_special_tokens=True)
        start = time.perf_counter()
        budget = min(config.max_new_tokens, self.context_length - len(ids))
        step = self._ar_steps if config.mode == "ar" else self._chain_steps
        produced = 0
        for tokens in step(ids, config, rng, stats):
            finish = None
            for n, tok in enumerate(tokens):
                if tok in self.eos_ids:
                    tokens, finish = tokens[:n], "stop"
                    break
            if produced + len(tokens) >= budget and finish is None:
                tokens, finish = tokens[:budget - produced], "length"
            produced += len(tokens)
            stats.new_tokens = produced
            stats.wall_s = time.perf_counter() - start
            text = "".join(detok.add(t) for t in tokens)
            if finish is None and self._cancel.is_set():
                finish = "cancelled"
            if finish:
                text += detok.flush()
            yield _Record(tokens, text, stats, finish)
            if finish:
                return

    def _prefill(self, ids: list[int], config: GenerationConfig, rng: np.random.Generator,
                 stats: GenerationStats) -> int:
        t0 = time.perf_counter()
        self.target.cache.reset()
        logits = self.target.forward(ids)
        stats.target_passes += 1
        stats.prefill_s = time.perf_counter() - t0
        return sample(logits[-1], config.sampling, rng)

    def _ar_steps(self, ids: list[int], config: GenerationConfig, rng: np.random.Generator,
                  stats: GenerationStats) -> Iterator[list[int]]:
        tok = self._prefill(ids, config, rng, stats)
        while True:
            yield [tok]
            t0 = time.perf_counter()
            logits = self.target.forward([tok])
            stats.verify_s += time.perf_counter() - t0
            stats.target_passes += 1
            tok = sample(logits[-1], config.sampling, rng)

    def _chain_steps(self, ids: list[int], config: GenerationConfig, rng: np.random.Generator,
                     stats: GenerationStats) -> Iterator[list[int]]:
        """Draft γ tokens, verify them in one target pass, keep the accepted prefix.

        Invariant between steps: `tokens` is everything committed; each cache holds a
        prefix of it and the last committed token is always still to be fed.
        """
        draft, target, params = self.draft, self.target, config.sampling
        assert draft is not None
        draft.cache.reset()
        tokens = [*ids, self._prefill(ids, config, rng, stats)]
        yield tokens[-1:]
        while True:
            room = target.max_len - len(tokens)  # positions left for the verify pass
            gamma = min(config.draft_tokens, room)
            t0 = time.perf_counter()
            proposals: list[int] = []
            q_rows = []
            feed = tokens[draft.cache.length:]
            for _ in range(max(gamma, 0)):
                logits = draft.forward(feed)[-1]
                stats.draft_passes += 1
                if params.greedy:
                    tok = int(np.argmax(logits))
                else:
                    q_rows.append(warp(logits, params))
                    tok = sample_probs(q_rows[-1], rng)
                proposals.append(tok)
                feed = [tok]
            t1 = time.perf_counter()
            logits = target.forward(tokens[target.cache.length:] + proposals)
            stats.target_passes += 1
            n, nxt = verify_chain(logits[-(len(proposals) + 1):], proposals,
                                  np.stack(q_rows) if q_rows else None, params, rng)
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            stats.drafted += len(proposals)
            stats.accepted += n
            new = proposals[:n] + [nxt]
            tokens += new
            target.cache.trim(target.cache.length - (len(tokens) - 1))
            draft.cache.trim(max(0, draft.cache.length - (len(tokens) - 1)))
            yield new

    def stream(self, prompt: str | list[int], config: GenerationConfig | None = None,
               **kwargs: Any) -> Iterator[str]:
        """Text chunks as they are decided; each is valid UTF-8 (no split characters)."""
        for record in self.records(prompt, config, **kwargs):
            if record.text:
                yield record.text

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None,
                 **kwargs: Any) -> GenerationResult:
        """Generate a continuation of `prompt` (text, or token ids)."""
        token_ids: list[int] = []
        text: list[str] = []
        record = None
        for record in self.records(prompt, config, **kwargs):
            token_ids += record.tokens
            text.append(record.text)
        assert record is not None
        return GenerationResult("".join(text), token_ids, record.stats,
                                record.finish_reason or "length")


def load(path: Path | str | None = None, providers: list[str] | None = None,
         device: str = "auto", verify: bool = True) -> Engine:
    """Open a bundle (the embedded demo when `path` is None)."""
    return Engine(path, device=device, providers=providers, verify=verify)
