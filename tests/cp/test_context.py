"""FLACPContext metadata against a per-token brute force, shard/unshard, and validation.

Every multi-rank check runs in gloo CPU processes (tests/multirank.py); each spawned function
runs many cases so the whole file costs a handful of spawns.
"""
import random

import pytest
import torch
import torch.distributed as dist

from cp_linattn.cp import build_cp_context, default_split, layout_ranges, shard, unshard
from tests.multirank import run_ranks


def brute_force_meta(cu: list[int], owner: list[int], rank: int, conv1d_kernel_size: int | None) -> dict:
    """Per-token definition of a rank's metadata, written independently of build_cp_context.

    owner: the rank holding each global token. A part is a maximal run of tokens of one owner;
    the chain is the parts in token order."""
    T = cu[-1]
    seq_of = [i for i in range(len(cu) - 1) for _ in range(cu[i + 1] - cu[i])]
    assert len(seq_of) == len(owner) == T
    run = [0] * T  # the part (chain slot) of each token
    for t in range(1, T):
        run[t] = run[t - 1] + (owner[t] != owner[t - 1])
    mine = [t for t in range(T) if owner[t] == rank]
    local_cu, seq_ids, parts = [0], [], []
    for slot in sorted({run[t] for t in mine}):
        tokens = [t for t in mine if run[t] == slot]
        first, last = seq_of[tokens[0]], seq_of[tokens[-1]]
        offset = sum(1 for t in range(tokens[0]) if seq_of[t] == first)
        for s in sorted({seq_of[t] for t in tokens}):
            seq_ids.append(s)
            local_cu.append(local_cu[-1] + sum(1 for t in tokens if seq_of[t] == s))
        parts.append({
            "range": (tokens[0], tokens[-1] + 1),
            "slot": slot,
            "pre": len({run[t] for t in range(T) if seq_of[t] == first and run[t] < slot}),
            "post": len({run[t] for t in range(T) if seq_of[t] == last and run[t] > slot}),
            "first_seq_offset": offset,
            "conv_tokens": 0 if conv1d_kernel_size is None else min(offset, conv1d_kernel_size - 1),
        })
    return {
        "ranges": tuple(p["range"] for p in parts),
        "split": tuple(owner.count(r) for r in range(max(owner) + 1)),
        "cu_seqlens": local_cu,
        "seq_ids": seq_ids,
        "parts": parts,
        "token_positions": mine,
        "pre_num_ranks": parts[0]["pre"],
        "post_num_ranks": parts[-1]["post"],
        "first_seq_offset": parts[0]["first_seq_offset"],
        "pre_num_conv_tokens": parts[0]["conv_tokens"],
    }


def _owners(T: int, world_size: int, layout: dict) -> list[int]:
    """The owner of each token, from the layout's own definition (not from layout_ranges)."""
    if "ranges" in layout:
        return [next(r for r, held in enumerate(layout["ranges"]) if any(s <= t < e for s, e in held))
                for t in range(T)]
    if layout.get("layout") == "zigzag":
        sizes = default_split(T, 2 * world_size)
        part = [i for i, n in enumerate(sizes) for _ in range(n)]
        return [p if p < world_size else 2 * world_size - 1 - p for p in part]
    split = layout.get("split") or default_split(T, world_size)
    return [r for r, n in enumerate(split) for _ in range(n)]


