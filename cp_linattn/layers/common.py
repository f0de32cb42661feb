"""Argument handling shared by the attention layers, and the choice of whose op they call."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from cp_linattn.cp.context import check_cp_call
from cp_linattn.cp.guard import checked_call

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext

OPS = ("ours", "fla")  # whose op a linear-attention layer calls: cp_linattn's, or FLA 0.6.0's
FLA_VERSION = "0.6.0"  # the FLA our ops are keyword-compatible with


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


def import_fla_op(module: str, name: str):
    """`name` of FLA's `module` (`fla.ops.kda`, `fla.ops.gla`), imported now. ImportError
    saying FLA 0.6.0 must be installed (and how) if it is missing or another version: its
    chunk_kda swallows unknown keywords, so only 0.6.0's keywords are known to mean ours."""
    need = f"FLA {FLA_VERSION} must be installed: pip install flash-linear-attention=={FLA_VERSION}"
    try:
        import fla
        op = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"{need} ({e})") from e
    version = getattr(fla, "__version__", None)
    if version != FLA_VERSION:
        raise ImportError(f"{need} (found fla {version})")
    return op


def check_ops_takes_context(layer: str, ops: str, cp_context: FLACPContext | None) -> None:
    """ValueError when a layer built with FLA's ops is called under CP: FLA's kernels run without
    our context (every rank's layer has the same ops, so every rank raises)."""
    if cp_context is not None and ops != "ours":
        raise ValueError(f"{layer}(ops={ops!r}) does not take a cp_context: FLA's kernels run without our "
                         "context parallelism (use ops='ours')")
