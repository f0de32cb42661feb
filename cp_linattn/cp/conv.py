"""Halo exchange for a short causal convolution under context parallelism.

A causal depthwise convolution of width W reads the W-1 tokens before each token. Under CP
the first W-1 tokens of a rank's first local sequence read tokens held by earlier ranks (of
the same sequence only: the convolution restarts at every sequence start). A rank can hold
fewer than W-1 tokens of that sequence, so the halo may come from several earlier ranks.

Forward: every rank all-gathers the last W-1 token rows of every rank and picks the rows of
the W-1 global positions before its first token that belong to its first local sequence
(zero rows elsewhere). Backward: the halo gradients are all-gathered and each rank adds the
ones aimed at its own tail rows. Which row goes where follows from the global sharding
metadata alone, so every rank computes the same table without talking (cp/README.md,
section 8).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

import torch

from cp_linattn.cp.comm import all_gather_tensor

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def halo_sources(cu_seqlens: list[int], bounds: list[tuple[int, int]], width: int) -> torch.Tensor:
    """Where each rank's halo rows come from.

    cu_seqlens: global offsets of the packed batch; bounds: `[start, end)` token slice of every
    rank; width: convolution width W. Returns int64 `[world_size, W - 1]`: entry (r, i), the
    halo row of rank r for global position `start_r - (W - 1) + i`, is `j * (W - 1) + row`
    when that token is row `row` of rank j's last W-1 rows (padded at the front when rank j
    holds fewer) and lies in rank r's first sequence, else -1.
    """
    n = width - 1
    table = torch.full((len(bounds), n), -1, dtype=torch.int64)
    owners = [j for j, (s, e) in enumerate(bounds) if e > s]
    for r, (start, end) in enumerate(bounds):
        if end == start:
            continue
        seq_start = cu_seqlens[bisect_right(cu_seqlens, start) - 1]
        for i in range(n):
            p = start - n + i
            if p < seq_start:
                continue
            j = next(j for j in owners if bounds[j][0] <= p < bounds[j][1])
            table[r, i] = j * n + p - (bounds[j][1] - n)
    return table


def rank_bounds(context: FLACPContext) -> list[tuple[int, int]]:
    """`[start, end)` global token slice of every rank of the context's group."""
    ends = torch.tensor(context.split, dtype=torch.int64).cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


class _ConvHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tail: torch.Tensor, context: FLACPContext, width: int) -> torch.Tensor:
        n = width - 1
        padded = tail.new_zeros(n, tail.shape[1])
        padded[n - tail.shape[0]:] = tail
        gathered = all_gather_tensor(padded, context.group).flatten(0, 1)
        table = halo_sources(context.global_cu_seqlens_cpu.tolist(), rank_bounds(context), width)
        src = table[context.rank].to(tail.device)
        halo = torch.where((src >= 0)[:, None], gathered[src.clamp(min=0)], 0)
        ctx.save_for_backward(table)
        ctx.context, ctx.n, ctx.tail_len = context, n, tail.shape[0]
        return halo

    @staticmethod
    def backward(ctx, dhalo: torch.Tensor):
        (table,) = ctx.saved_tensors
        n, context = ctx.n, ctx.context
        gathered = all_gather_tensor(dhalo.contiguous(), context.group).flatten(0, 1)
        flat = table.flatten()
        mine = ((flat >= 0) & (flat // n == context.rank)).to(dhalo.device)
        rows = (flat % n).to(dhalo.device)
        dtail = dhalo.new_zeros(n, dhalo.shape[1]).index_add_(0, rows[mine], gathered[mine])
        return dtail[n - ctx.tail_len:], None, None


def conv_halo(x: torch.Tensor, context: FLACPContext, width: int) -> torch.Tensor:
    """The W-1 token rows before this rank's first token, from earlier ranks (differentiable).

    x: this rank's `[T_local, D]` rows. Returns `[W - 1, D]`: row i is the token at global
    position `start - (W - 1) + i` when it belongs to the same sequence as this rank's first
    token, else zeros. Collective: every rank of `context.group` must call it.
    """
    if not isinstance(width, int) or width < 2:
        raise ValueError(f"width must be an int >= 2 for a halo to exist, got {width!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T_local, D], got shape {list(x.shape)}")
    return _ConvHalo.apply(x[max(0, x.shape[0] - (width - 1)):], context, width)
