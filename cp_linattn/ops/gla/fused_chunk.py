"""Fused chunked Gated Linear Attention, with the head-first `fused_chunk_gla` API.

`S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T`, `o_t = scale * S_t^T q_t`, gates in natural log.

"Fused" means one program per (batch, head, K-block, V-block) walks its sequence in chunks of
`BT = 16` tokens and carries its `[BK, BV]` block of the state in fp32 registers: no per-chunk
state is ever written to memory, and the intra-chunk attention is computed in the same kernel.

Segments. A walk is sequential, so one program per state block would leave the GPU idle on
long sequences with few heads (B=1, H=16, K=V=128: 16 programs of 128x128 tiles for a GPU
of over a hundred SMs). So each sequence is cut into S segments of `seg_chunks` whole chunks
(the last one shorter), walked side by side on a program-id axis, and stitched with the exact
algebra of the recurrence, which is linear in the state with diagonal transitions: a segment
maps its entering state x to `Diag(d_s) x + u_s`, d_s the exp of its gate total and u_s its
final state from zero.
- Forward: a state-only pass (no output) gives every (u_s, d_s); an fp32 scan over segments
  gives each segment's entering state (the user's initial state enters segment 0); the full
  pass then walks every segment from its entering state and writes o. The scan's last state
  is the final state.
- Backward: a dh-only reverse pass from a zero gradient gives each segment's local gradient
  of its entering state (dh does not depend on the states); the reverse scan gives the
  gradient entering each segment from its end (the user's dht for the last one); the full
  backward then runs on every segment with its entering state and that gradient. The scan's
  last gradient is dh0. The gate gradient needs no fix-up: the kernel seeds its reverse
  cumulative sum with `sum_v(h_end * dh_end)` of its segment, which equals what all later
  tokens (and the user's dht) contribute.
`segment_count` picks S; S = 1 is the plain single walk, one launch each way.

Numerics. The gate is cumulated inside each chunk, in fp32, by the kernel itself, each token's
floored at LOG_DECAY_FLOOR first (cp_linattn/ops/common/cumsum.py). The intra-chunk scores
are a dot of `q e^(g - g_m)` and `k e^(g_m - g)`, m the chunk's middle row,
when every `|g - g_m|` of the chunk is within SAFE_SPAN (cp_linattn/ops/common/intra.py; the
operands stay fp32, so the bound holds for every input dtype). Otherwise they are formed
column by column from differences `g_i - g_j` with `i` at or after `j`, `<= 0` for log-decay
gates, which never overflow however negative the gates are. Every other exponent is taken
against a chunk-start or chunk-end reference, also `<= 0`, and the segment decays are exps of
gate totals, `<= 0`; segment states and scans are fp32.

Backward is one kernel launch per (batch, head, K-block, V-block, segment): a forward sweep
rebuilds the states to get the inter-chunk part of dq, then a reverse sweep carries `dh` in
registers and produces dq, dk, dv, the gate gradient (its reverse cumulative sum carried
across chunks) and the gradient of the initial state; the gradient of the final state seeds
`dh`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import whole_chunk_segments
from cp_linattn.ops.common.chunk_h import dot_precision, fp32_dot_precision
from cp_linattn.ops.common.cumsum import floor_log_decay, suffix_sum
from cp_linattn.ops.common.intra import SAFE_SPAN, finite_or_zero, within_span
from cp_linattn.ops.launch import launch_kernel, tiles
from cp_linattn.ops.utils import (_fmt_shape, check_flag, check_inputs, check_kernel_dtype, check_scale, check_tensor,
                                  kernel_state, refuse_double_backward)

CHUNK = 16
# Segments (`segment_count`): a walk's programs per SM to aim at; the shortest segment, below
# which the extra state pass and scans cost more than the shorter walk saves; and the most
# segments, as the scans take one small launch per segment.
PROGRAMS_PER_SM = 2
MIN_SEGMENT_CHUNKS = 4
MAX_SEGMENTS = 32


@triton.jit
def _sequence_offsets(i_b, i_h, T, H: tl.constexpr, D: tl.constexpr, HEAD_FIRST: tl.constexpr):
    """Offset of token 0 of sequence (i_b, i_h) and the stride between tokens.

    For a contiguous `[B, H, T, D]` (HEAD_FIRST) or `[B, T, H, D]` tensor; int64 so that
    partial-sum buffers of several times the input size cannot overflow the offsets.
    """
    if HEAD_FIRST:
        base = (i_b * H + i_h).to(tl.int64) * T * D
        stride = D
    else:
        base = (i_b.to(tl.int64) * T * H + i_h) * D
        stride = H * D
    return base, stride


@triton.jit
def _segment_block(T, seg_chunks, B: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HEAD_FIRST: tl.constexpr):
    """Where a program of grid (NV * S, NK, B * H) works: (i_v, i_k, the K-side and V-side
    sequence offsets and strides, o_k, o_v, m_k, m_v, its (segment, batch, head) index i_sbh,
    the offsets and mask of its state block, the first and end chunk of its segment)."""
    NV = (V + BV - 1) // BV
    i_sv, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_v = i_sv // NV, i_sv % NV
    i_b, i_h = i_bh // H, i_bh % H
    base_k, st_k = _sequence_offsets(i_b, i_h, T, H, K, HEAD_FIRST)
    base_v, st_v = _sequence_offsets(i_b, i_h, T, H, V, HEAD_FIRST)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    i_sbh = (i_s * B * H + i_bh).to(tl.int64)
    p_h = i_sbh * K * V + o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    t_start = i_s * seg_chunks
    t_end = tl.minimum(t_start + seg_chunks, tl.cdiv(T, BT))
    return i_v, i_k, base_k, st_k, base_v, st_v, o_k, o_v, m_k, m_v, i_sbh, p_h, m_h, t_start, t_end


@triton.jit
def _row(x, j, BT: tl.constexpr):
    """Row `j` of a `[BT, N]` register tile: Triton cannot index registers directly."""
    return tl.sum(tl.where(tl.arange(0, BT)[:, None] == j, x, 0.0), axis=0)


@triton.jit
def _chunk_tiles(g, base_k, st_k, base_v, st_v, i_t, T, o_k, o_v, m_k, m_v, BT: tl.constexpr):
    """Offsets and masks of chunk i_t's `[BT, BK]` (K side) and `[BT, BV]` (V side) tiles, and
    its chunk-local gate cumsum (fp32, of the gates floored at LOG_DECAY_FLOOR) with the last
    row. Tail rows load gate 0, so the cumulative gate stays flat there and the last row holds
    the decay of the whole (partial) chunk."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    p_kd = base_k + o_t[:, None] * st_k + o_k[None, :]
    p_vd = base_v + o_t[:, None] * st_v + o_v[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_gc = tl.cumsum(floor_log_decay(tl.load(g + p_kd, mask=m_tk, other=0).to(tl.float32)), axis=0)
    return p_kd, p_vd, m_tk, m_tv, b_gc, _row(b_gc, BT - 1, BT)


@triton.jit
def _intra_chunk(b_qs, b_k, b_gc, b_dp, BT: tl.constexpr, BK: tl.constexpr, GRADS: tl.constexpr,
                 PRECISION: tl.constexpr, SPAN_LIMIT: tl.constexpr):
    """Intra-chunk gated scores of one K-block and, with GRADS, their gradients.

    b_qs (scaled q), b_k, b_gc (in-chunk cumulative gate): fp32 `[BT, BK]`;
    b_dp: fp32 `[BT, BT]`, `do @ v^T` (only read with GRADS).
    Returns A `[BT, BT]` with `A_ij = sum_k qs_ik k_jk exp(gc_ik - gc_jk)` for `i >= j`,
    and with GRADS the intra-chunk dq (before the scale) and dk, both `[BT, BK]`.
    The dot path's fp32 operands take PRECISION; on the column path column j's decay
    `exp(gc_i - gc_j)` is only formed for `i >= j` (exponent <= 0).
    """
    o_r = tl.arange(0, BT)
    causal = o_r[:, None] >= o_r[None, :]
    # Tail rows carry the last row's cumulative gate, so they never widen the span.
    b_rel = b_gc - _row(b_gc, BT // 2, BT)[None, :]
    if within_span(b_rel, SPAN_LIMIT):
        b_to_mid = tl.exp(b_rel)
        b_from_mid = tl.exp(-b_rel)
        b_qe = b_qs * b_to_mid
        b_ke = b_k * b_from_mid
        b_a = tl.where(causal, tl.dot(b_qe, tl.trans(b_ke), input_precision=PRECISION), 0.0)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        if GRADS:
            b_dpc = tl.where(causal, b_dp, 0.0)
            b_dq = b_to_mid * tl.dot(b_dpc, finite_or_zero(b_ke), input_precision=PRECISION)
            b_dk = b_from_mid * tl.dot(tl.trans(b_dpc), finite_or_zero(b_qe), input_precision=PRECISION)
    else:
        b_a = tl.zeros([BT, BT], dtype=tl.float32)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        for j in range(BT):
            b_kj = _row(b_k, j, BT)
            b_gj = _row(b_gc, j, BT)
            rows_j = (o_r >= j)[:, None]
            b_e = tl.exp(tl.where(rows_j, b_gc - b_gj[None, :], float("-inf")))
            b_qe = b_qs * b_e
            # selects, not the zero decays, above the diagonal: 0 * NaN would reach earlier rows
            b_a = tl.where((o_r[None, :] == j) & rows_j, tl.sum(b_qe * b_kj[None, :], axis=1)[:, None], b_a)
            if GRADS:
                b_dpj = tl.sum(tl.where(o_r[None, :] == j, b_dp, 0.0), axis=1)
                b_dq += tl.where(rows_j, b_dpj[:, None] * b_e * b_kj[None, :], 0.0)
                b_dk = tl.where(o_r[:, None] == j, tl.sum(tl.where(rows_j, b_dpj[:, None] * b_qe, 0.0), axis=0)[None, :],
                                b_dk)
    return b_a, b_dq, b_dk


@triton.jit
def fused_chunk_gla_fwd_kernel(
    q, k, v, g, o, h0, ht, decay,
    scale, T, seg_chunks,
    B: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HEAD_FIRST: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPAN_LIMIT: tl.constexpr,
):
    """Output and final state of one (K-block, V-block) of one (batch, head) over one segment.

    Segment i_s is chunks `[i_s * seg_chunks, (i_s + 1) * seg_chunks)` of the sequence, cut at
    its end. q, k, g: `[B, H, T, K]` or `[B, T, H, K]`; v: same layout with V; o:
    `[NK, *v.shape]`, this K-block's share of the output (summed over K-blocks by the caller
    when NK > 1); h0, ht: any float dtype, `[S, B, H, K, V]`, the state entering / leaving each
    segment (`[B, H, K, V]` when S = 1). With STATE_ONLY, o is not written and decay, fp32
    `[S, B, H, K]`, receives the exp of each segment's gate total (the K-block's V-block 0
    writes it). Grid: (NV * S, NK, B * H).
    """
    (i_v, i_k, base_k, st_k, base_v, st_v, o_k, o_v, m_k, m_v, i_sbh, p_h, m_h, t_start,
     t_end) = _segment_block(T, seg_chunks, B, H, K, V, BT, BK, BV, HEAD_FIRST)
    if not STATE_ONLY:
        o += i_k.to(tl.int64) * B * T * H * V

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_gsum = tl.zeros([BK], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + p_h, mask=m_h, other=0).to(tl.float32)
    for i_t in range(t_start, t_end):
        p_kd, p_vd, m_tk, m_tv, b_gc, b_glast = _chunk_tiles(g, base_k, st_k, base_v, st_v, i_t, T, o_k, o_v,
                                                             m_k, m_v, BT)
        b_k = tl.load(k + p_kd, mask=m_tk, other=0)
        b_v = tl.load(v + p_vd, mask=m_tv, other=0)

        if STATE_ONLY:
            b_gsum += b_glast
        else:
            b_qs = tl.load(q + p_kd, mask=m_tk, other=0).to(tl.float32) * scale
            b_a, _, _ = _intra_chunk(b_qs, b_k.to(tl.float32), b_gc, None, BT, BK, False, DOT_PRECISION,
                                     SPAN_LIMIT)
            b_o = tl.dot((b_qs * tl.exp(b_gc)).to(b_v.dtype), b_h.to(b_v.dtype), input_precision=DOT_PRECISION)
            # A's zeros above the diagonal would carry a non-finite v to earlier rows (0 * NaN):
            # the dot takes the finite entries, and the others join their own row only, as v - v
            # (0, or NaN for NaN and inf: no mask kept across the dot)
            b_o += tl.dot(b_a.to(b_v.dtype), finite_or_zero(b_v), input_precision=DOT_PRECISION)
            b_o += (b_v - b_v).to(tl.float32)
            tl.store(o + p_vd, b_o.to(o.dtype.element_ty), mask=m_tv)

        b_kd = (b_k * tl.exp(b_glast[None, :] - b_gc)).to(b_v.dtype)
        b_h = b_h * tl.exp(b_glast)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=DOT_PRECISION)
    if STORE_FINAL_STATE:
        tl.store(ht + p_h, b_h.to(ht.dtype.element_ty), mask=m_h)
    if STATE_ONLY:
        # The total is summed in fp32 before the one exp (<= 1), never as a product of decays.
        tl.store(decay + i_sbh * K + o_k, tl.exp(b_gsum), mask=m_k & (i_v == 0))


@triton.jit
def fused_chunk_gla_bwd_kernel(
    q, k, v, g, do, h0, dht,
    dq, dk, dv, dg, dh0,
    scale, T, seg_chunks,
    B: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HEAD_FIRST: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STORE_INITIAL_STATE_GRADIENT: tl.constexpr, DH_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPAN_LIMIT: tl.constexpr, STATE_PRECISION: tl.constexpr,
):
    """All gradients of one (K-block, V-block) of one (batch, head) over one segment.

    Inputs and segments as in the forward kernel, do like v; dht, the gradient entering each
    segment from its end, like h0. Outputs are this block's shares: dq, dk, dg `[NV, *q.shape]`
    (dg fp32) summed over V-blocks by the caller, dv `[NK, *v.shape]` summed over K-blocks, dh0
    fp32 like h0, the gradient leaving each segment at its start (each block owns its part).
    With DH_ONLY only dh0 is written (dq, dk, dv, dg unused): dh does not depend on the
    states, so the reverse walk alone gives it. Grid: (NV * S, NK, B * H).

    The gate gradient is a reverse cumulative sum over the whole sequence of
    `q*dq - k*dk`, a difference of large terms: bf16-rounded states in dq and dk would
    leave an error that grows with T. So every product with h or dh (and their updates)
    takes fp32 operands at STATE_PRECISION (fp32-accurate), for any input dtype.
    """
    (i_v, i_k, base_k, st_k, base_v, st_v, o_k, o_v, m_k, m_v, _, p_h, m_h, t_start,
     t_end) = _segment_block(T, seg_chunks, B, H, K, V, BT, BK, BV, HEAD_FIRST)
    if not DH_ONLY:
        dq += i_v.to(tl.int64) * B * T * H * K
        dk += i_v.to(tl.int64) * B * T * H * K
        dg += i_v.to(tl.int64) * B * T * H * K
        dv += i_k.to(tl.int64) * B * T * H * V

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    b_dg_carry = tl.zeros([BK], dtype=tl.float32)
    if not DH_ONLY:
        # Forward sweep: rebuild the states; dq's inter-chunk part needs the state before each
        # chunk. It is parked in this program's own slot of dg (fp32), which the reverse sweep
        # reads back and overwrites chunk by chunk with the gate gradient.
        if USE_INITIAL_STATE:
            b_h += tl.load(h0 + p_h, mask=m_h, other=0).to(tl.float32)
        for i_t in range(t_start, t_end):
            p_kd, p_vd, m_tk, m_tv, b_gc, b_glast = _chunk_tiles(g, base_k, st_k, base_v, st_v, i_t, T, o_k,
                                                                 o_v, m_k, m_v, BT)
            b_k = tl.load(k + p_kd, mask=m_tk, other=0)
            b_v = tl.load(v + p_vd, mask=m_tv, other=0)
            b_do = tl.load(do + p_vd, mask=m_tv, other=0)

            b_dq = tl.dot(b_do.to(tl.float32), tl.trans(b_h), input_precision=STATE_PRECISION)
            tl.store(dg + p_kd, scale * tl.exp(b_gc) * b_dq, mask=m_tk)

            b_kd = b_k.to(tl.float32) * tl.exp(b_glast[None, :] - b_gc)
            b_h = b_h * tl.exp(b_glast)[:, None] + tl.dot(tl.trans(b_kd), b_v.to(tl.float32),
                                                          input_precision=STATE_PRECISION)

        # b_h is now the segment's final state: the gradient entering at the segment's end
        # reaches every gate of the segment through its total decay, so sum_v(h_end * dht),
        # which is what all later tokens and the user's dht give them, starts the gate
        # gradient's reverse cumulative sum.
        if USE_FINAL_STATE_GRADIENT:
            b_dh += tl.load(dht + p_h, mask=m_h, other=0).to(tl.float32)
            b_dg_carry += tl.sum(b_h * b_dh, axis=1)
        # The reverse sweep reads dq values that other threads of this program stored above.
        tl.debug_barrier()

    # A unit-step loop walked backwards: negative-step loops are not trusted to the GPU pipeliner.
    for i_rev in range(0, t_end - t_start):
        i_t = t_end - 1 - i_rev
        p_kd, p_vd, m_tk, m_tv, b_gc, b_glast = _chunk_tiles(g, base_k, st_k, base_v, st_v, i_t, T, o_k, o_v,
                                                             m_k, m_v, BT)
        b_q = tl.load(q + p_kd, mask=m_tk, other=0).to(tl.float32)
        b_qs = b_q * scale
        b_do = tl.load(do + p_vd, mask=m_tv, other=0)
        if not DH_ONLY:
            b_k = tl.load(k + p_kd, mask=m_tk, other=0).to(tl.float32)
            b_v = tl.load(v + p_vd, mask=m_tv, other=0)
            b_dq = tl.load(dg + p_kd, mask=m_tk, other=0)

            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)
            b_a, b_dq_intra, b_dk = _intra_chunk(b_qs, b_k, b_gc, b_dp, BT, BK, True, STATE_PRECISION,
                                                 SPAN_LIMIT)
            b_dq += scale * b_dq_intra

            b_kdecay = tl.exp(b_glast[None, :] - b_gc)
            b_dv = tl.dot(tl.trans(b_a).to(b_do.dtype), b_do, input_precision=DOT_PRECISION)
            b_dv += tl.dot((b_k * b_kdecay).to(b_v.dtype), b_dh.to(b_v.dtype), input_precision=DOT_PRECISION)
            b_dk += b_kdecay * tl.dot(b_v.to(tl.float32), tl.trans(b_dh), input_precision=STATE_PRECISION)

            # d(cumulative gate) = q*dq - k*dk; the raw gate's gradient is its reverse cumsum
            # over the whole sequence: in-chunk part plus what the later chunks carried.
            b_dgc = b_q * b_dq - b_k * b_dk
            b_dg, b_dgc_total = suffix_sum(b_dgc, BT)
            b_dg += b_dg_carry[None, :]
            b_dg_carry += b_dgc_total

            tl.store(dq + p_kd, b_dq.to(dq.dtype.element_ty), mask=m_tk)
            tl.store(dk + p_kd, b_dk.to(dk.dtype.element_ty), mask=m_tk)
            tl.store(dg + p_kd, b_dg, mask=m_tk)
            tl.store(dv + p_vd, b_dv.to(dv.dtype.element_ty), mask=m_tv)

        b_qg = b_qs * tl.exp(b_gc)
        b_dh = b_dh * tl.exp(b_glast)[:, None] + tl.dot(tl.trans(b_qg), b_do.to(tl.float32),
                                                        input_precision=STATE_PRECISION)
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + p_h, b_dh, mask=m_h)


