"""Intra-chunk part of KDA: the WY representation of one chunk's delta-rule updates.

Per chunk of BT = 64 (or 32) tokens, value head and chunk-local gate cumsum gk (all `[BT, K]`):

    Akk[i, j] = beta_i * sum_c k_ic k_jc exp(gk_ic - gk_jc)     i > j   (strictly lower)
    Aqk[i, j] = scale  * sum_c q_ic k_jc exp(gk_ic - gk_jc)     i >= j
    A         = (I + Akk)^-1
    w = A (beta * k * exp(gk)),   u = A (beta * v),   qg = q * exp(gk),
    kg = k * exp(gk_last - gk)

so that with h the state entering the chunk, the chunk's new values are `v_new = u - w h`
(`cp_linattn.ops.common.chunk_delta_h`) and its output `o = scale * qg h + Aqk v_new`.

Overflow: exp(gk_i - gk_j) <= 1 for i >= j, but exp(gk_i) exp(-gk_j) is not usable with
strong decay. Rows come in sub-chunks of BC = 16; for a row i of sub-chunk I (first row f) and
a column j of an earlier sub-chunk J (last row l) the difference is split in three,
`exp(gk_i - gk_f) * exp(gk_f - gk_l) * exp(gk_l - gk_j)`, every factor <= 1, so a tensor-core
dot handles each of the six (one with BT = 32) off-diagonal 16 x 16 blocks; the first and last factors are formed
once per sub-chunk, the middle one is a K-vector per pair. The diagonal 16 x 16 blocks split
at their middle row and take a dot too when the gates' span allows it (log-sigmoid gates and
the safe gate with lower_bound >= -5 do); otherwise the block is bisected four times, one
dot per level with factors <= 1 (`diagonal_split_factors`). The span is measured where the
gate cumsum is formed (the `exact_blocks` bits, cp_linattn/ops/common/intra.py) and the
kernel is launched twice, once compiled with the dot path for the chunks whose blocks all fit
and once with the exact path for the others.

The inverse is formed by forward substitution inside each 16 x 16 diagonal block and a
block merge with dots. The stored `Akk` is the inverse A (what the backward needs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import chunk_bounds
from cp_linattn.ops.common.chunk_h import dot_precision
from cp_linattn.ops.common.intra import diagonal_split_factors, finite_or_zero, launch_takes_block, nonfinite_part
from cp_linattn.ops.launch import exact_path_key, jit_traced_as, launch_kernel, tiles

CHUNK_SIZE = 64
CHUNK_SIZES = (32, 64)  # FLA's choices; a chunk holds 2 or 4 sub-chunks
SUB_CHUNK_SIZE = 16


@triton.jit
def wy_chunk_rows(bos, t0, seq_len, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr):
    """(chunk_len, o_c, m_c, its rows in q/k `[B, T, H, *]`, its rows in `[B, T, HV, *]`) of the
    chunk starting at token t0 of a sequence starting at token bos."""
    chunk_len = tl.minimum(BT, seq_len - t0)
    o_c = tl.arange(0, BT)
    m_c = o_c < chunk_len
    return chunk_len, o_c, m_c, (bos + t0 + o_c) * H + i_h, (bos + t0 + o_c) * HV + i_hv


@triton.jit
def store_sub_block(a_ptr, r0, c0, b_x, chunk_len, stride, BC: tl.constexpr):
    o = tl.arange(0, BC)
    m = ((r0 + o) < chunk_len)[:, None] & (o < BC)[None, :]
    tl.store(a_ptr + (r0 + o)[:, None] * stride + c0 + o[None, :], b_x.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def substitution_step(a_ptr, r0, i, b_x, chunk_len, stride, BC: tl.constexpr):
    """Row i of (I + L)^-1, L the strictly lower diagonal block at (r0, r0), given its rows
    before i in b_x (the rest still identity rows): e_i - sum_{j < i} L_ij (row j)."""
    o = tl.arange(0, BC)
    b_l = tl.load(a_ptr + (r0 + i) * stride + r0 + o, mask=(o < i) & (r0 + i < chunk_len), other=0)
    # only the lower entries of the rows (j >= column): a NaN L_ij times the exact zeros above
    # row j's diagonal would make columns after j NaN, which L_ij does not reach
    b_row = -tl.sum(tl.where(o[:, None] >= o[None, :], b_l.to(tl.float32)[:, None] * b_x, 0), axis=0)
    return b_x + tl.where(o[:, None] == i, b_row[None, :], 0)


@triton.jit
def invert_diagonal_sub_blocks(a_ptr, chunk_len, stride, BC: tl.constexpr, NC: tl.constexpr):
    """(I + L)^-1 of each of the NC (2 or 4) strictly lower diagonal [BC, BC] blocks of a chunk's
    matrix, by forward substitution; the independent chains advance in one loop so that
    their latencies overlap. With NC = 2 the last two are identities (unused)."""
    o = tl.arange(0, BC)
    b_x0 = (o[:, None] == o[None, :]).to(tl.float32)
    b_x1, b_x2, b_x3 = b_x0, b_x0, b_x0
    for i in range(1, BC):
        b_x0 = substitution_step(a_ptr, 0, i, b_x0, chunk_len, stride, BC)
        b_x1 = substitution_step(a_ptr, BC, i, b_x1, chunk_len, stride, BC)
        if NC == 4:
            b_x2 = substitution_step(a_ptr, 2 * BC, i, b_x2, chunk_len, stride, BC)
            b_x3 = substitution_step(a_ptr, 3 * BC, i, b_x3, chunk_len, stride, BC)
    return b_x0, b_x1, b_x2, b_x3


@triton.jit
def store_block_row(a_ptr, r0, b_0, b_1, b_2, b_3, chunk_len, stride, BC: tl.constexpr, NC: tl.constexpr):
    """The NC [BC, BC] blocks of rows r0..r0+BC of a chunk's [NC BC, NC BC] matrix (b_2, b_3
    only with NC = 4: the matrix rows are NC BC wide)."""
    store_sub_block(a_ptr, r0, 0, b_0, chunk_len, stride, BC)
    store_sub_block(a_ptr, r0, BC, b_1, chunk_len, stride, BC)
    if NC == 4:
        store_sub_block(a_ptr, r0, 2 * BC, b_2, chunk_len, stride, BC)
        store_sub_block(a_ptr, r0, 3 * BC, b_3, chunk_len, stride, BC)


@triton.jit
def sub_chunk_factors(
    q, k, gk, chunk_row0, r0, chunk_len, i_h, i_hv, o_k, m_k,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EXACT_DIAGONAL: tl.constexpr,
):
    """One K tile of the sub-chunk of rows r0..r0+BC (chunk-local) of a chunk starting at token
    chunk_row0, with gf / gl the gate at its first / last row:

    - qf = q exp(gk - gf), kf = k exp(gk - gf) (fp32; rows against the first row, <= 1),
    - kl = k exp(gl - gk) (k's dtype; the last row against each row, <= 1),
    - gf, gl ([BK] fp32),
    - its diagonal [BC, BC] blocks of q.k and k.k scores (unmasked above the diagonal).

    A later sub-chunk i pairs with this one (j) through exp(gf_i - gl_j) <= 1, so every factor
    of an off-diagonal block is at most 1. The diagonal block is split at its middle row (its
    gate span known to fit), or with EXACT_DIAGONAL bisected (`diagonal_split_factors`).
    """
    dtype = k.dtype.element_ty
    o_r = r0 + tl.arange(0, BC)
    m_r = o_r < chunk_len
    m_rk = m_r[:, None] & m_k[None, :]
    p_qk = ((chunk_row0 + o_r) * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p_qk, mask=m_rk, other=0).to(tl.float32)
    b_k = tl.load(k + p_qk, mask=m_rk, other=0).to(tl.float32)
    b_g = tl.load(gk + ((chunk_row0 + o_r) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_rk, other=0)
    b_gf = tl.load(gk + ((chunk_row0 + tl.minimum(r0, chunk_len - 1)) * HV + i_hv) * K + o_k, mask=m_k, other=0)
    b_gl = tl.load(gk + ((chunk_row0 + tl.minimum(r0 + BC - 1, chunk_len - 1)) * HV + i_hv) * K + o_k,
                   mask=m_k, other=0)
    # masking the exponents (not the products) keeps padded rows from overflowing
    b_ef = tl.exp(tl.where(m_rk, b_g - b_gf[None, :], float("-inf")))
    b_kl = (b_k * tl.exp(tl.where(m_rk, b_gl[None, :] - b_g, float("-inf")))).to(dtype)
    b_sq = tl.zeros([BC, BC], dtype=tl.float32)
    b_sk = tl.zeros([BC, BC], dtype=tl.float32)
    g_first = gk + ((chunk_row0 + r0) * HV + i_hv) * K
    for level in range(1 + 3 * EXACT_DIAGONAL):
        b_rowfac, b_colfac, pairs = diagonal_split_factors(
            g_first, HV * K, b_g, tl.arange(0, BC), m_r, o_k, m_k, chunk_len - r0, level, EXACT_DIAGONAL, BC)
        b_kt = tl.trans((b_k * b_colfac).to(dtype))
        b_split_q = tl.dot((b_q * b_rowfac).to(dtype), b_kt, input_precision=DOT_PRECISION)
        b_split_k = tl.dot((b_k * b_rowfac).to(dtype), b_kt, input_precision=DOT_PRECISION)
        if EXACT_DIAGONAL:
            b_split_q = tl.where(pairs, b_split_q, 0)
            b_split_k = tl.where(pairs, b_split_k, 0)
        b_sq += b_split_q
        b_sk += b_split_k
    if EXACT_DIAGONAL:  # the bisection leaves out i == j, decay 1
        on_diagonal = tl.arange(0, BC)[:, None] == tl.arange(0, BC)[None, :]
        b_sq += tl.where(on_diagonal, tl.sum(b_q * b_k, axis=1)[:, None], 0)
        b_sk += tl.where(on_diagonal, tl.sum(b_k * b_k, axis=1)[:, None], 0)
    return b_q * b_ef, b_k * b_ef, b_kl, b_gf, b_gl, b_sq, b_sk


@triton.jit
def off_diagonal_scores(b_qf, b_kf, b_gf, b_kl, b_gl, DOT_PRECISION: tl.constexpr):
    """The [BC, BC] q.k and k.k scores of rows of sub-chunk i against the columns of an
    earlier sub-chunk j, from `sub_chunk_factors` of each (exp(gf_i - gl_j) <= 1)."""
    b_s = tl.exp(b_gf - b_gl)[None, :]
    b_klt = tl.trans(b_kl)
    return (tl.dot((b_qf * b_s).to(b_kl.dtype), b_klt, input_precision=DOT_PRECISION),
            tl.dot((b_kf * b_s).to(b_kl.dtype), b_klt, input_precision=DOT_PRECISION))


@jit_traced_as("EXACT_DIAGONAL", "chunk_kda_fwd_kernel_intra_exact")
def chunk_kda_fwd_kernel_intra(
    q, k, v, gk, beta, exact_blocks, Aqk, Akk, w, u, qg, kg,
    cu_seqlens, chunk_indices,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    COMPUTE_A: tl.constexpr, COMPUTE_U: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EXACT_DIAGONAL: tl.constexpr,
):
    """One (chunk, value head): Aqk and A = (I + Akk)^-1 (unless given), then w, u (unless
    not COMPUTE_U), qg, kg.

    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; gk: fp32 `[B, T, HV, K]`; beta: `[B, T, HV]`;
    Aqk, Akk: fp32 `[B, T, HV, BT]` (row t holds its chunk-local columns). Grid (NT, B * HV).
    With COMPUTE_A, exact_blocks (int32 `[NT_all, HV]`, nonzero where a diagonal block of the chunk is
    too wide for the dot path) picks the programs: those of its nonzero entries if EXACT_DIAGONAL (exact
    diagonal blocks), the others if not.
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, t0, i_chunk = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    if COMPUTE_A:
        if not launch_takes_block(tl.load(exact_blocks + i_chunk * HV + i_hv), EXACT_DIAGONAL):
            return
    chunk_len, o_c, m_c, qk_rows, hv_rows = wy_chunk_rows(bos, t0, seq_len, i_h, i_hv, H, HV, BT)
    dtype = k.dtype.element_ty
    # the chunk's [BT, BT] matrices: row r, column c at a_base + r * a_stride + c
    a_off = ((bos + t0) * HV + i_hv) * BT
    a_stride = HV * BT
    b_beta = tl.load(beta + hv_rows, mask=m_c, other=0).to(tl.float32)

    if COMPUTE_A:
        NC: tl.constexpr = BT // BC
        tl.static_assert(NC * BC == BT and (NC == 2 or NC == 4), "the block merge is written for 2 or 4 sub-chunks")
        chunk_row0 = bos + t0
        b_aqk_00 = tl.zeros([BC, BC], dtype=tl.float32)
        b_aqk_11, b_aqk_22, b_aqk_33 = b_aqk_00, b_aqk_00, b_aqk_00
        b_aqk_10, b_aqk_20, b_aqk_21, b_aqk_30, b_aqk_31, b_aqk_32 = b_aqk_00, b_aqk_00, b_aqk_00, b_aqk_00, \
            b_aqk_00, b_aqk_00
        b_akk_00, b_akk_11, b_akk_22, b_akk_33 = b_aqk_00, b_aqk_00, b_aqk_00, b_aqk_00
        b_akk_10, b_akk_20, b_akk_21, b_akk_30, b_akk_31, b_akk_32 = b_aqk_00, b_aqk_00, b_aqk_00, b_aqk_00, \
            b_aqk_00, b_aqk_00
        # Each block's scores come back fresh and are added here: helpers that take the
        # accumulators they add to (same arithmetic, one statement per block) are slower.
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_qf0, b_kf0, b_kl0, b_gf0, b_gl0, b_sq, b_sk = sub_chunk_factors(
                q, k, gk, chunk_row0, 0, chunk_len, i_h, i_hv, o_k, m_k, H, HV, K, BC, DOT_PRECISION, EXACT_DIAGONAL)
            b_aqk_00 += b_sq
            b_akk_00 += b_sk
            b_qf1, b_kf1, b_kl1, b_gf1, b_gl1, b_sq, b_sk = sub_chunk_factors(
                q, k, gk, chunk_row0, BC, chunk_len, i_h, i_hv, o_k, m_k, H, HV, K, BC, DOT_PRECISION, EXACT_DIAGONAL)
            b_aqk_11 += b_sq
            b_akk_11 += b_sk
            b_sq, b_sk = off_diagonal_scores(b_qf1, b_kf1, b_gf1, b_kl0, b_gl0, DOT_PRECISION)
            b_aqk_10 += b_sq
            b_akk_10 += b_sk
            if NC == 4:
                b_qf2, b_kf2, b_kl2, b_gf2, b_gl2, b_sq, b_sk = sub_chunk_factors(
                    q, k, gk, chunk_row0, 2 * BC, chunk_len, i_h, i_hv, o_k, m_k, H, HV, K, BC, DOT_PRECISION,
                    EXACT_DIAGONAL)
                b_aqk_22 += b_sq
                b_akk_22 += b_sk
                b_sq, b_sk = off_diagonal_scores(b_qf2, b_kf2, b_gf2, b_kl0, b_gl0, DOT_PRECISION)
                b_aqk_20 += b_sq
                b_akk_20 += b_sk
                b_sq, b_sk = off_diagonal_scores(b_qf2, b_kf2, b_gf2, b_kl1, b_gl1, DOT_PRECISION)
                b_aqk_21 += b_sq
                b_akk_21 += b_sk
                b_qf3, b_kf3, b_kl3, b_gf3, b_gl3, b_sq, b_sk = sub_chunk_factors(
                    q, k, gk, chunk_row0, 3 * BC, chunk_len, i_h, i_hv, o_k, m_k, H, HV, K, BC, DOT_PRECISION,
                    EXACT_DIAGONAL)
                b_aqk_33 += b_sq
                b_akk_33 += b_sk
                b_sq, b_sk = off_diagonal_scores(b_qf3, b_kf3, b_gf3, b_kl0, b_gl0, DOT_PRECISION)
                b_aqk_30 += b_sq
                b_akk_30 += b_sk
                b_sq, b_sk = off_diagonal_scores(b_qf3, b_kf3, b_gf3, b_kl1, b_gl1, DOT_PRECISION)
                b_aqk_31 += b_sq
                b_akk_31 += b_sk
                b_sq, b_sk = off_diagonal_scores(b_qf3, b_kf3, b_gf3, b_kl2, b_gl2, DOT_PRECISION)
                b_aqk_32 += b_sq
                b_akk_32 += b_sk
        o_b = tl.arange(0, BC)
        b_0 = tl.zeros([BC, BC], dtype=tl.float32)
        with_diag = o_b[:, None] >= o_b[None, :]
        strict = o_b[:, None] > o_b[None, :]
        a_ptr = Aqk + a_off
        store_block_row(a_ptr, 0, tl.where(with_diag, b_aqk_00, 0) * scale, b_0, b_0, b_0, chunk_len, a_stride, BC,
                        NC)
        store_block_row(a_ptr, BC, b_aqk_10 * scale, tl.where(with_diag, b_aqk_11, 0) * scale, b_0, b_0,
                        chunk_len, a_stride, BC, NC)
        if NC == 4:
            store_block_row(a_ptr, 2 * BC, b_aqk_20 * scale, b_aqk_21 * scale,
                            tl.where(with_diag, b_aqk_22, 0) * scale, b_0, chunk_len, a_stride, BC, NC)
            store_block_row(a_ptr, 3 * BC, b_aqk_30 * scale, b_aqk_31 * scale, b_aqk_32 * scale,
                            tl.where(with_diag, b_aqk_33, 0) * scale, chunk_len, a_stride, BC, NC)
        # Akk rows take their beta: L = beta_i k_i . k_j exp(gk_i - gk_j), strictly lower
        beta_rows = (chunk_row0 + o_b) * HV + i_hv
        b_b0 = tl.load(beta + beta_rows, mask=o_b < chunk_len, other=0).to(tl.float32)[:, None]
        b_b1 = tl.load(beta + beta_rows + BC * HV, mask=o_b + BC < chunk_len, other=0).to(tl.float32)[:, None]
        b_b2 = tl.load(beta + beta_rows + 2 * BC * HV, mask=o_b + 2 * BC < chunk_len, other=0).to(tl.float32)[:, None]
        b_b3 = tl.load(beta + beta_rows + 3 * BC * HV, mask=o_b + 3 * BC < chunk_len, other=0).to(tl.float32)[:, None]
        # The diagonal blocks go through memory: their inversion reads them row by row.
        a_ptr = Akk + a_off
        store_sub_block(a_ptr, 0, 0, tl.where(strict, b_akk_00, 0) * b_b0, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, BC, BC, tl.where(strict, b_akk_11, 0) * b_b1, chunk_len, a_stride, BC)
        if NC == 4:
            store_sub_block(a_ptr, 2 * BC, 2 * BC, tl.where(strict, b_akk_22, 0) * b_b2, chunk_len, a_stride, BC)
            store_sub_block(a_ptr, 3 * BC, 3 * BC, tl.where(strict, b_akk_33, 0) * b_b3, chunk_len, a_stride, BC)
        # Non-finite entries of L left out of the merge's dots (the rows of the diagonal inverses
        # that they reach are non-finite already): against those inverses' exact zeros above the
        # diagonal they would make entries NaN that they do not reach.
        b_l10, b_l20, b_l21 = (finite_or_zero(b_akk_10 * b_b1), finite_or_zero(b_akk_20 * b_b2),
                               finite_or_zero(b_akk_21 * b_b2))
        b_l30, b_l31, b_l32 = (finite_or_zero(b_akk_30 * b_b3), finite_or_zero(b_akk_31 * b_b3),
                               finite_or_zero(b_akk_32 * b_b3))
        tl.debug_barrier()
        b_x0, b_x1, b_x2, b_x3 = invert_diagonal_sub_blocks(a_ptr, chunk_len, a_stride, BC, NC)
        # block forward substitution: X_ij = -X_ii sum_{j <= m < i} L_im X_mj
        b_x10 = -tl.dot(b_x1, tl.dot(b_l10, b_x0, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
        if NC == 4:
            b_x21 = -tl.dot(b_x2, tl.dot(b_l21, b_x1, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
            b_x20 = -tl.dot(b_x2, tl.dot(b_l20, b_x0, input_precision=DOT_PRECISION)
                            + tl.dot(b_l21, b_x10, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
            b_x32 = -tl.dot(b_x3, tl.dot(b_l32, b_x2, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
            b_x31 = -tl.dot(b_x3, tl.dot(b_l31, b_x1, input_precision=DOT_PRECISION)
                            + tl.dot(b_l32, b_x21, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
            b_x30 = -tl.dot(b_x3, tl.dot(b_l30, b_x0, input_precision=DOT_PRECISION)
                            + tl.dot(b_l31, b_x10, input_precision=DOT_PRECISION)
                            + tl.dot(b_l32, b_x20, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
        tl.debug_barrier()
        store_block_row(a_ptr, 0, b_x0, b_0, b_0, b_0, chunk_len, a_stride, BC, NC)
        store_block_row(a_ptr, BC, b_x10, b_x1, b_0, b_0, chunk_len, a_stride, BC, NC)
        if NC == 4:
            store_block_row(a_ptr, 2 * BC, b_x20, b_x21, b_x2, b_0, chunk_len, a_stride, BC, NC)
            store_block_row(a_ptr, 3 * BC, b_x30, b_x31, b_x32, b_x3, chunk_len, a_stride, BC, NC)
        tl.debug_barrier()

    m_cc = m_c[:, None] & (o_c < BT)[None, :]
    b_a = tl.load(Akk + a_off + o_c[:, None] * a_stride + o_c[None, :], mask=m_cc, other=0).to(dtype)
    i_last = (bos + t0 + chunk_len - 1) * HV + i_hv
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ck = m_c[:, None] & m_k[None, :]
        b_k = tl.load(k + qk_rows[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
        b_q = tl.load(q + qk_rows[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
        b_g = tl.load(gk + hv_rows[:, None] * K + o_k[None, :], mask=m_ck, other=0)
        b_g_last = tl.load(gk + i_last * K + o_k, mask=m_k, other=0)
        b_eg = tl.exp(b_g)
        p_out = hv_rows[:, None] * K + o_k[None, :]
        # A's zeros above the diagonal would carry a non-finite row to earlier rows (0 * NaN):
        # the dot takes the finite entries, the others join their own row (A's diagonal is 1;
        # k read again, as keeping the tile alive across the dot spills more registers)
        b_w = tl.dot(b_a, finite_or_zero(b_k * b_eg * b_beta[:, None]).to(dtype), input_precision=DOT_PRECISION)
        b_w += nonfinite_part(tl.load(k + qk_rows[:, None] * K + o_k[None, :], mask=m_ck, other=0)).to(tl.float32) \
            * b_eg * b_beta[:, None]
        tl.store(w + p_out, b_w.to(w.dtype.element_ty), mask=m_ck)
        tl.store(qg + p_out, (b_q * b_eg).to(qg.dtype.element_ty), mask=m_ck)
        b_kg = b_k * tl.exp(tl.where(m_ck, b_g_last[None, :] - b_g, float("-inf")))
        tl.store(kg + p_out, b_kg.to(kg.dtype.element_ty), mask=m_ck)
    if COMPUTE_U:
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_cv = m_c[:, None] & (o_v < V)[None, :]
            p_v = hv_rows[:, None] * V + o_v[None, :]
            b_v = tl.load(v + p_v, mask=m_cv, other=0).to(tl.float32)
            b_u = tl.dot(b_a, finite_or_zero(b_v * b_beta[:, None]).to(dtype), input_precision=DOT_PRECISION)
            b_u += nonfinite_part(tl.load(v + p_v, mask=m_cv, other=0)).to(tl.float32) * b_beta[:, None]
            tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_cv)


def chunk_kda_fwd_intra(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor, scale: float,
    cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    Aqk: torch.Tensor | None = None, Akk: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
    compute_u: bool = True, exact_blocks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """WY quantities of every chunk.

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; beta: `[B, T, HV]` (one float dtype).
        gk: fp32 `[B, T, HV, K]` chunk-local cumsum of the log gate.
        chunk_indices: `prepare_chunk_indices(cu_seqlens, chunk_size)` when varlen.
        Aqk, Akk: fp32 `[B, T, HV, chunk_size]` from an earlier call, to skip rebuilding them
            (the backward's recompute); both or neither.
        compute_u: False skips u (None is returned): the backward's recompute has no use for it.
        exact_blocks: int32 `[NT_all, HV]` from `chunk_kda_gate_cumsum`, needed when Aqk, Akk are built:
            the chunks whose diagonal blocks take the exact path.

    Returns:
        w `[B, T, HV, K]`, u `[B, T, HV, V]`, qg, kg `[B, T, HV, K]` (all in k's dtype),
        Aqk and Akk = (I + Akk_strict)^-1, fp32 `[B, T, HV, chunk_size]`.
    """
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES} for the KDA kernels, got {chunk_size}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    compute_a = Akk is None
    if compute_a and exact_blocks is None:
        raise ValueError("exact_blocks (from chunk_kda_gate_cumsum) is needed to build Aqk and Akk")
    if compute_a:
        Aqk = k.new_empty(B, T, HV, chunk_size, dtype=torch.float32)
        Akk = k.new_empty(B, T, HV, chunk_size, dtype=torch.float32)
    w = k.new_empty(B, T, HV, K)
    qg = k.new_empty(B, T, HV, K)
    kg = k.new_empty(B, T, HV, K)
    # new_empty, not empty_like: u must be contiguous (the kernel writes flat offsets) whatever v's strides
    u = v.new_empty(v.shape) if compute_u else None
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    if NT * B * HV > 0:
        args = (q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), beta.contiguous(), exact_blocks,
                Aqk, Akk, w, u, qg, kg, cu_seqlens, chunk_indices, float(scale), T)
        # Every chunk runs in one of the two launches; one launch when A is given (no diagonal blocks).
        for exact in (False, True) if compute_a else (False,):
            kernel = exact_path_key("chunk_kda_fwd_intra", exact)
            BK, BV = tiles(kernel, K, V)
            launch_kernel(chunk_kda_fwd_kernel_intra, (NT, B * HV), kernel,
                *args, H=H, HV=HV, K=K, V=V, BT=chunk_size, BC=SUB_CHUNK_SIZE, BK=BK, BV=BV,
                COMPUTE_A=compute_a, COMPUTE_U=compute_u, IS_VARLEN=cu_seqlens is not None,
                DOT_PRECISION=dot_precision(k.dtype), EXACT_DIAGONAL=exact,
            )
    return w, u, qg, kg, Aqk, Akk
