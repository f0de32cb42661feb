"""Intra-chunk part of KDA: the WY representation of one chunk's delta-rule updates.

Per chunk of BT = 64 tokens, value head and chunk-local gate cumsum gk (all `[BT, K]`):

    Akk[i, j] = beta_i * sum_c k_ic k_jc exp(gk_ic - gk_jc)     i > j   (strictly lower)
    Aqk[i, j] = scale  * sum_c q_ic k_jc exp(gk_ic - gk_jc)     i >= j
    A         = (I + Akk)^-1
    w = A (beta * k * exp(gk)),   u = A (beta * v),   qg = q * exp(gk),
    kg = k * exp(gk_last - gk)

so that with h the state entering the chunk, the chunk's new values are `v_new = u - w h`
(`cp_linattn.ops.common.chunk_delta_h`) and its output `o = scale * qg h + Aqk v_new`.

Overflow: exp(gk_i - gk_j) <= 1 for i >= j, but exp(gk_i) exp(-gk_j) is not usable with
strong decay. Rows come in sub-chunks of BC = 16; for the columns before sub-chunk I the
difference is split at the gate of I's first row r: `exp(gk_i - gk_r) * exp(gk_r - gk_j)`,
both factors <= 1, so a tensor-core dot handles the off-diagonal blocks. The diagonal
16 x 16 blocks split at their middle row and take a dot too when the gates' span allows it
(checked at run time per block, cp_linattn/ops/common/intra.py: log-sigmoid gates and the
safe gate with lower_bound >= -5 do); otherwise each pair's exponent is formed exactly, one
key column per step.

The inverse is formed by forward substitution inside each 16 x 16 diagonal block and a
block merge with dots. The stored `Akk` is the inverse A (what the backward needs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.chunk_delta_h import chunk_span
from cp_linattn.ops.common.chunk_h import dot_precision
from cp_linattn.ops.common.intra import span_limit, within_span
from cp_linattn.ops.launch import launch_options

CHUNK_SIZE = 64
SUB_CHUNK_SIZE = 16


@triton.jit
def load_sub_block(a_ptr, r0, c0, chunk_len, stride, BC: tl.constexpr):
    """[BC, BC] fp32 block at chunk-local (r0, c0) of a chunk's [BT, BT] matrix; rows past
    the chunk's end read as 0."""
    o = tl.arange(0, BC)
    m = ((r0 + o) < chunk_len)[:, None] & (o < BC)[None, :]
    return tl.load(a_ptr + (r0 + o)[:, None] * stride + c0 + o[None, :], mask=m, other=0).to(tl.float32)


