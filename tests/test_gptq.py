"""edgespec.quant.gptq against independent oracles: round-to-nearest, the paper's unblocked
optimal-brain-surgeon recursion (explicit H⁻¹, eqs. 2-3 of arXiv 2210.17323), and the
output error GPTQ is meant to reduce."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.quant.gptq import accumulate_hessian, channel_scales, gptq_int8


def correlated(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Activation rows with strongly correlated, unevenly scaled inputs."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) * 0.3 + np.eye(k)
    return (rng.standard_normal((rows, k)) * rng.uniform(0.2, 3.0, k)) @ mix


def weights(n: int, k: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * 0.02
    w[:, rng.integers(0, k, 3)] *= 8  # a few outlier columns, as real layers have
    return w.astype(np.float32)


def rtn(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(np.round(w.astype(np.float64) / scale[:, None]), -127, 127)


def obs_reference(w: np.ndarray, h: np.ndarray, scale: np.ndarray, order: np.ndarray,
                  damp: float = 0.01) -> np.ndarray:
    """The unblocked recursion: quantize column q, move the rest by -err/[H⁻¹]_qq · H⁻¹[q],
    then eliminate q from H⁻¹ (Gaussian elimination), in `order`."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.inv(h)
    codes = np.zeros(w.shape, dtype=np.int64)
    for q in order:
        codes[:, q] = np.clip(np.round(w[:, q] / scale), -127, 127)
        err = (w[:, q] - codes[:, q] * scale) / hinv[q, q]
        w -= np.outer(err, hinv[q])
        hinv -= np.outer(hinv[:, q], hinv[q]) / hinv[q, q]
    return codes


def test_codes_in_range_and_layout():
    x, w = correlated(512, 96), weights(40, 96)
    w[3] = 0  # a dead output channel
    codes, scale = gptq_int8(w, accumulate_hessian(x))
    assert codes.dtype == np.int8 and codes.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (40,)
    assert codes.min() >= -127 and codes.max() <= 127
    assert not codes[3].any()
    peak = np.abs(w).max(1)
    np.testing.assert_allclose(scale, np.where(peak > 0, peak / 127, 1), rtol=1e-6)


@pytest.mark.parametrize("act_order", [False, True])
def test_identity_hessian_is_round_to_nearest(act_order):
    w = weights(64, 200)
    codes, scale = gptq_int8(w, np.eye(200), act_order=act_order, block=32)
    np.testing.assert_array_equal(codes, rtn(w, np.abs(w.astype(np.float64)).max(1) / 127))


def test_diagonal_hessian_is_round_to_nearest():
    """No correlation: nothing to compensate whatever the per-input importance."""
    w = weights(32, 80)
    h = np.diag(np.random.default_rng(3).uniform(0.1, 10, 80))
    codes, scale = gptq_int8(w, h)
    np.testing.assert_array_equal(codes, rtn(w, scale.astype(np.float64)))


@pytest.mark.parametrize("act_order", [False, True])
def test_matches_unblocked_obs_recursion(act_order):
    x, w = correlated(400, 72, seed=5), weights(24, 72, seed=6)
    h = accumulate_hessian(x)
    scale = np.abs(w.astype(np.float64)).max(1) / 127
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(72)
    expected = obs_reference(w, h, scale, order)
    for block in (128, 16, 5):  # lazy batching changes the arithmetic, not the result
        codes, _ = gptq_int8(w, h, act_order=act_order, block=block)
        assert (codes != expected).mean() < 1e-3  # rounding ties aside
    assert (expected != rtn(w, scale)).mean() > 0.1  # and it is not round-to-nearest


@pytest.mark.parametrize("clip", ["absmax", "mse"])
def test_output_error_below_round_to_nearest(clip):
    x, w = correlated(2048, 192, seed=7), weights(96, 192, seed=8)
    h = accumulate_hessian(x)
    reference = x @ w.T.astype(np.float64)
    scale = np.abs(w.astype(np.float64)).max(1) / 127
    rtn_error = np.linalg.norm(reference - x @ (rtn(w, scale) * scale[:, None]).T)
    codes, s = gptq_int8(w, h, clip=clip)
    gptq_error = np.linalg.norm(reference - x @ (codes * s[:, None].astype(np.float64)).T)
    assert gptq_error < 0.8 * rtn_error


def test_generalizes_to_held_out_rows():
    rng = np.random.default_rng(11)
    mix = rng.standard_normal((128, 128)) * 0.3 + np.eye(128)
    calib, test = (rng.standard_normal((n, 128)) @ mix for n in (2048, 2048))
    w = weights(64, 128, seed=12)
    scale = np.abs(w.astype(np.float64)).max(1) / 127
    codes, s = gptq_int8(w, accumulate_hessian(calib))
    reference = test @ w.T.astype(np.float64)
    rtn_error = np.linalg.norm(reference - test @ (rtn(w, scale) * scale[:, None]).T)
    gptq_error = np.linalg.norm(reference - test @ (codes * s[:, None].astype(np.float64)).T)
    assert gptq_error < 0.9 * rtn_error


def test_mse_clip_never_worse_per_channel():
    w = weights(50, 300)
    w[:, 7] = 0.5  # a clipping candidate
    imp = np.random.default_rng(2).uniform(0.5, 2, 300)
    for_scale = {c: channel_scales(w, imp, clip=c) for c in ("absmax", "mse")}

    def err(s):
        return ((w - rtn(w, s) * s[:, None]) ** 2) @ imp
    assert np.all(err(for_scale["mse"]) <= err(for_scale["absmax"]) + 1e-18)
    assert np.all(for_scale["mse"] <= for_scale["absmax"])
    with pytest.raises(ValueError):
        channel_scales(w, clip="max")


def test_act_order_is_permutation_equivariant():
    x, w = correlated(600, 64, seed=9), weights(16, 64, seed=10)
    perm = np.random.default_rng(4).permutation(64)
    codes, _ = gptq_int8(w, accumulate_hessian(x))
    permuted, _ = gptq_int8(w[:, perm], accumulate_hessian(x[:, perm]))
    assert (permuted != codes[:, perm]).mean() < 1e-3


def test_dead_input_column():
    x, w = correlated(300, 48, seed=13), weights(20, 48, seed=14)
    x[:, 5] = 0  # an input calibration never exercised
    h = accumulate_hessian(x)
    assert h[5, 5] == 0
    codes, s = gptq_int8(w, h)
    np.testing.assert_array_equal(codes[:, 5], rtn(w, s.astype(np.float64))[:, 5])
    assert np.isfinite(codes.astype(float)).all()


def test_accumulate_hessian_over_batches():
    x = correlated(90, 12)
    h = accumulate_hessian(x[:30].reshape(3, 10, 12))
    same = accumulate_hessian(x[30:], h)
    assert same is h and h.dtype == np.float64
    np.testing.assert_allclose(h, x.T @ x, rtol=1e-12)


def test_rejects_mismatched_hessian():
    with pytest.raises(ValueError):
        gptq_int8(weights(4, 8), np.eye(9))
