"""Blockwise symmetric quantization of a linear layer's weight for MatMulNBits.

A weight W of shape [N, K] (out, in; the Hugging Face layout) is cut along K into blocks
of `block_size`; each block gets one scale s = max|w| / qmax and codes
q = clamp(round(w / s), -qmax - 1, qmax). MatMulNBits stores codes unsigned with an
implicit zero point of 2**(bits-1) (so no zero-point tensor is needed for symmetric
codes), `8 // bits` codes per byte, lowest bits first, in a [N, K/block, block*bits/8]
array, and scales as [N * K/block].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class QuantizedWeight:
    packed: np.ndarray  # uint8 [N, n_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [N * n_blocks]
    bits: int
    block_size: int
    n: int
    k: int


def _codes(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    pad = (-k) % block_size
    blocks = np.pad(w.astype(np.float32), ((0, 0), (0, pad))).reshape(n, -1, block_size)
    qmax = 2 ** (bits - 1) - 1
    scales = np.abs(blocks).max(axis=-1, keepdims=True) / qmax
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(blocks / scales), -qmax - 1, qmax).astype(np.int16)
    return q, scales[..., 0]


def quantize_blockwise(w: np.ndarray, bits: int = 8, block_size: int = 32) -> QuantizedWeight:
    """Quantize a [N, K] weight; K is zero-padded up to a whole number of blocks."""
    if bits not in (2, 4, 8):
        raise ValueError(f"MatMulNBits supports 2, 4 or 8 bits, not {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, not {block_size}")
    n, k = w.shape
    q, scales = _codes(w, bits, block_size)
    u = (q + 2 ** (bits - 1)).astype(np.uint8)  # implicit zero point 2**(bits-1)
    per_byte = 8 // bits
    u = u.reshape(n, u.shape[1], block_size // per_byte, per_byte)
    packed = np.zeros(u.shape[:-1], dtype=np.uint8)
    for i in range(per_byte):
        packed |= u[..., i] << (i * bits)
    return QuantizedWeight(packed, scales.reshape(-1).astype(np.float32), bits, block_size, n, k)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The [N, K] float32 weight that MatMulNBits computes with (the numpy reference)."""
    per_byte = 8 // qw.bits
    mask = (1 << qw.bits) - 1
    codes = np.stack([(qw.packed >> (i * qw.bits)) & mask for i in range(per_byte)], axis=-1)
    codes = codes.reshape(qw.n, -1, qw.block_size).astype(np.float32) - 2 ** (qw.bits - 1)
    w = codes * qw.scales.reshape(qw.n, -1, 1)
    return w.reshape(qw.n, -1)[:, :qw.k]


def symmetric_zero_points(qw: QuantizedWeight) -> np.ndarray:
    """MatMulNBits' zero-point tensor for symmetric codes: 2**(bits-1) for every block,
    packed like the codes ([N, ceil(n_blocks * bits / 8)] bytes, low bits first)."""
    n_blocks = qw.scales.size // qw.n
    per_byte = 8 // qw.bits
    zp = np.full((qw.n, -(-n_blocks // per_byte) * per_byte), 2 ** (qw.bits - 1), np.uint8)
    zp = zp.reshape(qw.n, -1, per_byte)
    packed = np.zeros(zp.shape[:-1], np.uint8)
    for i in range(per_byte):
        packed |= zp[..., i] << (i * qw.bits)
    return packed.reshape(-1)
