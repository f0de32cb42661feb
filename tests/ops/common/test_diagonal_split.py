"""The bisection of the diagonal blocks (cp_linattn/ops/common/intra.diagonal_split_factors),
the exact path of the GLA and KDA chunk kernels: its four levels cover every pair i > j of a
16-row block once, with row and column factors <= 1 whose products are the exact decays,
under decays that no single split of a block could hold in fp32."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.intra import diagonal_split_factors

pytestmark = pytest.mark.interpreter

R, BK, BC = 32, 16, 16


@triton.jit
def bisection_kernel(g, decay, cover, largest, rows, R: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """decay `[R, R]`: sum over channels of rowfac_i colfac_j over the levels' pairs; cover
    `[R, R]`: how many levels pair (i, j); largest `[R, BK]`: the largest factor per entry."""
    o = tl.arange(0, R)
    o_k = tl.arange(0, BK)
    m_r = o < rows
    m_k = o_k < BK
    b_g = tl.load(g + o[:, None] * BK + o_k[None, :], mask=m_r[:, None], other=0)
    b_decay = tl.zeros([R, R], dtype=tl.float32)
    b_cover = tl.zeros([R, R], dtype=tl.int32)
    b_largest = tl.zeros([R, BK], dtype=tl.float32)
    for level in range(4):
        b_rowfac, b_colfac, pairs = diagonal_split_factors(g, BK, b_g, o, m_r, o_k, m_k, rows, level, True, BC)
        b_decay += tl.where(pairs, tl.dot(b_rowfac, tl.trans(b_colfac), input_precision="ieee"), 0)
        b_cover += pairs.to(tl.int32)
        b_largest = tl.maximum(b_largest, tl.maximum(b_rowfac, b_colfac))
    p = o[:, None] * R + o[None, :]
    tl.store(decay + p, b_decay)
    tl.store(cover + p, b_cover)
    tl.store(largest + o[:, None] * BK + o_k[None, :], b_largest)


@pytest.mark.parametrize("rows", [R, 27, 9])
def test_bisection_covers_each_pair_once_with_exact_decays(rows):
    torch.manual_seed(0)
    # up to -30 per token: a block's span reaches hundreds, far beyond exp's fp32 range
    g = (-30.0 * torch.rand(R, BK)).cumsum(0)
    decay = torch.empty(R, R)
    cover = torch.empty(R, R, dtype=torch.int32)
    largest = torch.empty(R, BK)
    bisection_kernel[(1,)](g, decay, cover, largest, rows, R=R, BK=BK, BC=BC)

    i, j = torch.meshgrid(torch.arange(R), torch.arange(R), indexing="ij")
    strictly_lower_in_block = (i > j) & (i // BC == j // BC)
    assert torch.equal(cover, strictly_lower_in_block.to(torch.int32))
    valid = strictly_lower_in_block & (i < rows) & (j < rows)
    gd = g.double()
    want = torch.where(valid, (gd[:, None, :] - gd[None, :, :]).exp().sum(-1), 0).float()
    assert (want[valid] > 1e-30).any()
    torch.testing.assert_close(decay, want, rtol=1e-4, atol=1e-35)
    assert torch.isfinite(largest).all() and (largest <= 1).all()
