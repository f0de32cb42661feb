"""Chunked KDA backward.

Per chunk (notation of `cp_linattn.ops.kda.wy`; h / dh the state entering / the gradient
of the state leaving the chunk, dv2 the total gradient of v_new):

1. `chunk_kda_bwd_dAv`: dS = scale * do v_new^T (lower incl. diagonal), the gradient of the
   unscaled scores `S_ij = sum_c q_ic k_jc exp(gk_ic - gk_jc)`, and dv = Aqk^T do.
2. `chunk_delta_rule_bwd_dhu`: dh per chunk, dh0, dv2 = dv + kg dh.
3. `chunk_kda_bwd_wy_dqkg`: the inter-chunk and WY terms
       dq  = scale * (do h^T) exp(gk)               from o = scale * qg h
       dk  = (v_new dh^T) exp(gk_last - gk)          from h_next = ... + kg^T v_new
       dgk_last += exp(gk_last) * rowsum(h * dh) + sum_t k dk
       dA  = dv2 (beta v)^T - dv2 h^T (beta k exp(gk))^T   (w = A kb, u = A (beta v))
       dv  = beta * A^T dv2,  dkb = -A^T (dv2 h^T) -> dk, dbeta, dgk
       dL  = -(A^T dA A^T) restricted to the strictly lower part (L = Akk before inversion)
4. `chunk_kda_bwd_intra`: the gradients through S and L, in sub-chunks of 16 with the same
   overflow-free reference points as the forward (first row of the sub-chunk for the columns
   before it, last row for the rows after it; inside the diagonal blocks the dot split at the
   middle row when the gate span allows it, else exact pairs, as in the forward: two launches,
   the sub-chunks split by the forward's `exact_blocks` bits).
5. dg = reverse chunk-local cumsum of dgk (the gk are cumsums of g), then the in-kernel
   gate's backward if any. Step 4 also sums dq, dk over each GVA group.

Steps 3 and 4 accumulate dq, dk, dg, dbeta in fp32; the kernel that completes a gradient
writes it in its input's dtype (dv in step 3, dq, dk, dbeta in step 4, dg in step 5), so no
separate cast kernel runs. dv2 is stored in the inputs' dtype: step 3 rounds it to that for
every dot anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import block_offsets, chunk_bounds
from cp_linattn.cp.exchange import CPExchange
from cp_linattn.cp.kda import kda_cp_bwd_dhu
from cp_linattn.ops.common.chunk_delta_h import chunk_delta_rule_bwd_dhu
from cp_linattn.ops.common.chunk_h import dot_precision
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.common.intra import diagonal_split_factors, finite_or_zero, launch_takes_block, nonfinite_part
from cp_linattn.ops.kda.chunk_fwd import ChunkKDAIntra, KDAGate
from cp_linattn.ops.kda.gate import kda_gate_bwd_cumsum
from cp_linattn.ops.kda.wy import SUB_CHUNK_SIZE, chunk_kda_fwd_intra, wy_chunk_rows
from cp_linattn.ops.launch import exact_path_key, jit_traced_as, launch_kernel, tile, tiles


@triton.jit
def chunk_kda_bwd_kernel_dAv(
    v_new, Aqk, do, dS, dv,
    cu_seqlens, chunk_indices,
    scale, T,
    HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dS = scale * do v_new^T (i >= j), dv = Aqk^T do; grid (NT, B * HV)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    bos, seq_len, t0, _ = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    o_c = tl.arange(0, BT)
    m_c = o_c < seq_len - t0
    rows = (bos + t0 + o_c) * HV + i_hv
    m_cc = m_c[:, None] & (o_c < BT)[None, :]
    p_a = rows[:, None] * BT + o_c[None, :]
    b_a = tl.load(Aqk + p_a, mask=m_cc, other=0)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_c[:, None] & (o_v < V)[None, :]
        p_v = rows[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_cv, other=0)
        b_vn = tl.load(v_new + p_v, mask=m_cv, other=0).to(b_do.dtype)
        b_ds += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PRECISION)
        b_dv = tl.dot(tl.trans(b_a.to(b_do.dtype)), b_do, input_precision=DOT_PRECISION)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_cv)
    b_ds = tl.where(o_c[:, None] >= o_c[None, :], b_ds * scale, 0)
    tl.store(dS + p_a, b_ds, mask=m_cc)


@triton.jit
def chunk_kda_bwd_kernel_wy_dqkg(
    q, k, v, v_new, gk, beta, A, h, do, dh, dv2,
    dq, dk, dv, dg, dbeta, dL,
    cu_seqlens, chunk_indices,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Step 3 of the module docstring for one (chunk, value head); grid (NT, B * HV).
    Reads dv2 `[B, T, HV, V]` in k's dtype. Writes the final dv `[B, T, HV, V]` in dv's dtype;
    for `chunk_kda_bwd_kernel_intra`, the fp32 partials dq, dk, dg `[B, T, HV, K]`, dbeta `[B, T, HV]`
    that it completes and dL fp32 `[B, T, HV, BT]`."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, t0, i_state = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    chunk_len, o_c, m_c, qk_rows, rows = wy_chunk_rows(bos, t0, seq_len, i_h, i_hv, H, HV, BT)
    dtype = k.dtype.element_ty
    i_last = (bos + t0 + chunk_len - 1) * HV + i_hv
    h_base = (i_state * HV + i_hv) * K * V
    m_cc = m_c[:, None] & (o_c < BT)[None, :]
    p_a = rows[:, None] * BT + o_c[None, :]
    b_a = tl.load(A + p_a, mask=m_cc, other=0)
    b_at = tl.trans(b_a).to(dtype)
    b_beta = tl.load(beta + rows, mask=m_c, other=0).to(tl.float32)

    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k, m_k, m_ck = block_offsets(i_k, BK, K, m_c)
        b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkg = tl.zeros([BT, BK], dtype=tl.float32)
        b_dwn = tl.zeros([BT, BK], dtype=tl.float32)
        b_dglast = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v, m_v, m_cv = block_offsets(i_v, BV, V, m_c)
            m_kv = m_k[:, None] & m_v[None, :]
            p_v = rows[:, None] * V + o_v[None, :]
            p_h = h_base + o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h + p_h, mask=m_kv, other=0)
            b_dh = tl.load(dh + p_h, mask=m_kv, other=0)
            b_do = tl.load(do + p_v, mask=m_cv, other=0).to(dtype)
            b_vn = tl.load(v_new + p_v, mask=m_cv, other=0).to(dtype)
            b_dv2 = tl.load(dv2 + p_v, mask=m_cv, other=0).to(dtype)
            b_dqg += tl.dot(b_do, tl.trans(b_h.to(dtype)), input_precision=DOT_PRECISION)
            b_dkg += tl.dot(b_vn, tl.trans(b_dh.to(dtype)), input_precision=DOT_PRECISION)
            b_dwn += tl.dot(b_dv2, tl.trans(b_h.to(dtype)), input_precision=DOT_PRECISION)
            b_dglast += tl.sum(b_h * b_dh, axis=1)
            if i_k == 0:
                b_v = tl.load(v + p_v, mask=m_cv, other=0).to(tl.float32)
                b_dA += tl.dot(b_dv2, tl.trans((b_v * b_beta[:, None]).to(dtype)),
                               input_precision=DOT_PRECISION)
                # A^T's zeros below the diagonal would carry a non-finite dv2 row to later rows
                # (0 * NaN): left out of the dot, it joins its own row (A's diagonal is 1)
                b_dvb = tl.dot(b_at, finite_or_zero(b_dv2), input_precision=DOT_PRECISION) + nonfinite_part(b_dv2)
                tl.store(dv + p_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_cv)
                b_dbeta += tl.sum(b_dvb * b_v, axis=1)
        p_qk = qk_rows[:, None] * K + o_k[None, :]
        p_hk = rows[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_ck, other=0).to(tl.float32)
        b_k = tl.load(k + p_qk, mask=m_ck, other=0).to(tl.float32)
        b_g = tl.load(gk + p_hk, mask=m_ck, other=0)
        b_g_last = tl.load(gk + i_last * K + o_k, mask=m_k, other=0)
        b_eg = tl.exp(b_g)
        b_dq = b_dqg * b_eg * scale
        b_dk = b_dkg * tl.exp(tl.where(m_ck, b_g_last[None, :] - b_g, float("-inf")))
        b_dg = b_q * b_dq - b_k * b_dk
        b_dglast = b_dglast * tl.exp(b_g_last) + tl.sum(b_k * b_dk, axis=0)
        b_kb = b_k * b_eg * b_beta[:, None]
        b_dA -= tl.dot(b_dwn.to(dtype), tl.trans(b_kb.to(dtype)), input_precision=DOT_PRECISION)
        b_dwn_op = b_dwn.to(dtype)
        b_dkb = -tl.dot(b_at, finite_or_zero(b_dwn_op), input_precision=DOT_PRECISION) - nonfinite_part(b_dwn_op).to(tl.float32)
        b_dk += b_dkb * b_eg * b_beta[:, None]
        b_dbeta += tl.sum(b_dkb * b_k * b_eg, axis=1)
        b_dg += b_dkb * b_kb
        b_dg += tl.where((o_c == chunk_len - 1)[:, None], b_dglast[None, :], 0)
        tl.store(dq + p_hk, b_dq, mask=m_ck)
        tl.store(dk + p_hk, b_dk, mask=m_ck)
        tl.store(dg + p_hk, b_dg, mask=m_ck)
    # both dots run over tokens against A's exact zeros, as dvb's
    b_dl = tl.dot(finite_or_zero(b_dA).to(dtype), tl.trans(b_a.to(dtype)), input_precision=DOT_PRECISION) \
        + nonfinite_part(b_dA)
    b_dl = -tl.dot(b_at, finite_or_zero(b_dl).to(dtype), input_precision=DOT_PRECISION) - nonfinite_part(b_dl)
    b_dl = tl.where((o_c[:, None] > o_c[None, :]) & m_cc, b_dl, 0)
    tl.store(dL + p_a, b_dl, mask=m_cc)
    tl.store(dbeta + rows, b_dbeta, mask=m_c)


@jit_traced_as("EXACT_DIAGONAL", "chunk_kda_bwd_kernel_intra_exact")
def chunk_kda_bwd_kernel_intra(
    q, k, gk, beta, exact_blocks, dS, dL, dq, dk, dg, dbeta, dq_out, dk_out, dbeta_out,
    cu_seqlens, chunk_indices,
    T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    """Adds the gradients through S (scores of q against k) and L (strict Akk) to the rows
    of one 16-row sub-chunk, for every value head of one q/k head; grid (NT * BT // BC, B * H).

    dq, dk, dg `[B, T, HV, K]` and dbeta `[B, T, HV]` hold the fp32 partials of
    `chunk_kda_bwd_kernel_wy_dqkg`. dg is completed in place (the cumsum's backward follows); the
    sums for dbeta go to dbeta_out (same shape), those for dq, dk, summed over the GVA group,
    to dq_out, dk_out `[B, T, H, K]` (any float dtype, or with HV == H the partials' own
    buffers), so that neither a cast nor a group sum follows.

    With P = dS, D = dL (both chunk-local [BT, BT]) and e_ij = exp(gk_i - gk_j):
        dq_i += sum_j P_ij k_j e_ij,  dk_j += sum_i P_ij q_i e_ij,
        R_i   = sum_j D_ij k_j e_ij,  C_j   = sum_i D_ij beta_i k_i e_ij,
        dk_i += beta_i R_i + C_i,     dbeta_i += k_i . R_i,
        dgk  += q dq_S - k dk_S + beta k R - k C.

    The diagonal block takes a dot split at its middle row, or with EXACT_DIAGONAL four dots, one per
    level of its bisection (`diagonal_split_factors`, exact under any decay): a program runs
    in the launch that matches its sub-chunk's bit in exact_blocks (int32 `[NT_all, HV]`,
    `chunk_kda_gate_cumsum`) for any value head of the group.
    """
    NC: tl.constexpr = BT // BC
    i_tc, i_bh = tl.program_id(0), tl.program_id(1)
    i_t, i_i = i_tc // NC, i_tc % NC
    G: tl.constexpr = HV // H
    i_b, i_h = i_bh // H, i_bh % H
    bos, seq_len, t0, i_chunk = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    b_exact = tl.load(exact_blocks + i_chunk * HV + i_h * G)
    for i_g in tl.static_range(1, G):
        b_exact |= tl.load(exact_blocks + i_chunk * HV + i_h * G + i_g)
    if not launch_takes_block((b_exact >> i_i) & 1, EXACT_DIAGONAL):
        return
    chunk_len = tl.minimum(BT, seq_len - t0)
    dtype = k.dtype.element_ty
    o_i = i_i * BC + tl.arange(0, BC)
    m_i = o_i < chunk_len
    qk_rows_i = (bos + t0 + o_i) * H + i_h
    # dq, dk of the group's value heads are summed in the first head's fp32 partial
    acc_rows_i = (bos + t0 + o_i) * HV + i_h * G
    for i_g in tl.static_range(G):
        i_hv = i_h * G + i_g
        rows_i = (bos + t0 + o_i) * HV + i_hv
        # reference rows: the sub-chunk's first (for earlier columns) and last (for later rows);
        # its middle one for the diagonal block
        i_first = (bos + t0 + tl.minimum(i_i * BC, chunk_len - 1)) * HV + i_hv
        i_final = (bos + t0 + tl.minimum(i_i * BC + BC, chunk_len) - 1) * HV + i_hv

        b_beta_i = tl.load(beta + rows_i, mask=m_i, other=0).to(tl.float32)
        # The diagonal blocks of dS and dL, strictly lower, for the dots. dS's own diagonal (the
        # i == j terms, decay 1) is added exactly: in dg = q dq - k dk those terms cancel, and under
        # strong decay they dominate, so bf16-rounded dot operands would leave their rounding as dg's error.
        p_diag = rows_i[:, None] * BT + o_i[None, :]
        m_strict = m_i[:, None] & (o_i[None, :] < o_i[:, None])
        b_p_diag = tl.load(dS + p_diag, mask=m_strict, other=0).to(dtype)
        b_d_diag = tl.load(dL + p_diag, mask=m_strict, other=0).to(dtype)
        b_p_self = tl.load(dS + rows_i * BT + o_i, mask=m_i, other=0)

        b_dbeta = tl.zeros([BC], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_ik = m_i[:, None] & m_k[None, :]
            p_i = qk_rows_i[:, None] * K + o_k[None, :]
            p_gi = rows_i[:, None] * K + o_k[None, :]
            b_qi = tl.load(q + p_i, mask=m_ik, other=0).to(tl.float32)
            b_ki = tl.load(k + p_i, mask=m_ik, other=0).to(tl.float32)
            b_gi = tl.load(gk + p_gi, mask=m_ik, other=0)
            b_dq = tl.zeros([BC, BK], dtype=tl.float32)
            b_dks = tl.zeros([BC, BK], dtype=tl.float32)
            b_r = tl.zeros([BC, BK], dtype=tl.float32)
            b_cc = tl.zeros([BC, BK], dtype=tl.float32)
            # Earlier sub-chunks j, as columns, one [BC, BC] block of dS / dL at a time: keys scaled
            # to this sub-chunk's first row, rows scaled from it (both factors <= 1).
            if i_i > 0:
                b_gf = tl.load(gk + i_first * K + o_k, mask=m_k, other=0)
                b_sum_q = tl.zeros([BC, BK], dtype=tl.float32)
                b_sum_r = tl.zeros([BC, BK], dtype=tl.float32)
                for j in range(0, i_i):
                    o_j = j * BC + tl.arange(0, BC)
                    m_j = o_j < chunk_len
                    m_jk = m_j[:, None] & m_k[None, :]
                    b_kj = tl.load(k + ((bos + t0 + o_j) * H + i_h)[:, None] * K + o_k[None, :], mask=m_jk, other=0)
                    b_gj = tl.load(gk + ((bos + t0 + o_j) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_jk, other=0)
                    b_kj = (b_kj.to(tl.float32) * tl.exp(tl.where(m_jk, b_gf[None, :] - b_gj, float("-inf")))).to(dtype)
                    p_block = rows_i[:, None] * BT + o_j[None, :]
                    m_block = m_i[:, None] & m_j[None, :]
                    b_sum_q += tl.dot(tl.load(dS + p_block, mask=m_block, other=0).to(dtype), b_kj,
                                      input_precision=DOT_PRECISION)
                    b_sum_r += tl.dot(tl.load(dL + p_block, mask=m_block, other=0).to(dtype), b_kj,
                                      input_precision=DOT_PRECISION)
                b_ei = tl.exp(tl.where(m_ik, b_gi - b_gf[None, :], float("-inf")))
                b_dq += b_ei * b_sum_q
                b_r += b_ei * b_sum_r
            # Later sub-chunks t, as rows: queries / keys scaled to this sub-chunk's last row.
            if i_i < NC - 1:
                b_gl = tl.load(gk + i_final * K + o_k, mask=m_k, other=0)
                b_sum_k = tl.zeros([BC, BK], dtype=tl.float32)
                b_sum_c = tl.zeros([BC, BK], dtype=tl.float32)
                for t in range(i_i + 1, NC):
                    o_t = t * BC + tl.arange(0, BC)
                    m_t = o_t < chunk_len
                    m_tk = m_t[:, None] & m_k[None, :]
                    p_t = ((bos + t0 + o_t) * H + i_h)[:, None] * K + o_k[None, :]
                    hv_rows_t = (bos + t0 + o_t) * HV + i_hv
                    b_qt = tl.load(q + p_t, mask=m_tk, other=0).to(tl.float32)
                    b_kt = tl.load(k + p_t, mask=m_tk, other=0).to(tl.float32)
                    b_gt = tl.load(gk + hv_rows_t[:, None] * K + o_k[None, :], mask=m_tk, other=0)
                    b_beta_t = tl.load(beta + hv_rows_t, mask=m_t, other=0).to(tl.float32)
                    b_et = tl.exp(tl.where(m_tk, b_gt - b_gl[None, :], float("-inf")))
                    p_block = hv_rows_t[:, None] * BT + o_i[None, :]
                    m_block = m_t[:, None] & m_i[None, :]
                    b_sum_k += tl.dot(tl.trans(tl.load(dS + p_block, mask=m_block, other=0).to(dtype)),
                                      (b_qt * b_et).to(dtype), input_precision=DOT_PRECISION)
                    b_sum_c += tl.dot(tl.trans(tl.load(dL + p_block, mask=m_block, other=0).to(dtype)),
                                      (b_kt * b_et * b_beta_t[:, None]).to(dtype), input_precision=DOT_PRECISION)
                b_ej = tl.exp(tl.where(m_ik, b_gl[None, :] - b_gi, float("-inf")))
                b_dks += b_ej * b_sum_k
                b_cc += b_ej * b_sum_c
            # the diagonal block: the middle split, or with EXACT_DIAGONAL the four bisection levels
            g_first = gk + ((bos + t0 + i_i * BC) * HV + i_hv) * K
            for level in range(1 + 3 * EXACT_DIAGONAL):
                b_rowfac, b_colfac, pairs = diagonal_split_factors(
                    g_first, HV * K, b_gi, tl.arange(0, BC), m_i, o_k, m_k, chunk_len - i_i * BC, level, EXACT_DIAGONAL,
                    BC)
                b_p, b_d = b_p_diag, b_d_diag
                if EXACT_DIAGONAL:
                    b_p = tl.where(pairs, b_p, 0)
                    b_d = tl.where(pairs, b_d, 0)
                # dots over the block's tokens against strictly lower P, D: non-finite operand
                # rows left out, as 0 * NaN would reach the rows the mask excludes
                b_kc = finite_or_zero(b_ki * b_colfac).to(dtype)
                b_dq += b_rowfac * tl.dot(b_p, b_kc, input_precision=DOT_PRECISION)
                b_r += b_rowfac * tl.dot(b_d, b_kc, input_precision=DOT_PRECISION)
                b_dks += b_colfac * tl.dot(tl.trans(b_p), finite_or_zero(b_qi * b_rowfac).to(dtype),
                                           input_precision=DOT_PRECISION)
                b_cc += b_colfac * tl.dot(tl.trans(b_d), finite_or_zero(b_ki * b_rowfac * b_beta_i[:, None]).to(dtype),
                                          input_precision=DOT_PRECISION)
            b_dq += b_p_self[:, None] * b_ki
            b_dks += b_p_self[:, None] * b_qi
            b_dg = b_qi * b_dq - b_ki * b_dks + b_ki * (b_beta_i[:, None] * b_r - b_cc)
            tl.store(dg + p_gi, tl.load(dg + p_gi, mask=m_ik, other=0) + b_dg, mask=m_ik)
            b_dq += tl.load(dq + p_gi, mask=m_ik, other=0)
            b_dk = b_dks + b_beta_i[:, None] * b_r + b_cc + tl.load(dk + p_gi, mask=m_ik, other=0)
            p_acc = acc_rows_i[:, None] * K + o_k[None, :]
            if i_g > 0:
                b_dq += tl.load(dq + p_acc, mask=m_ik, other=0)
                b_dk += tl.load(dk + p_acc, mask=m_ik, other=0)
            if i_g == G - 1:
                tl.store(dq_out + p_i, b_dq.to(dq_out.dtype.element_ty), mask=m_ik)
                tl.store(dk_out + p_i, b_dk.to(dk_out.dtype.element_ty), mask=m_ik)
            else:
                tl.store(dq + p_acc, b_dq, mask=m_ik)
                tl.store(dk + p_acc, b_dk, mask=m_ik)
            b_dbeta += tl.sum(b_ki * b_r, axis=1)
        b_dbeta += tl.load(dbeta + rows_i, mask=m_i, other=0)
        tl.store(dbeta_out + rows_i, b_dbeta.to(dbeta_out.dtype.element_ty), mask=m_i)
        if G > 1:  # the next head reads the sums just stored
            tl.debug_barrier()


def _output_buffer(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the kernel completing the fp32 `partial` writes the gradient in `dtype`: over the
    partial itself when that is fp32 (each element is read before it is written, by the same
    program), else a new tensor."""
    return partial if dtype == torch.float32 else torch.empty_like(partial, dtype=dtype)


def chunk_kda_bwd_dAv(
    *, v_new: torch.Tensor, Aqk: torch.Tensor, do: torch.Tensor, scale: float,
    cu_seqlens: torch.LongTensor | None, chunk_indices: torch.Tensor | None, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dS fp32 `[B, T, HV, chunk_size]`, dv fp32 `[B, T, HV, V]`) of step 1."""
    B, T, HV, V = v_new.shape
    NT = _num_chunks(T, cu_seqlens, chunk_indices, chunk_size)
    dS, dv = torch.empty_like(Aqk), torch.empty_like(v_new, dtype=torch.float32)
    if NT * B * HV > 0:
        launch_kernel(chunk_kda_bwd_kernel_dAv, (NT, B * HV), "chunk_kda_bwd_dAv",
            v_new, Aqk, do, dS, dv, cu_seqlens, chunk_indices, float(scale), T,
            HV=HV, V=V, BT=chunk_size, BV=tile("chunk_kda_bwd_dAv", "BV", V), IS_VARLEN=cu_seqlens is not None,
            DOT_PRECISION=dot_precision(do.dtype),
        )
    return dS, dv


def chunk_kda_bwd_wy_dqkg(
    *, q, k, v, v_new, gk, beta, Akk, h, do, dh, dv2, dq, dk, dv, dgk, dbeta, dL, scale: float,
    cu_seqlens: torch.LongTensor | None, chunk_indices: torch.Tensor | None, chunk_size: int,
) -> None:
    """Step 3, into the fp32 partials dq, dk, dgk, dbeta, dL and the final dv."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = _num_chunks(T, cu_seqlens, chunk_indices, chunk_size)
    BK, BV = tiles("chunk_kda_bwd_wy_dqkg", K, V)
    if NT * B * HV > 0:
        launch_kernel(chunk_kda_bwd_kernel_wy_dqkg, (NT, B * HV), "chunk_kda_bwd_wy_dqkg",
            q, k, v, v_new, gk, beta, Akk, h, do, dh, dv2, dq, dk, dv, dgk, dbeta, dL,
            cu_seqlens, chunk_indices, float(scale), T,
            H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None,
            DOT_PRECISION=dot_precision(k.dtype),
        )


def chunk_kda_bwd_intra(
    *, q, k, gk, beta, exact_blocks, dS, dL, dq_part, dk_part, dgk, dbeta_part, dq, dk, dbeta,
    cu_seqlens: torch.LongTensor | None, chunk_indices: torch.Tensor | None, chunk_size: int,
) -> None:
    """Step 4: completes dq, dk, dbeta (in their buffers' dtypes) and dgk, in two launches
    (each sub-chunk runs in one: the dot path or the exact diagonal blocks)."""
    B, T, H, K = q.shape
    HV = gk.shape[2]
    NT = _num_chunks(T, cu_seqlens, chunk_indices, chunk_size)
    if NT * B * HV == 0:
        return
    for exact in (False, True):
        launcher = exact_path_key("chunk_kda_bwd_intra", exact)
        launch_kernel(chunk_kda_bwd_kernel_intra, (NT * (chunk_size // SUB_CHUNK_SIZE), B * H), launcher,
            q, k, gk, beta, exact_blocks, dS, dL, dq_part, dk_part, dgk, dbeta_part, dq, dk, dbeta, cu_seqlens,
            chunk_indices, T, H=H, HV=HV, K=K, BT=chunk_size, BC=SUB_CHUNK_SIZE,
            BK=tile(launcher, "BK", K), IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype),
            EXACT_DIAGONAL=exact,
        )


def _num_chunks(T: int, cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None, chunk_size: int) -> int:
    return triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]


def chunk_kda_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    do: torch.Tensor, dht: torch.Tensor | None, need_dh0: bool, intra: ChunkKDAIntra, h: torch.Tensor,
    v_new: torch.Tensor, gate: KDAGate | None = None, state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None, exchange: CPExchange | None = None, dqk_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of chunked KDA (q, k already normalised if the op normalises them).

    need_dh0: compute the gradient of the initial states (there is a user initial state;
    under CP the state handed over by earlier ranks does not count). Under CP (`exchange`
    from the forward) dht and dh0 are those of the user's `[N_global, ...]` states.

    intra: the forward's gk, exact_blocks, Aqk, Akk, with w, qg, kg (`disable_recompute`)
    or None in their place (rebuilt here); its chunk size is the backward's. h, v_new: the forward's.
    do: `[B, T, HV, V]`; dht: gradient of the final state (layout as the states) or None.
    dqk_dtype: dtype of the returned dq, dk, q's by default; fp32 when a further backward
    (the l2norm's) consumes them.

    Returns dq, dk (`[B, T, H, K]`, dqk_dtype), dv (`[B, T, HV, V]`, v's dtype), dbeta
    (`[B, T, HV]`, beta's dtype), dg (`[B, T, HV, K]`, g's dtype), dh0 (fp32 or None), dA_log,
    ddt_bias (or None). Each is written in its dtype by the kernel that completes it, so no
    separate cast runs.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    gk, chunk_size = intra.gk, intra.chunk_size
    w, qg, kg = intra.w, intra.qg, intra.kg
    if w is None:
        w, _, qg, kg, _, _ = chunk_kda_fwd_intra(q, k, v, gk, beta, scale, cu_seqlens=cu_seqlens,
                                                 chunk_indices=chunk_indices, Aqk=intra.Aqk, Akk=intra.Akk,
                                                 chunk_size=chunk_size, compute_u=False)
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    do = do.to(k.dtype)
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=chunk_size)
    dS, dv_o = chunk_kda_bwd_dAv(v_new=v_new, Aqk=intra.Aqk, do=do, scale=scale, **varlen)
    walk = dict(chunk_offsets=chunk_offsets, **varlen)
    if exchange is None:
        dh, dh0, dv2 = chunk_delta_rule_bwd_dhu(qg, kg, w, gk, do, dv_o, scale, dht=dht, need_dh0=need_dh0,
                                                state_v_first=state_v_first, **walk)
    else:
        dh, dh0, dv2 = kda_cp_bwd_dhu(qg, kg, w, gk, do, dv_o, scale, dht=dht, need_dh0=need_dh0, exchange=exchange,
                                      state_v_first=state_v_first, **walk)
    dqk_dtype = dqk_dtype or q.dtype
    dq_part = q.new_empty(B, T, HV, K, dtype=torch.float32)
    dk_part = torch.empty_like(dq_part)
    dgk = torch.empty_like(dq_part)
    dv = torch.empty_like(v)
    dbeta_part = torch.empty_like(beta, dtype=torch.float32)
    dL = torch.empty_like(intra.Akk)
    # chunk_kda_bwd_intra completes dq, dk, dbeta in their final dtype (dq, dk summed over GVA groups)
    if HV == H:
        dq, dk = (_output_buffer(x, dqk_dtype) for x in (dq_part, dk_part))
    else:
        dq, dk = (q.new_empty(B, T, H, K, dtype=dqk_dtype) for _ in range(2))
    dbeta = _output_buffer(dbeta_part, beta.dtype)
    chunk_kda_bwd_wy_dqkg(q=q, k=k, v=v, v_new=v_new, gk=gk, beta=beta, Akk=intra.Akk, h=h, do=do, dh=dh, dv2=dv2,
                          dq=dq_part, dk=dk_part, dv=dv, dgk=dgk, dbeta=dbeta_part, dL=dL, scale=scale, **varlen)
    chunk_kda_bwd_intra(q=q, k=k, gk=gk, beta=beta, exact_blocks=intra.exact_blocks, dS=dS, dL=dL, dq_part=dq_part,
                        dk_part=dk_part, dgk=dgk, dbeta_part=dbeta_part, dq=dq, dk=dk, dbeta=dbeta, **varlen)
    dA_log = ddt_bias = None
    if gate is not None:
        dg, dA_log, ddt_bias = kda_gate_bwd_cumsum(g, gate.A_log, gate.dt_bias, dgk, gate.lower_bound, chunk_size,
                                                   cu_seqlens, chunk_indices)
    else:
        dg = chunk_local_cumsum(dgk, chunk_size, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                output_dtype=g.dtype)
    return dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias
