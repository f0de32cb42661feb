"""The overflow guard of the tensor-core path for the diagonal sub-blocks of intra-chunk scores.

Scores like `sum_k q_tk k_sk exp(b_tk - b_sk)` (s <= t, b a non-increasing gate cumsum) are
exact pair by pair, but a dot needs the exponent split per row: with a reference row m,
`exp(b_t - b_m) * exp(b_m - b_s)`. Inside a diagonal sub-block the two factors are not both
<= 1 whichever m is chosen, so they stay finite (and far from the bf16/fp32 underflow) only
while every `|b - b_m|` of the block is small. The kernels take m in the middle of the block and
use the dot when the span is at most `SAFE_SPAN`, otherwise the exact one-column-per-step
path. Typical gates (log-sigmoid, or KDA's safe gate with lower_bound >= -5) fit; only very
strong decays (below about -5 per token) take the slow path.

The chunked GLA and KDA kernels measure the span once, where the gate cumsum is formed
(`mark_wide_diagonal_blocks`), and run twice: a launch compiled with the dot path only, for
the chunks whose blocks all fit, and one compiled with the exact path only, for the rest. A
kernel holding both paths keeps registers for the exact one even where it never runs (both
spilled more that way, `scripts/kernel_regs.py`). fused_chunk_gla checks the span at run time
(`within_span`).

With a span of at most 40 every factor lies in [e^-40, e^40] (about [4e-18, 2e17]): bf16 and
fp32 hold that with full relative precision, and a product of two factors of the same pair
is the exact `exp(b_t - b_s)` up to rounding. fp16 cannot (its range ends near e^11), so the
kernels keep fp16 inputs on the exact path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SAFE_SPAN = 40.0


def span_limit(dtype: torch.dtype) -> float:
    """The largest gate offset the dot path accepts for operands of `dtype`: SAFE_SPAN for
    bf16 and fp32, and -1 (never met) for fp16."""
    return -1.0 if dtype == torch.float16 else SAFE_SPAN


@triton.jit
def within_span(b_rel, SPAN_LIMIT: tl.constexpr):
    """Whether every entry of the fp32 gate offsets `b_rel` ([R, BK], masked entries 0) is
    within SPAN_LIMIT of its reference row."""
    fits = tl.max(tl.max(tl.abs(b_rel), axis=1), axis=0) <= SPAN_LIMIT
    # Round trip through int32: the interpreter's scalar comparison result cannot be &-ed with a
    # mask otherwise.
    return fits.to(tl.int32) != 0


@triton.jit
def mark_wide_diagonal_blocks(wide_ptr, b_g, m_k, chunk_len, BC: tl.constexpr, NC: tl.constexpr,
                              SPAN_LIMIT: tl.constexpr):
    """ORs into the int32 at `wide_ptr` bit s for every diagonal block s (rows s BC .. s BC + BC)
    of a chunk whose gate offsets from the block's middle row exceed SPAN_LIMIT.

    b_g: fp32 `[NC * BC, BD]` chunk-local gate cumsum of one K tile (rows valid below
    chunk_len; columns valid where m_k); the middle row is the one the kernels take,
    min(s BC + BC / 2, chunk_len - 1). The int32 starts at 0; the K tiles of a chunk OR their
    bits into it. All blocks are measured at once in a `[NC, BC, BD]` view: one select-and-sum
    for the middle rows and one max, where a loop over the blocks took a pass over the whole
    tile per block and made the gate cumsum twice as slow as the plain one.
    """
    b_g3 = tl.reshape(b_g, [NC, BC, b_g.shape[1]])
    o_s = tl.arange(0, NC)
    o_row = o_s[:, None] * BC + tl.arange(0, BC)[None, :]
    i_mid = tl.minimum(o_s * BC + BC // 2, chunk_len - 1)
    b_gm = tl.sum(tl.where((o_row == i_mid[:, None])[:, :, None], b_g3, 0), axis=1)
    m_valid = (o_row < chunk_len)[:, :, None] & m_k[None, None, :]
    b_span = tl.max(tl.max(tl.abs(tl.where(m_valid, b_g3 - b_gm[:, None, :], 0)), axis=2), axis=1)
    # `<=` so that a NaN span counts as wide
    bits = tl.sum(tl.where(b_span <= SPAN_LIMIT, 0, 1 << o_s))
    tl.atomic_or(wide_ptr, bits, mask=bits != 0)


def new_wide_bits(B: int, T: int, H: int, chunk_size: int, chunk_indices: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """Zeroed int32 `[NT_all, H]` for `mark_wide_diagonal_blocks`: one entry per chunk of the
    batch (`B * cdiv(T, chunk_size)`, or the rows of chunk_indices when varlen) and head."""
    NT = B * triton.cdiv(T, chunk_size) if chunk_indices is None else chunk_indices.shape[0]
    return torch.zeros(NT, H, dtype=torch.int32, device=device)


@triton.jit
def in_this_launch(b_wide, WIDE: tl.constexpr):
    """Whether a program whose blocks have the wide bit `b_wide` (nonzero: some block too wide
    for the dot path) belongs to the launch compiled with the exact path (WIDE) or to the
    one compiled with the dot path (not WIDE); it returns at once in the other."""
    return (b_wide != 0) == WIDE
