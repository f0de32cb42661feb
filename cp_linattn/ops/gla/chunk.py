"""Chunked Gated Linear Attention: `S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T`, `o_t = scale S_t^T q_t`.

Per chunk of BT = 64 tokens, with b the chunk-local cumsum of g and h the state entering it:

    o_t = scale * (q_t * exp b_t)^T h + sum_{s <= t in chunk} A_ts v_s,
    A_ts = scale * sum_k q_tk k_sk exp(b_tk - b_sk).

The output kernel builds A in registers, in 16-row blocks, and stores it (scaled, in the input
dtype: exactly the operand of its dot) for the dv kernel. For the block of rows [r, r + 16)
and the columns before r the gate difference is split at b_r:
`exp(b_t - b_r) * exp(b_r - b_s)`, two factors <= 1, so any decay strength is safe and a
tensor-core dot does the work. Inside the diagonal 16 x 16 blocks the split is at each block's
middle row when the gates allow it; otherwise they are bisected, one dot per level with
factors <= 1 (`cp_linattn.ops.common.intra.diagonal_split_factors`), exact for any decay.
The gate cumsum marks the chunks whose blocks are too wide for the dot
(cp_linattn/ops/common/intra.py), and the output and dq/dk/dg
kernels run twice: compiled with the dot path for the other chunks, and with the exact path
for those.

Forward: gate cumsum, `chunk_fwd_h` (states, stored in the input dtype), output kernel.
Backward: `chunk_bwd_dh`, a dv kernel (from the stored A) and a dq/dk/dg kernel (from the
stored states). Keeping h and A costs `NT * H * K * V + T * H * 64` elements of the input
dtype per layer, and saves a second state recurrence and a second build of A. The log-gate
gradient uses `dL/db_t = q_t dq_t - k_t dk_t` for every token, and for the chunk's total decay
b_last (which every g of the chunk feeds) `dL/db_last = sum_v (h_next * dh)`, h_next the state
leaving the chunk; hence `dg = reverse_cumsum_in_chunk(q dq - k dk) + dL/db_last`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import block_offsets, chunk_bounds
from cp_linattn.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h, dot_precision
from cp_linattn.ops.common.cumsum import chunk_local_cumsum, suffix_sum
from cp_linattn.ops.common.intra import (diagonal_split_factors, finite_or_zero, launch_takes_block,
                                         new_exact_block_bits,
                                         nonfinite_part, span_limit)
from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.guard import call_signature, check_op_inputs, checked_call
from cp_linattn.cp.exchange import CPExchange
from cp_linattn.cp.gla import gla_cp_bwd_dh, gla_cp_fwd_h
from cp_linattn.ops.launch import exact_path_key, jit_traced_as, launch_kernel, tiles
from cp_linattn.ops.utils import (check_flag, check_scale, kernel_state, prepare_varlen_chunks, refuse_double_backward,
                                  save_for_backward, saved_tensors, transpose_state)

CHUNK_SIZE = 64
SUB_CHUNK_SIZE = 16


@triton.jit
def program_chunk(cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The chunk of a program of grid (tiles, NT, B * H): (i_h, its index in the state tensors,
    the tokens left in its sequence from its start, its first row in the flat (token, head)
    row space, the chunk-local row offsets and their mask)."""
    i_t, i_bh = tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos, seq_len, t0, state_index = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    # t0 in int64, like the offsets it enters: fewer register spills than with chunk_bounds's int32
    t0 = t0.to(tl.int64)
    chunk_len = seq_len - t0
    o_i = tl.arange(0, BT)
    return i_h, state_index, chunk_len, (bos + t0) * H + i_h, o_i, o_i < chunk_len


