"""Gated Linear Attention layer (Yang et al. 2023, "Gated Linear Attention Transformers")."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_linattn.layers.common import OPS, check_ops_takes_context, import_fla_op, local_cu_seqlens
from cp_linattn.layers.norm import GatedRMSNorm
from cp_linattn.ops.gla.chunk import chunk_gla

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def load_chunk_gla(ops: str):
    """The `chunk_gla` of `ops` (OPS): "ours" (cp_linattn's) or "fla" (FLA 0.6.0's
    `fla.ops.gla.chunk_gla`, `import_fla_op`). Both take the same keywords but `cp_context`,
    which only ours has."""
    if ops not in OPS:
        raise ValueError(f"ops must be one of {list(OPS)}, got {ops!r}")
    return chunk_gla if ops == "ours" else import_fla_op("fla.ops.gla", "chunk_gla")


class GatedLinearAttention(nn.Module):
    """q/k/v projections, a low-rank data-dependent forget gate, chunked GLA, a per-head
    RMSNorm gated by swish of an output-gate projection, and the output projection.

    The forget gate is `logsigmoid(W2 W1 x + b) / gate_normalizer`: the normaliser keeps the
    decay close to 1 at initialisation so information survives over long spans.

    `ops="fla"` calls FLA 0.6.0's `chunk_gla` with the same arguments instead of ours (a
    baseline for benchmarks; no CP context).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        gate_low_rank_dim: int = 16,
        gate_normalizer: float = 16.0,
        norm_eps: float = 1e-5,
        ops: str = "ours",
    ) -> None:
        super().__init__()
        self.ops, self.chunk_gla = ops, load_chunk_gla(ops)
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("head_k_dim", head_k_dim),
                            ("head_v_dim", head_v_dim), ("gate_low_rank_dim", gate_low_rank_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not gate_normalizer > 0:
            raise ValueError(f"gate_normalizer must be positive, got {gate_normalizer!r}")
        self.n_heads, self.head_k_dim, self.head_v_dim = n_heads, head_k_dim, head_v_dim
        self.gate_normalizer = gate_normalizer
        key_dim, value_dim = n_heads * head_k_dim, n_heads * head_v_dim
        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.gk_proj = nn.Sequential(
            nn.Linear(d_model, gate_low_rank_dim, bias=False), nn.Linear(gate_low_rank_dim, key_dim, bias=True)
        )
        self.o_norm = GatedRMSNorm(head_v_dim, activation="swish", eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.LongTensor | None = None, cp_context: FLACPContext | None = None
    ) -> torch.Tensor:
        """x: `[1, T, D]` packed tokens with cu_seqlens `[N + 1]`; under CP this rank's shard
        (cu_seqlens None or the global offsets). Returns x's shape."""
        check_ops_takes_context("GatedLinearAttention", self.ops, cp_context)
        local_cu_seqlens("GatedLinearAttention", x, cu_seqlens, cp_context)  # a bad call fails before any work
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k_dim, self.head_v_dim
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, H, V)
        g = (F.logsigmoid(self.gk_proj(x).float()) / self.gate_normalizer).view(B, T, H, K)
        # cp_context only under CP: FLA's chunk_gla has no such keyword (ops="fla" never gets one)
        cp = {} if cp_context is None else {"cp_context": cp_context}
        o, _ = self.chunk_gla(q, k, v, g, cu_seqlens=cu_seqlens, **cp)
        o = self.o_norm(o, self.g_proj(x).view(B, T, H, V))
        return self.o_proj(o.reshape(B, T, H * V))
