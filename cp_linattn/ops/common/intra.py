"""The overflow guard of the tensor-core path for the diagonal sub-blocks of intra-chunk scores.

Scores like `sum_k q_tk k_sk exp(b_tk - b_sk)` (s <= t, b a non-increasing gate cumsum) are
exact pair by pair, but a dot needs the exponent split per row: with a reference row m,
`exp(b_t - b_m) * exp(b_m - b_s)`. Inside a diagonal sub-block the two factors are not both
<= 1 whichever m is chosen, so they stay finite (and far from the bf16/fp32 underflow) only
while every `|b - b_m|` of the block is small. The kernels take m in the middle of the block and
use the dot when the span is at most `SAFE_SPAN`, otherwise an exact path that bisects the
block into dots whose factors are all <= 1 (`diagonal_split_factors`; fused_chunk_gla still
forms one column per step). Typical gates (log-sigmoid, or KDA's safe gate with lower_bound >= -5) fit; only very
strong decays (below about -5 per token) take the slow path.

The chunked GLA and KDA kernels measure the span once, where the gate cumsum is formed
(`mark_exact_diagonal_blocks`), and run twice: a launch compiled with the dot path only, for
the chunks whose blocks all fit, and one compiled with the exact path only, for the rest. A
kernel holding both paths keeps registers for the exact one even where it never runs, and
spills more. fused_chunk_gla checks the span at run time (`within_span`).

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
    # `<=` in a select, so that a NaN offset counts as too wide (a float max may skip NaN)
    too_wide = tl.max(tl.max(tl.where(tl.abs(b_rel) <= SPAN_LIMIT, 0, 1), axis=1), axis=0)
    fits = too_wide == 0
    # Round trip through int32: the interpreter's scalar comparison result cannot be &-ed with a
    # mask otherwise.
    return fits.to(tl.int32) != 0


@triton.jit
def mark_exact_diagonal_blocks(wide_ptr, b_x, chunk_len, BC: tl.constexpr, NC: tl.constexpr,
                              SPAN_LIMIT: tl.constexpr):
    """ORs into the int32 at `wide_ptr` bit s for every diagonal block s (rows s BC .. s BC + BC)
    of a chunk whose gate cumsum may stray more than SPAN_LIMIT from the block's middle row.

    b_x: fp32 `[NC * BC, BD]` per-token log gates of one K tile of the chunk (0 on padding
    rows and columns), whose chunk-local cumsum b the kernels use; the middle row is the one
    they take, m = min(s BC + BC / 2, chunk_len - 1). For a row r of the block, |b_r - b_m| is
    at most the sum of |x| between r and m, so the block is measured by two sums of |x|, from
    its first row (exclusive) to m and from m (exclusive) to its last row: the span itself for
    the non-positive gates the ops take, an upper bound of it for any sign. All blocks' sums
    come from one tf32 dot with a 0/1 segment matrix (cheaper than a pass over the tile per
    block, or an fp32 dot, which runs on the FMA units): tf32 rounds each |x| by at most
    2^-11, so a block may pass at a span 0.05% above SPAN_LIMIT, far inside the limit's margin
    (factors of e^40 against fp32's e^88). The int32 starts at 0; the K tiles of a chunk OR
    their bits into it.
    """
    tl.static_assert(2 * NC <= 16, "one 16-row segment matrix covers the sums of up to 8 blocks")
    o_w = tl.arange(0, 16)
    block = o_w // 2
    i_mid = tl.minimum(block * BC + BC // 2, chunk_len - 1)
    i_last = tl.minimum(block * BC + BC - 1, chunk_len - 1)
    lo = tl.where(o_w % 2 == 0, block * BC, i_mid)
    hi = tl.where(o_w % 2 == 0, i_mid, i_last)
    o_t = tl.arange(0, NC * BC)
    segments = ((o_t[None, :] > lo[:, None]) & (o_t[None, :] <= hi[:, None])).to(tl.float32)
    b_sums = tl.dot(segments, tl.abs(b_x), input_precision="tf32")
    # `<=` so that a NaN sum counts as wide
    b_exact = tl.max(tl.where(b_sums <= SPAN_LIMIT, 0, 1), axis=1)
    b_block = tl.max(tl.reshape(tl.where(o_w < 2 * NC, b_exact, 0), [8, 2]), axis=1)
    bits = tl.sum(b_block << tl.arange(0, 8))
    tl.atomic_or(wide_ptr, bits, mask=bits != 0)


def new_exact_block_bits(B: int, T: int, H: int, chunk_size: int, chunk_indices: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
    """Zeroed int32 `[NT_all, H]` for `mark_exact_diagonal_blocks`: one entry per chunk of the
    batch (`B * cdiv(T, chunk_size)`, or the rows of chunk_indices when varlen) and head."""
    NT = B * triton.cdiv(T, chunk_size) if chunk_indices is None else chunk_indices.shape[0]
    return torch.zeros(NT, H, dtype=torch.int32, device=device)


@triton.jit
def diagonal_split_factors(g_first, row_stride, b_g, o, m_r, o_k, m_k, rows, level, BISECT: tl.constexpr,
                           BC: tl.constexpr):
    """Row and column factors of one split of the decays of diagonal `[BC, BC]` blocks, so that
    `exp(b_i - b_j) = rowfac_i * colfac_j` on the pairs (i > j) the split covers.

    g_first: pointer to the tile's first row of the fp32 gate cumsum (K tile at o_k, m_k),
    row_stride between rows; b_g `[R, BK]` the tile's rows o (`[R]`, 0 .. R - 1, R a multiple
    of BC: its diagonal blocks are rows s BC .. s BC + BC), valid where m_r, `rows` of them.

    Without BISECT (a tile of one block, R == BC): the middle split, every pair, reference
    row m = min(BC / 2, rows - 1):
    rowfac = exp(b - b_m), colfac = exp(b_m - b), finite while the block's span is small
    (the dot path). With BISECT: level `level` (0 .. 3, a runtime int) of a bisection, the pairs
    with i in the lower and j in the upper half of the same group of BC >> level rows,
    reference r the upper half's last row: rowfac = exp(b_i - b_r), colfac = exp(b_r - b_j),
    both <= 1 under any decay. The levels cover every pair i > j once, one dot each: the
    exact path, much cheaper than a loop over the block's columns.

    Returns rowfac, colfac (fp32 `[R, BK]`, 0 on rows outside the split) and the `[R, R]`
    mask of the split's pairs (all true without BISECT).
    """
    m_rk = m_r[:, None] & m_k[None, :]
    if not BISECT:
        b_gm = tl.load(g_first + tl.minimum(BC // 2, rows - 1) * row_stride + o_k, mask=m_k, other=0)
        # factor 1 on padding rows, whose q and k are 0
        b_rel = tl.where(m_rk, b_g - b_gm[None, :], 0)
        return tl.exp(b_rel), tl.exp(-b_rel), (o[:, None] >= 0) & (o[None, :] >= 0)
    tl.static_assert(BC == 16, "the kernels run log2(BC) = 4 bisection levels")
    half = (BC // 2) >> level
    lower = (o // half) % 2 == 1
    group = o // (2 * half)
    ref = group * (2 * half) + half - 1
    # an upper half whose reference row is padding has no valid lower rows to pair with
    m_ref = ref < rows
    b_gr = tl.load(g_first + ref[:, None] * row_stride + o_k[None, :], mask=m_ref[:, None] & m_k[None, :], other=0)
    b_rowfac = tl.exp(tl.where(m_rk & lower[:, None], b_g - b_gr, float("-inf")))
    b_colfac = tl.exp(tl.where(m_rk & (m_ref & ~lower)[:, None], b_gr - b_g, float("-inf")))
    pairs = lower[:, None] & ~lower[None, :] & (group[:, None] == group[None, :])
    return b_rowfac, b_colfac, pairs


@triton.jit
def finite_or_zero(b_x):
    """b_x with its NaN and infinite entries replaced by 0: the operand of a dot over tokens whose
    other operand has exact zeros (a causal mask), where 0 * NaN would carry a non-finite input
    to the rows the mask excludes. The rows the mask keeps are non-finite in the reference."""
    return tl.where(tl.abs(b_x) < float("inf"), b_x, 0)


@triton.jit
def nonfinite_part(b_x):
    """b_x's NaN and infinite entries, 0 elsewhere: what `finite_or_zero` left out of a dot
    against a unit-diagonal matrix, added back on its own row so that the row stays non-finite."""
    return tl.where(tl.abs(b_x) < float("inf"), 0, b_x)


@triton.jit
def launch_takes_block(b_exact, EXACT_DIAGONAL: tl.constexpr):
    """Whether a program whose blocks have the bit `b_exact` in exact_blocks (nonzero: some block too wide
    for the dot path) belongs to the launch compiled with the exact path (EXACT_DIAGONAL) or to the
    one compiled with the dot path (not EXACT_DIAGONAL); it returns at once in the other."""
    return (b_exact != 0) == EXACT_DIAGONAL
