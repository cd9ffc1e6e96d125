"""Float weights -> GGUF blocks (Q4_K, Q6_K, Q5_0, Q8_0), with llama.cpp's error searches.

A numpy port of ggml-quants.c's quantizers (llama.cpp 0c1e570), vectorized over blocks:
each block's scale (and minimum) is the least-squares fit that minimizes the weighted
squared error over a sweep of candidate scales, not max|w| — the search that makes
Q4_K_M as faithful as it is. With an importance vector per input column (the mean
squared activation, llama.cpp's imatrix, see edgespec.quant.calibrate) the error is
weighted by how much each column matters to the layer's output.

Each quantizer fits its blocks' scales and returns them as a `Grid`: the values every
weight may take, its own round-to-nearest codes, and the packing into GGUF's bytes. With
an input Hessian (XᵀX from calibration) `quantize` keeps the grid but lets GPTQ choose
the codes (quant.gptq): the rounding errors of the columns already quantized are
compensated in the columns still to come, so the layer's output, not each weight, is
what the codes get close to.

The result is the tensor's raw GGUF bytes [N, row_bytes]: gguf_codes turns them into
the exact MatMulNBits encoding the import path uses, and `gguf.quants.dequantize` reads
them too (the tests' oracle). Float arithmetic follows ggml's order where it matters
(rounding to nearest even, float16 super-block scales), but is not promised bitwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, quants

QK_K = 256
EPS = 1e-15  # ggml's GROUP_MAX_EPS
F32 = np.float32


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float values [..] -> their float16 bytes [.., 2]."""
    return np.ascontiguousarray(x.astype(np.float16)[..., None]).view(np.uint8)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(F32)


@dataclasses.dataclass
class Grid:
    """A weight's fitted blocks: element (n, k) may be scale·q + offset for an integer q
    in [lo, hi]; `codes` is the format's own choice of q, and `pack` writes any codes on
    the grid as the format's GGUF rows."""

    scale: np.ndarray  # [N, K] float32
    offset: np.ndarray | None  # [N, K] float32, None for symmetric formats
    lo: int
    hi: int
    codes: np.ndarray  # [N, K]
    pack: Callable[[np.ndarray], np.ndarray]


def _per_weight(block_values: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Per-block values [..., blocks] spread over their block's weights, as [N, K]."""
    per_block = shape[0] * shape[1] // block_values.size
    return np.repeat(block_values.reshape(-1), per_block).reshape(shape).astype(F32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, F32), where=b != 0)