@triton.jit
def store_sub_block(a_ptr, r0, c0, b_x, chunk_len, stride, BC: tl.constexpr):
    o = tl.arange(0, BC)
    m = ((r0 + o) < chunk_len)[:, None] & (o < BC)[None, :]
    tl.store(a_ptr + (r0 + o)[:, None] * stride + c0 + o[None, :], b_x.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def invert_unit_lower_sub_block(a_ptr, r0, chunk_len, stride, BC: tl.constexpr):
    """(I + L)^-1 of the strictly lower diagonal block L at (r0, r0), by forward substitution:
    row i of the inverse is e_i - sum_{j < i} L_ij (row j of the inverse)."""
    o = tl.arange(0, BC)
    b_x = (o[:, None] == o[None, :]).to(tl.float32)
    for i in range(1, BC):
        b_l = tl.load(a_ptr + (r0 + i) * stride + r0 + o, mask=(o < i) & (r0 + i < chunk_len), other=0)
        b_row = -tl.sum(b_l.to(tl.float32)[:, None] * b_x, axis=0)
        b_x += tl.where(o[:, None] == i, b_row[None, :], 0)
    return b_x


@triton.jit
def kda_intra_wy_fwd_kernel(
    q, k, v, gk, beta, Aqk, Akk, w, u, qg, kg,
    cu_seqlens, chunk_indices,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    COMPUTE_A: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, SPAN_LIMIT: tl.constexpr,
):
    """One (chunk, value head): Aqk and A = (I + Akk)^-1 (unless given), then w, u, qg, kg.

    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; gk: fp32 `[B, T, HV, K]`; beta: `[B, T, HV]`;
    Aqk, Akk: fp32 `[B, T, HV, BT]` (row t holds its chunk-local columns). Grid (NT, B * HV).
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, seq_len, t0, _ = chunk_span(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    chunk_len = tl.minimum(BT, seq_len - t0)
    dtype = k.dtype.element_ty

    o_c = tl.arange(0, BT)
    m_c = o_c < chunk_len
    qk_rows = (bos + t0 + o_c) * H + i_h
    hv_rows = (bos + t0 + o_c) * HV + i_hv
    # the chunk's [BT, BT] matrices: row r, column c at a_base + r * a_stride + c
    a_off = ((bos + t0) * HV + i_hv) * BT
    a_stride = HV * BT
    b_beta = tl.load(beta + hv_rows, mask=m_c, other=0).to(tl.float32)

    if COMPUTE_A:
        for i_i in tl.static_range(BT // BC):
            o_i = i_i * BC + tl.arange(0, BC)
            m_i = o_i < chunk_len
            i_ref = tl.minimum(i_i * BC, chunk_len - 1)
            i_mid = tl.minimum(i_i * BC + BC // 2, chunk_len - 1)
            b_aqk = tl.zeros([BC, BT], dtype=tl.float32)
            b_akk = tl.zeros([BC, BT], dtype=tl.float32)
            for i_k in range(tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_ik = m_i[:, None] & m_k[None, :]
                i_qk = (bos + t0 + o_i) * H + i_h
                i_hv_rows = (bos + t0 + o_i) * HV + i_hv
                b_qi = tl.load(q + i_qk[:, None] * K + o_k[None, :], mask=m_ik, other=0).to(tl.float32)
                b_ki = tl.load(k + i_qk[:, None] * K + o_k[None, :], mask=m_ik, other=0).to(tl.float32)
                b_gi = tl.load(gk + i_hv_rows[:, None] * K + o_k[None, :], mask=m_ik, other=0)
                b_gm = tl.load(gk + ((bos + t0 + i_mid) * HV + i_hv) * K + o_k, mask=m_k, other=0)
                b_rel = tl.where(m_ik, b_gi - b_gm[None, :], 0)
                diagonal_by_dot = within_span(b_rel, SPAN_LIMIT)
                # The key tile: columns before the sub-chunk scaled to its first row (factor
                # <= 1), its own columns to its middle row when the diagonal block takes the dot.
                m_before = (o_c < i_i * BC) & m_c
                m_block = (o_c >= i_i * BC) & (o_c < i_i * BC + BC) & m_c & diagonal_by_dot
                m_ck = (m_before | m_block)[:, None] & m_k[None, :]
                b_kc = tl.load(k + qk_rows[:, None] * K + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
                b_gc = tl.load(gk + hv_rows[:, None] * K + o_k[None, :], mask=m_ck, other=0)
                b_gr = tl.load(gk + ((bos + t0 + i_ref) * HV + i_hv) * K + o_k, mask=m_k, other=0)
                b_ref = tl.where(m_before[:, None], b_gr[None, :], b_gm[None, :])
                # masking the exponent (not the product) keeps padded rows from overflowing
                b_kc = b_kc * tl.exp(tl.where(m_ck, b_ref - b_gc, float("-inf")))
                if i_i > 0:
                    b_ei = tl.exp(tl.where(m_ik, b_gi - b_gr[None, :], float("-inf")))
                    b_kct = tl.trans(tl.where(m_before[:, None], b_kc, 0).to(dtype))
                    b_aqk += tl.dot((b_qi * b_ei).to(dtype), b_kct, input_precision=DOT_PREC)
                    b_akk += tl.dot((b_ki * b_ei).to(dtype), b_kct, input_precision=DOT_PREC)
                if diagonal_by_dot:
                    b_em = tl.exp(b_rel)
                    b_kct = tl.trans(tl.where(m_block[:, None], b_kc, 0).to(dtype))
                    b_sq = tl.dot((b_qi * b_em).to(dtype), b_kct, input_precision=DOT_PREC)
                    b_sk = tl.dot((b_ki * b_em).to(dtype), b_kct, input_precision=DOT_PREC)
                    b_aqk += tl.where(o_c[None, :] <= o_i[:, None], b_sq, 0)
                    b_akk += tl.where(o_c[None, :] < o_i[:, None], b_sk, 0)
                else:
                    for j in range(BC):
                        c = i_i * BC + j
                        m_j = m_k & (c < chunk_len)
                        b_kj = tl.load(k + ((bos + t0 + c) * H + i_h) * K + o_k, mask=m_j, other=0).to(tl.float32)
                        b_gj = tl.load(gk + ((bos + t0 + c) * HV + i_hv) * K + o_k, mask=m_j, other=0)
                        m_pair = (o_i >= c) & m_i
                        b_kje = b_kj[None, :] * tl.exp(
                            tl.where(m_pair[:, None] & m_k[None, :], b_gi - b_gj[None, :], float("-inf")))
                        m_col = (o_c == c)[None, :]
                        b_aqk += tl.where(m_col, tl.sum(b_qi * b_kje, axis=1)[:, None], 0)
                        b_akk += tl.where(m_col & (o_i > c)[:, None], tl.sum(b_ki * b_kje, axis=1)[:, None], 0)
            b_beta_i = tl.load(beta + (bos + t0 + o_i) * HV + i_hv, mask=m_i, other=0).to(tl.float32)
            m_store = m_i[:, None] & (o_c < BT)[None, :]
            p_rows = a_off + o_i[:, None] * a_stride + o_c[None, :]
            tl.store(Aqk + p_rows, b_aqk * scale, mask=m_store)
            tl.store(Akk + p_rows, b_akk * b_beta_i[:, None], mask=m_store)
        # the blocks below are read back by other threads of this program
        tl.debug_barrier()
        a_ptr = Akk + a_off
        b_l10 = load_sub_block(a_ptr, BC, 0, chunk_len, a_stride, BC)
        b_l20 = load_sub_block(a_ptr, 2 * BC, 0, chunk_len, a_stride, BC)
        b_l21 = load_sub_block(a_ptr, 2 * BC, BC, chunk_len, a_stride, BC)
        b_l30 = load_sub_block(a_ptr, 3 * BC, 0, chunk_len, a_stride, BC)
        b_l31 = load_sub_block(a_ptr, 3 * BC, BC, chunk_len, a_stride, BC)
        b_l32 = load_sub_block(a_ptr, 3 * BC, 2 * BC, chunk_len, a_stride, BC)
        b_x0 = invert_unit_lower_sub_block(a_ptr, 0, chunk_len, a_stride, BC)
        b_x1 = invert_unit_lower_sub_block(a_ptr, BC, chunk_len, a_stride, BC)
        b_x2 = invert_unit_lower_sub_block(a_ptr, 2 * BC, chunk_len, a_stride, BC)
        b_x3 = invert_unit_lower_sub_block(a_ptr, 3 * BC, chunk_len, a_stride, BC)
        # block forward substitution: X_ij = -X_ii sum_{j <= m < i} L_im X_mj
        b_x10 = -tl.dot(b_x1, tl.dot(b_l10, b_x0, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_x21 = -tl.dot(b_x2, tl.dot(b_l21, b_x1, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_x20 = -tl.dot(b_x2, tl.dot(b_l20, b_x0, input_precision=DOT_PREC)
                        + tl.dot(b_l21, b_x10, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_x32 = -tl.dot(b_x3, tl.dot(b_l32, b_x2, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_x31 = -tl.dot(b_x3, tl.dot(b_l31, b_x1, input_precision=DOT_PREC)
                        + tl.dot(b_l32, b_x21, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_x30 = -tl.dot(b_x3, tl.dot(b_l30, b_x0, input_precision=DOT_PREC)
                        + tl.dot(b_l31, b_x10, input_precision=DOT_PREC)
                        + tl.dot(b_l32, b_x20, input_precision=DOT_PREC), input_precision=DOT_PREC)
        tl.debug_barrier()
        store_sub_block(a_ptr, 0, 0, b_x0, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, BC, 0, b_x10, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, BC, BC, b_x1, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 2 * BC, 0, b_x20, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 2 * BC, BC, b_x21, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 2 * BC, 2 * BC, b_x2, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 3 * BC, 0, b_x30, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 3 * BC, BC, b_x31, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 3 * BC, 2 * BC, b_x32, chunk_len, a_stride, BC)
        store_sub_block(a_ptr, 3 * BC, 3 * BC, b_x3, chunk_len, a_stride, BC)
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
        b_w = tl.dot(b_a, (b_k * b_eg * b_beta[:, None]).to(dtype), input_precision=DOT_PREC)
        tl.store(w + p_out, b_w.to(w.dtype.element_ty), mask=m_ck)
        tl.store(qg + p_out, (b_q * b_eg).to(qg.dtype.element_ty), mask=m_ck)
        b_kg = b_k * tl.exp(tl.where(m_ck, b_g_last[None, :] - b_g, float("-inf")))
        tl.store(kg + p_out, b_kg.to(kg.dtype.element_ty), mask=m_ck)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_cv = m_c[:, None] & (o_v < V)[None, :]
        p_v = hv_rows[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_cv, other=0).to(tl.float32)
        b_u = tl.dot(b_a, (b_v * b_beta[:, None]).to(dtype), input_precision=DOT_PREC)
        tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_cv)


def head_block_size(D: int) -> int:
    """Tile width along a head dim: a power of two in [16, 64] (tl.dot needs >= 16)."""
    return max(16, min(64, triton.next_power_of_2(D)))


def kda_intra_wy_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    Aqk: torch.Tensor | None = None,
    Akk: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """WY quantities of every chunk.

    Args:
        q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; beta: `[B, T, HV]` (one float dtype).
        gk: fp32 `[B, T, HV, K]` chunk-local cumsum of the log gate.
        chunk_indices: `prepare_chunk_indices(cu_seqlens, 64)` when varlen.
        Aqk, Akk: fp32 `[B, T, HV, 64]` from an earlier call, to skip rebuilding them
            (the backward's recompute); both or neither.

    Returns:
        w `[B, T, HV, K]`, u `[B, T, HV, V]`, qg, kg `[B, T, HV, K]` (all in k's dtype),
        Aqk and Akk = (I + Akk_strict)^-1, fp32 `[B, T, HV, 64]`.
    """
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_size must be {CHUNK_SIZE} for the KDA kernels, got {chunk_size}")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    compute_a = Akk is None
    if compute_a:
        Aqk = k.new_empty(B, T, HV, chunk_size, dtype=torch.float32)
        Akk = k.new_empty(B, T, HV, chunk_size, dtype=torch.float32)
    w = k.new_empty(B, T, HV, K)
    qg = k.new_empty(B, T, HV, K)
    kg = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    if NT * B * HV > 0:
        kda_intra_wy_fwd_kernel[(NT, B * HV)](
            q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), beta.contiguous(),
            Aqk, Akk, w, u, qg, kg, cu_seqlens, chunk_indices, float(scale), T,
            H=H, HV=HV, K=K, V=V, BT=chunk_size, BC=SUB_CHUNK_SIZE, BK=head_block_size(K), BV=head_block_size(V),
            COMPUTE_A=compute_a, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype),
            SPAN_LIMIT=span_limit(k.dtype),
            **launch_options("kda_intra_wy_fwd"),
        )
    return w, u, qg, kg, Aqk, Akk
