"""fp32 token-by-token reference for Gated Linear Attention.

`S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T`, `o_t = scale * S_t^T q_t`.
It is the ground truth that the chunked kernels are tested against: slow, simple, and
differentiable by autograd.
"""
from __future__ import annotations

import torch

from cp_linattn.ops.common.index import host_sequence_bounds, join_sequence_outputs
from cp_linattn.ops.utils import check_inputs, check_scale


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference GLA.

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, H, V]`; g: `[B, T, H, K]` log decay (natural log).
        initial_state: `[N, H, K, V]`, N = B, or the number of sequences with `cu_seqlens`.
        cu_seqlens: int64 `[N + 1]` offsets of a packed batch (B == 1).

    Returns:
        o `[B, T, H, V]` in v's dtype, and the fp32 final state `[N, H, K, V]` or None.
    """
    dims = check_inputs(q, k, v, g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    scale = check_scale(scale, dims.K)
    out_dtype = v.dtype
    q, k, v, g = (x.float() for x in (q, k, v, g))
    outs, finals = [], []
    for n, (b, start, end) in enumerate(host_sequence_bounds(dims)):
        S = q.new_zeros(dims.H, dims.K, dims.V) if initial_state is None else initial_state[n].float()
        o_seq = [q.new_zeros(0, dims.H, dims.V)]
        for t in range(start, end):
            S = S * g[b, t].exp()[..., None] + k[b, t][..., None] * v[b, t][:, None, :]
            o_seq.append(scale * torch.einsum("hk,hkv->hv", q[b, t], S)[None])
        outs.append(torch.cat(o_seq))
        finals.append(S)
    o = join_sequence_outputs(outs, dims).to(out_dtype)
    return o, (torch.stack(finals) if output_final_state else None)
