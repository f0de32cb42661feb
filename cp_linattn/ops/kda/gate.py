"""KDA's in-kernel gate fused with the chunk-local cumsum, and its backward.

From the raw gate input x = g + dt_bias (per value head and key channel) the log decay is

    default       a = -exp(A_log) * softplus(x)
    lower bound   a = lower_bound * sigmoid(exp(A_log) * x)   (or sigmoid(x) without A_log)

and the chunk kernels need its chunk-local cumsum, of a floored at LOG_DECAY_FLOOR like every
log gate (`cp_linattn.ops.common.cumsum`). One kernel computes both; its backward
takes the gradient of the cumsum, reverse-cumsums it inside the chunk (the gradient of a)
and applies the activation's derivative, also emitting per-chunk partial sums for the
A_log and dt_bias gradients (reduced over chunks on the host side: tiny tensors).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.launch import jit_traced_as, launch_kernel

from cp_linattn.ops.common.index import chunk_bounds
from cp_linattn.ops.common.cumsum import LOG_DECAY_FLOOR, floor_log_decay, suffix_sum
from cp_linattn.ops.common.intra import mark_exact_diagonal_blocks
from cp_linattn.ops.utils import compiled_for_nvidia


@triton.jit
def log_of_one_to_two(b_z, APPROX_LOG: tl.constexpr):
    """log(z) for z in [1, 2]. With APPROX_LOG, PTX `lg2.approx` (absolute error below 1e-6
    there): the gate kernels are issue-bound, and `tl.log` compiles to libdevice's logf, a
    dozen FMAs per element. Triton's interpreter (the CPU) cannot run inline PTX."""
    if APPROX_LOG:
        b_log2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [b_z], dtype=tl.float32,
                                           is_pure=True, pack=1)
        return b_log2 * 0.6931471805599453
    else:
        return tl.log(b_z)


@triton.jit
def kda_gate_activation(b_x, b_A, LOWER_BOUND: tl.constexpr, lower_bound, HAS_A: tl.constexpr,
                        APPROX_LOG: tl.constexpr):
    """(gate, d gate / d x, d gate / d A_log) for raw inputs b_x [BT, BK] and A_log b_A []."""
    if LOWER_BOUND:
        if HAS_A:
            b_scale = tl.exp(b_A)
        else:
            b_scale = 1.0
        b_s = tl.sigmoid(b_scale * b_x)
        b_gate = lower_bound * b_s
        b_dsig = lower_bound * b_s * (1 - b_s)
        b_dx = b_dsig * b_scale
        b_dA = b_dsig * b_scale * b_x
    else:
        b_neg_a = -tl.exp(b_A)
        # max(x, 0) + log(1 + exp(-|x|)) cannot overflow for any x
        b_sp = tl.maximum(b_x, 0) + log_of_one_to_two(1 + tl.exp(-tl.abs(b_x)), APPROX_LOG)
        # F.softplus (the reference) switches to the identity above 20
        b_sp = tl.where(b_x > 20.0, b_x, b_sp)
        b_gate = b_neg_a * b_sp
        b_dx = b_neg_a * tl.where(b_x > 20.0, 1.0, tl.sigmoid(b_x))
        b_dA = b_gate
    return b_gate, b_dx, b_dA


