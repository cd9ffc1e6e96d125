"""Counters every generation reports, whatever the mode."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class GenerationStats:
    mode: str
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV was kept from the previous generation
    new_tokens: int = 0
    # tokens the passes decided up to the finish: those handed out, those a stop string
    # cut, and an end-of-sequence token, which ends the text but took a pass to decide
    committed: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    runtime_s: float = 0.0  # inside ONNX Runtime (all sessions); the rest is engine overhead
    transfer_s: float = 0.0  # of runtime_s: streaming offloaded weights to the device
    device: str = "cpu"

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Tokens committed per decoding pass (the prefill pass, which commits one, excluded)."""
        decode_passes = self.target_passes - 1
        return (self.committed - 1) / decode_passes if decode_passes > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed: tokens after the first over the time after prefill."""
        decode_s = self.wall_s - self.prefill_s
        return (self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of the wall time spent outside ONNX Runtime (Python, sampling, masks)."""
        return max(0.0, 1 - self.runtime_s / self.wall_s) if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate,
                 tokens_per_target_pass=self.tokens_per_target_pass,
                 tokens_per_second=self.tokens_per_second,
                 other_s=max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s),
                 overhead_share=self.overhead_share)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}
