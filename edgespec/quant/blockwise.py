"""Blockwise integer quantization of a linear layer's weight for MatMulNBits.

A weight W of shape [N, K] (out, in; the Hugging Face layout) is cut along K into blocks
of `block_size`; each block gets one scale s and one zero point z, and every weight the
unsigned code u = clamp(round(w / s) + z, 0, 2**bits - 1), so that w ≈ (u - z) · s.

- symmetric: s = max|w| / (2**(bits-1) - 1), z = 2**(bits-1), which is MatMulNBits'
  implicit zero point, so no zero-point tensor is stored (except where an EP insists).
- asymmetric: s = (max - min) / (2**bits - 1), z = round(-min / s): the whole code range
  covers [min, max], worth about one bit at 2-4 bits when blocks are lopsided.

MatMulNBits packs `8 // bits` codes per byte, lowest bits first, as [N, K/block,
block*bits/8]; scales as [N * K/block]; zero points packed the same way per row,
[N * ceil(K/block * bits / 8)].

Imported weights (GGUF) may also carry a float minimum per block, w = (u - z) · s + m,
which MatMulNBits cannot hold: the graph adds m times the block sums of the activations.
They may also say how their scales and minimums are *stored* (`stored`): as float16
values, or float16 super-block values times small integers, as GGUF keeps them; the graph
then stores those and rebuilds the float32 arrays at session load, so a bundle is no
bigger than the file it came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

# gguf-py's IQ4_NL.kvalues + 128: the 8-bit codes GGUF's IQ4 indices stand for (the
# codebook edgespec's kernel knows, blockq_iq4)
IQ4_CODES = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                       113]) + 128).astype(np.uint8)


@dataclass
class QuantizedWeight:
    packed: np.ndarray  # uint8 [N, n_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [N * n_blocks]
    zero_points: np.ndarray  # uint8 [N, n_blocks], one unpacked zero point per block
    bits: int
    block_size: int
    n: int
    k: int
    symmetric: bool = True  # zero point 2**(bits-1) everywhere: MatMulNBits' implicit one
    mins: np.ndarray | None = None  # float32 [N * n_blocks], added to every weight of a block
    # how `scales`/`mins` are stored: (float16 [N, G, 1],) or (float16 [N, G, 1], int [N, G, P])
    # whose float32 product, flattened, is the source's value (G * P = n_blocks); "centre":
    # (zero point per block, or one for all,) with mins = product + centre · scales;
    # "codes": (4-bit low parts, packed high parts) of 8-bit codes holding 5/6-bit values
    stored: dict[str, tuple[np.ndarray, ...]] | None = None
    # uint8 [16]: 4-bit codes are indices, the code of a weight is codebook[index] (GGUF's
    # IQ4 grid), so w = (codebook[u] - z) · s; MatMulNBits takes them widened (`widened`)
    codebook: np.ndarray | None = None

    def codes(self) -> np.ndarray:
        """The codes [N, n_blocks * block_size], one byte each, a codebook's values."""
        codes = unpack_rows(self.packed, self.bits).reshape(self.n, -1)
        return codes if self.codebook is None else self.codebook[codes]

    def widened(self) -> QuantizedWeight:
        """A codebook's weights as plain 8-bit codes (MatMulNBits has no codebook)."""
        if self.codebook is None:
            return self
        nb = self.packed.shape[1]
        stored = {k: v for k, v in (self.stored or {}).items() if k != "codes"}
        return dataclasses.replace(
            self, packed=self.codes().reshape(self.n, nb, -1), bits=8, codebook=None,
            symmetric=bool(np.all(self.zero_points == 128)), stored=stored or None)

    def packed_zero_points(self) -> np.ndarray:
        """The zero points as MatMulNBits' optional input reads them."""
        return pack_rows(self.zero_points, self.bits).reshape(-1)

    def rows(self, index: np.ndarray) -> QuantizedWeight:
        """The same encoding for a subset of output rows (a trimmed LM head)."""
        nb = self.packed.shape[1]
        per_row = {key: tuple(part if part.ndim == 0 else part.reshape(
            self.n, *((-1,) if key != "codes" else part.shape[1:]))[index] for part in parts)
                   for key, parts in (self.stored or {}).items()}
        flat = (np.asarray(index)[:, None] * nb + np.arange(nb)).reshape(-1)
        return dataclasses.replace(
            self, packed=self.packed[index], scales=self.scales[flat],
            zero_points=self.zero_points[index], n=len(index),
            mins=None if self.mins is None else self.mins[flat], stored=per_row or None)


