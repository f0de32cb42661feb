"""fp32 token-by-token reference for Kimi Delta Attention and its gates.

`S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T`, `o_t = scale * S_t^T q_t`,
with per-channel log gates g. GVA: v, g, beta carry HV heads, q/k carry H heads and value
head j reads q/k head j // (HV / H).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_linattn.ops.common.index import host_sequence_bounds, join_sequence_outputs
from cp_linattn.ops.utils import check_inputs, check_scale, check_tensor


def _check_gate_params(g: torch.Tensor, A_log, dt_bias) -> None:
    check_tensor("g", g, ndim=None)
    if g.dim() < 2:
        raise ValueError(f"g must be [..., HV, K], got shape {list(g.shape)}")
    HV, K = g.shape[-2:]
    if A_log is not None:
        check_tensor("A_log", A_log, device=g.device)
        if A_log.numel() != HV:
            raise ValueError(f"A_log must have HV={HV} elements, got shape {list(A_log.shape)}")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, device=g.device)
        if dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K={HV * K} elements, got shape {list(dt_bias.shape)}")


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`-exp(A_log) * softplus(g + dt_bias)` in fp32.

    g: `[..., HV, K]`; A_log: `[HV]`; dt_bias: `[HV * K]` (or `[HV, K]`). Returns fp32 `[..., HV, K]`.
    """
    _check_gate_params(g, A_log, dt_bias)
    HV, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(HV, K)
    sp = F.softplus(x)
    # x = +inf: the gate is -inf, its decay 0, and every gradient through it 0 (the limit);
    # the product's backward would form the A_log one as 0 * inf = NaN
    infinite = torch.isinf(sp)
    gate = -A_log.float().view(HV, 1).exp() * torch.where(infinite, 0.0, sp)
    return torch.where(infinite, float("-inf"), gate)


def kda_lower_bound_gate(
    g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None = None, lower_bound: float = -5.0
) -> torch.Tensor:
    """Safe gate `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`, bounded in `(lower_bound, 0)`.

    Without A_log: `lower_bound * sigmoid(g + dt_bias)`. Shapes as in `kda_gate`; fp32 result.
    """
    _check_gate_params(g, A_log, dt_bias)
    if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool) or not lower_bound < 0:
        raise ValueError(f"lower_bound must be a negative number, got {lower_bound!r}")
    HV, K = g.shape[-2:]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(HV, K)
    if A_log is not None:
        x = A_log.float().view(HV, 1).exp() * x
    return lower_bound * torch.sigmoid(x)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    state_v_first: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    return_intermediate_states: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reference KDA (gates already in log space; see `kda_gate` for the in-kernel gate).

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; g: `[B, T, HV, K]`; beta: `[B, T, HV]`.
        initial_state: `[N, HV, K, V]` (or `[N, HV, V, K]` with `state_v_first`).
        cu_seqlens: int32 or int64 `[N + 1]` offsets of a packed batch (B == 1).
        use_beta_sigmoid_in_kernel: beta holds logits, the step sizes are `sigmoid(beta)`, or
            with `allow_neg_eigval` (which requires it) `2 * sigmoid(beta)`.
        return_intermediate_states: also return the state entering every chunk of
            `chunk_size` tokens of each sequence, as `chunk_kda` does (fp32 here).

    Returns:
        o `[B, T, HV, V]` in v's dtype, and the fp32 final state (same layout as
        initial_state) or None; with return_intermediate_states also the chunk states
        `[B, NT, HV, K, V]` (`[B, NT, HV, V, K]` with `state_v_first`), NT the chunks of a
        row, or of all sequences with cu_seqlens.
    """
    dims = check_inputs(
        q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, allow_gva=True, state_v_first=state_v_first
    )
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True, got False")
    scale = check_scale(scale, dims.K)
    out_dtype = v.dtype
    G = dims.HV // dims.H
    q, k = (x.float().repeat_interleave(G, dim=2) for x in (q, k))
    v, g, beta = (x.float() for x in (v, g, beta))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    layout = (lambda S: S.transpose(-1, -2)) if state_v_first else (lambda S: S)  # noqa: E731
    outs, finals, chunk_states = [], [], [[] for _ in range(dims.B)]
    for n, (b, start, end) in enumerate(host_sequence_bounds(dims)):
        S = q.new_zeros(dims.HV, dims.K, dims.V) if initial_state is None else layout(initial_state[n].float())
        o_seq = [q.new_zeros(0, dims.HV, dims.V)]
        for t in range(start, end):
            if (t - start) % chunk_size == 0:
                chunk_states[b].append(layout(S))
            S = S * g[b, t].exp()[..., None]
            k_t = k[b, t]
            # delta rule: move the value stored under k_t towards v_t by a step beta_t
            residual = v[b, t] - torch.einsum("hk,hkv->hv", k_t, S)
            S = S + beta[b, t][:, None, None] * k_t[..., None] * residual[:, None, :]
            o_seq.append(scale * torch.einsum("hk,hkv->hv", q[b, t], S)[None])
        outs.append(torch.cat(o_seq))
        finals.append(layout(S))
    o = join_sequence_outputs(outs, dims).to(out_dtype)
    ht = torch.stack(finals) if output_final_state else None
    if not return_intermediate_states:
        return o, ht
    state_shape = (dims.HV, dims.V, dims.K) if state_v_first else (dims.HV, dims.K, dims.V)
    h = torch.stack([torch.stack(row) if row else q.new_zeros(0, *state_shape) for row in chunk_states])
    return o, ht, h
