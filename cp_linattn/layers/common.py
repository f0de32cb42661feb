"""Argument handling shared by the attention layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def local_cu_seqlens(
    x: torch.Tensor, cu_seqlens: torch.LongTensor | None, cp_context: FLACPContext | None
) -> torch.LongTensor | None:
    """The offsets of the tokens this rank holds: `cu_seqlens` without CP, the context's
    local offsets under CP (where a global `cu_seqlens` would be ambiguous, so it is refused)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {list(x.shape)}")
    if cp_context is None:
        return cu_seqlens
    if cu_seqlens is not None:
        raise ValueError("pass cu_seqlens=None with cp_context: the context carries this rank's local offsets")
    cp_context.check_local(x)
    return cp_context.cu_seqlens