def _build_cases(rank: int, world_size: int, cases_by_size: dict) -> dict:
    """Build every case on groups of each size n (the first n ranks; n == world_size: the default group)."""
    out = {}
    for n, cases in cases_by_size.items():
        group = None if n == world_size else dist.new_group(ranks=list(range(n)))  # every rank must call new_group
        if rank < n:
            out[n] = [_describe(build_cp_context(torch.tensor(cu), group, conv1d_kernel_size=k, **layout))
                      for cu, layout, k in cases]
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
    assert ctx.num_seqs == len(ctx.seq_ids) and ctx.local_len == sum(e - s for s, e in ctx.ranges)
    for p in ctx.parts:  # the part's own view of its sequences agrees with the local offsets
        cu = ctx.cu_seqlens_cpu.tolist()
        assert cu[p.seq_begin] == p.offset and cu[p.seq_end] == p.offset + p.end - p.start
        assert p.first_seq_end == cu[p.seq_begin + 1] and p.last_seq_start == cu[p.seq_end - 1]
        assert ctx.chain[p.slot] == (ctx.rank, ctx.parts.index(p))
    return {
        "ranges": ctx.ranges,
        "split": ctx.split,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "comm": ctx.comm,
        "cu_seqlens": ctx.cu_seqlens.tolist(),
        "cu_seqlens_cpu": ctx.cu_seqlens_cpu.tolist(),
        "global_cu_seqlens_cpu": ctx.global_cu_seqlens_cpu.tolist(),
        "global_num_seqs": ctx.global_num_seqs,
        "seq_ids": ctx.seq_ids.tolist(),
        "parts": [{"range": (p.start, p.end), "slot": p.slot, "pre": p.pre_num_parts, "post": p.post_num_parts,
                   "first_seq_offset": p.first_seq_offset, "conv_tokens": p.conv_tokens} for p in ctx.parts],
        "token_positions": ctx.token_positions.tolist(),
        "pre_num_ranks": ctx.pre_num_ranks,
        "post_num_ranks": ctx.post_num_ranks,
        "first_seq_offset": ctx.first_seq_offset,
        "pre_num_conv_tokens": ctx.pre_num_conv_tokens,
        "conv4": ctx.with_conv1d_kernel_size(4).pre_num_conv_tokens,
        "local_matches": torch.equal(local, x[:, ctx.token_positions]),
        "round_trip": torch.equal(unshard(local, ctx), x),
        "round_trip_dim2": torch.equal(unshard(shard(head_first, ctx, dim=2), ctx, dim=2), head_first),
    }


def _random_ranges(rng: random.Random, T: int, world_size: int) -> list:
    """A random disjoint cover of [0, T) in which every rank holds at least one range."""
    pieces = rng.randint(world_size, min(T, 3 * world_size))
    cuts = sorted(rng.sample(range(1, T), pieces - 1))
    bounds = list(zip([0] + cuts, cuts + [T]))
    owners = list(range(world_size)) + [rng.randrange(world_size) for _ in range(pieces - world_size)]
    rng.shuffle(owners)
    return [[b for b, o in zip(bounds, owners) if o == r] for r in range(world_size)]


def _random_cases(world_size: int, n: int, seed: int) -> list:
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        # zero lengths (empty sequences) are frequent, including at the ends of the batch
        lens = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 8))]
        T = sum(lens)
        if T < max(world_size, 2):
            continue
        cu = [0]
        for n_tok in lens:
            cu.append(cu[-1] + n_tok)
        layout, pick = {}, rng.random()
        if pick < 0.25 and world_size > 1:
            cuts = sorted(rng.sample(range(1, T), world_size - 1))
            layout = {"split": [b - a for a, b in zip([0] + cuts, cuts + [T])]}
        elif pick < 0.5:
            layout = {"layout": "zigzag"}
        elif pick < 0.75:
            layout = {"ranges": _random_ranges(rng, T, world_size)}
        cases.append((cu, layout, rng.choice([None, 2, 4])))
    return cases