@jit_traced_as("BACKWARD", "kda_gate_bwd_kernel_cumsum")
def kda_gate_fwd_kernel_cumsum(
    g, A_log, dt_bias, g_cum, exact_blocks, dg_cum, dg, dA_part, dbias_part,
    cu_seqlens, chunk_indices,
    lower_bound, T,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, LOWER_BOUND: tl.constexpr,
    BACKWARD: tl.constexpr, IS_VARLEN: tl.constexpr, MARK_EXACT: tl.constexpr, BC: tl.constexpr,
    SPAN_LIMIT: tl.constexpr, APPROX_LOG: tl.constexpr,
):
    """Forward: g_cum = cumsum_in_chunk(gate(g)), the gate floored at LOG_DECAY_FLOOR, and with
    MARK_EXACT the bits of the chunk's diagonal BC-blocks too wide for the dot path ORed into
    exact_blocks, int32 `[NT_all, HV]` (`mark_exact_diagonal_blocks`). Backward: dg = gate'(g) *
    reverse_cumsum(dg_cum) (0 where the gate was floored), plus per-chunk sums over tokens for
    dA_log/dt_bias `[NT_all, HV, K]`. Grid (cdiv(K, BK), NT_all, B * HV)."""
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, seq_len, t0, chunk_id = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m = (o_t[:, None] < seq_len) & m_k[None, :]
    offs = ((bos + o_t[:, None]) * HV + i_h) * K + o_k[None, :]
    b_x = tl.load(g + offs, mask=m, other=0).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
    if HAS_A:
        b_A = tl.load(A_log + i_h).to(tl.float32)
    else:
        b_A = 0.0
    b_gate, b_dx, b_dA = kda_gate_activation(b_x, b_A, LOWER_BOUND, lower_bound, HAS_A, APPROX_LOG)
    if BACKWARD:
        # The floored gate is constant below the floor: no gradient to x or A_log there (the
        # reference's is exp(gate) * (...) = 0), and no 0 * -inf from an infinite gate.
        floored = b_gate < LOG_DECAY_FLOOR
        b_dx = tl.where(floored, 0, b_dx)
        b_dA = tl.where(floored, 0, b_dA)
        b_dc = tl.load(dg_cum + offs, mask=m, other=0).to(tl.float32)
        b_dgate, _ = suffix_sum(b_dc, BT)
        b_dg = tl.where(m, b_dgate * b_dx, 0)
        tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=m)
        part_offs = (chunk_id * HV + i_h) * K + o_k
        tl.store(dbias_part + part_offs, tl.sum(b_dg, axis=0), mask=m_k)
        tl.store(dA_part + part_offs, tl.sum(tl.where(m, b_dgate * b_dA, 0), axis=0), mask=m_k)
    else:
        b_gate = tl.where(m, floor_log_decay(b_gate), 0)
        tl.store(g_cum + offs, tl.cumsum(b_gate, axis=0), mask=m)
        if MARK_EXACT:
            mark_exact_diagonal_blocks(exact_blocks + chunk_id * HV + i_h, b_gate, seq_len - t0,
                                      BC, BT // BC, SPAN_LIMIT)


def _launch(g, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices, sub_chunk_size=16,
            span_limit=0.0, **buffers):
    """Runs the forward (buffers g_cum, exact_blocks) or the backward (dg_cum, dg, dA_part, dbias_part);
    the `[B, T, HV, K]` buffers contiguous (`g.new_empty(g.shape)`, never `empty_like(g)`, which
    would copy a non-contiguous g's strides that the kernel's flat offsets do not follow)."""
    B, T, HV, K = g.shape
    NT = B * triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    BK = min(64, max(16, triton.next_power_of_2(K)))
    grid = (triton.cdiv(K, BK), NT // B if cu_seqlens is None else NT, B * HV)
    if NT > 0:
        launch_kernel(
            kda_gate_fwd_kernel_cumsum, grid, "kda_gate_bwd_cumsum" if "dg" in buffers else "kda_gate_fwd_cumsum",
            g.contiguous(), A_log.contiguous() if A_log is not None else None,
            dt_bias.contiguous() if dt_bias is not None else None,
            *(buffers.get(n) for n in ("g_cum", "exact_blocks", "dg_cum", "dg", "dA_part", "dbias_part")),
            cu_seqlens, chunk_indices, float(lower_bound) if lower_bound is not None else 0.0, T,
            HV=HV, K=K, BT=chunk_size, BK=BK, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
            LOWER_BOUND=lower_bound is not None, BACKWARD="dg" in buffers, IS_VARLEN=cu_seqlens is not None,
            MARK_EXACT=buffers.get("exact_blocks") is not None, BC=sub_chunk_size, SPAN_LIMIT=span_limit,
            APPROX_LOG=compiled_for_nvidia(g),
        )
    return NT


def kda_gate_fwd_cumsum(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    exact_blocks: torch.Tensor | None = None,
    sub_chunk_size: int = 16,
    span_limit: float = 0.0,
) -> torch.Tensor:
    """Chunk-local cumsum of the in-kernel KDA gate.

    g: raw gate input `[B, T, HV, K]` (any float dtype); A_log: `[HV]` (None only with
    lower_bound); dt_bias: `[HV * K]` or None; lower_bound: selects the sigmoid gate.
    chunk_indices: `prepare_chunk_indices(cu_seqlens, chunk_size)` when varlen.
    exact_blocks: zeroed int32 `[NT_all, HV]` taking the exact_blocks diagonal blocks of each chunk (as
    `chunk_local_cumsum`'s), or None.
    Returns fp32 `[B, T, HV, K]`.
    """
    g_cum = g.new_empty(g.shape, dtype=torch.float32)
    _launch(g, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices, sub_chunk_size, span_limit,
            g_cum=g_cum, exact_blocks=exact_blocks)
    return g_cum


def kda_gate_bwd_cumsum(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dg_cum: torch.Tensor,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward of `kda_gate_fwd_cumsum` given dg_cum fp32 `[B, T, HV, K]`.

    Returns dg (g's dtype, `[B, T, HV, K]`), dA_log (A_log's dtype, `[HV]`, or None) and
    d dt_bias (dt_bias's dtype and shape, or None).
    """
    B, T, HV, K = g.shape
    NT = B * triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    # the kernel rounds dg to g's dtype on store: no separate cast follows
    dg = g.new_empty(g.shape)
    dA_part = g.new_empty(NT, HV, K, dtype=torch.float32)
    dbias_part = g.new_empty(NT, HV, K, dtype=torch.float32)
    _launch(g, A_log, dt_bias, lower_bound, chunk_size, cu_seqlens, chunk_indices,
            dg_cum=dg_cum.contiguous(), dg=dg, dA_part=dA_part, dbias_part=dbias_part)
    dA = dA_part.sum((0, 2)).to(A_log.dtype).view_as(A_log) if A_log is not None else None
    dbias = dbias_part.sum(0).to(dt_bias.dtype).view_as(dt_bias) if dt_bias is not None else None
    return dg, dA, dbias


def beta_sigmoid(beta_logits: torch.Tensor, scale: float) -> torch.Tensor:
    """The step sizes from logits, `scale * sigmoid(beta_logits)` in fp32, as FLA's
    `use_beta_sigmoid_in_kernel` forms them (scale 2 with `allow_neg_eigval`: beta in (0, 2),
    so `I - beta k k^T` may have the eigenvalue -1). One elementwise pass over `[B, T, HV]`."""
    return torch.sigmoid(beta_logits.float()).mul_(scale)


def beta_sigmoid_bwd(beta: torch.Tensor, dbeta: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the logits from that of `beta = beta_sigmoid(logits, scale)`, through the
    fp32 beta itself: `scale * s * (1 - s) = beta * (1 - beta / scale)` (torch's sigmoid
    backward also works from the output). Returned in the logits' `dtype`."""
    return (dbeta.float() * beta * (1.0 - beta / scale)).to(dtype)