def segment_count(T: int, programs: int, device: torch.device) -> int:
    """How many segments to cut each sequence of T tokens into, for a walk of `programs`
    programs per segment (B * H * K-blocks * V-blocks).

    Enough that all segments' programs fill the GPU, PROGRAMS_PER_SM per SM, but none shorter
    than MIN_SEGMENT_CHUNKS chunks and at most MAX_SEGMENTS. 1, the plain single walk, when
    one walk's programs already fill the GPU or the sequence is short. The interpreter has no
    SMs: 8 slots and 2-chunk segments there keep the CPU tests' shapes on the segmented path.
    The tests monkeypatch this function to force a count.
    """
    if device.type == "cuda":
        slots = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        min_chunks = MIN_SEGMENT_CHUNKS
    else:
        slots, min_chunks = 8, 2
    return max(1, min(MAX_SEGMENTS, slots // max(1, programs), triton.cdiv(T, CHUNK) // min_chunks))


def _segments(q: torch.Tensor, v: torch.Tensor, head_first: bool) -> tuple[int, int]:
    """(S, chunks per segment) of a call, from `segment_count` rounded to whole chunks (no
    segment is empty, the last may be shorter). The backward reuses the forward's segments,
    whose entering states it is given, so both come from the forward's tiles."""
    B, T, H, K = _shape(q, head_first)
    V = v.shape[-1]
    BK, BV = tiles("fused_chunk_gla_fwd", K, V)
    n_chunks = triton.cdiv(T, CHUNK)
    count = segment_count(T, B * H * triton.cdiv(K, BK) * triton.cdiv(V, BV), q.device)
    return whole_chunk_segments(n_chunks, count)


def _scan_segments(local: torch.Tensor, decay: torch.Tensor, start: torch.Tensor | None,
                   reverse: bool) -> torch.Tensor:
    """Chain the segments' maps `x -> Diag(decay_s) x + local_s` (decay on the K rows), in fp32.

    local: fp32 `[S, B, H, K, V]`, each segment's result from zero; decay: fp32 `[S, B, H, K]`;
    start: `[B, H, K, V]` (any float dtype) or None for zero, what enters the first segment
    walked. Returns fp32 `[S + 1, B, H, K, V]`, out[s] what enters segment s at its start and
    out[S] what leaves the last. With `reverse` (gradients, walked from the last segment),
    out[s + 1] is what enters segment s at its end (start enters at out[S]) and out[0] what
    leaves segment 0 at its start.
    """
    S = local.shape[0]
    out = local.new_empty(S + 1, *local.shape[1:])
    out[S if reverse else 0] = 0 if start is None else start
    for s in (range(S - 1, -1, -1) if reverse else range(S)):
        src, dst = (s + 1, s) if reverse else (s, s + 1)
        torch.addcmul(local[s], decay[s].unsqueeze(-1), out[src], out=out[dst])
    return out


def _launch_config(kernel: str, q: torch.Tensor, v: torch.Tensor, head_first: bool):
    """(B, T, H, K, V, K-blocks NK, V-blocks NV, the launch's constexpr arguments: block sizes
    and the fp32 dot precision; warps and stages come from ops/launch.py at the launch).

    fp32 inputs use exact fp32 dots: fp32 is the accuracy path; bf16/fp16 are the fast one.
    """
    B, T, H, K = _shape(q, head_first)
    V = v.shape[-1]
    BK, BV = tiles(kernel, K, V)
    cfg = dict(BT=CHUNK, BK=BK, BV=BV, DOT_PRECISION=dot_precision(q.dtype), SPAN_LIMIT=SAFE_SPAN)
    return B, T, H, K, V, triton.cdiv(K, BK), triton.cdiv(V, BV), cfg


def _sum_blocks(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum the per-block shares on dim 0 (a view when there is one block), cast to `dtype`."""
    return (x[0] if x.shape[0] == 1 else x.sum(0)).to(dtype)


def _shape(x: torch.Tensor, head_first: bool) -> tuple[int, int, int, int]:
    """(B, T, H, D) of a `[B, H, T, D]` (head_first) or `[B, T, H, D]` tensor."""
    if head_first:
        B, H, T, D = x.shape
    else:
        B, T, H, D = x.shape
    return B, T, H, D


def fused_chunk_gla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, head_first: bool, segments: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel on validated contiguous inputs, over `segments` (S, chunks
    per segment; see `_segments`).

    Returns o (v's dtype, v's shape), the fp32 final state `[B, H, K, V]` or None, and what
    the backward needs of the segments: the state entering each, `initial_state` itself for
    S = 1 (possibly None), else fp32 `[S, B, H, K, V]`; and each one's decay, the exp of its
    gate total, fp32 `[S, B, H, K]` (None for S = 1).
    """
    B, T, H, K, V, NK, NV, cfg = _launch_config("fused_chunk_gla_fwd", q, v, head_first)
    S, seg_chunks = segments

    def walk(o, h0, ht, decay):
        launch_kernel(
            fused_chunk_gla_fwd_kernel, (NV * S, NK, B * H), "fused_chunk_gla_fwd",
            q, k, v, g, o, h0, ht, decay, scale, T, seg_chunks,
            B=B, H=H, K=K, V=V, HEAD_FIRST=head_first, USE_INITIAL_STATE=h0 is not None,
            STORE_FINAL_STATE=ht is not None,
            STATE_ONLY=o is None, **cfg,
        )

    o = v.new_empty(NK, *v.shape, dtype=v.dtype if NK == 1 else torch.float32)
    if S == 1:
        ht = q.new_empty(B, H, K, V, dtype=torch.float32) if output_final_state else None
        walk(o, initial_state, ht, None)
        return _sum_blocks(o, v.dtype), ht, initial_state, None
    finals = q.new_empty(S, B, H, K, V, dtype=torch.float32)
    decay = q.new_empty(S, B, H, K, dtype=torch.float32)
    walk(None, None, finals, decay)
    states = _scan_segments(finals, decay, initial_state, reverse=False)
    walk(o, states, None, None)
    # A copy: the caller may modify the final state in place, and states[:S] is saved for backward.
    ht = states[S].clone() if output_final_state else None
    return _sum_blocks(o, v.dtype), ht, states[:S], decay


def fused_chunk_gla_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None,
    scale: float, h0: torch.Tensor | None, decay: torch.Tensor | None, need_dh0: bool, head_first: bool,
    segments: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel over the forward's `segments`, with the segments' entering
    states h0 and decays as `fused_chunk_gla_fwd` returned them; returns dq, dk, dv, dg
    (dtypes of q, k, v, g) and fp32 dh0 `[B, H, K, V]` (None unless need_dh0)."""
    B, T, H, K, V, NK, NV, cfg = _launch_config("fused_chunk_gla_bwd", q, v, head_first)
    S, seg_chunks = segments

    def walk(grads, h0, dht, dh0):
        dq, dk, dv, dg = grads
        launch_kernel(
            fused_chunk_gla_bwd_kernel, (NV * S, NK, B * H), "fused_chunk_gla_bwd",
            q, k, v, g, do, h0, dht, dq, dk, dv, dg, dh0, scale, T, seg_chunks,
            B=B, H=H, K=K, V=V, HEAD_FIRST=head_first, USE_INITIAL_STATE=h0 is not None,
            USE_FINAL_STATE_GRADIENT=dht is not None,
            STORE_INITIAL_STATE_GRADIENT=dh0 is not None, DH_ONLY=dq is None,
            STATE_PRECISION=fp32_dot_precision(q.dtype), **cfg,
        )

    grads = (q.new_empty(NV, *q.shape, dtype=q.dtype if NV == 1 else torch.float32),
             k.new_empty(NV, *k.shape, dtype=k.dtype if NV == 1 else torch.float32),
             v.new_empty(NK, *v.shape, dtype=v.dtype if NK == 1 else torch.float32),
             g.new_empty(NV, *g.shape, dtype=torch.float32))
    if S == 1:
        dh0 = q.new_empty(B, H, K, V, dtype=torch.float32) if need_dh0 else None
        walk(grads, h0, dht, dh0)
    else:
        dh_local = q.new_empty(S, B, H, K, V, dtype=torch.float32)
        walk((None,) * 4, None, None, dh_local)
        dhs = _scan_segments(dh_local, decay, dht, reverse=True)
        walk(grads, h0, dhs[1:], None)
        dh0 = dhs[0] if need_dh0 else None
    dq, dk, dv, dg = grads
    return (_sum_blocks(dq, q.dtype), _sum_blocks(dk, k.dtype), _sum_blocks(dv, v.dtype),
            _sum_blocks(dg, g.dtype), dh0)


class FusedChunkGLAFunction(torch.autograd.Function):
    """Autograd wrapper: saves the inputs and, when segmented, each segment's entering state
    and decay; the backward recomputes the states within each segment."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, head_first):
        segments = _segments(q, v, head_first)
        o, ht, h0, decay = fused_chunk_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, head_first,
                                               segments)
        ctx.save_for_backward(q, k, v, g, h0, decay)
        ctx.scale, ctx.head_first, ctx.segments = scale, head_first, segments
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        refuse_double_backward("fused_chunk_gla")
        q, k, v, g, h0, decay = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        need_dh0 = ctx.h0_dtype is not None and ctx.needs_input_grad[5]
        dq, dk, dv, dg, dh0 = fused_chunk_gla_bwd(
            q, k, v, g, do, dht, ctx.scale, h0, decay, need_dh0, ctx.head_first, ctx.segments)
        if dh0 is not None:
            dh0 = dh0.to(ctx.h0_dtype)
        return dq, dk, dv, dg, None, dh0, None, None


def _check_fused_inputs(q, k, v, g, initial_state, head_first: bool):
    """Validate shapes for either layout, with the messages of `check_inputs`; an
    `initial_state` whose head count fits only the other layout says so."""
    check_tensor("q", q, ndim=4)
    if initial_state is not None and isinstance(initial_state, torch.Tensor) and initial_state.dim() == 4:
        heads, other = (q.shape[1], q.shape[2]) if head_first else (q.shape[2], q.shape[1])
        if initial_state.shape[1] != heads and initial_state.shape[1] == other:
            layout, wanted = ("[B, H, T, K]", "head_first=False") if head_first else ("[B, T, H, K]", "head_first=True")
            raise ValueError(
                f"initial_state must have {heads} heads (with head_first={head_first} q {_fmt_shape(q.shape)} is read "
                f"as {layout}), got {other}, which fits only the other layout: pass {wanted} for tensors in that layout")
    if head_first:
        B, H, T, K = q.shape
        check_tensor("k", k, shape=(B, H, T, K), device=q.device)
        check_tensor("v", v, shape=(B, H, T, None), device=q.device)
        check_tensor("g", g, shape=(B, H, T, K), device=q.device)
        q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    dims = check_inputs(q, k, v, g, initial_state=initial_state)
    check_kernel_dtype(q)
    return dims


def fused_chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = -1,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    head_first: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated Linear Attention, fused chunked kernels (forward and backward).

    Not the recommended path for training: `chunk_gla` computes the same (to rounding) and
    its forward+backward is faster; this op's backward is a sequential walk per segment,
    bound by each program's work (BENCHMARKS.md, "Profile and roofline"). Its forward alone
    is faster than FLA's chunk_gla. Kept for FLA's `fused_chunk_gla` API, without varlen or CP.

    The default layout is head-first, `[B, H, T, K]` (`head_first=True`, kept for API
    compatibility), unlike every other op here: pass `head_first=False` for `[B, T, H, K]`
    tensors. The shapes of q, k, v, g alone cannot tell the layouts apart, so tensors in the
    other layout are silently read with T and H swapped; an `initial_state` that fits only the
    other layout raises.

    Args:
        q, k: `[B, H, T, K]` if `head_first` else `[B, T, H, K]`, fp32/fp16/bf16 (one dtype
            shared with v).
        v: `[B, H, T, V]` if `head_first` else `[B, T, H, V]`.
        g: like q, log decay (natural log, <= 0), any float dtype; cumulated in fp32 in-kernel.
        scale: `-1` or None mean `K ** -0.5`; otherwise a positive float.
        initial_state: `[B, H, K, V]`, any float dtype; it receives a gradient.
        output_final_state: return the fp32 final state `[B, H, K, V]` (its gradient is used).
        head_first: layout of q, k, v, g and of the output.

    Returns:
        o: like v, in v's dtype; final_state: fp32 `[B, H, K, V]` or None.
    """
    check_flag("head_first", head_first)
    check_flag("output_final_state", output_final_state)
    dims = _check_fused_inputs(q, k, v, g, initial_state, head_first)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == -1:
        scale = None
    scale = check_scale(scale, dims.K)
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    return FusedChunkGLAFunction.apply(q, k, v, g, scale, kernel_state(initial_state), output_final_state,
                                       head_first)
