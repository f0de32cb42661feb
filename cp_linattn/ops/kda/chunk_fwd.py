"""Chunked KDA forward: gate cumsum -> WY quantities -> state recurrence -> output.

    o = scale * qg h + Aqk v_new         (per chunk; h the fp32 state entering it)

`chunk_kda_fwd_prepare` is everything up to the state recurrence, for a whole batch or for
one `[1, T_frag, ...]` fragment: the context-parallel runtime runs it on its shard and then
`chunk_delta_rule_fwd_h` with zero / identity initial states to get (S_ext, M).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.state import expand_h0, kda_incoming_state, scatter_final_state, send_final_state
from cp_linattn.ops.common.chunk_delta_h import chunk_delta_rule_fwd_h, chunk_span
from cp_linattn.ops.common.chunk_h import dot_precision
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.common.intra import SAFE_SPAN, finite_or_zero, new_wide_bits, span_limit
from cp_linattn.ops.kda.gate import kda_gate_chunk_cumsum
from cp_linattn.ops.kda.wy import CHUNK_SIZE, SUB_CHUNK_SIZE, kda_intra_wy_fwd
from cp_linattn.ops.launch import launch_options, tiles

L2NORM_EPS = 1e-6


@triton.jit
def l2norm_kernel(
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
        l2norm_kernel[(triton.cdiv(n_rows, BR),)](x, y, dy, dx, n_rows, D=D, BD=BD, BR=BR, eps=L2NORM_EPS,
                                                   BACKWARD=backward)


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


@triton.jit
def kda_output_kernel(
    qg, v_new, h, Aqk, o,
    cu_seqlens, chunk_indices,
    scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """o = scale * qg h + Aqk v_new for one (V tile, chunk, value head); grid (cdiv(V, BV), NT, B * HV)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    bos, seq_len, t0, i_state = chunk_span(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    o_c = tl.arange(0, BT)
    m_c = o_c < seq_len - t0
    rows = (bos + t0 + o_c) * HV + i_hv
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_cv = m_c[:, None] & m_v[None, :]
    dtype = qg.dtype.element_ty
    h_base = h + (i_state * HV + i_hv) * K * V

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_qg = tl.load(qg + rows[:, None] * K + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_o += tl.dot(b_qg, b_h.to(dtype), input_precision=DOT_PREC)
    b_a = tl.load(Aqk + rows[:, None] * BT + o_c[None, :], mask=m_c[:, None] & (o_c < BT)[None, :], other=0)
    b_vn = tl.load(v_new + rows[:, None] * V + o_v[None, :], mask=m_cv, other=0)
    # Aqk's zeros above the diagonal would carry a non-finite v_new to earlier rows (0 * NaN):
    # the dot takes the finite entries, and the others join their own row only, as v - v (0, or
    # NaN for NaN and inf: no mask kept across the dot, which spills registers)
    b_o = b_o * scale + tl.dot(b_a.to(b_vn.dtype), finite_or_zero(b_vn), input_precision=DOT_PREC)
    b_o += (b_vn - b_vn).to(tl.float32)
    tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_cv)


def kda_output(
    qg: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    Aqk: torch.Tensor,
    scale: float,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """o `[B, T, HV, V]` from qg `[B, T, HV, K]`, v_new `[B, T, HV, V]`, h fp32
    `[B, NT, HV, K, V]` and Aqk fp32 `[B, T, HV, 64]`."""
    B, T, HV, K = qg.shape
    V = v_new.shape[-1]
    o = v_new.new_empty(B, T, HV, V, dtype=out_dtype or v_new.dtype)
    NT = triton.cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    BK, BV = tiles("kda_output", K, V)
    if NT * B * HV > 0:
        kda_output_kernel[(triton.cdiv(V, BV), NT, B * HV)](
            qg, v_new.to(qg.dtype).contiguous(), h, Aqk, o, cu_seqlens, chunk_indices, float(scale), T,
            HV=HV, K=K, V=V, BT=CHUNK_SIZE, BK=BK, BV=BV,
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(qg.dtype), **launch_options("kda_output"),
        )
    return o


def kda_gate_cumsum(
    g: torch.Tensor,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    span_limit: float = SAFE_SPAN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 chunk-local cumsum `[B, T, HV, K]` of the log gate (applying the in-kernel gate to
    raw g first), and int32 `wide` `[NT_all, HV]`: per chunk, the bits of its 16-token
    diagonal blocks whose gate span exceeds `span_limit` (`cp_linattn.ops.common.intra`)."""
    B, T, HV, _ = g.shape
    wide = new_wide_bits(B, T, HV, CHUNK_SIZE, chunk_indices, g.device)
    blocks = dict(wide=wide, sub_chunk_size=SUB_CHUNK_SIZE, span_limit=span_limit)
    if use_gate_in_kernel:
        gk = kda_gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, CHUNK_SIZE, cu_seqlens, chunk_indices, **blocks)
    else:
        gk = chunk_local_cumsum(g, CHUNK_SIZE, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, **blocks)
    return gk, wide


def chunk_kda_fwd_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The per-chunk quantities of a batch (or a `[1, T_frag, ...]` fragment), before the
    state recurrence.

    Args:
        q, k: `[B, T, H, K]`, already L2-normalised if the op normalises them;
            v: `[B, T, HV, V]`; g: `[B, T, HV, K]` log gate (raw input if use_gate_in_kernel);
            beta: `[B, T, HV]`; A_log `[HV]`, dt_bias `[HV * K]`, lower_bound: the in-kernel gate.
        chunk_indices: `prepare_chunk_indices(cu_seqlens, 64)` when varlen.

    Returns a dict with gk (fp32 gate cumsum `[B, T, HV, K]`), wide (`kda_gate_cumsum`), w,
    qg, kg (`[B, T, HV, K]`, k's dtype), u (`[B, T, HV, V]`), Aqk and Akk (the inverse
    (I + Akk)^-1), fp32 `[B, T, HV, 64]`. The fragment's transition is then
    `chunk_delta_rule_fwd_h(kg, w, zeros_like(w), gk, initial_state=I)` and its state from a
    zero start `chunk_delta_rule_fwd_h(kg, w, u, gk)`.
    """
    gk, wide = kda_gate_cumsum(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices,
                               span_limit(k.dtype))
    w, u, qg, kg, Aqk, Akk = kda_intra_wy_fwd(q, k, v, gk, beta, scale, cu_seqlens, chunk_indices, wide=wide)
    return dict(gk=gk, wide=wide, w=w, u=u, qg=qg, kg=kg, Aqk=Aqk, Akk=Akk)


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    cp_context: FLACPContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Forward of chunked KDA on validated inputs (q, k already normalised if asked).

    Under `cp_context`, `initial_state` is the user's `[N_global, ...]` tensor: the state
    entering this rank's first sequence comes from the boundary exchange (cp/state.py) and
    the final state is `[N_global, ...]` with the rows of the sequences ending here.

    Returns o (`[B, T, HV, V]`, v's dtype), the fp32 final state or None, and the
    intermediates (`chunk_kda_fwd_prepare`'s plus h, v_new and, under CP, the
    exchange record `cp_record`) for the backward.
    """
    saved = chunk_kda_fwd_prepare(q, k, v, g, beta, scale, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                                  cu_seqlens, chunk_indices)
    h0, record = initial_state, None
    # A rank that receives no state runs its local pass first: that pass yields its message.
    sends_after_pass = cp_context is not None and not cp_context.pre_num_ranks
    if cp_context is not None:
        S_in = None
        if not sends_after_pass:
            S_in, record = kda_incoming_state(saved["kg"], saved["w"], saved["u"], saved["gk"], initial_state,
                                              cp_context, state_v_first)
            if state_v_first:
                S_in = S_in.transpose(-1, -2)
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        h0 = expand_h0(S_in, initial_state, cp_context, (HV, V, K) if state_v_first else (HV, K, V))
    h, v_new, final_state = chunk_delta_rule_fwd_h(
        saved["kg"], saved["w"], saved["u"], saved["gk"], h0, output_final_state or sends_after_pass,
        cu_seqlens, chunk_indices, chunk_offsets, CHUNK_SIZE, state_v_first,
    )
    if sends_after_pass:
        record = send_final_state(final_state, cp_context, diagonal=False, state_v_first=state_v_first)
    o = kda_output(saved["qg"], v_new, h, saved["Aqk"], scale, cu_seqlens, chunk_indices, out_dtype=v.dtype)
    if cp_context is not None:
        final_state = scatter_final_state(final_state, cp_context, cp_context.global_num_seqs, initial_state) \
            if output_final_state else None
    saved.update(h=h, v_new=v_new, cp_record=record)
    return o, final_state, saved
