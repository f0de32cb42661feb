import pytest
import torch
import torch.distributed as dist

from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank


def _all_gather_and_ring(rank: int, world_size: int) -> dict:
    mine = torch.full((3,), float(rank + 1))
    gathered = torch.empty(3 * world_size)
    dist.all_gather_into_tensor(gathered, mine)
    expected = torch.arange(1, world_size + 1, dtype=torch.float32).repeat_interleave(3)
    assert torch.equal(gathered, expected), gathered
    received = None
    if world_size > 1:
        # a chain rank -> rank + 1, the transport CP uses for boundary states
        if rank + 1 < world_size:
            dist.send(mine * 10, dst=rank + 1)
        if rank > 0:
            received = torch.empty(3)
            dist.recv(received, src=rank - 1)
            assert torch.equal(received, torch.full((3,), 10.0 * rank))
    return {"rank": rank, "received": received}


@pytest.mark.parametrize("world_size", [1, *(pytest.param(n, marks=pytest.mark.slow) for n in (2, 3, 4))])
def test_collectives_check_values(world_size):
    out = run_ranks(_all_gather_and_ring, world_size, timeout=90)
    assert [o["rank"] for o in out] == list(range(world_size))
    for r in range(1, world_size):
        assert torch.equal(out[r]["received"], torch.full((3,), 10.0 * r))


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom from rank one")


def test_failure_reports_rank_traceback():
    with pytest.raises(pytest.fail.Exception, match="(?s)rank 1 of 2 failed.*boom from rank one"):
        run_ranks(_raise_on_rank_one, 2, timeout=60)


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        # waits for a message rank 1 never sends
        dist.recv(torch.empty(1), src=1)


def test_hung_collective_fails_within_timeout():
    import time

    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="rank 0"):
        run_ranks(_hang_on_rank_zero, 2, timeout=15)
    assert time.monotonic() - t0 < 40
