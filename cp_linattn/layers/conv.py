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
                       continuing: list[int], width: int) -> torch.Tensor:
    """`[T]` int64: how many earlier tokens of its own sequence each token may read.

    Tokens of a local sequence in `continuing` (the first sequence of a part, begun in an
    earlier part) may read up to W-1 halo rows (which are zero where the sequence had no
    token), hence the offset of `width - 1`.
    """
    pos = torch.arange(T)
    if cu_seqlens is None:
        return pos
    cu = host_offsets(cu_seqlens, cu_seqlens_cpu)
    seq = torch.bucketize(pos, cu[1:], right=True)
    since = pos - cu[seq]
    if continuing:
        since = torch.where(torch.isin(seq, torch.tensor(continuing)), since + width - 1, since)
    return since


class ShortConvolution(nn.Module):
    """Causal depthwise conv (width W, no bias) + SiLU that restarts at every sequence start.

    Under CP the first sequence of each local part reads the last W-1 tokens of the same
    sequence in the earlier parts (`cp_linattn.cp.conv.conv_halo`), so the result equals the
    unsharded one.
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
        continuing = [p.seq_begin for p in cp_context.parts if p.receives] if cp_context is not None else []
        since = _steps_since_start(cu_seqlens, cp_context.cu_seqlens_cpu if cp_context else None, T, continuing,
                                   self.width).to(x.device)
        if cp_context is None:
            return self._conv(x, x.new_zeros(B, n, D), since)
        halos = conv_halo(x[0], cp_context, self.width) if n > 0 else x.new_zeros(cp_context.num_parts, 0, D)
        # one convolution per part: each reads its own halo
        outs = [self._conv(x[:, p.offset:p.offset + p.end - p.start], halos[i][None],
                           since[p.offset:p.offset + p.end - p.start]) for i, p in enumerate(cp_context.parts)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _conv(self, x: torch.Tensor, halo: torch.Tensor, since: torch.Tensor) -> torch.Tensor:
        """x `[B, T, D]` after halo `[B, W - 1, D]`; since `[T]` as `_steps_since_start`."""
        n, T = self.width - 1, x.shape[1]
        x_ext = torch.cat([halo, x], dim=1)
        w = self.weight.to(x.dtype)
        out = x * w[:, n]
        for j in range(1, self.width):
            out = out + x_ext[:, n - j:n - j + T] * w[:, n - j] * (since >= j).to(x.dtype)[None, :, None]
        return F.silu(out)