def split_blocks(q: QuantizedWeight, block: int) -> QuantizedWeight:
    """The same weights in blocks of `block` (a divisor of q.block_size): every scale,
    minimum and zero point serves the sub-blocks of its block. Stored factors get a factor
    of ones that repeats them at load, so nothing is stored twice."""
    r = q.block_size // block
    n, nb = q.packed.shape[:2]
    keep = -(-q.k // block)  # MatMulNBits reads ceil(K / block) blocks a row
    if keep < nb * r:  # K zero-padded to q.block_size: the sub-blocks wholly past K go

        def cut(per_block: np.ndarray) -> np.ndarray:
            return np.repeat(per_block.reshape(n, nb), r, axis=1)[:, :keep].reshape(-1)

        return QuantizedWeight(
            packed=q.packed.reshape(n, nb * r, -1)[:, :keep], scales=cut(q.scales),
            zero_points=np.repeat(q.zero_points, r, axis=1)[:, :keep], bits=q.bits,
            block_size=block, n=n, k=q.k, symmetric=q.symmetric,
            mins=None if q.mins is None else cut(q.mins))

    def repeated(parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        ones = np.ones((1,) * parts[0].ndim + (r,), np.uint8)
        return (*(p[..., None] for p in parts), ones)

    stored = {kind: repeated(parts) for kind, parts in (q.stored or {}).items()
              if kind in ("scales", "mins")}
    stored.setdefault("scales", repeated((q.scales.reshape(n, nb, 1),)))
    if q.mins is not None:
        stored.setdefault("mins", repeated((q.mins.reshape(n, nb, 1),)))
    if q.stored and "centre" in q.stored:
        (centre,) = q.stored["centre"]
        stored["centre"] = (centre if centre.ndim == 0 else np.repeat(centre, r),)
    return QuantizedWeight(
        packed=q.packed.reshape(n, nb * r, -1), scales=np.repeat(q.scales, r),
        zero_points=np.repeat(q.zero_points, r, axis=1), bits=q.bits, block_size=block,
        n=n, k=q.k, symmetric=q.symmetric,
        mins=None if q.mins is None else np.repeat(q.mins, r), stored=stored)


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes along the last axis, `8 // bits` per byte, low bits first."""
    per_byte = 8 // bits
    pad = (-codes.shape[-1]) % per_byte
    codes = np.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)], constant_values=0)
    codes = codes.reshape(*codes.shape[:-1], -1, per_byte).astype(np.uint8)
    packed = np.zeros(codes.shape[:-1], dtype=np.uint8)
    for i in range(per_byte):
        packed |= codes[..., i] << (i * bits)
    return packed


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(8 // bits)]
    return np.stack(parts, axis=-1).reshape(*packed.shape[:-1], -1)


def quantize_blockwise(w: np.ndarray, bits: int = 8, block_size: int = 32,
                       symmetric: bool = True) -> QuantizedWeight:
    """Quantize a [N, K] weight; K is zero-padded up to a whole number of blocks."""
    if bits not in (2, 4, 8):
        raise ValueError(f"MatMulNBits supports 2, 4 or 8 bits, not {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, not {block_size}")
    n, k = w.shape
    blocks = np.pad(w.astype(np.float32), ((0, 0), (0, (-k) % block_size)))
    blocks = blocks.reshape(n, -1, block_size)
    top = 2 ** bits - 1
    if symmetric:
        scales = np.abs(blocks).max(axis=-1) / (2 ** (bits - 1) - 1)
        zero = np.full(scales.shape, 2 ** (bits - 1), dtype=np.int32)
    else:
        lo = np.minimum(blocks.min(axis=-1), 0.0)  # keep 0 exactly representable
        hi = np.maximum(blocks.max(axis=-1), 0.0)
        scales = (hi - lo) / top
        zero = np.clip(np.rint(-lo / np.where(scales == 0, 1.0, scales)), 0, top).astype(
            np.int32)
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(blocks / scales[..., None]) + zero[..., None], 0, top)
    return QuantizedWeight(pack_rows(codes.astype(np.uint8), bits),
                           scales.reshape(-1).astype(np.float32), zero.astype(np.uint8), bits,
                           block_size, n, k, symmetric)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The [N, K] float32 weight that MatMulNBits computes with (the numpy reference)."""
    codes = qw.codes().reshape(qw.n, -1, qw.block_size)
    w = (codes.astype(np.float32) - qw.zero_points[..., None]) * qw.scales.reshape(qw.n, -1, 1)
    if qw.mins is not None:
        w = w + qw.mins.reshape(qw.n, -1, 1)
    return w.reshape(qw.n, -1)[:, :qw.k]
