"""chunk_gla / chunk_kda under context parallelism against the single-rank call.

Every case builds one global packed batch, runs the op without CP in the test process and
with CP on N gloo ranks (each holding its shard), and checks that every rank's outputs and
input gradients are exactly its slice of the single-rank ones; the per-rank pieces of the
global initial-state gradient and of the final states sum to the single-rank tensors.
"""
from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import pytest
import torch

from tests.multirank import run_ranks
from tests.utils import logsigmoid_gate, max_rel_err, random_qkvg

TOL = 2e-5


def _make_inputs(op: str, cu: list[int], H: int, K: int, V: int, seed: int, options: dict):
    """Global inputs of one case (the same on every rank: generated from the seed)."""
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1
    HV = H * options.get("gva", 1)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if op == "kda" and options.get("gate_in_kernel"):
        gate = lambda shape, gen: torch.randn(*shape, generator=gen)  # noqa: E731
    else:
        gate = lambda shape, gen: logsigmoid_gate(shape, gen) * options.get("gate_scale", 1.0)  # noqa: E731
    x = random_qkvg(gen, 1, T, H, K, V, gate, HV=HV)  # gva (HV > H) is KDA's only
    if op == "kda":
        x["beta"] = torch.rand(1, T, HV, generator=gen)
        if not options.get("l2norm"):
            x["q"], x["k"] = (torch.nn.functional.normalize(x[n], dim=-1) for n in ("q", "k"))
    state = (N, HV, V, K) if options.get("state_v_first") else (N, HV, K, V)
    extra = dict(h0=rnd(*state) if options.get("h0") else None,
                 do=rnd(1, T, HV, V), dht=rnd(*state) if options.get("ht") else None)
    if options.get("gate_in_kernel"):
        extra["A_log"] = rnd(HV) * 0.5
        extra["dt_bias"] = rnd(HV * K) * 0.5
    device, dtype = options.get("device", "cpu"), getattr(torch, options.get("dtype", "float32"))
    x = {n: t.to(device, dtype) for n, t in x.items()}
    extra = {n: None if t is None else t.to(device) for n, t in extra.items()}
    return x, extra


def _run_op(op: str, x: dict, extra: dict, options: dict, cu_seqlens, cp_context):
    """Forward + backward; returns o, final state (or None) and the gradients by name."""
    from cp_linattn import chunk_gla, chunk_kda

    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    params = {n: extra[n].clone().requires_grad_() for n in ("h0", "A_log", "dt_bias") if extra.get(n) is not None}
    kw = dict(initial_state=params.get("h0"), output_final_state=extra["dht"] is not None,
              state_v_first=options.get("state_v_first", False), cu_seqlens=cu_seqlens,
              cu_seqlens_cpu=options.get("cu_seqlens_cpu"), cp_context=cp_context)
    if op == "gla":
        o, ht = chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], **kw)
    else:
        kw.update(use_qk_l2norm_in_kernel=options.get("l2norm", False),
                  disable_recompute=options.get("disable_recompute", False), chunk_size=options.get("chunk_size", 64))
        if options.get("gate_in_kernel"):
            kw.update(use_gate_in_kernel=True, A_log=params["A_log"], dt_bias=params["dt_bias"],
                      safe_gate=options.get("safe_gate", False), lower_bound=options.get("lower_bound"))
        o, ht = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], **kw)
    return o, ht, leaves, params


def _cp_worker(rank: int, world_size: int, op: str, cases: list[dict]) -> list[dict]:
    from cp_linattn.cp import build_cp_context, shard

    results = []
    for case in cases:
        x, extra = _make_inputs(op, case["cu"], case["H"], case["K"], case["V"], case["seed"], case["options"])
        device = torch.device(case["options"].get("device", "cpu"))
        ctx = build_cp_context(torch.tensor(case["cu"], device=device), split=case.get("split"), comm=case["comm"],
                               **case.get("layout", {}))
        local = {n: shard(t, ctx) for n, t in x.items()}
        o, ht, leaves, params = _run_op(op, local, extra, case["options"], None, ctx)
        loss = (o * shard(extra["do"], ctx)).sum()
        if ht is not None:
            loss = loss + (ht * extra["dht"]).sum()
        loss.backward()
        results.append(dict(
            o=o.detach(), ht=None if ht is None else ht.detach(), positions=ctx.token_positions,
            grads={n: t.grad for n, t in leaves.items()},
            param_grads={n: t.grad for n, t in params.items()},
        ))
    return results


