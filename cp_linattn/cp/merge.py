"""The CP merge kernels: fold the ranks' boundary states, and correct a sequence's stored
states once the state entering it is known (cp/README.md, sections 2 and 4)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.launch import LAUNCH, launch_kernel, tile, tiles
from cp_linattn.ops.utils import check_tensor


@triton.jit
def add_decayed_state_kernel(
    x, decay, S, n,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
):
    """x[c, h] += Diag(exp decay[c, h]) S[h] for one [BK, BV] tile of BC chunks c; grid
    (cdiv(V, BV), cdiv(K, BK), cdiv(n, BC) * H).

    Rows whose factor exp(decay) is exactly 0 (a channel the state no longer reaches) would add
    exact zeros: they are neither read nor written, so the pass moves only the live rows of x.
    Except where S holds a NaN or an infinity: 0 * NaN is NaN, and the rerun this pass stands
    for would carry it, so those entries are added too."""
    i_v, i_k, i_ch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, i_cb = i_ch % H, i_ch // H
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_tile = m_k[:, None] & (o_v < V)[None, :]
    state_offs = o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(S + i_h * K * V + state_offs, mask=m_tile, other=0)
    # |S| < inf is false exactly for NaN and infinities.
    m_s = ~(tl.abs(b_s) < float("inf")) & m_tile
    for j in range(BC):
        c = (i_cb * BC + j).to(tl.int64)
        m_c = c < n
        b_factor = tl.exp(tl.load(decay + (c * H + i_h) * K + o_k, mask=m_k & m_c, other=float("-inf")))
        m_kv = ((b_factor > 0)[:, None] & m_tile | m_s) & m_c
        p_x = x + (c * H + i_h) * K * V + state_offs
        b_x = tl.load(p_x, mask=m_kv, other=0).to(tl.float32) + b_factor[:, None] * b_s
        tl.store(p_x, b_x.to(x.dtype.element_ty), mask=m_kv)


def add_decayed_state(x: torch.Tensor, decay: torch.Tensor, S: torch.Tensor) -> None:
    """In place `x[c] += Diag(exp decay[c]) S` for every c: the per-chunk states of a sequence
    after the fact, once the state S entering it (or, in reverse, the gradient leaving it) is
    known. The diagonal recurrences are linear, so this equals rerunning them from S.

    Args:
        x: `[n, H, K, V]` contiguous states (any float dtype; the sum is formed in fp32).
        decay: fp32 `[n, H, K]`, the log decay from S's point to each state.
        S: fp32 `[H, K, V]`.
    """
    n, H, K, V = x.shape
    check_tensor("decay", decay, shape=(n, H, K), device=x.device, dtypes=(torch.float32,))
    check_tensor("S", S, shape=(H, K, V), device=x.device, dtypes=(torch.float32,))
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (it is updated in place)")
    BK, BV = tiles("add_decayed_state", K, V)
    BC = LAUNCH["add_decayed_state"]["BC"]
    if n * H > 0:
        grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), triton.cdiv(n, BC) * H)
        launch_kernel(
            add_decayed_state_kernel, grid, "add_decayed_state",
            x, decay.contiguous(), S.contiguous(), n, H=H, K=K, V=V, BK=BK, BV=BV, BC=BC,
        )


@triton.jit
def fold_states_kernel(
    states, transitions, out, first, step, n, stride_state, stride_m, stride_m_head, stride_m_row, input_columns,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DIAGONAL: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """out = the fold `S = M_j S + S_j` from S = 0 over j = first, first + step, ... (n terms)
    for one [K, BV] column tile (BK: K padded to a power of two); M_j diagonal `[H, K]` if
    DIAGONAL, else `[H, K, K]` (M_j^T if TRANSPOSE), rows strided. Only the first
    `input_columns` columns of S_j are read after the first term (the others are zero).
    Grid (cdiv(V, BV), H)."""
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    state_offs = (i_h * K + o_k[:, None]) * V + o_v[None, :]
    if TRANSPOSE:
        m_offs = i_h * stride_m_head + o_k[None, :] * stride_m_row + o_k[:, None]
    else:
        m_offs = i_h * stride_m_head + o_k[:, None] * stride_m_row + o_k[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(n):
        j = (first + i * step).to(tl.int64)
        m_x = m_kv & ((o_v < input_columns) | (i == 0))[None, :]
        b_x = tl.load(states + j * stride_state + state_offs, mask=m_x, other=0)
        if DIAGONAL:
            b_m = tl.load(transitions + j * stride_m + i_h * stride_m_head + o_k, mask=m_k, other=0)
            b_s = b_m[:, None] * b_s + b_x
        else:
            b_m = tl.load(transitions + j * stride_m + m_offs, mask=m_k[:, None] & m_k[None, :], other=0)
            # Three tf32 passes: fp32-accurate, as the states exchanged between ranks stay fp32.
            b_s = tl.dot(b_m, b_s, input_precision="tf32x3") + b_x
    tl.store(out + state_offs, b_s, mask=m_kv)


def fold_states(states: torch.Tensor, transitions: torch.Tensor, order: range, transpose: bool = False,
                input_columns: int | None = None) -> torch.Tensor:
    """`S = 0; for j in order: S = M_j S + S_j` in one launch: the merge of the boundary states
    of context-parallel ranks, instead of two launches per rank.

    Args:
        states: fp32 `[D, H, K, V]`, rows may be strided (as the rows of an all-gathered
            table), each row contiguous.
        transitions: fp32 `[D, H, K]` (diagonal, GLA) or `[D, H, K, K]` (KDA; `M_j^T` with
            `transpose`); any strides but a contiguous last dim (a view of the walk's final
            states is read in place).
        order: the rows to fold, in order (a `range`, ascending or descending, within [0, D)).
        input_columns: after the first term, only S_j's first `input_columns` columns are
            inputs, the others read as zero (default: all V). The walk of a fragment's
            segments carries each segment's transition in its last K columns, where it is
            the map of that segment, not an input of the fold.

    Returns: fp32 `[H, K, V]`.
    """
    check_tensor("states", states, ndim=4, dtypes=(torch.float32,))
    D, H, K, V = states.shape
    diagonal = transitions.dim() == 3
    check_tensor("transitions", transitions, shape=(D, H, K) if diagonal else (D, H, K, K), device=states.device,
                 dtypes=(torch.float32,))
    if len(order) and not (0 <= min(order) and max(order) < D):
        raise ValueError(f"order must index the {D} rows of states, got {order}")
    if states.stride()[1:] != (K * V, V, 1):
        states = states.contiguous()
    if input_columns is not None and not 0 <= input_columns <= V:
        raise ValueError(f"input_columns must be in [0, {V}] (the states' columns), got {input_columns}")
    if transitions.stride(-1) != 1:
        transitions = transitions.contiguous()
    out = states.new_empty(H, K, V)
    BV = tile("fold_states", "BV", V)
    launch_kernel(fold_states_kernel, (triton.cdiv(V, BV), H), "fold_states",
        states, transitions, out, order.start, order.step, len(order), states.stride(0), *transitions.stride()[:2],
        transitions.stride(2) if not diagonal else 0, V if input_columns is None else input_columns,
        H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BV=BV, DIAGONAL=diagonal, TRANSPOSE=transpose,
    )
    return out