def make_qx(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric codes l in [-nmax, nmax) for blocks x [B, n] under weights w: the scale
    is the weighted least-squares fit, best over 19 candidate grids (make_qx_quants,
    rmse_type 1). Returns (scale [B], codes + nmax [B, n] uint8)."""
    at = np.abs(x).argmax(axis=1)
    peak = np.take_along_axis(x, at[:, None], 1)[:, 0]
    alive = np.abs(peak) >= EPS
    peak = np.where(alive, peak, 1).astype(F32)

    def trial(step: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        iscale = (-(nmax + F32(0.1) * F32(step)) / peak).astype(F32)
        q = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1).astype(F32)
        return q, (w * x * q).sum(1, dtype=F32), (w * q * q).sum(1, dtype=F32)

    best_q, sumlx, suml2 = trial(0)
    scale = _div(sumlx, suml2)
    best = scale * sumlx
    for step in (s for s in range(-9, 10) if s):
        q, lx, l2 = trial(step)
        better = (l2 > 0) & (lx * lx > best * l2)
        best_q = np.where(better[:, None], q, best_q)
        scale = np.where(better, _div(lx, l2), scale)
        best = np.where(better, scale * lx, best)
    scale = np.where(alive, scale, 0).astype(F32)
    codes = np.where(alive[:, None], best_q + nmax, 0)
    return scale, codes.astype(np.uint8)


def make_qkx(x: np.ndarray, nmax: int, w: np.ndarray, rmin: float, rdelta: float,
             nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric codes in [0, nmax] for blocks x [B, n]: w ≈ scale · l - the_min, the
    (scale, min) pair fitted by weighted least squares over `nstep` + 1 candidate grids
    (make_qkx2/3_quants). Returns (scale [B], the_min [B] >= 0)."""
    lo = np.minimum(x.min(axis=1), 0).astype(F32)
    hi = x.max(axis=1)
    alive = hi > lo
    span = np.where(alive, hi - lo, 1).astype(F32)
    sum_w = w.sum(1, dtype=F32)
    sum_x = (w * x).sum(1, dtype=F32)
    iscale = F32(nmax) / span
    scale = (1 / iscale).astype(F32)
    q = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    best = (w * (scale[:, None] * q + lo[:, None] - x) ** 2).sum(1, dtype=F32)
    best_min = lo
    for step in range(nstep + 1):
        iscale = ((F32(rmin) + F32(rdelta) * F32(step) + nmax) / span).astype(F32)
        q = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax).astype(F32)
        sl, sl2, sxl = ((w * q).sum(1, dtype=F32), (w * q * q).sum(1, dtype=F32),
                        (w * q * x).sum(1, dtype=F32))
        det = sum_w * sl2 - sl * sl
        this_scale = _div(sum_w * sxl - sum_x * sl, det)
        this_min = _div(sl2 * sum_x - sl * sxl, det)
        positive = this_min > 0
        this_scale = np.where(positive, _div(sxl, sl2), this_scale)
        this_min = np.where(positive, 0, this_min).astype(F32)
        err = (w * (this_scale[:, None] * q + this_min[:, None] - x) ** 2).sum(1, dtype=F32)
        better = (det > 0) & (err < best)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        best_min = np.where(better, this_min, best_min)
    return np.where(alive, scale, 0).astype(F32), (-np.where(alive, best_min, lo)).astype(F32)