def _fixed_cases(world_size: int) -> list:
    W = world_size
    zig = {"layout": "zigzag"}
    cases = [
        ([0, 7 * W + 3], {}, 4),  # one long sequence over every rank, T % W != 0
        ([0, 0, 4 * W, 4 * W], {}, None),  # empty sequences at both ends
        ([0] + [4 * (r + 1) for r in range(W)], {}, 3),  # every sequence ends exactly on a rank edge
        ([0] + [x for r in range(W) for x in (4 * r + 4, 4 * r + 4)], {}, None),  # ...followed by an empty one
        ([0, 1, 5 * W - 1, 5 * W], {}, 2),  # ranks wholly inside the middle sequence
        ([0, 3, 3, 3, 9 + W], {}, None),  # repeated offsets inside a rank
        ([0, 7 * W + 3], zig, 4),  # one document over every part, T % 2W != 0
        ([0, 2 * W - 1, 2 * W + 1, 6 * W], zig, 3),  # a document across the fold between the halves
        ([0, W, W + 1], zig, 2),  # T = W + 1 < 2W: empty parts
    ]
    if W > 1:
        ranges = [[(0, 1), (5 * W + 1, 5 * W + 2)]] + [[(r, r + 1)] for r in range(1, W - 1)] + [[(W - 1, 5 * W + 1)]]
        cases.append(([0, 5, 5 * W + 2], {"ranges": ranges}, 4))  # one-token parts around a long one
        cases.append(([0, 2 * W + 1], {"split": [1] * (W - 1) + [W + 2]}, 5))  # explicit, very uneven split
    return cases


