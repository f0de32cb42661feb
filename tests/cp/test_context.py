"""FLACPContext metadata against a per-token brute force, shard/unshard, and validation.

Every multi-rank check runs in gloo CPU processes (tests/multirank.py); each spawned function
runs many cases so the whole file costs a handful of spawns.
"""
import random

import pytest
import torch
import torch.distributed as dist

from cp_linattn.cp import build_cp_context, default_split, shard, unshard
from tests.multirank import run_ranks


def brute_force_meta(cu: list[int], split: list[int], rank: int, conv1d_kernel_size: int | None) -> dict:
    """Per-token definition of a rank's metadata, written independently of build_cp_context."""
    T = cu[-1]
    seq_of = [i for i in range(len(cu) - 1) for _ in range(cu[i + 1] - cu[i])]
    owner = [r for r, n in enumerate(split) for _ in range(n)]
    assert len(seq_of) == len(owner) == T
    start = sum(split[:rank])
    end = start + split[rank]
    local = [seq_of[t] for t in range(start, end)]
    seq_ids = sorted(set(local))
    local_cu = [0]
    for s in seq_ids:
        local_cu.append(local_cu[-1] + local.count(s))
    first, last = seq_of[start], seq_of[end - 1]
    offset = sum(1 for t in range(start) if seq_of[t] == first)
    bounds = [sum(split[:r]) for r in range(len(split))]
    return {
        "start": start,
        "end": end,
        "split": tuple(split),
        "cu_seqlens": local_cu,
        "seq_ids": seq_ids,
        "pre_num_ranks": len({owner[t] for t in range(T) if seq_of[t] == first and owner[t] < rank}),
        "post_num_ranks": len({owner[t] for t in range(T) if seq_of[t] == last and owner[t] > rank}),
        "first_seq_offset": offset,
        "pre_num_conv_tokens": 0 if conv1d_kernel_size is None else min(offset, conv1d_kernel_size - 1),
        "rank_first_seq": tuple(seq_of[b] for b in bounds),
        "rank_last_seq": tuple(seq_of[b + n - 1] for b, n in zip(bounds, split)),
    }


def _build_cases(rank: int, world_size: int, cases_by_size: dict) -> dict:
    """Build every case on groups of each size n (the first n ranks; n == world_size: the default group)."""
    out = {}
    for n, cases in cases_by_size.items():
        group = None if n == world_size else dist.new_group(ranks=list(range(n)))  # every rank must call new_group
        if rank < n:
            out[n] = [_describe(build_cp_context(torch.tensor(cu), group, split=split, conv1d_kernel_size=k))
                      for cu, split, k in cases]
    return out


def _describe(ctx) -> dict:
    """The context's fields as plain values, after checking shard/unshard/check_local on it."""
    T = ctx.total_tokens
    x = torch.randn(1, T, 3, generator=torch.Generator().manual_seed(T))
    local = shard(x, ctx)
    ctx.check_local(local, "o")
    head_first = x.transpose(1, 2).contiguous()  # [1, 3, T]: the sequence axis is dim 2
    assert ctx.cu_seqlens.dtype == ctx.cu_seqlens_cpu.dtype == ctx.seq_ids.dtype == torch.int64
    assert ctx.cu_seqlens.device == ctx.device == torch.device("cpu")
    assert ctx.is_first_rank == (ctx.pre_num_ranks == 0) and ctx.is_last_rank == (ctx.post_num_ranks == 0)
    assert ctx.num_seqs == len(ctx.seq_ids) and ctx.local_len == ctx.end - ctx.start
    return {
        "start": ctx.start,
        "end": ctx.end,
        "split": ctx.split,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "comm": ctx.comm,
        "cu_seqlens": ctx.cu_seqlens.tolist(),
        "cu_seqlens_cpu": ctx.cu_seqlens_cpu.tolist(),
        "global_cu_seqlens_cpu": ctx.global_cu_seqlens_cpu.tolist(),
        "global_num_seqs": ctx.global_num_seqs,
        "seq_ids": ctx.seq_ids.tolist(),
        "pre_num_ranks": ctx.pre_num_ranks,
        "post_num_ranks": ctx.post_num_ranks,
        "first_seq_offset": ctx.first_seq_offset,
        "pre_num_conv_tokens": ctx.pre_num_conv_tokens,
        "conv4": ctx.with_conv1d_kernel_size(4).pre_num_conv_tokens,
        "rank_first_seq": ctx.rank_first_seq,
        "rank_last_seq": ctx.rank_last_seq,
        "local_matches": torch.equal(local, x[:, ctx.start:ctx.end]),
        "round_trip": torch.equal(unshard(local, ctx), x),
        "round_trip_dim2": torch.equal(unshard(shard(head_first, ctx, dim=2), ctx, dim=2), head_first),
    }


