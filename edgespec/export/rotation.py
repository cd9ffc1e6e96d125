"""Orthogonal rotations folded into a decoder's float weights (QuaRot, arXiv 2404.00456),
so that one int8 scale per activation row is enough.

The exact integer GEMM (export.linear_ops.rowwise_int8) is batch-invariant by construction
and verifies 5 tokens for about the cost of one, but it needs one activation scale per
row, and a few channels of a transformer's activations are far larger than the rest:
per-row int8 on SmolLM2-135M costs KL 0.040 against float. Rotating every activation by
an orthogonal matrix spreads those channels over all of them (a rotation keeps norms and
dot products), and per-row int8 then costs KL 0.006 (tools/fake_quant_kl.py).

Row-vector convention, y = x Wᵀ with W [out, in]. The residual stream is rotated by one
orthogonal Q: the embedding table becomes E Q, every writer to the stream (o_proj,
down_proj) Qᵀ W, every reader W diag(g) Q with its RMSNorm weight g folded in (RMSNorm
without a weight commutes with Q: rms(xQ) = rms(x)). Each head's values are rotated by a
Hadamard matrix H (v_proj's rows Hᵀ W_v, o_proj's columns W_o H); attention mixes
positions, not channels, so nothing else changes. down_proj's input follows a
nonlinearity, so its block-diagonal Hadamard runs in the graph (`down_block`), a small
float MatMul. The LM head reads ((x / rms) ⊙ g_f) Wᵀ = (x̃ / rms) M (W Q)ᵀ with
M = Qᵀ diag(g_f) Q, also run in the graph, so a tied head keeps the embedding's codes.
Architectures with norms on the branch outputs (Gemma 2/3) cannot move a rotation through
those norms and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.export.architectures import DecoderSpec, LayerWeights, Weight
from edgespec.export.graph import as_float


@dataclass
class Rotated:
    """A decoder's weights with the rotations folded in, and the two the graph runs."""

    embeddings: np.ndarray  # E Q
    layers: list[LayerWeights]  # every norm weight 1
    lm_head: np.ndarray  # W Q (the same array as `embeddings` when tied)
    head_input: np.ndarray  # M = Qᵀ diag(g_f) Q, [d, d]: rotated normed state -> head input
    unrotate: np.ndarray  # Qᵀ: the head's input back to the model's own basis (`hidden`)
    down_block: np.ndarray  # H_B, [B, B]: down_proj's input, per block of B channels


def hadamard(n: int) -> np.ndarray:
    """Sylvester's orthonormal (and symmetric) Hadamard matrix, n a power of two."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q * np.sign(np.diag(r))  # Haar-distributed, not biased by QR's sign choice


def block_size_for(n: int, largest: int = 128) -> int:
    """The largest power of two up to `largest` that divides n."""
    b = largest
    while n % b:
        b //= 2
    return b


def block_diagonal(block: np.ndarray, n: int) -> np.ndarray:
    return np.kron(np.eye(n // block.shape[0]), block)


def as_float64(weight: Weight | list[Weight]) -> np.ndarray:
    """Float values of a weight, an imported encoding (GGUF codes, requantized after the
    rotation) or unfused parts."""
    parts = weight if isinstance(weight, list) else [weight]
    return np.concatenate([as_float(w).astype(np.float64) for w in parts])


def rotate(spec: DecoderSpec, embeddings: Weight, layers: list[LayerWeights],
           final_norm: np.ndarray, lm_head: Weight, seed: int = 0) -> Rotated:
    """Fold the rotations into float weights; the result computes the same function."""
    if any(lw.attn_out_norm is not None or lw.mlp_out_norm is not None for lw in layers):
        raise EdgespecError(f"{spec.architecture} normalizes its attention and MLP outputs, "
                            "which a rotated residual stream cannot pass through; export it "
                            "with --quant k.")
    d, hd = spec.hidden_size, spec.head_dim
    q = random_orthogonal(d, seed)
    per_head = hadamard(hd) if hd & (hd - 1) == 0 else random_orthogonal(hd, seed + 1)
    q_dim, kv_dim = spec.num_heads * hd, spec.num_kv_heads * hd
    v_rows = block_diagonal(per_head, kv_dim)
    o_cols = block_diagonal(per_head, q_dim)
    down = hadamard(block_size_for(spec.intermediate_size))
    down_full = block_diagonal(down, spec.intermediate_size)

    def reader(w: Weight | list[Weight], g: np.ndarray) -> np.ndarray:
        return (as_float64(w) * g) @ q

    out = []
    for lw in layers:
        qkv = reader(lw.qkv, lw.input_norm)
        qkv[q_dim + kv_dim:] = v_rows.T @ qkv[q_dim + kv_dim:]
        bias = None
        if lw.qkv_bias is not None:
            bias = lw.qkv_bias.astype(np.float64).copy()
            bias[q_dim + kv_dim:] = bias[q_dim + kv_dim:] @ v_rows
        out.append(replace(
            lw, qkv=qkv.astype(np.float32),
            qkv_bias=None if bias is None else bias.astype(np.float32),
            o=(q.T @ as_float64(lw.o) @ o_cols).astype(np.float32),
            gate_up=reader(lw.gate_up, lw.mlp_norm).astype(np.float32),
            down=(q.T @ as_float64(lw.down) @ down_full).astype(np.float32),
            input_norm=np.ones_like(lw.input_norm), mlp_norm=np.ones_like(lw.mlp_norm)))
    table = (as_float64(embeddings) @ q).astype(np.float32)
    head = table if lm_head is embeddings else (as_float64(lm_head) @ q).astype(np.float32)
    return Rotated(embeddings=table, layers=out, lm_head=head,
                   head_input=(q.T * final_norm.astype(np.float64)) @ q,
                   unrotate=q.T, down_block=down)
