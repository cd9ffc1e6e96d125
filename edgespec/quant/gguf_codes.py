"""GGUF quantized tensors -> MatMulNBits encodings with the very same effective weights.

One function per GGUF block layout (as in gguf-py's `quants.py`, which is the reference:
`gguf.quants.dequantize` must give bitwise the weights these encodings describe). Each
takes the tensor's raw blocks as gguf-py maps them, uint8 [N, row_bytes] (rows are output
features), and returns a `QuantizedWeight`: codes u, scales s, zero points z and, for
the types with a minimum, a float m per block, so that w = (u - z) · s (+ m).

- 4-bit values stay 4-bit; 5- and 6-bit values become 8-bit codes (MatMulNBits has no
  5/6-bit kernel); K-quants' sub-blocks (32, or 16 for Q2_K, Q3_K and Q6_K) are the
  MatMulNBits blocks. 2- and 3-bit values are held as 4-bit codes.
- IQ4_NL/IQ4_XS pick each weight from a table of 16 integers (IQ4_NL's `kvalues`), not a
  step of a linear grid: their 4-bit indices stay, with that table + 128 as the codebook of
  8-bit codes (zero point 128).
- Scales and minimums keep GGUF's storage (float16, or a float16 per super-block times a
  small integer per sub-block) in `stored`, so the graph can hold them at GGUF's size.

Types not listed are refused: IQ1-IQ3 pick groups of weights from lattice codebooks with
signs, TQ* are ternary, Q8_K is llama.cpp's activation format.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edgespec.quant.blockwise import IQ4_CODES, QuantizedWeight, pack_rows


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """A float16 field of every block, [N, nb, 1]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 32-value nibble layout: value j is the low nibble of byte j, value j + 16
    the high nibble (of the 16 bytes at the last axis)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of a little-endian bit field (the last axis, bytes), for j < count."""
    bits = (qh[..., :, None] >> np.arange(8, dtype=np.uint8)) & 1
    return bits.reshape(*qh.shape[:-1], -1)[..., :count]


def _product(parts: tuple) -> np.ndarray:
    out = parts[0].astype(np.float32)
    for p in parts[1:]:
        out = out * p.astype(np.float32)
    return out.reshape(-1)


def _weight(codes: np.ndarray, bits: int, block: int, zero: int, scale_parts: tuple,
            min_parts: tuple | None = None, levels: int = 16,
            high_bits: int = 0, codebook: np.ndarray | None = None) -> QuantizedWeight:
    """Codes [N, n_blocks, block] and scale/min factors ([N, G, 1] float16, optionally
    times [N, G, P] integers) -> the MatMulNBits weight.

    Types with a minimum (w = s·u + m, codes u in [0, levels)) are re-centred: zero point
    c = levels / 2 and minimum m' = m + c·s, so w = s·(u - c) + m' — the same weights, but
    MatMulNBits' int8 activations then err on s·(u - c), not on the all-positive s·u the
    separately added minimum cannot cancel (SmolLM2 Q4_1, KL to fp32 activations: 0.0168
    uncentred, 0.0038 centred). A block keeps c = 0 where m + c·s would round in float32,
    so the effective weights stay bitwise gguf-py's.
    5- and 6-bit values (8-bit codes) are stored as 4-bit low parts and `high_bits`-bit
    high parts, as GGUF packs them, and widened to bytes at session load.
    """
    n, nb = codes.shape[:2]
    scales = _product(scale_parts)
    stored: dict[str, tuple] = {"scales": scale_parts}
    if high_bits:
        stored["codes"] = (pack_rows(codes & 0x0F, 4), pack_rows(codes >> 4, high_bits))
    zeros, mins = np.full(n * nb, zero, np.uint8), None
    if min_parts is not None:
        base, c = _product(min_parts), levels // 2
        mins = (base + np.float32(c) * scales).astype(np.float32)
        exact = mins.astype(np.float64) == base.astype(np.float64) + c * scales.astype(
            np.float64)
        mins = np.where(exact, mins, base)
        zeros = np.where(exact, c, 0).astype(np.uint8)
        centre = (np.array(c, np.uint8),) if exact.all() else (zeros,)
        stored.update(mins=min_parts, centre=centre)
    return QuantizedWeight(
        packed=pack_rows(codes.astype(np.uint8), bits), scales=scales,
        zero_points=zeros.reshape(n, nb), bits=bits, block_size=block, n=n, k=nb * block,
        symmetric=codebook is None and bool(np.all(zeros == 2 ** (bits - 1))), mins=mins,
        stored=stored, codebook=codebook)


def q8_0(blocks: np.ndarray) -> QuantizedWeight:  # d f16, int8 q[32]; w = d·q
    codes = np.ascontiguousarray(blocks[..., 2:]) ^ np.uint8(0x80)  # q + 128
    return _weight(codes, 8, 32, 128, (_f16(blocks, 0),))


def q4_0(blocks: np.ndarray) -> QuantizedWeight:  # d, qs[16]; w = d·(q - 8)
    return _weight(_nibbles(blocks[..., 2:]), 4, 32, 8, (_f16(blocks, 0),))


def q4_1(blocks: np.ndarray) -> QuantizedWeight:  # d, m, qs[16]; w = d·q + m
    return _weight(_nibbles(blocks[..., 4:]), 4, 32, 0, (_f16(blocks, 0),), (_f16(blocks, 2),))


def q5_0(blocks: np.ndarray) -> QuantizedWeight:  # d, qh[4], qs[16]; w = d·(q - 16)
    codes = _nibbles(blocks[..., 6:]) | (_high_bits(blocks[..., 2:6], 32) << 4)
    return _weight(codes, 8, 32, 16, (_f16(blocks, 0),), high_bits=1)


def q5_1(blocks: np.ndarray) -> QuantizedWeight:  # d, m, qh[4], qs[16]; w = d·q + m
    codes = _nibbles(blocks[..., 8:]) | (_high_bits(blocks[..., 4:8], 32) << 4)
    return _weight(codes, 8, 32, 0, (_f16(blocks, 0),), (_f16(blocks, 2),), levels=32,
                   high_bits=1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of a Q4_K/Q5_K super-block (12 bytes)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quants' 4-bit layout: 32-byte chunk c holds sub-block 2c in its low nibbles and
    2c + 1 in its high ones -> [N, G, 8, 32]."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.stack([chunks[..., 0, :] & 0x0F, chunks[..., 0, :] >> 4], axis=-2).reshape(
        *qs.shape[:-1], 8, 32)


def _k_weight(blocks: np.ndarray, codes: np.ndarray, bits: int, levels: int,
              high_bits: int = 0) -> QuantizedWeight:
    """Q4_K/Q5_K: w = (d·sc)·q - dmin·mn per 32-value sub-block."""
    n, g = blocks.shape[:2]
    sc, mn = _k_scales(blocks[..., 4:16])
    neg_dmin = -_f16(blocks, 2)  # -(dmin·mn) == (-dmin)·mn exactly
    return _weight(codes.reshape(n, g * 8, 32), bits, 32, 0, (_f16(blocks, 0), sc),
                   (neg_dmin, mn), levels, high_bits)


def q4_k(blocks: np.ndarray) -> QuantizedWeight:  # d, dmin, scales[12], qs[128]
    return _k_weight(blocks, _k_low_nibbles(blocks[..., 16:]), 4, 16)


def q5_k(blocks: np.ndarray) -> QuantizedWeight:  # d, dmin, scales[12], qh[32], qs[128]
    qh = blocks[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
    return _k_weight(blocks, _k_low_nibbles(blocks[..., 48:]) | (high << 4), 8, 32, 1)


def q6_k(blocks: np.ndarray) -> QuantizedWeight:  # ql[128], qh[64], int8 sc[16], d
    n, g = blocks.shape[:2]
    ql = blocks[..., :128].reshape(n, g, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & 0x0F).reshape(n, g, 8, 32)
    qh = blocks[..., 128:192].reshape(n, g, 2, 1, 32) >> np.array([0, 2, 4, 6],
                                                                   np.uint8)[:, None]
    qh = (qh & 0x03).reshape(n, g, 8, 32)
    codes = (ql | (qh << 4)).reshape(n, g * 16, 16)  # q + 32
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
    return _weight(codes, 8, 16, 32, (_f16(blocks, 208), sc), high_bits=2)


def _k_16(values: np.ndarray) -> np.ndarray:
    """K-quants' 2-bit planes: each 32-byte chunk holds four 32-value rows, 2 bits each,
    low bits first -> the super-block's 16 sub-blocks of 16 values, [N, G, 16, 16]."""
    n, g = values.shape[:2]
    planes = values.reshape(n, g, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    return (planes & 0x03).reshape(n, g, 16, 16)


def q2_k(blocks: np.ndarray) -> QuantizedWeight:  # scales[16] (sc | m << 4), qs[64], d, dmin
    """w = d·sc·q - dmin·m per sub-block of 16, q in 0..3."""
    n, g = blocks.shape[:2]
    packed = blocks[..., :16]
    return _weight(_k_16(blocks[..., 16:80]).reshape(n, g * 16, 16), 4, 16, 0,
                   (_f16(blocks, 80), packed & 0x0F), (-_f16(blocks, 82), packed >> 4), levels=4)


def q3_k(blocks: np.ndarray) -> QuantizedWeight:  # hmask[32], qs[64], scales[12], d
    """w = d·(sc - 32)·q, q in -4..3: 2 low bits in qs, and -4 where hmask's bit is 0."""
    n, g = blocks.shape[:2]
    high = (blocks[..., None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
    codes = _k_16(blocks[..., 32:96]) | (high.reshape(n, g, 16, 16) << 2)  # q + 4
    low, top = blocks[..., 96:104], blocks[..., 104:108]
    sc = np.concatenate([low & 0x0F, low >> 4], axis=-1) | (np.concatenate(
        [top >> s for s in (0, 2, 4, 6)], axis=-1) & 0x03) << 4
    return _weight(codes.reshape(n, g * 16, 16), 4, 16, 4,
                   (_f16(blocks, 108), sc.astype(np.int8) - np.int8(32)))


def iq4_nl(blocks: np.ndarray) -> QuantizedWeight:  # d, qs[16]; w = d·kvalues[q]
    return _weight(_nibbles(blocks[..., 2:]), 4, 32, 128, (_f16(blocks, 0),),
                   codebook=IQ4_CODES)


def iq4_xs(blocks: np.ndarray) -> QuantizedWeight:  # d, scales_h u16, scales_l[4], qs[128]
    n, g = blocks.shape[:2]
    low = blocks[..., 4:8]
    high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [N, G, 1]
    ls = np.concatenate([low[..., :, None] & 0x0F, low[..., :, None] >> 4], axis=-1).reshape(
        n, g, 8) | ((high >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03).astype(np.uint8) << 4
    codes = _nibbles(blocks[..., 8:].reshape(n, g, 8, 16))
    return _weight(codes.reshape(n, g * 8, 32), 4, 32, 128,
                   (_f16(blocks, 0), ls.astype(np.int8) - np.int8(32)), codebook=IQ4_CODES)


ENCODINGS: dict[GGMLQuantizationType, Callable[[np.ndarray], QuantizedWeight]] = {
    GGMLQuantizationType.Q8_0: q8_0,
    GGMLQuantizationType.Q4_0: q4_0,
    GGMLQuantizationType.Q4_1: q4_1,
    GGMLQuantizationType.Q5_0: q5_0,
    GGMLQuantizationType.Q5_1: q5_1,
    GGMLQuantizationType.Q4_K: q4_k,
    GGMLQuantizationType.Q5_K: q5_k,
    GGMLQuantizationType.Q6_K: q6_k,
    GGMLQuantizationType.Q2_K: q2_k,
    GGMLQuantizationType.Q3_K: q3_k,
    GGMLQuantizationType.IQ4_NL: iq4_nl,
    GGMLQuantizationType.IQ4_XS: iq4_xs,
}


def encode(data: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """Raw GGUF rows uint8 [N, row_bytes] of a supported type -> its exact encoding."""
    values, size = GGML_QUANT_SIZES[qtype]
    n = data.shape[0]
    return ENCODINGS[qtype](np.asarray(data).reshape(n, -1, size))