def _random_cases(world_size: int, n: int, seed: int) -> list:
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        # zero lengths (empty sequences) are frequent, including at the ends of the batch
        lens = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 8))]
        T = sum(lens)
        if T < world_size:
            continue
        cu = [0]
        for n_tok in lens:
            cu.append(cu[-1] + n_tok)
        split = None
        if rng.random() < 0.4:
            cuts = sorted(rng.sample(range(1, T), world_size - 1))
            split = [b - a for a, b in zip([0] + cuts, cuts + [T])]
        cases.append((cu, split, rng.choice([None, 2, 4])))
    return cases


def _fixed_cases(world_size: int) -> list:
    W = world_size
    cases = [
        ([0, 7 * W + 3], None, 4),  # one long sequence over every rank, T % W != 0
        ([0, 0, 4 * W, 4 * W], None, None),  # empty sequences at both ends
        ([0] + [4 * (r + 1) for r in range(W)], None, 3),  # every sequence ends exactly on a rank edge
        ([0] + [x for r in range(W) for x in (4 * r + 4, 4 * r + 4)], None, None),  # ...followed by an empty one
        ([0, 1, 5 * W - 1, 5 * W], None, 2),  # ranks wholly inside the middle sequence
        ([0, 3, 3, 3, 9 + W], None, None),  # repeated offsets inside a rank
    ]
    if W > 1:
        cases.append(([0, 2 * W + 1], [1] * (W - 1) + [W + 2], 5))  # explicit, very uneven split
    return cases


@pytest.mark.multirank
@pytest.mark.slow
def test_context_metadata_matches_brute_force():
    # one spawn of 4 ranks covers CP degrees 1..4 through groups of the first n ranks
    cases_by_size = {n: _fixed_cases(n) + _random_cases(n, 25, seed=n) for n in (1, 2, 3, 4)}
    per_rank = run_ranks(_build_cases, 4, cases_by_size, timeout=120)
    for n, cases in cases_by_size.items():
        for rank in range(n):
            for (cu, split, k), got in zip(cases, per_rank[rank][n]):
                used_split = split if split is not None else list(default_split(cu[-1], n))
                want = brute_force_meta(cu, used_split, rank, k)
                where = f"rank {rank}/{n}, cu_seqlens={cu}, split={split}, k={k}"
                for key, value in want.items():
                    assert got[key] == value, f"{key}: got {got[key]}, want {value} ({where})"
                assert got["cu_seqlens_cpu"] == want["cu_seqlens"] and got["global_cu_seqlens_cpu"] == cu, where
                assert got["global_num_seqs"] == len(cu) - 1, where
                assert (got["rank"], got["world_size"], got["comm"]) == (rank, n, "all_gather"), where
                assert got["conv4"] == min(want["first_seq_offset"], 3), where
                assert got["local_matches"] and got["round_trip"] and got["round_trip_dim2"], where


@pytest.mark.parametrize("T, world_size, want", [(11, 4, (3, 3, 3, 2)), (9, 3, (3, 3, 3)), (5, 4, (2, 1, 1, 1)), (4, 1, (4,))])
def test_default_split_gives_extra_tokens_to_first_ranks(T, world_size, want):
    assert default_split(T, world_size) == want


