"""L2 normalisation over the last dim (KDA's `use_qk_l2norm_in_kernel`): a Triton kernel for
both directions, and the fp32 reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.launch import jit_traced_as, launch_kernel


L2NORM_EPS = 1e-6


@jit_traced_as("BACKWARD", "l2norm_bwd_kernel")
def l2norm_fwd_kernel(
    x, y, dy, dx, n_rows,
    D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, eps, BACKWARD: tl.constexpr,
):
    """Forward y = x / sqrt(sum x^2 + eps) per row of D; backward
    dx = (dy - y * sum(y * dy)) / sqrt(sum x^2 + eps). Grid (cdiv(n_rows, BR),)."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    offs = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + offs, mask=m, other=0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
    b_y = b_x * b_rstd[:, None]
    if BACKWARD:
        b_dy = tl.load(dy + offs, mask=m, other=0).to(tl.float32)
        b_dx = (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None]) * b_rstd[:, None]
        tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)
    else:
        tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=m)


def _l2norm_launch(x, y, dy, dx, backward):
    D = x.shape[-1]
    n_rows = x.numel() // max(D, 1)
    BD = max(16, triton.next_power_of_2(D))
    BR = max(1, 4096 // BD)
    if n_rows > 0:
        launch_kernel(l2norm_fwd_kernel, (triton.cdiv(n_rows, BR),), "l2norm_bwd" if backward else "l2norm_fwd",
               x, y, dy, dx, n_rows, D=D, BD=BD, BR=BR, eps=L2NORM_EPS, BACKWARD=backward)


def l2norm_fwd(x: torch.Tensor) -> torch.Tensor:
    """`x / sqrt(sum(x^2, -1) + 1e-6)` (as `naive.l2norm`), fp32 math, x's dtype out."""
    x = x.contiguous()
    y = torch.empty_like(x)
    _l2norm_launch(x, y, None, None, False)
    return y


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient of `l2norm_fwd` w.r.t. x (the un-normalised input), x's dtype."""
    x = x.contiguous()
    dx = torch.empty_like(x)
    _l2norm_launch(x, None, dy.contiguous(), dx, True)
    return dx


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim, in fp32, cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