def _reference(op: str, case: dict):
    x, extra = _make_inputs(op, case["cu"], case["H"], case["K"], case["V"], case["seed"], case["options"])
    cu = torch.tensor(case["cu"], device=case["options"].get("device", "cpu"))
    o, ht, leaves, params = _run_op(op, x, extra, case["options"], cu, None)
    loss = (o * extra["do"]).sum()
    if ht is not None:
        loss = loss + (ht * extra["dht"]).sum()
    loss.backward()
    return o.detach(), ht, {n: t.grad for n, t in leaves.items()}, {n: t.grad for n, t in params.items()}


def _single_rank(op: str, case: dict) -> dict[str, torch.Tensor]:
    """The single-rank results of a case by name (o, every gradient, the final state)."""
    o, ht, grads, param_grads = _reference(op, case)
    out = {"o": o, **{f"d{n}": g for n, g in grads.items()}, **{f"d{n}": g for n, g in param_grads.items()}}
    if ht is not None:
        out["final_state"] = ht.detach()
    return out


def _pieces(op: str, case: dict, per_rank: list, i: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (what the ranks give together for case i, the single-rank tensor)}: per-token
    tensors go to their global positions (the layout's), the per-sequence and parameter ones sum."""
    single = _single_rank(op, case)
    together = {}

    def placed(pick) -> torch.Tensor:
        out = torch.full_like(single[name].cpu(), float("nan"))  # a token no rank gives stays NaN
        for r in per_rank:
            out[:, r[i]["positions"]] = pick(r[i]).cpu()
        return out

    for name in single:
        if name == "final_state":
            together[name] = sum(r[i]["ht"].cpu() for r in per_rank)
        elif name == "o":
            together[name] = placed(lambda r: r["o"])
        elif name[1:] in per_rank[0][i]["grads"]:
            together[name] = placed(lambda r: r["grads"][name[1:]])
        else:
            together[name] = sum(r[i]["param_grads"][name[1:]].cpu() for r in per_rank)
    return {name: (together[name], single[name]) for name in single}


def _check_cases(op: str, world_size: int, cases: list[dict], tol: float = TOL) -> None:
    per_rank = run_ranks(_cp_worker, world_size, op, cases, timeout=600)
    for i, case in enumerate(cases):
        label = f"{op} world={world_size} case={case}"
        for name, (got, ref) in _pieces(op, case, per_rank, i).items():
            assert max_rel_err(got, ref) <= tol, f"{name} [{label}]: max rel err {max_rel_err(got, ref):.3e}"


def _check_cases_against_fp32(op: str, world_size: int, cases: list[dict], tol: float) -> None:
    """For low-precision runs: CP must be as accurate as the single-rank run, both measured
    against the fp32 single-rank run. Rounding makes CP and single-rank differ by up to the
    sum of their errors (the reductions over ranks and the handed-over states round in other
    places), so comparing them directly measures rounding noise as much as CP (it tripped at
    2.7% on KDA's dA_log, a sum over every token). Each tensor passes within `tol` of the
    fp32 run, or at most 1.5x the single-rank run's own error."""
    per_rank = run_ranks(_cp_worker, world_size, op, cases, timeout=600)
    for i, case in enumerate(cases):
        label = f"{op} world={world_size} case={case}"
        truth = _single_rank(op, dict(case, options=dict(case["options"], dtype="float32")))
        for name, (got, single) in _pieces(op, case, per_rank, i).items():
            err_cp, err_single = max_rel_err(got, truth[name]), max_rel_err(single, truth[name])
            assert err_cp <= max(tol, 1.5 * err_single), \
                f"{name} [{label}]: CP err {err_cp:.3e}, single-rank err {err_single:.3e} (vs fp32)"


def _cases(world_size: int, comm: str, H=1, K=32, V=32, **options) -> list[dict]:
    base = dict(H=H, K=K, V=V, comm=comm, options=options)
    return [
        # random varlen whose total (211) divides by none of 2, 3, 4
        dict(base, cu=[0, 37, 41, 150, 211], seed=1),
        # one long sequence covering every rank (middle ranks wholly inside it; with 4 ranks
        # one of them holds only 3 tokens)
        dict(base, cu=[0, 230], seed=2, split=[100, 3, 60, 67] if world_size == 4 else None),
        # a sequence ending exactly on a rank edge, and pieces shorter than a chunk
        dict(base, cu=[0, 70, 73, 160], seed=3, split={2: [70, 90], 3: [70, 5, 85], 4: [70, 2, 40, 48]}[world_size]),
    ]


def _layout_cases(world_size: int, comm: str, H=1, K=32, V=32, **options) -> list[dict]:
    """Zigzag and explicit ranges: documents across the fold between the two halves, one
    document over every part, T not divisible by 2W, parts shorter than a chunk, a rank holding
    three fragments of one document."""
    W = world_size
    base = dict(H=H, K=K, V=V, comm=comm, options=options)
    zig = {"layout": "zigzag"}
    T = 64 * W + 37
    chunks = [(a, min(a + 29, T)) for a in range(0, T, 29)]  # 29-token pieces dealt round the ranks
    dealt = [[c for j, c in enumerate(chunks) if j % W == r] for r in range(W)]
    return [
        dict(base, cu=[0, 2 * W * 16 + 5], seed=5, layout=zig),  # one document over every part
        dict(base, cu=[0, 30, 64 * W - 3, 64 * W + 40, 64 * W + 41], seed=6, layout=zig),  # across the fold
        dict(base, cu=[0, 11, T], seed=7, layout={"ranges": dealt}),  # several fragments per rank
    ]


CASE_SETS = {"contiguous": _cases, "zigzag-and-ranges": _layout_cases}


# The passes a CP rank may add to its local kernels (the names cp/gla.py and cp/kda.py call): GLA's correction of
# a middle rank's stored states, KDA's walks of a middle rank's fragment.
PRE_PROCESS_PASSES = {"gla": ("add_decayed_state",), "kda": ("chunk_delta_rule_fwd_h", "chunk_delta_rule_bwd_dhu")}


def _count_pre_process_passes(rank: int, world_size: int, op: str, case: dict) -> int:
    from cp_linattn.cp import gla as cp_gla, kda as cp_kda

    module = {"gla": cp_gla, "kda": cp_kda}[op]
    calls = []

    def counted(fn):
        def wrapper(*args, **kwargs):
            # the local passes go through the same modules; the pre-process walks store no chunk
            if fn.__name__ == "add_decayed_state" or \
                    kwargs.get("store_chunk_states", kwargs.get("store_chunk_grads")) is False:
                calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return wrapper

    with ExitStack() as stack:
        for name in PRE_PROCESS_PASSES[op]:
            stack.enter_context(mock.patch.object(module, name, counted(getattr(module, name))))
        _cp_worker(rank, world_size, op, [case])
    return len(calls)


@pytest.mark.parametrize("n_tokens, programs, cu, offsets", [
    (77, 1, [0, 64, 77], [0, 1, 2]),                # a segment per chunk, the last one partial
    (300, 1, [0, 128, 256, 300], [0, 2, 4, 5]),     # 5 chunks over at most 4 slots: 3 segments of 2
    (300, 3, [0, 300], [0, 5]),                     # a walk already fills the slots: not cut
    (300, 8, [0, 300], [0, 5]),
])
def test_fragment_segments_are_whole_chunks(n_tokens, programs, cu, offsets):
    """KDA middle ranks walk their fragment as segments side by side (the CPU has 4 slots);
    every segment but the last is whole chunks, so each chunk is the one of the unsplit walk."""
    from cp_linattn.cp.kda import FragmentSegments

    segments = FragmentSegments.filling(n_tokens, programs, torch.device("cpu"), 64)
    assert segments.count == len(cu) - 1
    if segments.count == 1:  # the plain walk
        assert segments.cu_seqlens is None and segments.chunk_offsets is None
    else:
        assert segments.cu_seqlens.tolist() == cu and segments.chunk_offsets.tolist() == offsets


@pytest.mark.parametrize("slots,programs,count", [(132, 32, 4), (132, 8, 8), (132, 64, 2), (132, 256, 1)])
def test_fragment_segments_fill_the_sms_up_to_eight(monkeypatch, slots, programs, count):
    """On an H200's 132 SMs: HV=16 heads of 64-column walks (32 programs) take 4 segments;
    fewer programs stop at 8, past which the forward fold cost more than it saved."""
    from cp_linattn.cp import kda as cp_kda

    monkeypatch.setattr(cp_kda, "_parallel_slots", lambda device: slots)
    assert cp_kda.FragmentSegments.filling(8192, programs, torch.device("cpu"), 64).count == count


@pytest.mark.parametrize("warps,BV", [(4, 64), (8, 128), (2, 32)])
def test_state_tiles_grow_with_the_warps(monkeypatch, warps, BV):
    """A delta-rule state tile keeps to 64 fp32 registers per thread: at K=128 a 128-column
    cap gives 64 columns at 4 warps, all 128 at 8."""
    from cp_linattn.ops.common.chunk_delta_h import delta_state_block_sizes
    from cp_linattn.ops.launch import LAUNCH

    monkeypatch.setitem(LAUNCH, "cp_bwd_fragment_dhu", dict(LAUNCH["cp_bwd_fragment_dhu"], BV=128, num_warps=warps))
    assert delta_state_block_sizes("cp_bwd_fragment_dhu", 128, 128) == (128, BV)


def _fragment(T: int, HV: int, K: int, V: int, seed: int, chunk_size: int) -> dict[str, torch.Tensor]:
    """Random fp32 WY-stage tensors of a `[1, T]` fragment (gk a chunk-local cumsum)."""
    from cp_linattn.ops.common.cumsum import chunk_local_cumsum

    torch.manual_seed(seed)
    gk = chunk_local_cumsum(-torch.rand(1, T, HV, K) * 0.2, chunk_size)
    x = {name: torch.randn(1, T, HV, K) * 0.1 for name in ("kg", "w", "qg")}  # transitions of norm < 1
    x.update({name: torch.randn(1, T, HV, V) for name in ("u", "do", "dv")})
    return dict(x, gk=gk)


@pytest.mark.interpreter
@pytest.mark.parametrize("count,chunk_size", [(2, 64), (3, 64), (5, 64), (3, 32)])
def test_segmented_fragment_walks_equal_the_plain_walk(count, chunk_size):
    """The KDA middle-rank messages walked in segments and folded equal the plain walk
    (S = 1), whose [S_ext, M] is the fragment's affine map: final(S0) = M S0 + S_ext."""
    from cp_linattn.cp.kda import FragmentSegments, cp_bwd_fragment_dhu, cp_fwd_fragment_h
    from cp_linattn.ops.common.chunk_delta_h import chunk_delta_rule_fwd_h

    T, HV, K, V = 300, 2, 16, 32  # 5 (or 10) chunks, the last partial
    x = _fragment(T, HV, K, V, seed=count, chunk_size=chunk_size)
    cpu = torch.device("cpu")
    plain, segmented = FragmentSegments(T, 1, cpu, chunk_size), FragmentSegments(T, count, cpu, chunk_size)
    assert plain.count == 1 and segmented.count == count
    S_ext, M = cp_fwd_fragment_h(x["kg"], x["w"], x["u"], x["gk"], plain)
    S0 = torch.randn(1, HV, K, V)
    _, _, final = chunk_delta_rule_fwd_h(x["kg"], x["w"], x["u"], x["gk"], S0, True, store_chunk_states=False,
                                         chunk_size=chunk_size)
    torch.testing.assert_close(M @ S0[0] + S_ext, final[0], rtol=1e-5, atol=1e-5)
    for got, ref in zip(cp_fwd_fragment_h(x["kg"], x["w"], x["u"], x["gk"], segmented), (S_ext, M)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must have been walked by cp_fwd_fragment_h"):
        cp_bwd_fragment_dhu(x["qg"], x["kg"], x["w"], x["gk"], x["do"], x["dv"], 0.25,
                           FragmentSegments(T, count, cpu, chunk_size))
    grads = [cp_bwd_fragment_dhu(x["qg"], x["kg"], x["w"], x["gk"], x["do"], x["dv"], 0.25, segments)
             for segments in (plain, segmented)]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("op", ["gla", "kda"])
def test_only_middle_ranks_pay_a_pre_process_pass(op):
    """A rank where the sequence starts sends its local pass's result, one where it ends
    starts its local pass from what it received (in each direction): neither adds a pass of
    its own. One sequence over three ranks: only the middle rank pays, once each way."""
    case = dict(H=1, K=32, V=32, comm="all_gather", options={}, cu=[0, 200], seed=4)
    assert run_ranks(_count_pre_process_passes, 3, op, case, timeout=600) == [0, 2, 0]


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, *(pytest.param(n, marks=pytest.mark.slow) for n in (3, 4))])
@pytest.mark.parametrize("comm", ["all_gather", pytest.param("send_recv", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layouts", ["contiguous", "zigzag-and-ranges"])
def test_gla_cp_matches_single_rank(world_size, comm, layouts):
    # V-first states (state_v_first) with the zigzag and ranges layouts
    _check_cases("gla", world_size, CASE_SETS[layouts](world_size, comm, h0=True, ht=True,
                                                       state_v_first=layouts != "contiguous"))


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(gate_scale=5.0), dict(gate_scale=0.02, h0=True, ht=True)],
                         ids=["strong-decay-no-states", "slow-decay"])
def test_gla_cp_gate_strengths(options):
    _check_cases("gla", 4, _cases(4, "all_gather", **options))


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("op", ["gla", "kda"])
def test_cp_fp16_as_accurate_as_single_rank(op):
    """The low-precision criterion of the GPU test, on the CPU in fp16 (the interpreter's
    bf16 dots are wrong): CP against the fp32 run, no worse than the single-rank run."""
    options = dict(dtype="float16", h0=True, ht=True)
    if op == "kda":
        options.update(gva=2, gate_in_kernel=True, l2norm=True)
    _check_cases_against_fp32(op, 2, _cases(2, "all_gather", **options)[1:2], tol=2e-2)


def _bad_cp_calls(rank: int, world_size: int, op: str) -> list[str]:
    """Each misuse must raise on every rank, before any collective (no rank left waiting)."""
    import dataclasses

    from cp_linattn.cp import build_cp_context, shard

    cu = [0, 50, 120]
    x, extra = _make_inputs(op, cu, 1, 16, 16, 0, {})
    ctx = build_cp_context(torch.tensor(cu))
    local = {n: shard(t, ctx) for n, t in x.items()}
    messages = []
    bad_calls = [
        ("the global tensors", lambda: _run_op(op, x, extra, {}, None, ctx), r"must be \d+ \(the tokens"),
        ("B > 1", lambda: _run_op(op, {n: t.expand(2, *t.shape[1:]) for n, t in local.items()}, extra, {}, None, ctx),
         r"batch size 1"),
        ("another rank's context", lambda: _run_op(op, local, extra, {}, None, dataclasses.replace(ctx, rank=1 - rank)),
         r"cp_context was built for rank"),
        ("local cu_seqlens", lambda: _run_op(op, local, extra, {}, ctx.cu_seqlens, ctx), r"cu_seqlens must be omitted"),
        ("local cu_seqlens_cpu", lambda: _run_op(op, local, extra, dict(cu_seqlens_cpu=ctx.cu_seqlens_cpu), None, ctx),
         r"cu_seqlens_cpu must be omitted"),
        ("not a context", lambda: _run_op(op, local, extra, {}, None, object()), r"cp_context must be an FLACPContext"),
    ]
    for what, call, pattern in bad_calls:
        with pytest.raises((ValueError, TypeError), match=pattern):
            call()
        messages.append(what)
    return messages


@pytest.mark.multirank
@pytest.mark.parametrize("op", ["gla", pytest.param("kda", marks=pytest.mark.slow)])
def test_bad_cp_calls_raise_on_every_rank(op):
    out = run_ranks(_bad_cp_calls, 2, op, timeout=300)
    assert out[0] == out[1] and len(out[0]) == 6


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("comm", ["all_gather", "send_recv"])
@pytest.mark.parametrize("layouts", ["contiguous", "zigzag-and-ranges"])
def test_kda_cp_matches_single_rank(world_size, comm, layouts):
    options = dict(h0=True, ht=True)
    if layouts != "contiguous" and world_size == 3:  # GVA, the in-kernel gate, l2norm, V-first states too
        options.update(gva=2, gate_in_kernel=True, l2norm=True, state_v_first=True)
    _check_cases("kda", world_size, CASE_SETS[layouts](world_size, comm, **options))


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        # the combination that matters: GVA + in-kernel gate + l2norm + states, V-first layout
        dict(gva=2, gate_in_kernel=True, l2norm=True, h0=True, ht=True, state_v_first=True),
        dict(gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, disable_recompute=True, ht=True),
        # slow decay: states (and the K x K transitions) carry across whole ranks
        dict(gate_scale=0.02, h0=True, ht=True),
        # 32-token chunks: the fragment walks and their segments follow the op's chunk size
        dict(chunk_size=32, gva=2, h0=True, ht=True),
    ],
    ids=["gva-gate-l2norm-vfirst", "safe-gate-no-recompute", "slow-decay", "chunk-size-32"],
)
def test_kda_cp_options(options):
    _check_cases("kda", 3, _cases(3, "all_gather", **options)[:2] + _cases(3, "send_recv", **options)[2:])


@pytest.mark.multirank
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gla", "kda"])
@pytest.mark.parametrize("comm", ["all_gather", "send_recv"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cp_on_one_gpu_bf16(op, comm, layout):
    """Several gloo processes sharing the one GPU (NCCL needs a GPU per rank): CUDA tensors
    cross ranks through gloo's all_gather or CPU-staged send/recv; bf16 at real head sizes."""
    options = dict(device="cuda", dtype="bfloat16", h0=True, ht=True, gate_scale=0.1)
    if op == "kda":
        options.update(gva=2, gate_in_kernel=True, l2norm=True)
    cases = [dict(H=4, K=128, V=128, comm=comm, options=options, cu=cu, seed=s, layout={"layout": layout})
             for s, cu in enumerate([[0, 1000, 5000, 8191], [0, 8192]])]
    _check_cases_against_fp32(op, 4, cases, tol=2e-2)