def _expect_error(fn, exc=ValueError) -> str:
    with pytest.raises(exc) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def _bad_arguments(rank: int, world_size: int) -> tuple[dict, dict, dict]:
    cu = torch.tensor([0, 3, 10])
    build = {
        "split_sum": _expect_error(lambda: build_cp_context(cu, split=[4, 4, 1])),
        "split_zero": _expect_error(lambda: build_cp_context(cu, split=[5, 5, 0])),
        "split_len": _expect_error(lambda: build_cp_context(cu, split=[5, 5])),
        "split_type": _expect_error(lambda: build_cp_context(cu, split=[5.0, 5.0, 0.0]), TypeError),
        "comm": _expect_error(lambda: build_cp_context(cu, comm="ring")),
        "conv": _expect_error(lambda: build_cp_context(cu, conv1d_kernel_size=0)),
        "too_short": _expect_error(lambda: build_cp_context(torch.tensor([0, 2]))),
        "dtype": _expect_error(lambda: build_cp_context(cu.int()), TypeError),
        "start": _expect_error(lambda: build_cp_context(torch.tensor([1, 3, 10]))),
        "decreasing": _expect_error(lambda: build_cp_context(torch.tensor([0, 5, 3, 10]))),
        "group": _expect_error(lambda: build_cp_context(cu, group="world"), TypeError),
        "cu_cpu": _expect_error(lambda: build_cp_context(cu, cu_seqlens_cpu=cu[:2])),
        "cu_cpu_values": _expect_error(lambda: build_cp_context(cu, cu_seqlens_cpu=torch.tensor([0, 4, 10]))),
    }
    # arguments that differ between ranks, valid or not, must fail everywhere, not hang
    mismatched = {
        "cu": _expect_error(lambda: build_cp_context(torch.tensor([0, 4 + rank, 12]))),
        "one_rank_invalid": _expect_error(lambda: build_cp_context(torch.tensor([0, 8, 4, 12] if rank == 1 else [0, 4, 8, 12]))),
        "comm": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), comm="send_recv" if rank == 0 else "all_gather")),
        "split": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), split=[4, 4, 4] if rank else [2, 5, 5])),
        "conv": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), conv1d_kernel_size=rank + 2)),
        "one_rank_bad_device": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]),
                                                                      device="nowhere" if rank == 1 else None)),
    }
    # still in step after all those failures; explicit and default spellings of a split agree
    ctx = build_cp_context(cu, comm="send_recv", split=[4, 3, 3] if rank == 2 else None)
    assert ctx.comm == "send_recv" and ctx.split == (4, 3, 3)
    ctx.check_group(None)
    ctx.check_group(dist.group.WORLD)
    # FLA's positional order (cu_seqlens, group, conv1d_kernel_size, cu_seqlens_cpu)
    fla_style = build_cp_context(cu, dist.group.WORLD, 4, torch.tensor([0, 3, 10]))
    assert fla_style.global_cu_seqlens_cpu.tolist() == [0, 3, 10] and fla_style.conv1d_kernel_size == 4
    assert fla_style.pre_num_conv_tokens == [0, 1, 3][rank]
    other = dist.new_group(ranks=list(range(world_size)))
    local = shard(torch.zeros(1, 10, 2), ctx)
    checks = {
        "check_group": _expect_error(lambda: ctx.check_group(other)),
        "check_local_global": _expect_error(lambda: ctx.check_local(torch.zeros(1, 10, 2), "q")),
        "check_local_batch": _expect_error(lambda: ctx.check_local(local.expand(2, -1, -1), "q")),
        "shard": _expect_error(lambda: shard(torch.zeros(1, 9, 2), ctx)),
    }
    return build, checks, mismatched


# What the message of each case of _bad_arguments holds (build_cp_context's cases as rank 0 saw
# them, the checks' as rank 1 did).
EXPECTED_MESSAGES = {
    "split_sum": ("ValueError: split must sum to T=10", "got sum 9"),
    "split_zero": ("ValueError: split entries must all be >= 1", "[5, 5, 0]"),
    "split_len": ("ValueError: split must have one entry per rank (3), got 2",),
    "split_type": ("TypeError: split must be a list or tuple of ints",),
    "comm": ("ValueError: comm must be one of ['all_gather', 'send_recv'], got 'ring'",),
    "conv": ("ValueError: conv1d_kernel_size must be >= 1, got 0",),
    "too_short": ("ValueError: cu_seqlens holds T=2 tokens, fewer than the world size 3",),
    "dtype": ("TypeError: cu_seqlens must have dtype int64, got int32",),
    "start": ("ValueError: cu_seqlens must start at 0, got 1",),
    "decreasing": ("ValueError: cu_seqlens must be non-decreasing",),
    "group": ("TypeError: group must be a torch.distributed ProcessGroup or None, got str",),
    "cu_cpu": (
        "ValueError: cu_seqlens_cpu must be a CPU copy of cu_seqlens ([3] torch.int64), got [2] torch.int64 on cpu",
    ),
    "cu_cpu_values": ("ValueError: cu_seqlens_cpu must hold the values of cu_seqlens [0, 3, 10], got [0, 4, 10]",),
    "check_group": ("ValueError: group does not match cp_context",),
    "check_local_global": ("q.shape[1] must be 3 (the tokens [4, 7)", "got 10"),
    "check_local_batch": ("q must have batch size 1",),
    "shard": ("x.shape[1] must be T=10", "[1, 9, 2]"),
}


@pytest.mark.multirank
def test_bad_or_mismatched_arguments_raise_on_every_rank_without_hanging():
    per_rank = run_ranks(_bad_arguments, 3, timeout=90)
    assert per_rank[0][0] == per_rank[1][0] == per_rank[2][0], "build_cp_context must raise identically on every rank"
    m = {**per_rank[0][0], **per_rank[1][1]}
    for case, parts in EXPECTED_MESSAGES.items():
        for part in parts:
            assert part in m[case], (case, part, m[case])
    for rank, (_, _, mismatched) in enumerate(per_rank):
        for case, msg in mismatched.items():
            assert msg.startswith("ValueError: cu_seqlens differ across ranks"), (rank, case, msg)
    assert "rank 1: invalid arguments" in per_rank[0][2]["one_rank_invalid"]
    assert "rank 1: invalid arguments" in per_rank[0][2]["one_rank_bad_device"]
    assert "this rank: ValueError: cu_seqlens must be non-decreasing" in per_rank[1][2]["one_rank_invalid"]
    assert "rank 2: T=12, N=2" in per_rank[2][2]["cu"]
