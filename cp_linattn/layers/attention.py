"""Causal softmax attention (GQA, RoPE) over a packed varlen batch, CP aware.

The full-attention layer of hybrid models (Kimi Linear interleaves it with KDA layers).
Under CP it reads the same `FLACPContext` as the linear layers, whatever the layout, and
gathers K/V over the context's group (`cp_linattn.cp.attention`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from cp_linattn.cp.attention import (KERNELS, attention_plan, document_causal_attention, gather_tokens,
                                     local_plan, resolve_kernel)
from cp_linattn.layers.common import local_cu_seqlens
from cp_linattn.ops.utils import check_cu_seqlens, check_option

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x `[B, L, H, D]` (D even) at integer
    `positions` `[L]`: channel pairs (i, i + D/2) turn by `positions * theta ** (-2i / D)`.
    Angles are computed in fp64 (exact at any position), the rotation in fp32; returns x's dtype."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)  # [D/2]
    angles = positions.to(torch.float64)[:, None] * inv_freq[None]  # [L, D/2]
    cos, sin = angles.cos().float()[None, :, None], angles.sin().float()[None, :, None]  # [1, L, 1, D/2]
    x1, x2 = x.float().split(half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SoftmaxAttention(nn.Module):
    """q/k/v projections (n_kv_heads key/value heads shared by groups of query heads), RoPE on
    q and k with positions counted from each sequence's first token, causal softmax
    attention restricted to the token's own sequence, and the output projection.

    kernel: "auto" (compiled flex_attention on CUDA when both head dims are >= 16, SDPA with an
        explicit mask elsewhere),
    "flex" or "sdpa" (`cp_linattn.cp.attention.document_causal_attention`).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        head_v_dim: int | None = None,
        rope_theta: float | None = 10000.0,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if isinstance(d_model, int) and isinstance(n_heads, int) and head_dim is None and n_heads > 0:
            head_dim = d_model // n_heads
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim), ("head_v_dim", head_v_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if rope_theta is not None:
            if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
                raise ValueError(f"rope_theta must be a positive number or None (no RoPE), got {rope_theta!r}")
            if head_dim % 2:
                raise ValueError(f"head_dim must be even for RoPE (rope_theta={rope_theta}), got {head_dim}")
        check_option("kernel", kernel, KERNELS)
        resolve_kernel(kernel, torch.device("cpu"), (head_dim, head_v_dim))  # raises for flex with small heads
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.head_v_dim, self.rope_theta, self.kernel = head_dim, head_v_dim, rope_theta, kernel
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_v_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_v_dim, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.LongTensor | None = None, cp_context: FLACPContext | None = None
    ) -> torch.Tensor:
        """x: `[1, T, D]` packed tokens with cu_seqlens `[N + 1]` (`[B, T, D]` without: one
        sequence per row); under CP this rank's shard (cu_seqlens None or the global offsets).
        Returns x's shape."""
        cu_seqlens = local_cu_seqlens("SoftmaxAttention", x, cu_seqlens, cp_context)  # a bad call fails before any work
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [B, T, {self.d_model}], got shape {list(x.shape)}")
        B, T, _ = x.shape
        H, Hkv, Dk, Dv = self.n_heads, self.n_kv_heads, self.head_dim, self.head_v_dim
        if cp_context is not None:
            plan = attention_plan(cp_context)
        else:
            cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, batch_size=B, seq_len=T, device=x.device)
            plan = local_plan(cu, T, x.device)
        q = self.q_proj(x).view(B, T, H, Dk)
        k = self.k_proj(x).view(B, T, Hkv, Dk)
        v = self.v_proj(x).view(B, T, Hkv, Dv)
        if self.rope_theta is not None:
            positions = plan.positions_in_doc
            q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        if cp_context is not None:
            # one all-gather for K and V: [L, Hkv, Dk + Dv] -> [T, Hkv, Dk + Dv] in global order
            kv = gather_tokens(torch.cat([k, v], dim=-1)[0], cp_context, plan)[None]
            k, v = kv.split([Dk, Dv], dim=-1)
        kernel = resolve_kernel(self.kernel, x.device, (Dk, Dv))
        block_mask = plan.block_mask() if kernel == "flex" else None
        o = document_causal_attention(q, k, v, plan.q_pos, plan.q_lo, kernel=kernel, block_mask=block_mask)
        return self.o_proj(o.reshape(B, T, H * Dv))