@pytest.mark.multirank
@pytest.mark.slow
def test_context_metadata_matches_brute_force():
    # one spawn of 4 ranks covers CP degrees 1..4 through groups of the first n ranks
    cases_by_size = {n: _fixed_cases(n) + _random_cases(n, 40, seed=n) for n in (1, 2, 3, 4)}
    per_rank = run_ranks(_build_cases, 4, cases_by_size, timeout=120)
    for n, cases in cases_by_size.items():
        for rank in range(n):
            for (cu, layout, k), got in zip(cases, per_rank[rank][n]):
                want = brute_force_meta(cu, _owners(cu[-1], n, layout), rank, k)
                where = f"rank {rank}/{n}, cu_seqlens={cu}, layout={layout}, k={k}"
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
        "dtype": _expect_error(lambda: build_cp_context(cu.short()), TypeError),
        "start": _expect_error(lambda: build_cp_context(torch.tensor([1, 3, 10]))),
        "decreasing": _expect_error(lambda: build_cp_context(torch.tensor([0, 5, 3, 10]))),
        "group": _expect_error(lambda: build_cp_context(cu, group="world"), TypeError),
        "cu_cpu": _expect_error(lambda: build_cp_context(cu, cu_seqlens_cpu=cu[:2])),
        "cu_cpu_values": _expect_error(lambda: build_cp_context(cu, cu_seqlens_cpu=torch.tensor([0, 4, 10]))),
        "layout": _expect_error(lambda: build_cp_context(cu, layout="ring")),
        "zigzag_split": _expect_error(lambda: build_cp_context(cu, layout="zigzag", split=[4, 3, 3])),
        "ranges_overlap": _expect_error(lambda: build_cp_context(cu, ranges=[[(0, 4)], [(3, 7)], [(7, 10)]])),
        "ranges_gap": _expect_error(lambda: build_cp_context(cu, ranges=[[(0, 4)], [(5, 7)], [(7, 10)]])),
        "ranges_short": _expect_error(lambda: build_cp_context(cu, ranges=[[(0, 4)], [(4, 9)], [(9, 9)]])),
        "ranges_order": _expect_error(lambda: build_cp_context(cu, ranges=[[(5, 7), (0, 4)], [(4, 5)], [(7, 10)]])),
        "ranges_empty_rank": _expect_error(lambda: build_cp_context(cu, ranges=[[(0, 4), (4, 10)], [], [(10, 10)]])),
        "ranges_count": _expect_error(lambda: build_cp_context(cu, ranges=[[(0, 10)]])),
        "ranges_type": _expect_error(lambda: build_cp_context(cu, ranges=[[(0, 4.0)], [(4, 7)], [(7, 10)]]), TypeError),
        "ranges_and_layout": _expect_error(lambda: build_cp_context(cu, layout="zigzag", ranges=[[(0, 4)], [(4, 7)],
                                                                                               [(7, 10)]])),
        "zigzag_short": _expect_error(lambda: build_cp_context(torch.tensor([0, 2]), layout="zigzag")),
        "tf32x3": _expect_error(lambda: build_cp_context(cu, use_tf32x3_affine_chain=False)),
    }
    # arguments that differ between ranks, valid or not, must fail everywhere, not hang
    mismatched = {
        "cu": _expect_error(lambda: build_cp_context(torch.tensor([0, 4 + rank, 12]))),
        "one_rank_invalid": _expect_error(lambda: build_cp_context(torch.tensor([0, 8, 4, 12] if rank == 1 else [0, 4, 8, 12]))),
        "comm": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), comm="send_recv" if rank == 0 else "all_gather")),
        "split": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), split=[4, 4, 4] if rank else [2, 5, 5])),
        "conv": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), conv1d_kernel_size=rank + 2)),
        "ranges": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), ranges=[[(0, 4)], [(4, 8)], [(8, 12)]]
                                                         if rank else [[(0, 2)], [(2, 8)], [(8, 12)]])),
        "layout": _expect_error(lambda: build_cp_context(torch.tensor([0, 12]), layout="zigzag" if rank else "contiguous")),
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
    # int32 offsets (FLA's own tests pass them), with and without an int32 CPU copy: the int64 context
    for narrow in (build_cp_context(cu.int()), build_cp_context(cu.int(), cu_seqlens_cpu=cu.int())):
        assert narrow.global_cu_seqlens_cpu.dtype == narrow.cu_seqlens.dtype == torch.int64
        assert torch.equal(narrow.global_cu_seqlens_cpu, cu) and narrow.ranges == ctx.ranges
    zig = build_cp_context(cu, dist.group.WORLD, None, None, True, "zigzag")  # FLA 0.6.0's positions
    assert zig.layout == "zigzag" and zig.ranges == layout_ranges(10, world_size, "zigzag")[rank]
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
    "dtype": ("TypeError: cu_seqlens must have dtype int32 or int64, got int16",),
    "start": ("ValueError: cu_seqlens must start at 0, got 1",),
    "decreasing": ("ValueError: cu_seqlens must be non-decreasing",),
    "group": ("TypeError: group must be a torch.distributed ProcessGroup or None, got str",),
    "cu_cpu": (
        "ValueError: cu_seqlens_cpu must be a CPU copy of cu_seqlens ([3] torch.int64), got [2] torch.int64 on cpu",
    ),
    "cu_cpu_values": ("ValueError: cu_seqlens_cpu must hold the values of cu_seqlens [0, 3, 10], got [0, 4, 10]",),
    "layout": ("ValueError: layout must be one of ['contiguous', 'zigzag'], got 'ring'",),
    "zigzag_split": ("ValueError: split= applies to the contiguous layout only",),
    "ranges_overlap": ("ValueError: ranges must cover [0, T=10) exactly once: token 3 is on two ranks",),
    "ranges_gap": ("ValueError: ranges must cover [0, T=10) exactly once: tokens [4, 5) are on no rank",),
    "ranges_short": ("ValueError: ranges must cover [0, T=10) exactly once: tokens [9, 10) are on no rank",),
    "ranges_order": ("ValueError: ranges[0] must be ascending and disjoint",),
    "ranges_empty_rank": ("ValueError: rank 1 holds no token under layout ranges",),
    "ranges_count": ("ValueError: ranges must hold one list of (start, end) pairs per rank (3), got 1",),
    "ranges_type": ("TypeError: ranges[0] must be a list of (start, end) int pairs",),
    "ranges_and_layout": ("ValueError: ranges= is the layout itself",),
    "zigzag_short": ("ValueError: rank 2 holds no token under layout zigzag (T=2, world size 3)",),
    "tf32x3": ("ValueError: use_tf32x3_affine_chain must be True",),
    "check_group": ("ValueError: group does not match cp_context",),
    "check_local_global": ("q.shape[1] must be 3 (the tokens [4, 7) this rank holds", "got 10"),
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
