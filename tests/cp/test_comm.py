"""all_gather_tensor and send_recv_chain over gloo CPU processes, plus backend staging rules."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cp_linattn.cp import all_gather_tensor, build_cp_context, send_recv_chain
from cp_linattn.cp import comm
from tests.multirank import run_ranks

# (global cu_seqlens, split) layouts for 4 ranks; tokens per rank default to 5
CHAIN_LAYOUTS = [
    ([0, 20], None),  # one sequence over every rank
    ([0, 5, 10, 15, 20], None),  # every sequence ends on a rank edge: no messages at all
    ([0, 3, 13, 13, 14, 20], None),  # rank 1 inside a sequence; rank 2 ends it, holds an empty one, starts another
    ([0, 6, 20], [6, 1, 1, 12]),  # one-token ranks inside a sequence
]
SHAPE = (2, 3, 4)


def _message(rank: int) -> torch.Tensor:
    # powers of two: a received sum names exactly the ranks that contributed to it
    return torch.full(SHAPE, float(2 ** rank))


def _chain(rank: int, world_size: int) -> dict:
    out = {"layouts": []}
    for cu, split in CHAIN_LAYOUTS:
        ctx = build_cp_context(torch.tensor(cu), split=split, comm="send_recv")
        row = {"pre": ctx.pre_num_ranks, "post": ctx.post_num_ranks}
        for direction in ("forward", "backward"):
            calls = []

            def step(i, state_in, calls=calls, ctx=ctx):
                calls.append(state_in)
                # the outgoing state depends on the incoming one only when this rank holds a
                # single sequence (first == last), exactly like M_r S_in + S_ext_r
                carried = state_in if state_in is not None and ctx.num_seqs == 1 else 0
                return _message(rank) + carried

            (received,) = send_recv_chain(step, ctx, shape=SHAPE, direction=direction)
            assert received is None or (received.shape == SHAPE and received.dtype == torch.float32)
            row[direction] = None if received is None else received.unique().tolist()
            row[direction + "_calls"] = len(calls)
        out["layouts"].append(row)

    # a subgroup's chain must address peers by their global rank: groups {0, 1} and {2, 3}
    groups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
    group = groups[rank // 2]
    ctx = build_cp_context(torch.tensor([0, 8]), group)
    (got,) = send_recv_chain(lambda i, s: _message(rank), ctx, shape=SHAPE)
    out["subgroup"] = None if got is None else got.unique().tolist()
    out["subgroup_gather"] = all_gather_tensor(torch.tensor([rank]), group).tolist()
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_send_recv_chain_moves_states_only_between_ranks_sharing_a_sequence():
    per_rank = run_ranks(_chain, 4, timeout=90)
    for i, (cu, split) in enumerate(CHAIN_LAYOUTS):
        for r in range(4):
            row = per_rank[r]["layouts"][i]
            pre, post = row["pre"], row["post"]
            where = f"layout {cu} split {split}, rank {r}: {row}"
            # forward: the sum over the earlier ranks holding this rank's first sequence
            assert row["forward"] == (None if pre == 0 else [float(sum(2 ** j for j in range(r - pre, r)))]), where
            assert row["backward"] == (None if post == 0 else [float(sum(2 ** j for j in range(r + 1, r + post + 1)))]), where
            assert row["forward_calls"] == int(post > 0) and row["backward_calls"] == int(pre > 0), where
    # layouts whose metadata is known by hand, so the test does not trust pre/post alone
    assert [per_rank[r]["layouts"][0]["forward"] for r in range(4)] == [None, [1.0], [3.0], [7.0]]
    assert [per_rank[r]["layouts"][0]["backward"] for r in range(4)] == [[14.0], [12.0], [8.0], None]
    assert all(per_rank[r]["layouts"][1][d] is None for r in range(4) for d in ("forward", "backward"))
    assert [per_rank[r]["layouts"][2]["forward"] for r in range(4)] == [None, [1.0], [3.0], [4.0]]
    assert [per_rank[r]["layouts"][3]["backward"] for r in range(4)] == [None, [12.0], [8.0], None]
    assert [per_rank[r]["subgroup"] for r in range(4)] == [None, [1.0], None, [4.0]]
    assert [per_rank[r]["subgroup_gather"] for r in range(4)] == [[[0], [1]], [[0], [1]], [[2], [3]], [[2], [3]]]


def _gather(rank: int, world_size: int) -> dict:
    base = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = base.to(dtype)
        results[str(dtype)] = (all_gather_tensor(x).tolist(), all_gather_tensor(x.t()).tolist())
    results["scalar"] = all_gather_tensor(torch.tensor(float(rank))).tolist()
    results["backend"] = comm.backend_for(None, "cpu")
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_all_gather_tensor_values(world_size):
    per_rank = run_ranks(_gather, world_size, timeout=60)
    rows = [torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r for r in range(world_size)]
    for res in per_rank:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            want = torch.stack([x.to(dtype) for x in rows])
            got, got_t = res[str(dtype)]
            assert got == want.tolist()
            assert got_t == want.transpose(1, 2).tolist()  # a non-contiguous input
        assert res["scalar"] == [float(r) for r in range(world_size)]
        assert res["backend"] == "gloo"


def test_staging_rules(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert comm.wire_device("gloo", cuda) == cpu  # gloo cannot send CUDA tensors between processes
    assert comm.wire_device("gloo", cpu) == cpu
    assert comm.wire_device("nccl", cuda) == cuda
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert comm.backend_for(None, "cuda") == "nccl" and comm.backend_for(None, "cpu") == "gloo"


def test_chain_rejects_a_step_of_the_wrong_shape_before_sending():
    # a sender-only position (rank 0 of a shared sequence): nothing is received, so no process group is needed
    part = SimpleNamespace(receives=False, sends=True, slot=0, num_seqs=1)
    ctx = SimpleNamespace(rank=0, parts=(part,), chain=((0, 0), (1, 0)), group=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"step must return a tensor of shape \(2, 3, 4\) and dtype torch.float32, got \(2, 3\)"):
        send_recv_chain(lambda i, s: torch.zeros(2, 3), ctx, shape=SHAPE)
    with pytest.raises(ValueError, match="direction must be one of"):
        send_recv_chain(lambda i, s: torch.zeros(SHAPE), ctx, shape=SHAPE, direction="up")
