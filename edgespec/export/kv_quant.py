"""Static scales for an int8 KV cache, calibrated on what the model itself writes.

ONNX Runtime's GroupQueryAttention stores the cache as int8 codes when given per-channel
scales ([kv_heads, 1, head_dim], fixed in the graph): it quantizes each rotated K and V
row it writes and dequantizes what it reads, in place, at the speed of a float cache
(tools/bench_kv_cache.py, CPU: 0.43 vs 0.51 ms per step at 2048 positions) and a
quarter of its memory. Scales are per channel, not per token, so they come from calibration: the
largest |K| and |V| per channel over prompts and the model's own continuations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.bundle import ModelEntry
from edgespec.runtimes import DecoderSession
from edgespec.spec import GenerationStats, SamplingParams, ar_decode
from edgespec.tokenizer import Tokenizer

CALIBRATION_LEN = 512  # positions per calibration sequence


Scales = list[tuple[np.ndarray, np.ndarray]]


def _session(graph: Path, entry: ModelEntry) -> DecoderSession:
    return DecoderSession(graph, entry, ["CPUExecutionProvider"],
                          max_len=min(entry.max_positions, CALIBRATION_LEN))


def calibrate_target(graph: Path, entry: ModelEntry, tokenizer: Tokenizer,
                     prompts: list[str], new_tokens: int = 48
                     ) -> tuple[list[list[int]], Scales]:
    """The target's scales, and the sequences they came from (each prompt followed by
    the target's greedy continuation: the text it will meet), for the draft's scales.
    One session serves both steps."""
    session = _session(graph, entry)
    sequences = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)[:session.max_len - new_tokens - 1]
        session.cache.reset()
        out: list[int] = []
        steps = ar_decode(session, ids, SamplingParams(0.0), np.random.default_rng(0),
                          GenerationStats("ar"))
        for tokens in steps:
            out += tokens
            if len(out) >= new_tokens:
                break
        steps.close()
        sequences.append(ids + out)
    return sequences, _scales(session, sequences)


def kv_scales(graph: Path, entry: ModelEntry, sequences: list[list[int]]) -> Scales:
    """The scales of another model (the draft) on the target's calibration text."""
    return _scales(_session(graph, entry), sequences)


def _scales(session: DecoderSession, sequences: list[list[int]],
            margin: float = 1.1) -> Scales:
    """Per layer, the (K, V) scales [kv_heads, 1, head_dim] that map the largest value
    seen per channel (times `margin`, for text unlike the calibration) to 127."""
    entry = session.entry
    peak = np.zeros((entry.num_layers, 2, entry.num_kv_heads, entry.head_dim))
    for ids in sequences:
        session.cache.reset()
        ids = ids[:session.max_len]
        session.forward(ids)
        for i, pair in enumerate(session.cache.arrays):
            for j, t in enumerate(pair):
                seen = np.abs(t[0, :, :len(ids)].astype(np.float64)).max(axis=1)
                peak[i, j] = np.maximum(peak[i, j], seen)
    scales = np.maximum(peak * margin, 1e-6) / 127.0
    return [(layer[0][:, None, :], layer[1][:, None, :]) for layer in scales]
