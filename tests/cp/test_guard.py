"""A bad argument on only some CP ranks raises on every rank, within seconds, naming the
argument and the rank at fault (cp_linattn/cp/guard.py); nothing waits in an exchange."""
from __future__ import annotations

import pytest
import torch

from tests.multirank import run_ranks
from tests.utils import random_qkvg

pytestmark = pytest.mark.multirank

CU = [0, 50, 130]
H, K, V = 2, 16, 16


def _inputs(op: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    T = CU[-1]
    x = random_qkvg(gen, 1, T, H, K, V)
    if op == "kda":
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
        x["beta"] = torch.rand(1, T, H, generator=gen)
    return x


def _call(op: str, x: dict, ctx, **kw):
    from cp_linattn import chunk_gla, chunk_kda

    if op == "gla":
        return chunk_gla(x["q"], x["k"], x["v"], x["g"], cp_context=ctx, **kw)
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cp_context=ctx, **kw)


def _one_bad_rank(rank: int, world_size: int, op: str, comm: str) -> dict[str, tuple[str, str]]:
    """Per case, (exception type, message) as this rank saw it; rank 1 is the one at fault."""
    from cp_linattn.cp import build_cp_context, shard
    from cp_linattn.layers import GatedLinearAttention, KimiDeltaAttention

    ctx = build_cp_context(torch.tensor(CU), comm=comm)
    other_batch = build_cp_context(torch.tensor([0, 60, 130]), comm=comm)
    x = {n: shard(t, ctx) for n, t in _inputs(op).items()}
    bad = rank == 1
    local_h0 = torch.zeros(ctx.num_seqs, H, K, V)  # the local sequence count: wrong where it is not the global one
    cases = {
        "initial_state": lambda: _call(op, x, ctx, initial_state=local_h0 if bad else torch.zeros(2, H, K, V)),
        "q": lambda: _call(op, {**x, "q": x["q"][:, :-1]} if bad else x, ctx),
        "q.dtype": lambda: _call(op, {**x, **{n: x[n].half() for n in "qkv"}} if bad else x, ctx),
        "scale": lambda: _call(op, x, ctx, scale=0.3 if bad else 0.25),
        "H (q.shape[2])": lambda: _call(op, {n: t[:, :, :1] for n, t in x.items()} if bad else x, ctx),
        "K (q.shape[3])": lambda: _call(op, {n: t[..., :8] if n in "qkg" else t for n, t in x.items()} if bad else x,
                                        ctx),
        "output_final_state": lambda: _call(op, x, ctx, output_final_state=bad),
        "cp_context (the global batch)": lambda: _call(op, x, other_batch if bad else ctx),
    }
    if op == "kda":
        cases["use_qk_l2norm_in_kernel"] = lambda: _call(op, x, ctx, use_qk_l2norm_in_kernel=bad)
        layer = KimiDeltaAttention(d_model=32, n_heads=2, head_k_dim=16, head_v_dim=16)
    else:
        layer = GatedLinearAttention(d_model=32, n_heads=2, head_k_dim=16, head_v_dim=16)
    xs = torch.randn(1, ctx.local_len, 32)
    cases["x"] = lambda: layer(xs[:, :-1] if bad else xs, cp_context=ctx)
    seen = {}
    for name, call in cases.items():
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        seen[name] = (type(info.value).__name__, str(info.value))
    # the group is still usable afterwards: a good call runs to the end on every rank
    o, _ = _call(op, {n: t.clone().requires_grad_() for n, t in x.items()}, ctx)
    o.sum().backward()
    return seen


@pytest.mark.interpreter
@pytest.mark.parametrize("op, comm", [("gla", "all_gather"), pytest.param("kda", "send_recv", marks=pytest.mark.slow)])
def test_argument_error_on_one_rank_raises_on_every_rank(op, comm):
    """Each case hung before (the healthy ranks waited in the boundary exchange until the
    process-group timeout); the short timeout turns a regression into a fast failure."""
    per_rank = run_ranks(_one_bad_rank, 2, op, comm, timeout=90)
    assert per_rank[0].keys() == per_rank[1].keys()
    for name, (kind, message) in per_rank[0].items():
        assert per_rank[1][name] == (kind, message), f"{name}: the ranks raised different errors"
        assert "rank 1" in message, f"{name}: the rank at fault is not named: {message}"
        argument = name.split(" ")[0]
        assert argument in message, f"{name}: the argument is not named: {message}"


def _agree_over_a_companion_group(rank: int, world_size: int) -> tuple[str, bool]:
    """With an NCCL-only group (emulated: the default group claims NCCL for CPU tensors), the
    agreement travels over a gloo group of the same ranks, made once, never through the GPU."""
    from unittest import mock

    import cp_linattn.cp.comm as comm
    from cp_linattn.cp import build_cp_context
    from cp_linattn.cp.guard import check_on_every_rank

    ctx = build_cp_context(torch.tensor(CU))
    real = comm.backend_for
    with mock.patch.object(comm, "backend_for", lambda g, d: "nccl" if g is None else real(g, d)):
        def check():
            if rank == 1:
                raise ValueError("scale must be a positive finite number, got -1.0")
            return None, {"scale": 1.0}

        with pytest.raises(ValueError) as info:
            check_on_every_rank("chunk_gla", ctx, check)
        assert check_on_every_rank("chunk_gla", ctx, lambda: (None, {"scale": 1.0})) is None
    companions = [g for key, g in comm._HOST_GROUPS.items() if key[1] == tuple(range(world_size))]
    return str(info.value), len(companions) == 1 and comm.backend_for(companions[0], "cpu") == "gloo"


def test_nccl_group_agrees_over_a_gloo_companion():
    out = run_ranks(_agree_over_a_companion_group, 2, timeout=60)
    assert out[0] == out[1]
    message, companion = out[0]
    assert companion and message.startswith("chunk_gla under cp_context: rank 1 of 2 rejected its arguments: scale")
