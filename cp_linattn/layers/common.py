"""Argument handling shared by the attention layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cp_linattn.cp.context import check_cp_call
from cp_linattn.cp.guard import checked_call

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext


def local_cu_seqlens(
    layer: str, x: torch.Tensor, cu_seqlens: torch.LongTensor | None, cp_context: FLACPContext | None
) -> torch.LongTensor | None:
    """The offsets of the tokens this rank holds, as the ops define them: `cu_seqlens`
    without CP; under CP x must be this rank's shard, cu_seqlens None or the global offsets
    the context was built from, and the result is the context's local offsets. Under CP every
    rank of the group raises if any rank's call is bad (`cp_linattn.cp.guard`)."""
    def check():
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a [B, T, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        return cu_seqlens if cp_context is None else check_cp_call(cp_context, cu_seqlens, x=x)

    return checked_call(layer, cp_context, check, lambda _: {
        "cp_context (the global batch)": cp_context.batch_signature, "x.dtype": x.dtype, "D (x.shape[2])": x.shape[2]})
