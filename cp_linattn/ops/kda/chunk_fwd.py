"""Chunked KDA forward: gate cumsum -> WY quantities -> state recurrence -> output.

    o = scale * qg h + Aqk v_new         (per chunk; h the fp32 state entering it)

`chunk_kda_fwd_prepare` is everything up to the state recurrence, for a whole batch or for
one `[1, T_frag, ...]` fragment: the context-parallel runtime runs it on its shard and then
`chunk_delta_rule_fwd_h` with zero / identity initial states to get (S_ext, M).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import chunk_bounds
from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.exchange import CPExchange
from cp_linattn.cp.kda import kda_cp_fwd_h
from cp_linattn.ops.common.chunk_delta_h import chunk_delta_rule_fwd_h
from cp_linattn.ops.common.chunk_h import dot_precision
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.common.intra import SAFE_SPAN, finite_or_zero, new_exact_block_bits, span_limit
from cp_linattn.ops.kda.gate import kda_gate_fwd_cumsum
from cp_linattn.ops.kda.wy import CHUNK_SIZE, SUB_CHUNK_SIZE, chunk_kda_fwd_intra
from cp_linattn.ops.launch import launch_kernel, tiles


@triton.jit
def chunk_kda_fwd_kernel_o(
    qg, v_new, h, Aqk, o,
    cu_seqlens, chunk_indices,
    scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """o = scale * qg h + Aqk v_new for one (V tile, chunk, value head); grid (cdiv(V, BV), NT, B * HV)."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    bos, seq_len, t0, i_state = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
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
        b_o += tl.dot(b_qg, b_h.to(dtype), input_precision=DOT_PRECISION)
    b_a = tl.load(Aqk + rows[:, None] * BT + o_c[None, :], mask=m_c[:, None] & (o_c < BT)[None, :], other=0)
    b_vn = tl.load(v_new + rows[:, None] * V + o_v[None, :], mask=m_cv, other=0)
    # Aqk's zeros above the diagonal would carry a non-finite v_new to earlier rows (0 * NaN):
    # the dot takes the finite entries, and the others join their own row only, as v - v (0, or
    # NaN for NaN and inf: no mask kept across the dot, which spills registers)
    b_o = b_o * scale + tl.dot(b_a.to(b_vn.dtype), finite_or_zero(b_vn), input_precision=DOT_PRECISION)
    b_o += (b_vn - b_vn).to(tl.float32)
    tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_cv)


