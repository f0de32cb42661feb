"""Chunk-local cumulative sums of log gates (forward and reverse), varlen aware."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import chunk_bounds, prepare_chunk_indices
from cp_linattn.ops.launch import launch_kernel
from cp_linattn.ops.common.intra import mark_exact_diagonal_blocks


# Per-token floor of the log decays, applied before any cumulative sum. exp(x) rounds to 0 in
# fp32 (and bf16) for every x < ln(2^-150) ~ -103.97, and every exponent a kernel forms from a
# floored token is a sum of non-positive gates that includes it (<= the floor, up to cumsum
# rounding far below the 6-unit margin), so flooring changes no representable decay. It keeps
# -inf (a hard reset) from giving -inf - -inf = NaN, and huge gates (-1e30) from absorbing the
# smaller gates after them in the cumsum.
LOG_DECAY_FLOOR = tl.constexpr(-110.0)


@triton.jit
def floor_log_decay(b_g):
    """b_g with entries below LOG_DECAY_FLOOR replaced by it; a select, so NaN stays NaN."""
    return tl.where(b_g < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, b_g)


@triton.jit
def suffix_sum(b_x, BT: tl.constexpr):
    """(sum_{s >= t} b_x[s] per column of a [BT, D] tile, the column totals), formed as total -
    prefix + own (a reverse tl.cumsum takes ten times the shuffles). A non-finite entry makes
    the rows at or before its own NaN (and the total) and no others: in the total it would
    reach every row."""
    o_t = tl.arange(0, BT)
    finite = tl.abs(b_x) < float("inf")
    b_f = tl.where(finite, b_x, 0)
    last_bad = tl.max(tl.where(finite, -1, o_t[:, None]), axis=0)
    b_total = tl.sum(b_f, axis=0)
    b_y = b_total[None, :] - tl.cumsum(b_f, axis=0) + b_f
    return (tl.where(o_t[:, None] <= last_bad[None, :], float("nan"), b_y),
            tl.where(last_bad >= 0, float("nan"), b_total))


@triton.jit
def chunk_local_cumsum_kernel(
    x,
    y,
    exact_blocks,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    REVERSE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    MARK_EXACT: tl.constexpr,
    BC: tl.constexpr,
    SPAN_LIMIT: tl.constexpr,
):
    """y[t] = sum of x over the chunk of t up to t (or from t to the chunk end if REVERSE); the
    forward sum takes x floored at LOG_DECAY_FLOOR (x are log gates there).

    x, y: `[B, T, H, D]` contiguous; grid (cdiv(D, BD), NT, B * H). With MARK_EXACT (forward
    only) the bits of the chunk's diagonal BC-blocks too wide for the dot path are ORed into
    exact_blocks, int32 `[NT_all, H]` (`mark_exact_diagonal_blocks`).
    """
    i_d, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos, seq_len, t0, i_chunk = chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT, IS_VARLEN)
    o_t = t0 + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m = (o_t[:, None] < seq_len) & (o_d[None, :] < D)
    offs = ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_x = tl.load(x + offs, mask=m, other=0).to(tl.float32)
    if REVERSE:
        b_y, _ = suffix_sum(b_x, BT)
    else:
        # the forward cumsum is of log gates; the reverse one sums gradients, never floored
        b_x = floor_log_decay(b_x)
        b_y = tl.cumsum(b_x, axis=0)
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=m)
    if MARK_EXACT:
        tl.static_assert(not REVERSE, "the span of a reverse cumsum is not what the chunk kernels check")
        mark_exact_diagonal_blocks(exact_blocks + i_chunk * H + i_h, b_x, seq_len - t0,
                                  BC, BT // BC, SPAN_LIMIT)


def chunk_local_cumsum(
    x: torch.Tensor,
    chunk_size: int,
    reverse: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.float32,
    exact_blocks: torch.Tensor | None = None,
    sub_chunk_size: int = 16,
    span_limit: float = 0.0,
) -> torch.Tensor:
    """Cumulative sum of `x` `[B, T, H, D]` within each chunk of `chunk_size` tokens.

    Chunks restart at every sequence start of a packed batch (`cu_seqlens`). The forward sum
    (of log gates) floors each x at LOG_DECAY_FLOOR first; the reverse one (of gradients) does
    not. Accumulates in fp32; returns `output_dtype` (fp32 by default, which the chunked
    kernels expect).
    exact_blocks: zeroed int32 `[NT_all, H]` (NT_all the chunks of the whole batch) that takes, per
    chunk and head, the bits of the `sub_chunk_size` diagonal blocks whose gate span exceeds
    `span_limit` (forward only; `cp_linattn.ops.common.intra`).
    """
    if exact_blocks is not None and reverse:
        raise ValueError("exact_blocks marks the blocks of a forward cumsum; got reverse=True")
    B, T, H, D = x.shape
    x = x.contiguous()
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    y = torch.empty_like(x, dtype=output_dtype)
    # at least 16 wide: marking the exact blocks takes a dot with the tile
    BD = max(16, min(triton.next_power_of_2(D), 64))
    grid = (triton.cdiv(D, BD), NT, B * H)
    if NT > 0:
        launch_kernel(chunk_local_cumsum_kernel, grid, "chunk_local_cumsum",
            x, y, exact_blocks, cu_seqlens, chunk_indices, T,
            H=H, D=D, BT=chunk_size, BD=BD, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
            MARK_EXACT=exact_blocks is not None, BC=sub_chunk_size, SPAN_LIMIT=span_limit,
        )
    return y
