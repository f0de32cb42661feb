"""Argument handling shared by the attention layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cp_linattn.cp.context import check_cp_call

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def local_cu_seqlens(
    x: torch.Tensor, cu_seqlens: torch.LongTensor | None, cp_context: FLACPContext | None
) -> torch.LongTensor | None:
    """The offsets of the tokens this rank holds, as the ops define them: `cu_seqlens`
    without CP; under CP x must be this rank's shard, cu_seqlens None or the global offsets
    the context was built from, and the result is the context's local offsets."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {list(x.shape)}")
    if cp_context is None:
        return cu_seqlens
    return check_cp_call(cp_context, cu_seqlens, x=x)
