"""GPTQ (Frantar et al. 2022, arXiv 2210.17323) for symmetric int8, one scale per output
channel: the layout the exact integer GEMM (MatMulIntegerToFloat, rowwise_int8) needs.

Why: round-to-nearest minimizes each weight's own error, but what the model sees is the
layer's output error ||X W^T - X Ŵ^T||² = Σ_n (w_n - ŵ_n) H (w_n - ŵ_n)^T with
H = X^T X, the input's (uncentred) second moment on calibration text. When the inputs are
correlated (they are: rotated residual streams, gated MLP activations) rounding one input
column up can be compensated by nudging the columns not yet quantized. GPTQ quantizes the
columns one at a time (the optimal-brain-surgeon update, in the order of a fixed Cholesky
factor of H⁻¹) and spreads each column's rounding error over the remaining ones; the
codes stay plain int8 in [-127, 127] with the same per-channel scales, so nothing changes
for the kernel, only which integers it multiplies.

Details, as in the paper's reference code:
- dampening: H + λI with λ = `damp` (1%) of H's mean diagonal, so H is invertible when
  calibration has fewer rows than inputs or dead channels (a zero diagonal entry: its
  column gets no compensation and its weights are quantized as they stand);
- lazy batches: the error update is applied inside a block of `block` (128) columns
  column by column, and to the rest of the matrix once per block (one GEMM);
- act order (optional, default on): columns in decreasing diag(H), so the inputs that
  matter most are rounded first, while the most columns are left to absorb their error;
  with one scale per row fixed beforehand, the order costs nothing at inference.
The scales are chosen before the pass, per output channel: max|w|/127 (`clip="absmax"`)
or the clipped range whose round-to-nearest error, weighted by diag(H), is least
(`clip="mse"`, a grid of shrink factors as in the reference code's `find_params`).

With H = I (no correlation) there is nothing to compensate and the result is exactly
round-to-nearest. Arithmetic is float64.
"""

from __future__ import annotations

import dataclasses

import numpy as np

QMAX = 127
ROWS = 2048  # output channels per pass


def accumulate_hessian(rows: np.ndarray, hessian: np.ndarray | None = None) -> np.ndarray:
    """H += Σ x^T x over activation rows (any leading shape, last axis K), in float64.

    Pass the previous result back as `hessian` to accumulate over batches; the first call
    (hessian None) starts from zero. Returns the [K, K] float64 sum (a new array the first
    time, `hessian` itself, updated in place, afterwards). GPTQ is invariant to H's scale,
    so a sum and a mean are the same to it.
    """
    x = np.asarray(rows, dtype=np.float64)
    x = x.reshape(-1, x.shape[-1])
    if hessian is None:
        return x.T @ x
    hessian += x.T @ x
    return hessian


def channel_scales(weight: np.ndarray, importance: np.ndarray | None = None,
                   clip: str = "absmax", grid: int = 100, max_shrink: float = 0.8
                   ) -> np.ndarray:
    """One symmetric scale per output channel [N] (float64) for int8 codes in [-127, 127].

    `absmax`: max|w_n| / 127. `mse`: max|w_n| * s / 127 for the s in (1 - max_shrink, 1]
    (`grid` steps) whose round-to-nearest error Σ_k importance_k (w_nk - ŵ_nk)² is least,
    importance being diag(H) (ones if None). A zero row gets scale 1 (codes 0).
    """
    w = np.asarray(weight, dtype=np.float64)
    peak = np.abs(w).max(1)
    peak = np.where(peak > 0, peak, QMAX)
    scale = peak / QMAX
    if clip == "absmax":
        return scale
    if clip != "mse":
        raise ValueError(f"clip must be 'absmax' or 'mse', not {clip!r}")
    imp = np.ones(w.shape[1]) if importance is None else np.asarray(importance, np.float64)
    best = np.full(w.shape[0], np.inf)
    chosen = scale.copy()
    for i in range(int(max_shrink * grid)):
        s = scale * (1 - i / grid)
        q = np.clip(np.round(w / s[:, None]), -QMAX, QMAX) * s[:, None]
        err = ((w - q) ** 2) @ imp
        better = err < best
        best = np.where(better, err, best)
        chosen = np.where(better, s, chosen)
    return chosen


def _upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """U upper triangular with H⁻¹ = Uᵀ U: row i of U, divided by U[i, i], is how column
    i's rounding error spreads over columns i.. once the columns before i are fixed.

    With J the reversal, J chol(J H J) J = R is upper with H = R Rᵀ, so H⁻¹ = R⁻ᵀ R⁻¹ and
    U = R⁻¹ (Cholesky factors are unique): one factorization and a triangular inverse.
    """
    r = np.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]
    eye = np.eye(len(h))
    try:
        from scipy.linalg import solve_triangular
    except ImportError:  # numpy only: a general inverse, ~3x the arithmetic
        return np.triu(np.linalg.inv(r))
    return solve_triangular(r, eye, lower=False)


