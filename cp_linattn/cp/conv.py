"""Halo exchange for a short causal convolution under context parallelism.

A causal depthwise convolution of width W reads the W-1 tokens before each token. Under CP
the first W-1 tokens of each part's first local sequence read tokens held by earlier parts
of the chain (of the same sequence only: the convolution restarts at every sequence start).
A part can hold fewer than W-1 tokens of that sequence, so the halo may come from several
earlier parts, on several ranks.

Forward: every rank all-gathers the last W-1 token rows of every part and picks, for each of
its parts, the rows of the W-1 global positions before the part's first token that belong to
its first sequence (zero rows elsewhere). Backward: the halo gradients are all-gathered and
each rank adds the ones aimed at its own parts' tail rows. Which row goes where follows from
the global sharding metadata alone, so every rank computes the same table without talking
(cp/README.md, section 8).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cp_linattn.cp.comm import all_gather_parts

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def halo_sources(cu_seqlens: list[int], bounds: list[tuple[int, int]], width: int) -> torch.Tensor:
    """Where each part's halo rows come from.

    cu_seqlens: global offsets of the packed batch; bounds: `[start, end)` token range of every
    part in chain order; width: convolution width W. Returns int64 `[num_parts, W - 1]`: entry
    (s, i), the halo row of part s for global position `start_s - (W - 1) + i`, is
    `j * (W - 1) + row` when that token is row `row` of part j's last W-1 rows (padded at the
    front when part j holds fewer) and lies in part s's first sequence, else -1.
    """
    n = width - 1
    table = torch.full((len(bounds), n), -1, dtype=torch.int64)
    ends = [e for _, e in bounds]
    for s, (start, _) in enumerate(bounds):
        seq_start = cu_seqlens[bisect_right(cu_seqlens, start) - 1]
        for i in range(n):
            p = start - n + i
            if p < seq_start:
                continue
            j = bisect_right(ends, p)  # the part holding p: the first whose end lies past it
            table[s, i] = j * n + p - (ends[j] - n)
    return table


def chain_bounds(context: FLACPContext) -> list[tuple[int, int]]:
    """`[start, end)` global token range of every part, in chain order."""
    return [context.all_ranges[r][i] for r, i in context.chain]


def _tails(x: torch.Tensor, context: FLACPContext, n: int) -> torch.Tensor:
    """`[P, n, D]`: each local part's last n rows of x `[T_local, D]`, zero-padded at the front
    (differentiable: the gradient reaches only those rows)."""
    tails = []
    for part in context.parts:
        end = part.offset + part.end - part.start
        rows = min(n, part.end - part.start)
        tails.append(F.pad(x[end - rows:end], (0, 0, n - rows, 0)))
    return torch.stack(tails)


class _ConvHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tails: torch.Tensor, context: FLACPContext, width: int) -> torch.Tensor:
        n = width - 1
        gathered = all_gather_parts(tails, context).flatten(0, 1)  # [num_slots * n, D]
        table = halo_sources(context.global_cu_seqlens_cpu.tolist(), chain_bounds(context), width)
        src = table[[p.slot for p in context.parts]].to(tails.device)  # [P, n]
        halo = torch.where((src >= 0)[..., None], gathered[src.clamp(min=0)], 0)
        ctx.save_for_backward(table)
        ctx.context, ctx.n = context, n
        return halo

    @staticmethod
    def backward(ctx, dhalo: torch.Tensor):
        (table,) = ctx.saved_tensors
        n, context = ctx.n, ctx.context
        gathered = all_gather_parts(dhalo.contiguous(), context).flatten(0, 1)  # [num_slots * n, D]
        flat = table.flatten()
        slot_to_local = torch.full((len(context.chain),), -1, dtype=torch.int64)
        slot_to_local[[p.slot for p in context.parts]] = torch.arange(context.num_parts)
        local = torch.where(flat >= 0, slot_to_local[(flat // n).clamp(min=0)], -1)
        mine = (local >= 0).to(dhalo.device)
        rows = (local.clamp(min=0) * n + flat % n).to(dhalo.device)
        dtails = dhalo.new_zeros(context.num_parts * n, dhalo.shape[-1]).index_add_(0, rows[mine], gathered[mine])
        return dtails.view_as(dhalo), None, None


def conv_halo(x: torch.Tensor, context: FLACPContext, width: int) -> torch.Tensor:
    """The W-1 token rows before each local part's first token, from earlier parts
    (differentiable).

    x: this rank's `[T_local, D]` rows. Returns `[P, W - 1, D]`: row i of part p is the token
    at global position `start_p - (W - 1) + i` when it belongs to the part's first sequence,
    else zeros. Collective: every rank of `context.group` must call it.
    """
    if not isinstance(width, int) or width < 2:
        raise ValueError(f"width must be an int >= 2 for a halo to exist, got {width!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T_local, D], got shape {list(x.shape)}")
    return _ConvHalo.apply(_tails(x, context, width - 1), context, width)