def make_qp(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative values x [B, n] (a super-block's scales or minimums) as a float scale
    times integers in [0, nmax], weighted least squares (make_qp_quants)."""
    peak = x.max(axis=1)
    alive = peak >= EPS
    peak = np.where(alive, peak, 1).astype(F32)

    def mse(iscale: np.ndarray) -> np.ndarray:
        q = np.minimum(np.rint(iscale[:, None] * x), nmax)
        return (w * (x - (1 / iscale)[:, None] * q) ** 2).sum(1, dtype=F32)

    iscale = (F32(nmax) / peak).astype(F32)
    best = mse(iscale)
    for step in (s for s in range(-4, 5) if s):
        trial = ((F32(0.1) * F32(step) + nmax) / peak).astype(F32)
        err = mse(trial)
        iscale = np.where(err < best, trial, iscale)
        best = np.minimum(err, best)
    q = np.minimum(np.rint(iscale[:, None] * x), nmax).astype(F32)
    sumlx, suml2 = (w * x * q).sum(1, dtype=F32), (w * q * q).sum(1, dtype=F32)
    for _ in range(5):  # move single values while the fit improves
        changed = np.zeros(len(x), bool)
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], q[:, i]
            slx, sl2 = sumlx - wi * xi * li, suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = np.minimum(np.rint(xi * _div(sl2, slx)), nmax).astype(F32)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = ok & (new != li) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            q[:, i] = np.where(take, new, li)
            sumlx, suml2 = np.where(take, slx2, sumlx), np.where(take, sl22, suml2)
            changed |= take
        if not changed.any():
            break
    return np.where(alive, _div(sumlx, suml2), 0).astype(F32), q.astype(np.uint8)


def _importance(rows: np.ndarray, importance: np.ndarray | None) -> np.ndarray | None:
    return None if importance is None else np.broadcast_to(
        importance.astype(F32), rows.shape)


def q4_k(w: np.ndarray, importance: np.ndarray | None = None) -> Grid:
    """[N, K] (K a multiple of 256) -> Q4_K rows: 8 sub-blocks of 32 per super-block,
    w = d·sc·q - dmin·m with 6-bit sc, m (quantize_row_q4_K_ref / _impl)."""
    n, k = w.shape
    x = w.astype(F32).reshape(-1, QK_K)
    qw = _importance(w, importance)
    sub = x.reshape(-1, 32)
    if qw is None:
        av = np.sqrt((sub * sub).sum(1, dtype=F32) / 32)
        weights = av[:, None] + np.abs(sub)
        scales, mins = make_qkx(sub, 15, weights, -1.0, 0.1, 20)
        scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
        top_s, top_m = scales.max(1), mins.max(1)
        ls = np.minimum(63, np.rint(_div(F32(63), top_s)[:, None] * scales))
        lm = np.minimum(63, np.rint(_div(F32(63), top_m)[:, None] * mins))
        d, dmin = top_s / 63, top_m / 63
    else:
        sigma2 = 2 * (x * x).sum(1, dtype=F32) / QK_K
        weights = qw.reshape(-1, QK_K) * np.sqrt(sigma2[:, None] + x * x)
        weights = weights.reshape(-1, 32)
        scales, mins = make_qkx(sub, 15, weights, -0.9, 0.05, 36)
        sw = weights.sum(1, dtype=F32).reshape(-1, 8)
        d, ls = make_qp(scales.reshape(-1, 8), 63, sw)
        dmin, lm = make_qp(mins.reshape(-1, 8), 63, sw)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    eff_d = _f16(d)[:, None] * ls
    eff_m = _f16(dmin)[:, None] * lm
    q = np.clip(np.rint(_div(x.reshape(-1, 8, 32) + eff_m[..., None], eff_d[..., None])), 0,
                15)
    packed_scales = np.zeros((len(x), 12), np.uint8)
    packed_scales[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed_scales[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed_scales[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)

    def pack(codes: np.ndarray) -> np.ndarray:
        pairs = codes.astype(np.uint8).reshape(-1, 4, 2, 32)
        qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
        block = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed_scales, qs], axis=1)
        return block.reshape(n, -1)

    return Grid(_per_weight(eff_d, w.shape), -_per_weight(eff_m, w.shape), 0, 15,
                q.reshape(n, k), pack)


def q6_k(w: np.ndarray, importance: np.ndarray | None = None) -> Grid:
    """[N, K] (K a multiple of 256) -> Q6_K rows: 16 sub-blocks of 16, w = d·sc·(q - 32)
    with int8 sc (quantize_row_q6_K_ref / _impl)."""
    n, k = w.shape
    x = w.astype(F32).reshape(-1, QK_K)
    sub = x.reshape(-1, 16)
    qw = _importance(w, importance)
    weights = sub * sub if qw is None else qw.reshape(-1, 16)
    scales, _ = make_qx(sub, 32, weights)
    scales = scales.reshape(-1, 16)
    at = np.abs(scales).argmax(1)
    top = np.take_along_axis(scales, at[:, None], 1)[:, 0]
    alive = np.abs(top) >= EPS
    iscale = np.where(alive, _div(F32(-128), top), 0).astype(F32)
    d = np.where(alive, _div(F32(1), iscale), 0)
    sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
    eff = _f16(d)[:, None] * sc
    q = np.clip(np.rint(_div(x.reshape(-1, 16, 16), eff[..., None])), -32, 31)

    def pack(codes: np.ndarray) -> np.ndarray:
        q = (codes.reshape(-1, 16, 16) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
        ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                             (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)
        ql = ql.reshape(-1, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
        block = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
        return block.reshape(n, -1)

    return Grid(_per_weight(eff, w.shape), None, -32, 31, q.reshape(n, k), pack)


def _reference(w: np.ndarray, qtype: GGMLQuantizationType, nmax: int) -> Grid:
    """gguf-py's reference quantizer (max|w| per block of 32, symmetric) as a grid."""
    n, k = w.shape
    rows = quants.quantize(w.astype(F32), qtype)
    d = _f16(rows.reshape(-1, rows.shape[1] * 32 // k)[:, :2].copy().view(np.float16))
    back = quants.dequantize(rows, qtype).reshape(n, k)
    codes = np.rint(_div(back, _per_weight(d, w.shape))).astype(np.int16)
    encode = {GGMLQuantizationType.Q5_0: _q5_0_rows, GGMLQuantizationType.Q8_0: _q8_0_rows}
    return Grid(_per_weight(d, w.shape), None, -nmax, nmax - 1, codes,
                lambda c: encode[qtype](d[:, 0], c, n))


def _q5_0_rows(d: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    q = (codes.reshape(-1, 32) + 16).astype(np.uint8)
    qs = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    high = (q >> 4).astype(np.uint32)
    qh = (high << np.arange(32, dtype=np.uint32)).sum(1, dtype=np.uint32)
    block = np.concatenate([_f16_bytes(d), qh[:, None].view(np.uint8), qs], axis=1)
    return block.reshape(n, -1)


def _q8_0_rows(d: np.ndarray, codes: np.ndarray, n: int) -> np.ndarray:
    q = codes.reshape(-1, 32).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=1).reshape(n, -1)


def _searched(w: np.ndarray, importance: np.ndarray, nmax: int,
              rows: Callable[[np.ndarray, np.ndarray, int], np.ndarray]) -> Grid:
    """Symmetric blocks of 32, w = d·q with q in [-nmax, nmax), d the weighted search's."""
    n, k = w.shape
    x = w.astype(F32)
    sigma2 = (x * x).sum(1, dtype=F32, keepdims=True) / k
    weights = (_importance(w, importance) * np.sqrt(sigma2 + x * x)).reshape(-1, 32)
    d, q = make_qx(x.reshape(-1, 32), nmax, weights)
    return Grid(_per_weight(_f16(d), w.shape), None, -nmax, nmax - 1,
                (q.astype(np.int16) - nmax).reshape(n, k), lambda c: rows(d, c, n))


def q5_0(w: np.ndarray, importance: np.ndarray | None = None) -> Grid:
    """[N, K] (K a multiple of 32) -> Q5_0 rows, w = d·(q - 16): max|w| without an
    importance vector (gguf-py's reference), the weighted search with one."""
    if importance is None:
        return _reference(w, GGMLQuantizationType.Q5_0, 16)
    return _searched(w, importance, 16, _q5_0_rows)


def q8_0(w: np.ndarray, importance: np.ndarray | None = None) -> Grid:
    """[N, K] -> Q8_0 rows, w = d·q: max|w| / 127 without an importance vector (gguf-py's
    reference, as llama.cpp, which ignores one for Q8_0), the weighted search with one
    (codes in [-128, 127], as in Q5_0)."""
    if importance is None:
        return _reference(w, GGMLQuantizationType.Q8_0, 128)
    return _searched(w, importance, 128, _q8_0_rows)


QUANTIZERS = {GGMLQuantizationType.Q4_K: q4_k, GGMLQuantizationType.Q6_K: q6_k,
              GGMLQuantizationType.Q5_0: q5_0, GGMLQuantizationType.Q8_0: q8_0}


def quantize(w: np.ndarray, qtype: GGMLQuantizationType,
             importance: np.ndarray | None = None, hessian: np.ndarray | None = None,
             rows: int = 2048) -> np.ndarray:
    """A [N, K] weight as `qtype`'s raw GGUF rows, `rows` at a time (bounded memory).

    With `hessian` (the input's XᵀX, [K, K]) the blocks are fitted with its diagonal as
    the importance (in place of `importance`) and GPTQ chooses the codes on them."""
    fn = QUANTIZERS[qtype]
    if hessian is not None:
        from edgespec.quant.gptq import factor, grid_codes

        importance = np.diag(hessian).astype(F32)
        columns = factor(hessian)
    out = []
    for i in range(0, len(w), rows):
        grid = fn(w[i:i + rows], importance)
        codes = grid.codes if hessian is None else grid_codes(
            w[i:i + rows], columns, grid.scale, grid.offset, grid.lo, grid.hi)
        out.append(grid.pack(codes))
    return np.concatenate(out)
