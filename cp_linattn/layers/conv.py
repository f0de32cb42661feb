"""Short causal depthwise convolution over a packed varlen batch, CP aware."""
from __future__ import annotations

import math

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_linattn.cp.conv import conv_halo
from cp_linattn.layers.common import local_cu_seqlens
from cp_linattn.ops.utils import host_offsets

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def _steps_since_start(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, T: int,
                       first_continues: bool, width: int) -> torch.Tensor:
    """`[T]` int64: how many earlier tokens of its own sequence each token may read.

    Tokens of a sequence that began on an earlier rank may read up to W-1 halo rows (which
    are zero where the sequence had no token), hence the offset of `width - 1`.
    """
    pos = torch.arange(T)
    if cu_seqlens is None:
        return pos
    cu = host_offsets(cu_seqlens, cu_seqlens_cpu)
    seq = torch.bucketize(pos, cu[1:], right=True)
    since = pos - cu[seq]
    if first_continues:
        since = torch.where(seq == 0, since + width - 1, since)
    return since


class ShortConvolution(nn.Module):
    """Causal depthwise conv (width W, no bias) + SiLU that restarts at every sequence start.

    Under CP the first local sequence reads the last W-1 tokens of the same sequence on the
    earlier ranks (`cp_linattn.cp.conv.conv_halo`), so the result equals the unsharded one.
    """

    def __init__(self, dim: int, width: int = 4) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.dim, self.width = dim, width
        self.weight = nn.Parameter(torch.empty(dim, width))
        # nn.Conv1d's default init for a depthwise kernel (fan_in = width)
        nn.init.uniform_(self.weight, -1 / math.sqrt(width), 1 / math.sqrt(width))

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.LongTensor | None = None, cp_context: FLACPContext | None = None
    ) -> torch.Tensor:
        """x: `[1, T, D]` packed tokens with cu_seqlens (`[B, T, D]` without); under CP this
        rank's shard (cu_seqlens None or the global offsets). Returns x's shape."""
        cu_seqlens = local_cu_seqlens("ShortConvolution", x, cu_seqlens, cp_context)
        if x.shape[-1] != self.dim:
            raise ValueError(f"x must be [B, T, {self.dim}], got shape {list(x.shape)}")
        B, T, D = x.shape
        n = self.width - 1
        if cp_context is not None:
            halo = conv_halo(x[0], cp_context, self.width)[None] if n > 0 else x.new_zeros(1, 0, D)
        else:
            halo = x.new_zeros(B, n, D)
        x_ext = torch.cat([halo, x], dim=1)
        since = _steps_since_start(cu_seqlens, cp_context.cu_seqlens_cpu if cp_context else None, T,
                                   cp_context is not None and cp_context.pre_num_ranks > 0, self.width)
        since = since.to(x.device)
        w = self.weight.to(x.dtype)
        out = x * w[:, n]
        for j in range(1, self.width):
            out = out + x_ext[:, n - j:n - j + T] * w[:, n - j] * (since >= j).to(x.dtype)[None, :, None]
        return F.silu(out)