def chunk_kda_fwd_o(
    qg: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, Aqk: torch.Tensor, scale: float,
    cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """o `[B, T, HV, V]` from qg `[B, T, HV, K]`, v_new `[B, T, HV, V]`, h fp32
    `[B, NT, HV, K, V]` and Aqk fp32 `[B, T, HV, chunk_size]`."""
    B, T, HV, K = qg.shape
    V = v_new.shape[-1]
    o = v_new.new_empty(B, T, HV, V, dtype=out_dtype or v_new.dtype)
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    BK, BV = tiles("chunk_kda_fwd_o", K, V)
    if NT * B * HV > 0:
        launch_kernel(chunk_kda_fwd_kernel_o, (triton.cdiv(V, BV), NT, B * HV), "chunk_kda_fwd_o",
            qg, v_new.to(qg.dtype).contiguous(), h, Aqk, o, cu_seqlens, chunk_indices, float(scale), T,
            HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
            IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(qg.dtype),
        )
    return o


def chunk_kda_gate_cumsum(
    g: torch.Tensor, gate: KDAGate | None = None, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None, span_limit: float = SAFE_SPAN, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 chunk-local cumsum `[B, T, HV, K]` of the log gate (applying the in-kernel gate to
    raw g first), and int32 `exact_blocks` `[NT_all, HV]`: per chunk, the bits of its 16-token
    diagonal blocks whose gate span exceeds `span_limit` (`cp_linattn.ops.common.intra`)."""
    B, T, HV, _ = g.shape
    exact_blocks = new_exact_block_bits(B, T, HV, chunk_size, chunk_indices, g.device)
    blocks = dict(exact_blocks=exact_blocks, sub_chunk_size=SUB_CHUNK_SIZE, span_limit=span_limit)
    if gate is not None:
        gk = kda_gate_fwd_cumsum(g, gate.A_log, gate.dt_bias, gate.lower_bound, chunk_size, cu_seqlens, chunk_indices,
                                 **blocks)
    else:
        gk = chunk_local_cumsum(g, chunk_size, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, **blocks)
    return gk, exact_blocks


@dataclass(frozen=True)
class KDAGate:
    """The in-kernel gate's parameters (`chunk_kda(use_gate_in_kernel=True)`): g is then the raw
    input, and the log decay `-exp(A_log) * softplus(g + dt_bias)`, or with lower_bound
    `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` (`cp_linattn.ops.kda.naive`)."""
    A_log: torch.Tensor | None  # [HV]
    dt_bias: torch.Tensor | None  # [HV * K]
    lower_bound: float | None


@dataclass
class ChunkKDAIntra:
    """The per-chunk quantities of KDA before the state recurrence (`chunk_kda_fwd_prepare`):
    gk fp32 gate cumsum `[B, T, HV, K]` and its exact_blocks (`chunk_kda_gate_cumsum`); w, qg,
    kg `[B, T, HV, K]` and u `[B, T, HV, V]` in k's dtype; Aqk and Akk (the inverse
    (I + Akk)^-1), fp32 `[B, T, HV, BT]` (BT the chunk size: `chunk_size`)."""
    gk: torch.Tensor
    exact_blocks: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    Aqk: torch.Tensor
    Akk: torch.Tensor

    @property
    def chunk_size(self) -> int:
        """The chunk size these quantities were built with (Aqk's rows hold one chunk)."""
        return self.Aqk.shape[-1]


def chunk_kda_fwd_prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    gate: KDAGate | None = None, cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> ChunkKDAIntra:
    """The per-chunk quantities of a batch (or a `[1, T_frag, ...]` fragment), before the
    state recurrence.

    Args:
        q, k: `[B, T, H, K]`, already L2-normalised if the op normalises them;
            v: `[B, T, HV, V]`; g: `[B, T, HV, K]` log gate (the raw input with `gate`);
            beta: `[B, T, HV]`; gate: the in-kernel gate's parameters, or None.
        chunk_indices: `prepare_chunk_indices(cu_seqlens, chunk_size)` when varlen.

    A fragment's transition is then `chunk_delta_rule_fwd_h(kg, w, zeros_like(w), gk,
    initial_state=I)` and its state from a zero start `chunk_delta_rule_fwd_h(kg, w, u, gk)`.
    """
    gk, exact_blocks = chunk_kda_gate_cumsum(g, gate, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                             span_limit=span_limit(k.dtype), chunk_size=chunk_size)
    w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(q, k, v, gk, beta, scale, cu_seqlens=cu_seqlens,
                                                 chunk_indices=chunk_indices, exact_blocks=exact_blocks,
                                                 chunk_size=chunk_size)
    return ChunkKDAIntra(gk=gk, exact_blocks=exact_blocks, w=w, u=u, qg=qg, kg=kg, Aqk=Aqk, Akk=Akk)


def chunk_kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False, gate: KDAGate | None = None,
    state_v_first: bool = False, cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None, cp_context: FLACPContext | None = None, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None, ChunkKDAIntra, torch.Tensor, torch.Tensor, CPExchange | None]:
    """Forward of chunked KDA on validated inputs (q, k already normalised if asked).

    Under `cp_context`, `initial_state` is the user's `[N_global, ...]` tensor and the final
    state `[N_global, ...]` holds the rows of the sequences ending here (`kda_cp_fwd_h`).

    Returns o (`[B, T, HV, V]`, v's dtype), the fp32 final state or None, the intra-chunk
    quantities, h (fp32 `[B, NT, HV, K, V]`), v_new, and under CP the exchange.
    """
    intra = chunk_kda_fwd_prepare(q, k, v, g, beta, scale, gate=gate, cu_seqlens=cu_seqlens,
                                  chunk_indices=chunk_indices, chunk_size=chunk_size)
    walk = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    exchange = None
    if cp_context is None:
        h, v_new, ht = chunk_delta_rule_fwd_h(intra.kg, intra.w, intra.u, intra.gk, initial_state=initial_state,
                                              output_final_state=output_final_state, chunk_size=chunk_size,
                                              state_v_first=state_v_first, **walk)
    else:
        h, v_new, ht, exchange = kda_cp_fwd_h(intra.kg, intra.w, intra.u, intra.gk, initial_state=initial_state,
                                              output_final_state=output_final_state, context=cp_context,
                                              state_v_first=state_v_first, chunk_size=chunk_size, **walk)
    o = chunk_kda_fwd_o(qg=intra.qg, v_new=v_new, h=h, Aqk=intra.Aqk, scale=scale, cu_seqlens=cu_seqlens,
                        chunk_indices=chunk_indices, out_dtype=v.dtype, chunk_size=chunk_size)
    return o, ht, intra, h, v_new, exchange
