"""RMSNorm with an output gate, the per-head output norm of GLA and KDA."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_linattn.ops.utils import check_option

GATE_ACTIVATIONS = {"swish": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """`rmsnorm(x) * weight * act(gate)` over the last dim (one head), computed in fp32."""

    def __init__(self, dim: int, activation: str = "swish", eps: float = 1e-5) -> None:
        super().__init__()
        check_option("activation", activation, tuple(GATE_ACTIVATIONS))
        self.act = GATE_ACTIVATIONS[activation]
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: `[..., dim]`. Returns x's shape and dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * self.act(gate.float())).to(x.dtype)
