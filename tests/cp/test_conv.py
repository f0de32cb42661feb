"""Short causal convolution: varlen restarts, and CP (halo exchange) equal to the unsharded run."""
import pytest
import torch
import torch.nn.functional as F

from cp_linattn.cp.conv import halo_sources
from cp_linattn.layers.conv import ShortConvolution
from tests.multirank import run_ranks

D, W = 6, 4


def _inputs(T: int):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    probe = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    return x, probe


def _conv(seed: int = 0) -> ShortConvolution:
    torch.manual_seed(seed)
    return ShortConvolution(D, W).double()


def test_varlen_matches_per_sequence_conv1d():
    cu = torch.tensor([0, 1, 1, 7, 9, 20], dtype=torch.int64)
    x, _ = _inputs(20)
    conv = _conv()
    out = conv(x, cu)
    weight = conv.weight.detach()[:, None, :]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if s == e:
            continue
        seq = x[0, s:e].T[None]
        ref = F.silu(F.conv1d(F.pad(seq, (W - 1, 0)), weight, groups=D))[0].T
        torch.testing.assert_close(out[0, s:e], ref)


def test_halo_sources_table():
    # sequences [0, 5), [5, 12); ranks hold [0, 4), [4, 5), [5, 6), [6, 12): W = 4
    table = halo_sources([0, 5, 12], [(0, 4), (4, 5), (5, 6), (6, 12)], 4)
    # rank 1 reads positions 1, 2, 3 = rows 1, 2, 3 of rank 0's last three rows (1, 2, 3)
    assert table[1].tolist() == [0, 1, 2]
    # rank 2 starts sequence 1: no halo; rank 3 reads 3 (rank 0), 4 (rank 1), 5 (rank 2)
    assert table[2].tolist() == [-1, -1, -1]
    assert table[3].tolist() == [-1, -1, 2 * 3 + 2]
    assert table[0].tolist() == [-1, -1, -1]


def _conv_rank(rank, world_size, cases):
    from cp_linattn.cp.context import build_cp_context, shard

    results = []
    for cu_list, layout in cases:
        cu = torch.tensor(cu_list, dtype=torch.int64)
        layout = {"split": layout} if layout is None or isinstance(layout[0], int) else (
            {"layout": layout} if isinstance(layout, str) else {"ranges": layout})
        ctx = build_cp_context(cu, conv1d_kernel_size=W, **layout)
        x, probe = _inputs(cu_list[-1])
        x_local = shard(x, ctx).clone().requires_grad_()
        conv = _conv()
        out = conv(x_local, cp_context=ctx)
        (out * shard(probe, ctx)).sum().backward()
        results.append((out.detach(), x_local.grad, conv.weight.grad, ctx.token_positions))
    return results


# world size -> [(cu_seqlens, layout)]: a split (None: the context's default), "zigzag", or ranges
CASES = {
    2: [
        ([0, 9, 30, 41], None),
        ([0, 9, 30, 41], "zigzag"),                     # a sequence across the fold (parts 1 and 2 on rank 1)
        ([0, 7], "zigzag"),                             # parts of 2 and 1 tokens, shorter than W-1
        ([0, 20], [[(0, 2), (3, 4), (9, 20)], [(2, 3), (4, 9)]]),  # halo through four one- and two-token parts
    ],
    3: [
        ([0, 40], None),                                # one sequence over every rank
        ([0, 3, 15, 16, 33], [14, 2, 17]),              # rank 1 shorter than W-1 inside a sequence
        ([0, 40], "zigzag"),                            # one sequence over every part
    ],
    4: [
        ([0, 5, 12], [4, 1, 1, 6]),                     # halo from three earlier ranks
        ([0, 2, 2, 8, 8, 23], [6, 2, 5, 10]),           # empty sequences, boundaries at rank edges
        ([0, 2, 2, 8, 8, 23], "zigzag"),
    ],
}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, *(pytest.param(n, marks=pytest.mark.slow) for n in (3, 4))])
def test_cp_equals_unsharded(world_size):
    ranks = run_ranks(_conv_rank, world_size, CASES[world_size], timeout=120)
    for i, (cu_list, _) in enumerate(CASES[world_size]):
        x, probe = _inputs(cu_list[-1])
        x = x.clone().requires_grad_()
        conv = _conv()
        out = conv(x, torch.tensor(cu_list, dtype=torch.int64))
        (out * probe).sum().backward()
        got = [r[i] for r in ranks]
        for g in got:  # each rank's tokens, wherever the layout puts them
            torch.testing.assert_close(g[0], out.detach()[:, g[3]], rtol=0, atol=1e-12)
            torch.testing.assert_close(g[1], x.grad[:, g[3]], rtol=0, atol=1e-12)
        assert sorted(torch.cat([g[3] for g in got]).tolist()) == list(range(cu_list[-1]))
        torch.testing.assert_close(sum(g[2] for g in got), conv.weight.grad, rtol=0, atol=1e-12)