@triton.jit
def chunk_tile(i_d, chunk_row0, o_i, m_t, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Block i_d of a head dim of D: (its offsets, their mask, the [BT, BD] mask and offsets
    of the chunk's rows in a `[B, T, H, D]` tensor)."""
    o_d, m_d, m_td = block_offsets(i_d, BD, D, m_t)
    return o_d, m_d, m_td, (chunk_row0 + o_i[:, None] * H) * D + o_d[None, :]


@triton.jit
def offset_from_block_middle(gk, b_g, o_k, m_tk, o_i, chunk_row0, chunk_len, H: tl.constexpr, K: tl.constexpr,
                             BC: tl.constexpr):
    """b - b_m per entry of a [BT, BK] gate tile, m the middle row of the row's BC-block
    (0 on padding): the split point of the diagonal blocks' dot path."""
    o_mid = tl.minimum((o_i // BC) * BC + BC // 2, chunk_len - 1)
    b_mid = tl.load(gk + (chunk_row0 + o_mid[:, None] * H) * K + o_k[None, :], mask=m_tk, other=0)
    return tl.where(m_tk, b_g - b_mid, 0)


@triton.jit
def intra_chunk_scores(
    k, gk, b_q, b_g, o_k, m_k, o_i, m_t, chunk_row0, chunk_len, H: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    """Causal `sum_k q_tk k_sk exp(b_tk - b_sk)` over one key-channel block, [BT, BT] fp32.

    b_q, b_g: fp32 [BT, BK] tiles of q and the gate cumsum; chunk_row0: index of the chunk's
    first row in the flat (token, head) row space; rows at or past chunk_len are padding.
    The diagonal blocks by a dot split at their middle rows, or with EXACT_DIAGONAL by the four
    dots of their bisection (`diagonal_split_factors`).
    """
    dtype = k.dtype.element_ty
    m_tk = m_t[:, None] & m_k[None, :]
    b_k = tl.load(k + (chunk_row0 + o_i[:, None] * H) * K + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
    b_a = tl.zeros([BT, BT], dtype=tl.float32)
    for i_c in tl.static_range(1, BT // BC):
        ref_valid = i_c * BC < chunk_len
        b_ref = tl.load(gk + (chunk_row0 + i_c * BC * H) * K + o_k, mask=m_k & ref_valid, other=0)
        # A non-finite gate at or before the reference row would make every key factor NaN, and
        # the zero query factors off the block would pass it to earlier rows (0 * NaN): with -inf
        # instead the keys before the gate get 0 (the rows of the block are NaN through b_g).
        b_ref = tl.where(tl.abs(b_ref) < float("inf"), b_ref, float("-inf"))
        in_block = (o_i >= i_c * BC) & (o_i < i_c * BC + BC) & m_t
        before = (o_i < i_c * BC) & ref_valid
        # Masking the exponent (not the product) keeps exp from overflowing off the block.
        b_q_ref = b_q * tl.exp(tl.where(in_block[:, None], b_g - b_ref[None, :], float("-inf")))
        b_k_ref = b_k * tl.exp(tl.where(before[:, None], b_ref[None, :] - b_g, float("-inf")))
        b_a += tl.dot(b_q_ref.to(dtype), tl.trans(b_k_ref.to(dtype)), input_precision=DOT_PRECISION)
    if not EXACT_DIAGONAL:
        b_rel = offset_from_block_middle(gk, b_g, o_k, m_tk, o_i, chunk_row0, chunk_len, H, K, BC)
        b_diag = tl.dot((b_q * tl.exp(b_rel)).to(dtype), tl.trans((b_k * tl.exp(-b_rel)).to(dtype)),
                        input_precision=DOT_PRECISION)
        in_diagonal = (o_i[:, None] // BC == o_i[None, :] // BC) & (o_i[:, None] >= o_i[None, :])
        b_a += tl.where(in_diagonal, b_diag, 0)
    else:
        for level in range(4):
            b_rowfac, b_colfac, pairs = diagonal_split_factors(
                gk + chunk_row0 * K, H * K, b_g, o_i, m_t, o_k, m_k, chunk_len, level, True, BC)
            b_split = tl.dot((b_q * b_rowfac).to(dtype), tl.trans((b_k * b_colfac).to(dtype)),
                             input_precision=DOT_PRECISION)
            b_a += tl.where(pairs, b_split, 0)
        # the bisection leaves out t == s, decay 1
        b_a += tl.where(o_i[:, None] == o_i[None, :], tl.sum(b_q * b_k, axis=1)[:, None], 0)
    # A non-finite q or k row reaches the whole row / column through the zero factors of the
    # blocks (0 * NaN): a select keeps it out of the entries above the diagonal.
    return tl.where(o_i[:, None] >= o_i[None, :], b_a, 0)


@jit_traced_as("EXACT_DIAGONAL", "chunk_gla_fwd_kernel_o_exact")
def chunk_gla_fwd_kernel_o(
    q, k, v, gk, exact_blocks, h, o, A, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    """o = scale * (q * exp b) h + A v for one [BT, BV] tile, and A = scale * scores (the
    rounded dot operand, stored for dv); grid (cdiv(V, BV), NT, B * H). With several V tiles
    each writes the same A. Runs the chunks whose entry of exact_blocks (int32 `[NT_all, H]`) is
    nonzero if EXACT_DIAGONAL (exact diagonal blocks), the others if not."""
    i_v = tl.program_id(0)
    i_h, state_index, chunk_len, chunk_row0, o_i, m_t = program_chunk(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    if not launch_takes_block(tl.load(exact_blocks + state_index * H + i_h), EXACT_DIAGONAL):
        return
    dtype = q.dtype.element_ty
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    h_base = h + (state_index * H + i_h) * K * V

    b_a = tl.zeros([BT, BT], dtype=tl.float32)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k, m_k, m_tk, offs = chunk_tile(i_k, chunk_row0, o_i, m_t, H, K, BK)
        b_q = tl.load(q + offs, mask=m_tk, other=0).to(tl.float32)
        b_g = tl.load(gk + offs, mask=m_tk, other=0)
        b_a += intra_chunk_scores(k, gk, b_q, b_g, o_k, m_k, o_i, m_t, chunk_row0, chunk_len,
                                  H, K, BT, BC, DOT_PRECISION, EXACT_DIAGONAL)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_q_start = tl.where(m_tk, b_q * tl.exp(b_g), 0)
        b_o += tl.dot(b_q_start.to(dtype), b_h.to(dtype), input_precision=DOT_PRECISION)
    b_a = (b_a * scale).to(dtype)
    # the [BT, BV] offsets only after the K loop: a shorter live range, fewer registers in it
    _, _, m_tv, v_offs = chunk_tile(i_v, chunk_row0, o_i, m_t, H, V, BV)
    tl.store(A + (chunk_row0 + o_i[:, None] * H) * BT + o_i[None, :], b_a, mask=m_t[:, None])
    b_v = tl.load(v + v_offs, mask=m_tv, other=0)
    # A's zeros above the diagonal would carry a non-finite v to earlier rows (0 * NaN): the dot
    # takes the finite entries, and the others join their own row only
    b_o = b_o * scale + tl.dot(b_a, finite_or_zero(b_v), input_precision=DOT_PRECISION)
    # (read again: keeping the tile alive across the dot spills more registers)
    b_o += nonfinite_part(tl.load(v + v_offs, mask=m_tv, other=0))
    tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def chunk_gla_bwd_kernel_dv(
    k, gk, A, do, dh, dv, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dv = A^T do + (k * exp(b_last - b)) dh for one [BT, BV] tile, A the forward's scaled
    scores; grid like the output."""
    i_v = tl.program_id(0)
    i_h, state_index, chunk_len, chunk_row0, o_i, m_t = program_chunk(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    dtype = k.dtype.element_ty
    last_row = chunk_row0 + (tl.minimum(chunk_len, BT) - 1) * H
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    dh_base = dh + (state_index * H + i_h) * K * V

    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k, m_k, m_tk, offs = chunk_tile(i_k, chunk_row0, o_i, m_t, H, K, BK)
        b_k = tl.load(k + offs, mask=m_tk, other=0).to(tl.float32)
        b_g = tl.load(gk + offs, mask=m_tk, other=0)
        b_g_last = tl.load(gk + last_row * K + o_k, mask=m_k, other=0)
        b_k_end = tl.where(m_tk, b_k * tl.exp(b_g_last[None, :] - b_g), 0)
        b_dh = tl.load(dh_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_dv += tl.dot(b_k_end.to(dtype), b_dh.to(dtype), input_precision=DOT_PRECISION)
    b_a = tl.load(A + (chunk_row0 + o_i[:, None] * H) * BT + o_i[None, :], mask=m_t[:, None], other=0)
    _, _, m_tv, v_offs = chunk_tile(i_v, chunk_row0, o_i, m_t, H, V, BV)  # after the loop, as in the output kernel
    b_do = tl.load(do + v_offs, mask=m_tv, other=0)
    b_dv += tl.dot(tl.trans(b_a), b_do, input_precision=DOT_PRECISION)
    tl.store(dv + v_offs, b_dv.to(dv.dtype.element_ty), mask=m_tv)


@jit_traced_as("EXACT_DIAGONAL", "chunk_gla_bwd_kernel_dqkg_exact")
def chunk_gla_bwd_kernel_dqkg(
    q, k, v, gk, exact_blocks, h, do, dh, dq, dk, dg, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    """dq, dk and dg for one [BT, BK] tile; grid (cdiv(K, BK), NT, B * H). The chunks of
    nonzero exact_blocks entries if EXACT_DIAGONAL (exact diagonal blocks), the others if not, as the output
    kernel."""
    i_k = tl.program_id(0)
    i_h, state_index, chunk_len, chunk_row0, o_i, m_t = program_chunk(cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    if not launch_takes_block(tl.load(exact_blocks + state_index * H + i_h), EXACT_DIAGONAL):
        return
    dtype = q.dtype.element_ty
    last_row = chunk_row0 + (tl.minimum(chunk_len, BT) - 1) * H
    o_k, m_k, m_tk, offs = chunk_tile(i_k, chunk_row0, o_i, m_t, H, K, BK)
    b_q = tl.load(q + offs, mask=m_tk, other=0).to(tl.float32)
    b_k = tl.load(k + offs, mask=m_tk, other=0).to(tl.float32)
    b_g = tl.load(gk + offs, mask=m_tk, other=0)
    b_g_last = tl.load(gk + last_row * K + o_k, mask=m_k, other=0)
    state_base = (state_index * H + i_h) * K * V

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_h_dh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_v, m_tv, v_offs = chunk_tile(i_v, chunk_row0, o_i, m_t, H, V, BV)
        b_do = tl.load(do + v_offs, mask=m_tv, other=0)
        b_v = tl.load(v + v_offs, mask=m_tv, other=0)
        m_kv = m_k[:, None] & m_v[None, :]
        s_offs = state_base + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(h + s_offs, mask=m_kv, other=0)
        b_dh = tl.load(dh + s_offs, mask=m_kv, other=0)
        b_dq += tl.dot(b_do, tl.trans(b_h.to(dtype)), input_precision=DOT_PRECISION)
        b_dk += tl.dot(b_v, tl.trans(b_dh.to(dtype)), input_precision=DOT_PRECISION)
        b_da += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
        b_h_dh += tl.sum(b_h * b_dh, axis=1)
    b_da = tl.where((o_i[:, None] >= o_i[None, :]) & m_t[:, None], b_da * scale, 0)
    b_dq = tl.where(m_tk, b_dq * tl.exp(b_g) * scale, 0)
    b_dk = tl.where(m_tk, b_dk * tl.exp(b_g_last[None, :] - b_g), 0)
    # Gradient of b_last, all of it through the state leaving the chunk.
    b_dg_last = b_h_dh * tl.exp(b_g_last) + tl.sum(b_dk * b_k, axis=0)

    for i_c in tl.static_range(1, BT // BC):
        ref_valid = i_c * BC < chunk_len
        b_ref = tl.load(gk + (chunk_row0 + i_c * BC * H) * K + o_k, mask=m_k & ref_valid, other=0)
        in_block = (o_i >= i_c * BC) & (o_i < i_c * BC + BC) & m_t
        before = (o_i < i_c * BC) & ref_valid
        b_decay_q = tl.exp(tl.where(in_block[:, None], b_g - b_ref[None, :], float("-inf")))
        b_decay_k = tl.exp(tl.where(before[:, None], b_ref[None, :] - b_g, float("-inf")))
        b_da_block = tl.where(in_block[:, None] & (o_i[None, :] < i_c * BC), b_da, 0).to(dtype)
        # selects, not the zero factors, off the block's rows and columns: 0 * NaN would carry a
        # non-finite input to the rows outside them
        b_k_ref = tl.where(before[:, None], b_k * b_decay_k, 0).to(dtype)
        b_q_ref = tl.where(in_block[:, None], b_q * b_decay_q, 0).to(dtype)
        b_dq += tl.where(in_block[:, None], b_decay_q * tl.dot(b_da_block, b_k_ref, input_precision=DOT_PRECISION), 0)
        b_dk += tl.where(before[:, None], b_decay_k * tl.dot(tl.trans(b_da_block), b_q_ref, input_precision=DOT_PRECISION),
                         0)
    # The diagonal blocks: the middle split, or with EXACT_DIAGONAL the four levels of their bisection.
    # The t == s terms (decay 1) are added exactly, outside the dots: in dg = q dq - k dk they
    # cancel, and under strong decay they dominate, so bf16-rounded dot operands would leave
    # their rounding as dg's error.
    on_diagonal = o_i[:, None] == o_i[None, :]
    b_da_self = tl.sum(tl.where(on_diagonal, b_da, 0), axis=1)
    b_da_strict = tl.where((o_i[:, None] // BC == o_i[None, :] // BC) & ~on_diagonal, b_da, 0).to(dtype)
    for level in range(1 + 3 * EXACT_DIAGONAL):
        if EXACT_DIAGONAL:
            b_rowfac, b_colfac, pairs = diagonal_split_factors(
                gk + chunk_row0 * K, H * K, b_g, o_i, m_t, o_k, m_k, chunk_len, level, True, BC)
            b_da_split = tl.where(pairs, b_da_strict, 0)
        else:
            b_rel = offset_from_block_middle(gk, b_g, o_k, m_tk, o_i, chunk_row0, chunk_len, H, K, BC)
            b_rowfac, b_colfac, b_da_split = tl.exp(b_rel), tl.exp(-b_rel), b_da_strict
        b_dq += b_rowfac * tl.dot(b_da_split, finite_or_zero(b_k * b_colfac).to(dtype), input_precision=DOT_PRECISION)
        b_dk += b_colfac * tl.dot(tl.trans(b_da_split), finite_or_zero(b_q * b_rowfac).to(dtype),
                                  input_precision=DOT_PRECISION)
    b_dq += b_da_self[:, None] * b_k
    b_dk += b_da_self[:, None] * b_q

    b_dg_token = tl.where(m_tk, b_q * b_dq - b_k * b_dk, 0)
    b_dg, _ = suffix_sum(b_dg_token, BT)
    b_dg += b_dg_last[None, :]
    tl.store(dq + offs, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def _launch_shape(kernel: str, q: torch.Tensor, v: torch.Tensor):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return B, T, H, K, V, *tiles(kernel, K, V)


def chunk_gla_gate_cumsum(
    g: torch.Tensor, dtype: torch.dtype, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 chunk-local cumsum `[B, T, H, K]` of the log gate g, and int32 `exact_blocks`
    `[NT_all, H]`: the chunks whose diagonal blocks are too wide for the dot path with
    operands of `dtype` (`cp_linattn.ops.common.intra`)."""
    B, T, H, _ = g.shape
    exact_blocks = new_exact_block_bits(B, T, H, CHUNK_SIZE, chunk_indices, g.device)
    gk = chunk_local_cumsum(g, CHUNK_SIZE, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
    exact_blocks=exact_blocks,
                            sub_chunk_size=SUB_CHUNK_SIZE, span_limit=span_limit(dtype))
    return gk, exact_blocks


def chunk_gla_fwd_o(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, exact_blocks: torch.Tensor, h: torch.Tensor,
    scale: float, cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output `[B, T, H, V]` (v's dtype) from the gate cumsum gk (fp32) and its exact_blocks bits
    (`chunk_gla_gate_cumsum`) and the states h
    (`[B, NT, H, K, V]`, state before each chunk, from `chunk_fwd_h`); and the scaled
    intra-chunk scores A `[B, T, H, CHUNK_SIZE]` in q's dtype (row t of a chunk holds
    `scale * sum_k q_tk k_sk exp(b_tk - b_sk)` for its keys s <= t, zeros after), which dv reads."""
    NT = h.shape[1]
    o = torch.empty_like(v)
    A = q.new_empty(*q.shape[:3], CHUNK_SIZE)
    if NT > 0:
        for exact in (False, True):  # each chunk runs in one of them
            kernel = exact_path_key("chunk_gla_fwd_o", exact)
            B, T, H, K, V, BK, BV = _launch_shape(kernel, q, v)
            launch_kernel(chunk_gla_fwd_kernel_o, (triton.cdiv(V, BV), NT, B * H), kernel,
                q, k, v, gk, exact_blocks, h, o, A, cu_seqlens, chunk_indices, scale, T,
                H=H, K=K, V=V, BT=CHUNK_SIZE, BC=SUB_CHUNK_SIZE, BK=BK, BV=BV,
                IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(q.dtype), EXACT_DIAGONAL=exact,
            )
    return o, A


def chunk_gla_bwd_dv(
    k: torch.Tensor, gk: torch.Tensor, A: torch.Tensor, do: torch.Tensor, dh: torch.Tensor,
    cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """dv `[B, T, H, V]` in do's dtype; A from `chunk_gla_fwd_o`, dh fp32 `[B, NT, H, K, V]`
    from `chunk_bwd_dh`."""
    B, T, H, K, V, BK, BV = _launch_shape("chunk_gla_bwd_dv", k, do)
    NT = dh.shape[1]
    dv = torch.empty_like(do)
    if NT > 0:
        launch_kernel(chunk_gla_bwd_kernel_dv, (triton.cdiv(V, BV), NT, B * H), "chunk_gla_bwd_dv",
            k, gk, A, do, dh, dv, cu_seqlens, chunk_indices, T,
            H=H, K=K, V=V, BT=CHUNK_SIZE, BK=BK, BV=BV,
            IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype),
        )
    return dv


def chunk_gla_bwd_dqkg(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, exact_blocks: torch.Tensor, h: torch.Tensor,
    do: torch.Tensor, dh: torch.Tensor, scale: float,
    cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    dg_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk (q's dtype) and dg (`dg_dtype`; accumulated in fp32), all `[B, T, H, K]`;
    gk and exact_blocks from `chunk_gla_gate_cumsum`."""
    NT = h.shape[1]
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty_like(gk, dtype=dg_dtype)
    if NT > 0:
        for exact in (False, True):  # each chunk runs in one of them
            kernel = exact_path_key("chunk_gla_bwd_dqkg", exact)
            B, T, H, K, V, BK, BV = _launch_shape(kernel, q, v)
            launch_kernel(chunk_gla_bwd_kernel_dqkg, (triton.cdiv(K, BK), NT, B * H), kernel,
                q, k, v, gk, exact_blocks, h, do, dh, dq, dk, dg, cu_seqlens, chunk_indices, scale, T,
                H=H, K=K, V=V, BT=CHUNK_SIZE, BC=SUB_CHUNK_SIZE, BK=BK, BV=BV,
                IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(q.dtype), EXACT_DIAGONAL=exact,
            )
    return dq, dk, dg


@dataclass
class ChunkGLASaved:
    """What the forward keeps for the backward: the inputs, the gate cumsum and its exact
    blocks, the per-chunk states h and the scaled intra-chunk scores A, the varlen tables."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gk: torch.Tensor
    exact_blocks: torch.Tensor
    h: torch.Tensor
    A: torch.Tensor
    cu_seqlens: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


def chunk_gla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None,
    cp_context: FLACPContext | None = None, state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, ChunkGLASaved, CPExchange | None]:
    """Forward of chunked GLA on validated, contiguous inputs: gate cumsum, states, output.
    initial_state and the final state are `[N, H, V, K]` with state_v_first.

    Returns o, the final state (or None), what the backward reads, and under CP the exchange."""
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    gk, exact_blocks = chunk_gla_gate_cumsum(g, q.dtype, **varlen)
    # States in q's dtype: the output and dq kernels cast them to that dtype anyway.
    walk = dict(chunk_offsets=chunk_offsets, chunk_size=CHUNK_SIZE, states_dtype=q.dtype, **varlen)
    exchange = None
    if cp_context is None:
        h, ht, _ = chunk_fwd_h(k, v, gk, h0=initial_state, output_final_state=output_final_state,
                               state_v_first=state_v_first, **walk)
    else:
        # cp/ exchanges K-first states: the user's [N, H, V, K] states are turned round at its edge
        h, ht, exchange = gla_cp_fwd_h(k, v, gk, initial_state=transpose_state(initial_state, state_v_first),
                                       output_final_state=output_final_state, context=cp_context, **walk)
        ht = transpose_state(ht, state_v_first)
    o, A = chunk_gla_fwd_o(q=q, k=k, v=v, gk=gk, exact_blocks=exact_blocks, h=h, scale=scale, **varlen)
    return o, ht, ChunkGLASaved(q, k, v, gk, exact_blocks, h, A, cu_seqlens, chunk_indices, chunk_offsets), exchange


def chunk_gla_bwd(
    do: torch.Tensor, dht: torch.Tensor | None, saved: ChunkGLASaved, scale: float, need_dh0: bool,
    g_dtype: torch.dtype, exchange: CPExchange | None = None, state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of chunked GLA: state gradients, dv, then dq, dk, dg (in `g_dtype`).

    need_dh0: the user passed an initial state. Under CP `exchange` is the forward's.
    dht and dh0 are `[N, H, V, K]` with state_v_first.
    Returns dq, dk, dv, dg and the initial state's gradient (fp32) or None."""
    varlen = dict(cu_seqlens=saved.cu_seqlens, chunk_indices=saved.chunk_indices)
    walk = dict(chunk_offsets=saved.chunk_offsets, chunk_size=CHUNK_SIZE, **varlen)
    do = do.to(saved.q.dtype).contiguous()
    if exchange is None:
        dh, dh0, _ = chunk_bwd_dh(saved.q, saved.gk, do, scale, dht=dht, need_dh0=need_dh0,
                                  state_v_first=state_v_first, **walk)
    else:
        dh, dh0 = gla_cp_bwd_dh(saved.q, saved.gk, do, scale, dht=transpose_state(dht, state_v_first),
                                need_dh0=need_dh0, exchange=exchange, **walk)
        dh0 = transpose_state(dh0, state_v_first)
    dv = chunk_gla_bwd_dv(k=saved.k, gk=saved.gk, A=saved.A, do=do, dh=dh, **varlen)
    dq, dk, dg = chunk_gla_bwd_dqkg(q=saved.q, k=saved.k, v=saved.v, gk=saved.gk, exact_blocks=saved.exact_blocks,
                                    h=saved.h, do=do, dh=dh, scale=scale, dg_dtype=g_dtype, **varlen)
    return dq, dk, dv, dg, dh0


class ChunkGLAFunction(torch.autograd.Function):
    """Autograd over `chunk_gla_fwd` / `chunk_gla_bwd`; inputs are validated and contiguous.
    Under CP the state chain crosses ranks in `cp_linattn.cp.gla` (cp/README.md)."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
                cp_context):
        chunk_indices = chunk_offsets = None
        if cu_seqlens is not None:
            chunk_indices, chunk_offsets = prepare_varlen_chunks(cu_seqlens, cu_seqlens_cpu, CHUNK_SIZE)
        o, ht, saved, exchange = chunk_gla_fwd(q, k, v, g, scale, initial_state=initial_state,
                                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                               chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                                               cp_context=cp_context, state_v_first=state_v_first)
        save_for_backward(ctx, saved)
        ctx.options = dict(scale=scale, need_dh0=initial_state is not None, g_dtype=g.dtype, exchange=exchange,
                           state_v_first=state_v_first)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        refuse_double_backward("chunk_gla")
        dq, dk, dv, dg, dh0 = chunk_gla_bwd(do, dht, saved_tensors(ctx), **ctx.options)
        return dq, dk, dv, dg, None, dh0, None, None, None, None, None


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: FLACPContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated Linear Attention with chunked Triton kernels (forward and backward). Keyword (and
    position) compatible with `fla.ops.gla.chunk_gla`; `cp_context` is ours.

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, H, V]`; one dtype of fp32/fp16/bf16.
        g: `[B, T, H, K]` log decay (natural log, <= 0), any float dtype.
        scale: defaults to `K ** -0.5`.
        initial_state: `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`; any float dtype,
            used in fp32), N = B or the number of sequences of `cu_seqlens`.
        output_final_state: also return the fp32 final states (same layout as initial_state).
        state_v_first: states laid out `[V, K]` per head, as FLA's `state_v_first`.
        cu_seqlens: int32 or int64 `[N + 1]` offsets of a packed batch (B == 1).
        cu_seqlens_cpu: the same offsets on the CPU (int32 or int64), to spare the one
            device-to-host read of cu_seqlens. Without it that read happens once per cu_seqlens
            tensor (and again after an in-place change of it), not once per call: the layers of a
            model share it. With it, or without cu_seqlens, forward and backward make no
            device-to-host copy (tests/ops/test_host_sync.py).
        cp_context: context parallelism (`cp_linattn.cp.build_cp_context`): q, k, v, g are this
            rank's shard `[1, T_local, ...]` of the global packed batch (its tokens in the
            context's layout), and the result is
            exactly this rank's slice of the single-rank result. `cu_seqlens` is then taken
            from the context (if given, it must be the global offsets the context was built
            from). `initial_state` is `[N_global, H, K, V]`, the same on every rank, each row
            applied on the rank where its sequence starts; its gradient on each rank holds the
            rows of the sequences starting there (the sum over the group is the full gradient).
            The final state is `[N_global, H, K, V]` on every rank with the rows of the
            sequences that END on this rank filled and zeros elsewhere: summing over the group
            gives every final state. Every rank of the group must call the op (collective).

    Returns:
        o `[B, T, H, V]` in q's dtype, and the final state (fp32, `[N, H, K, V]` or with
        `state_v_first` `[N, H, V, K]`) or None.
    """
    def check():
        flags = {name: check_flag(name, value) for name, value in (
            ("output_final_state", output_final_state), ("state_v_first", state_v_first))}
        dims = check_op_inputs(q, k, v, g, initial_state=initial_state, cu_seqlens=cu_seqlens,
                               cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context,
                               state_v_first=flags["state_v_first"])
        return dims, check_scale(scale, dims.K), flags

    dims, scale, flags = checked_call(
        "chunk_gla", cp_context, check,
        lambda call: call_signature(cp_context, call[0], q, g, call[1], initial_state, **call[2]))
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    return ChunkGLAFunction.apply(q, k, v, g, scale, kernel_state(initial_state), flags["output_final_state"],
                                  flags["state_v_first"], dims.cu_seqlens, dims.cu_seqlens_cpu, cp_context)
