"""The EAGLE draft head in PyTorch, computing what export.draft_head's graph computes.

fc([embed(t_{j+1}); h_j]) -> one Llama layer (RMSNorm, RoPE attention, SiLU MLP) ->
RMSNorm: the head's guess at the target's state after t_{j+1}, scored by the target's
frozen LM head over the kept tokens.

`unrolled` trains what drafting does (EAGLE-3's "training-time test"): step 1 reads the
target's true states; step s > 1 reads the head's own step s-1 output, one position
later, attending to the true states before it and to its own earlier steps of the same
chain only. A head trained on true states alone degrades from its second token on.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgespec.export.draft_head import LAYER, HeadConfig


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE over halves (GroupQueryAttention's non-interleaved layout); x [B, H, T, D]."""
    angles = positions[..., None].float() * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 embed_scale: float | None = None):
        """`embed` [V, d] and `lm_head` [K, d] (the kept rows) are the target's, frozen."""
        super().__init__()
        c = self.config = config
        d, q_dim, kv_dim = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.embed_scale = embed_scale or 1.0
        self.fusion = nn.Linear(2 * d, d, bias=False)
        self.q_proj = nn.Linear(d, q_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.input_norm = RMSNorm(d, c.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, c.rms_norm_eps)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        half = c.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / c.rope_theta ** (
            torch.arange(half, dtype=torch.float64) / half).float(), persistent=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.config.head_dim).transpose(1, 2)

    def _qkv(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor):
        c = self.config
        x = self.fusion(torch.cat([self.embed[ids] * self.embed_scale, states], dim=-1))
        h = self.input_norm(x)
        q = rotate(self._heads(self.q_proj(h), c.num_heads), positions, self.inv_freq)
        k = rotate(self._heads(self.k_proj(h), c.num_kv_heads), positions, self.inv_freq)
        v = self._heads(self.v_proj(h), c.num_kv_heads)
        repeat = c.num_heads // c.num_kv_heads
        return x, q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.norm(x)

    def forward(self, ids: torch.Tensor, states: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Pairs (states[:, j], ids[:, j]) at positions j -> predicted states [B, T, d];
        causal, with `mask` [B, T] (False: padding) on keys."""
        return self.unrolled(ids[:, None], states, mask)[0]

    def unrolled(self, ids: torch.Tensor, states: torch.Tensor, mask: torch.Tensor | None = None
                 ) -> list[torch.Tensor]:
        """`ids` [B, steps, T]: step s's token at chain j is the one after the state it
        reads. Returns each step's predicted states [B, T, d]; step s at chain j sits at
        position j + s and predicts the target's state there."""
        b, steps, t = ids.shape
        scale = 1.0 / math.sqrt(self.config.head_dim)
        positions = torch.arange(t, device=ids.device).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        allowed = causal if mask is None else causal & mask[:, None, None, :]
        outputs, keys, values = [], [], []
        for s in range(steps):
            x, q, k, v = self._qkv(ids[:, s], states, positions + s)
            scores = [(q @ keys[0].transpose(-1, -2) if keys else q @ k.transpose(-1, -2))
                      * scale]
            scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
            # the chain's own earlier steps and itself: one score per step, on the diagonal
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:] + [k]] if keys else []
            weights = torch.softmax(torch.cat(scores + own, dim=-1), dim=-1)
            attn = weights[..., :t] @ (values[0] if values else v)
            if keys:
                for i, vv in enumerate(values[1:] + [v]):
                    attn = attn + weights[..., t + i:t + i + 1] * vv
            keys.append(k)
            values.append(v)
            outputs.append(self._finish(x, attn))
            states = outputs[-1]
        return outputs

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return states @ self.lm_head.T

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        """A trained head's weights (DraftHead.weights, export_weights' names)."""
        state = {f"{k.removeprefix('layer.')}.weight":
                 torch.from_numpy(np.require(v, np.float32, "W"))  # a read-only view warns
                 for k, v in weights.items()}
        self.load_state_dict(state, strict=True)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """In export.draft_head's names and HF's [out, in] layout."""
        w = {"fusion": self.fusion.weight, "norm": self.norm.weight}
        for name in LAYER:
            module = getattr(self, name)
            w[f"layer.{name}"] = module.weight
        return {k: v.detach().float().cpu() for k, v in w.items()}
