"""BitNest nested precision: one int8 code per weight, whose high nibble is a 4-bit model.

Per block of a [N, K] weight, with scale s:
- base (the draft): q4 = clamp(round(w / s), -8, 7), so w ≈ q4 · s;
- residual: qr = clamp(round((w - q4 · s) / (s / 16)), lo, 7) with lo = 0 when q4 = -8
  (else -8), which keeps 16 · q4 + qr inside int8;
- the target computes with W8 = (16 · q4 + qr) · s / 16 = q4 · s + qr · s / 16.

So the target is exactly two 4-bit MatMulNBits summed (scales s and s/16), and the draft
is the first of them alone: the draft lives inside the target's weights. The base scale
comes from a clipping search (the clip ratio minimizing the base's squared error per
block), because the draft's quality is the base's quality.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.quant.blockwise import QuantizedWeight, dequantize, pack_rows, unpack_rows

CLIP_RATIOS = np.linspace(1.0, 0.6, 9)


@dataclass
class NestedWeight:
    base: QuantizedWeight  # 4-bit codes q4 + 8, scale s: the draft's weight
    residual: QuantizedWeight  # 4-bit codes qr + 8, scale s / 16

    def w8(self) -> np.ndarray:
        """The target's weight, (16 · q4 + qr) · s / 16, as float32 [N, K]."""
        return dequantize(self.base) + dequantize(self.residual)

    def int8_codes(self) -> np.ndarray:
        """16 · q4 + qr per weight: the single int8 store both models read."""
        q4 = _codes(self.base)
        qr = _codes(self.residual)
        return (16 * q4 + qr).astype(np.int8)

    def as_8bit(self) -> QuantizedWeight:
        """The same W8 as one 8-bit weight: codes 16 · q4 + qr at scale s / 16. What a
        model reading both nibbles keeps (the LM head, read whole by draft and target
        alike): one plane and one set of block scales instead of two, as much memory as
        the W8 target's own head, and one matmul instead of two."""
        base, residual = (unpack_rows(q.packed, 4).astype(np.int16) - 8
                          for q in (self.base, self.residual))
        codes = (16 * base + residual + 128).astype(np.uint8)
        r = self.residual
        return QuantizedWeight(pack_rows(codes, 8), r.scales,
                               np.full(r.zero_points.shape, 128, np.uint8), 8, r.block_size,
                               r.n, r.k)


def _codes(qw: QuantizedWeight) -> np.ndarray:
    return unpack_rows(qw.packed, 4).reshape(qw.n, -1).astype(np.int16)[:, :qw.k] - 8


def nest(w: np.ndarray, block_size: int = 32, clip_search: bool = True) -> NestedWeight:
    """Nested 4+4 quantization of a [N, K] weight (K zero-padded to whole blocks)."""
    n, k = w.shape
    blocks = np.pad(w.astype(np.float32), ((0, 0), (0, (-k) % block_size)))
    blocks = blocks.reshape(n, -1, block_size)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    ratios = CLIP_RATIOS if clip_search else CLIP_RATIOS[:1]
    best_err, scale = None, None
    for ratio in ratios:
        s = np.where(amax == 0, 1.0, amax * ratio / 7.0)
        err = ((np.clip(np.rint(blocks / s), -8, 7) * s - blocks) ** 2).sum(-1, keepdims=True)
        if best_err is None:
            best_err, scale = err, s
        else:
            better = err < best_err
            best_err, scale = np.where(better, err, best_err), np.where(better, s, scale)
    q4 = np.clip(np.rint(blocks / scale), -8, 7)
    lo = np.where(q4 == -8, 0, -8)
    qr = np.clip(np.rint((blocks - q4 * scale) / (scale / 16)), lo, 7)

    def pack(codes: np.ndarray, s: np.ndarray) -> QuantizedWeight:
        zero = np.full(s.shape[:2], 8, dtype=np.uint8)
        return QuantizedWeight(pack_rows((codes + 8).astype(np.uint8), 4),
                               s.reshape(-1).astype(np.float32), zero, 4, block_size, n, k)

    return NestedWeight(pack(q4, scale), pack(qr, scale / 16))
