"""Kimi Delta Attention layer (Kimi Linear, Moonshot AI 2025)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from cp_linattn.layers.common import OPS, check_ops_takes_context, import_fla_op
from cp_linattn.layers.conv import ShortConvolution
from cp_linattn.layers.norm import GatedRMSNorm
from cp_linattn.ops.kda.chunk import chunk_kda

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def init_gate_parameters(n_v_heads: int, head_k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-kernel gate's parameters as the layer initialises them: A_log fp32 `[n_v_heads]`
    with decay rates exp(A_log) spread over [1, 16], and dt_bias fp32 `[n_v_heads * head_k_dim]`,
    the inverse softplus of a dt log-uniform in [1e-3, 1e-1]."""
    A_log = torch.empty(n_v_heads).uniform_(1, 16).log()
    dt = torch.empty(n_v_heads * head_k_dim).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
    return A_log, dt + torch.log(-torch.expm1(-dt))


def load_chunk_kda(ops: str):
    """The `chunk_kda` of `ops` (OPS): "ours" (cp_linattn's) or "fla" (FLA 0.6.0's
    `fla.ops.kda.chunk_kda`, `import_fla_op`). Both take the same keywords; FLA's runs
    without our CP context."""
    if ops not in OPS:
        raise ValueError(f"ops must be one of {list(OPS)}, got {ops!r}")
    return chunk_kda if ops == "ours" else import_fla_op("fla.ops.kda", "chunk_kda")


class KimiDeltaAttention(nn.Module):
    """q/k/v projections through a short causal conv + SiLU, a low-rank per-channel forget
    gate applied in the kernel (`-exp(A_log) * softplus(f + dt_bias)`), `beta = sigmoid(b x)`,
    chunked KDA with L2-normalised q/k, a per-head RMSNorm gated by sigmoid of a low-rank
    output gate, and the output projection. `n_v_heads > n_heads` gives grouped value heads.
    `ops="fla"` calls FLA 0.6.0's `chunk_kda` with the same arguments instead of ours (a
    baseline for benchmarks; no CP context).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        n_v_heads: int | None = None,
        conv_size: int = 4,
        norm_eps: float = 1e-5,
        ops: str = "ours",
    ) -> None:
        super().__init__()
        self.ops, self.chunk_kda = ops, load_chunk_kda(ops)
        n_v_heads = n_heads if n_v_heads is None else n_v_heads
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_k_dim", head_k_dim),
                            ("head_v_dim", head_v_dim), ("n_v_heads", n_v_heads), ("conv_size", conv_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_v_heads % n_heads:
            raise ValueError(f"n_v_heads={n_v_heads} must be a multiple of n_heads={n_heads}")
        self.n_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim = n_heads, n_v_heads, head_k_dim, head_v_dim
        key_dim, value_dim = n_heads * head_k_dim, n_v_heads * head_v_dim
        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        # one depthwise conv over [q, k, v]: channels are independent, so this is three convs
        # sharing a single halo exchange under CP
        self.conv = ShortConvolution(2 * key_dim + value_dim, conv_size)
        self.f_proj = nn.Sequential(
            nn.Linear(d_model, head_v_dim, bias=False), nn.Linear(head_v_dim, n_v_heads * head_k_dim, bias=False)
        )
        self.b_proj = nn.Linear(d_model, n_v_heads, bias=False)
        A_log, dt_bias = init_gate_parameters(n_v_heads, head_k_dim)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.g_proj = nn.Sequential(
            nn.Linear(d_model, head_v_dim, bias=False), nn.Linear(head_v_dim, value_dim, bias=True)
        )
        self.o_norm = GatedRMSNorm(head_v_dim, activation="sigmoid", eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.LongTensor | None = None, cp_context: FLACPContext | None = None
    ) -> torch.Tensor:
        """x: `[1, T, D]` packed tokens with cu_seqlens `[N + 1]`; under CP this rank's shard
        (cu_seqlens None or the global offsets). Returns x's shape."""
        check_ops_takes_context("KimiDeltaAttention", self.ops, cp_context)
        B, T, _ = x.shape
        H, HV, K, V = self.n_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim
        qkv = self.conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), cu_seqlens, cp_context)
        q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
        o, _ = self.chunk_kda(
            q.reshape(B, T, H, K),
            k.reshape(B, T, H, K),
            v.reshape(B, T, HV, V),
            self.f_proj(x).view(B, T, HV, K),
            self.b_proj(x).sigmoid(),
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            cu_seqlens=cu_seqlens,
            cp_context=cp_context,
        )
        o = self.o_norm(o, self.g_proj(x).view(B, T, HV, V))
        return self.o_proj(o.reshape(B, T, HV * V))