@dataclasses.dataclass
class Columns:
    """The order GPTQ quantizes a layer's input columns in, and U (H⁻¹ = UᵀU in that
    order): what a Hessian fixes, shared by every row chunk and part of its weight."""

    order: np.ndarray
    u: np.ndarray


def factor(hessian: np.ndarray, damp: float = 0.01, act_order: bool = True) -> Columns:
    """The columns' order and H⁻¹'s factor for hessian [K, K]; `damp` is the dampening
    as a fraction of H's mean diagonal, `act_order` quantizes in decreasing diag(H)."""
    h = np.array(np.squeeze(hessian), dtype=np.float64)
    k = len(h)
    diag = np.diag(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0  # never seen (H PSD: its row and column are zero): no coupling
    order = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    h = h[np.ix_(order, order)]
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    return Columns(order, _upper_cholesky_of_inverse(h))


def grid_codes(weight: np.ndarray, columns: Columns, scale: np.ndarray,
               offset: np.ndarray | None, lo: int, hi: int, block: int = 128) -> np.ndarray:
    """GPTQ codes q in [lo, hi] for weight [N, K] on a fixed grid: element (n, k) is
    dequantized as scale[n, k]·q + offset[n, k] (both broadcastable to [N, K]; offset None
    is 0; a zero scale leaves q 0), e.g. a GGUF format's fitted blocks (quant.kquants).
    Returns int16 codes [N, K]."""
    w = np.asarray(weight, dtype=np.float64)
    n, k = w.shape
    if columns.u.shape != (k, k):
        raise ValueError(f"hessian is {columns.u.shape}, expected {(k, k)} for weight "
                         f"{w.shape}")
    order = columns.order
    scale = np.broadcast_to(scale, (n, k))
    offset = None if offset is None else np.broadcast_to(offset, (n, k))
    codes = np.empty((n, k), dtype=np.int16)
    for r in range(0, n, ROWS):  # output channels are independent: chunks stay in cache
        rows = slice(r, r + ROWS)
        codes[rows, order] = _columns(
            w[rows][:, order].T.copy(), columns.u, scale[rows][:, order].T.astype(np.float64),
            None if offset is None else offset[rows][:, order].T.astype(np.float64),
            lo, hi, block).T
    return codes


def gptq_int8(weight: np.ndarray, hessian: np.ndarray, *, scale: np.ndarray | None = None,
              damp: float = 0.01, block: int = 128, act_order: bool = True,
              clip: str = "absmax") -> tuple[np.ndarray, np.ndarray]:
    """GPTQ-quantize weight [N, K] (output channels x inputs) under input Hessian
    hessian [K, K] (Σ x^T x of the rows the layer multiplies, see accumulate_hessian).

    Returns (codes int8 [N, K] in [-127, 127], scale float32 [N]); the dequantized weight
    is codes * scale[:, None]. `scale` overrides the per-channel scales (otherwise
    channel_scales(weight, diag(H), clip)); `damp` is the dampening as a fraction of H's
    mean diagonal; `block` the lazy-batch width; `act_order` quantizes columns in
    decreasing diag(H).
    """
    w = np.asarray(weight, dtype=np.float64)
    n, k = w.shape
    h = np.asarray(hessian, dtype=np.float64)
    if h.shape != (k, k):
        raise ValueError(f"hessian is {h.shape}, expected {(k, k)} for weight {w.shape}")
    s = (channel_scales(w, np.diag(h), clip) if scale is None
         else np.asarray(scale, dtype=np.float64).reshape(n))
    codes = grid_codes(w, factor(h, damp, act_order), s[:, None], None, -QMAX, QMAX, block)
    return codes.astype(np.int8), s.astype(np.float32)


def _columns(wt: np.ndarray, u: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
             lo: int, hi: int, block: int) -> np.ndarray:
    """The GPTQ pass over wt [K, N] (transposed: column i is the contiguous row wt[i],
    updated in place) on the grid scale, offset [K, N], in lazy batches of `block`
    columns; returns codes [K, N]."""
    k, n = wt.shape
    codes = np.empty((k, n), dtype=np.int16)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        u1 = u[i1:i2, i1:i2]
        err = np.empty((i2 - i1, n))
        for j in range(i2 - i1):
            col, s = wt[i1 + j], scale[i1 + j]
            base = col if offset is None else col - offset[i1 + j]
            q = np.clip(np.rint(np.divide(base, s, out=np.zeros(n), where=s != 0)), lo, hi)
            codes[i1 + j] = q
            value = q * s if offset is None else q * s + offset[i1 + j]
            e = (col - value) / u1[j, j]
            wt[i1 + j + 1:i2] -= np.outer(u1[j, j + 1:], e)
            err[j] = e
        wt[i2:] -= u[i1:i2, i2:].T @ err
    return codes
