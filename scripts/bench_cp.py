"""Cost of context parallelism (CP) for chunk_gla and chunk_kda, CP degree D emulated on one GPU.

What it measures, per op, layout and D (bf16, B=1, H=16, K=V=128, one sequence of T=32768
tokens spanning all D ranks, i.e. global cu_seqlens = [0, T]; every rank holds T/D tokens:
one slice under the contiguous layout, two parts of T/2D under zigzag, each pre-process
function then running once per part):

- local: forward and forward+backward of the rank's slice as a plain single-rank call
  (`cu_seqlens=[0, T/D]`, no cp_context): the kernels every rank runs anyway.
- pre-process: the extra work of a CP rank, timed by calling the library's own functions
  with the exact arguments the op passes them in a real CP step (captured from one):
    GLA forward  `expand_h0` and one of (cp/gla.py): `send_final_state` (a rank that
             receives no state: its local pass's final state is the message),
             `receive_state` (one that sends none: the all-gather and the fold before its
             local pass, which starts from the result), `correct_incoming_state` (a middle
             rank: its local pass from zero yields the message (its last fragment's final
             state, and the diagonal transition from the chunk decays the pass also
             returns); then the all-gather, the fold, and one chunk-parallel pass adding the
             incoming state to the first sequence's stored states, `add_decayed_state`);
    GLA backward `gather_final_state_grad` and the same three in reverse:
             `send_first_state_grad`, `receive_final_state_grad`, `correct_incoming_grad`;
    KDA forward  `walk_incoming_state` (cp/kda.py) or `send_final_state`, + `expand_h0`: a rank that
             receives a state walks its last fragment with the delta-rule
             `chunk_delta_rule_fwd_h` before its local pass (on [u, 0] from [0, I], S_ext and
             the K x K transition in one pass, when that sequence continues through the rank;
             on u alone when it starts here), then the all-gather and the fold; a rank that
             receives none sends its local pass's final state (no walk);
    KDA backward `walk_incoming_grad` (a rank that receives a gradient:
             `chunk_delta_rule_bwd_dhu` over the first fragment from a zero gradient, the
             seed's dhu pre-process, the all-gather and the fold) or
             `gather_final_state_grad` + `send_first_state_grad` (one that receives none:
             its local reverse pass's dh0 is the message, no walk).
  Every rank is timed and the table shows the one CP costs most (`cp_cost_pct`).
  Overhead = (pre fwd + pre bwd) / local fwd+bwd, in two measures:
  kernel time (the summed durations of the GPU kernels a call launches, from torch.profiler:
  what a rank adds to the GPU's work, the target's measure) and wall time (do_bench, which
  also counts host launch gaps: the pre-process is a few dozen small launches, so at a few
  thousand tokens per rank its wall time is host time the GPU spends idle here, and which a
  real multi-GPU step, whose host runs ahead of the GPU, mostly hides).
- CP fwd+bwd: the whole op under cp_context, end to end: its excess over local also counts
  what the pre-process timing leaves out (host-side validation, the h0 and dht the local
  kernels then read, KDA's dh0 of the incoming state). The target column judges the larger
  of the two shares, in kernel time.

How the emulation works: one process plays each rank in turn. A fake process group
(torch's "fake" backend, world size D, rank r) gives `build_cp_context` and the op the
rank and world size they ask for; the all-gather (`cp_linattn.cp.comm._all_gather_flat`)
is replaced by a table of every rank's message. A rank's message never depends on what it
receives (its fragment's state from a zero start and its transition; the gradient leaving
its first fragment with none arriving), so after one pass over all ranks the table holds
exactly what a real D-rank all-gather delivers: the incoming states are the real ones, and
each rank's output and gradients are checked against the single-rank run of the whole
sequence (column "max rel err"). The gates' decay rates are spread over the key channels so
that state does cross whole ranks (with uniformly strong decay the transitions vanish and
that check would not see them). Each rank's local call runs on that rank's slice.

Limits: communication is not timed (one GPU has none); the emulated all-gather, two device
copies of the D small fp32 messages (a few microseconds), sits inside the pre-process
figures. Ranks run one after another, so neither contention between ranks nor overlap of
the pre-process with other work is modelled. Figures are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed between runs): they include host launch
latency where the GPU would otherwise idle, which inflates the small kernels of large D.
Without CUDA (`--smoke` under TRITON_INTERPRET=1) a wall-clock timer runs fp32 (the
interpreter's bf16 tl.dot is wrong): those figures only show that the script works.

    python scripts/bench_cp.py --json bench_out/cp.json
    CUDA_VISIBLE_DEVICES='' TRITON_INTERPRET=1 python scripts/bench_cp.py --smoke
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.testing

# Importing fake_pg registers torch's "fake" process-group backend (a single process that
# believes it is rank r of D).
from torch.testing._internal.distributed.fake_pg import FakeStore

import cp_linattn.cp.comm as cp_comm
import cp_linattn.cp.guard as cp_guard
import cp_linattn.cp.gla as cp_gla
import cp_linattn.cp.kda as cp_kda
from benchlib import profile_kernels  # scripts/benchlib.py
from cp_linattn import build_cp_context, chunk_gla, chunk_kda
from cp_linattn.cp import FLACPContext, shard

TARGET_PCT = 10.0
CPU_REPS = 2  # the interpreter is slow and its timings mean nothing beyond "it runs"

Tensors = dict[str, torch.Tensor]
Timer = Callable[[Callable[[], object]], float]  # median milliseconds of a callable


def _gla_inputs(T: int, H: int, K: int, V: int, device: torch.device, dtype: torch.dtype) -> Tensors:
    # Decay rates spread over the key channels, as in trained models (per token from about
    # -0.7 down to -5e-5): the slow channels carry state across whole ranks, so the incoming
    # states and the transitions matter and the accuracy check sees them.
    decay_bias = torch.linspace(0, 10, K, device=device)
    return dict(
        q=torch.randn(1, T, H, K, device=device, dtype=dtype),
        k=torch.randn(1, T, H, K, device=device, dtype=dtype),
        v=torch.randn(1, T, H, V, device=device, dtype=dtype),
        g=F.logsigmoid(torch.randn(1, T, H, K, device=device) + decay_bias).to(dtype),
    )


def _kda_inputs(T: int, H: int, K: int, V: int, device: torch.device, dtype: torch.dtype) -> Tensors:
    x = _gla_inputs(T, H, K, V, device, dtype)
    # The delta rule is only stable with unit-norm keys (see chunk_kda's docstring).
    x["q"], x["k"] = (F.normalize(x[n].float(), dim=-1).to(dtype) for n in ("q", "k"))
    x["beta"] = torch.rand(1, T, H, device=device, dtype=dtype)
    return x


@dataclass(frozen=True)
class OpSpec:
    """One op, and the module-level names through which it calls its CP pre-processes:
    wrapping them there sees exactly the calls a CP step makes."""

    inputs: Callable[[int, int, int, int, torch.device, torch.dtype], Tensors]
    call: Callable[..., torch.Tensor]  # call(x, cu_seqlens=..., cp_context=...) -> o
    fwd_hooks: tuple[tuple[ModuleType, str], ...]  # the forward pre-process calls
    bwd_hooks: tuple[tuple[ModuleType, str], ...]  # the backward ones

    def hooks(self) -> dict[str, tuple[ModuleType, str]]:
        return {f"{d}:{attr}": (mod, attr) for d, hooks in (("fwd", self.fwd_hooks), ("bwd", self.bwd_hooks))
                for mod, attr in hooks}


OPS = {
    "gla": OpSpec(_gla_inputs, lambda x, **kw: chunk_gla(x["q"], x["k"], x["v"], x["g"], **kw)[0],
                  ((cp_gla, "expand_h0"), (cp_gla, "send_final_state"), (cp_gla, "receive_state"),
                   (cp_gla, "correct_incoming_state")),
                  ((cp_gla, "gather_final_state_grad"), (cp_gla, "send_first_state_grad"),
                   (cp_gla, "receive_final_state_grad"), (cp_gla, "correct_incoming_grad"))),
    "kda": OpSpec(_kda_inputs, lambda x, **kw: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)[0],
                  ((cp_kda, "walk_incoming_state"), (cp_kda, "send_final_state"), (cp_kda, "expand_h0")),
                  ((cp_kda, "walk_incoming_grad"), (cp_kda, "gather_final_state_grad"),
                   (cp_kda, "send_first_state_grad"))),
}


class EmulatedAllGather:
    """Stands in for `dist.all_gather_into_tensor(out, inp, group)` of a D-rank group.

    Keeps one `[D, n]` table per message kind (told apart by size, dtype and device: the
    context's fingerprint, the forward (S_ext, M) and the backward dS_ext all differ); each
    call stores the caller's row and returns the table. Rows of ranks not yet seen start as
    copies of the caller's message (so identical fingerprints agree on the first pass).
    """

    def __init__(self) -> None:
        self.tables: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def __call__(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        key = (inp.numel(), inp.dtype, inp.device)
        if key not in self.tables:
            self.tables[key] = inp.expand(world, -1).clone()
        table = self.tables[key]
        table[rank].copy_(inp)
        out.copy_(table.view(-1))


@contextmanager
def emulated_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process is rank `rank` of a `world_size` default group until the block ends."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_timer() -> Timer:
    """Median milliseconds of a callable: do_bench on CUDA, a wall clock otherwise."""
    if torch.cuda.is_available():
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(CPU_REPS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    return wall


def kernel_profile(fn: Callable[[], object], reps: int = 5) -> list[tuple[str, float, int]] | None:
    """The kernels (and device copies) one call launches, as (name, ms per call, launches per
    call) from torch.profiler's CUDA activity, longest first; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    fn()
    return profile_kernels(fn, reps)


def total_ms(kernels: list[tuple[str, float, int]] | None) -> float | None:
    """GPU kernel time of one call: the summed kernel durations, with no host gaps."""
    return None if kernels is None else sum(ms for _, ms, _ in kernels)


def kernel_excess(cp: list[tuple[str, float, int]], local: list[tuple[str, float, int]]
                  ) -> list[tuple[str, float, int]]:
    """Per kernel name, what the CP call spends beyond the local call (ms, extra launches),
    largest first: where a CP excess above the pre-process comes from."""
    after, before = ({name: (ms, n) for name, ms, n in call} for call in (cp, local))
    diff = []
    for name in dict.fromkeys([*after, *before]):  # CP's kernels first, then those only the local call runs
        (ms, n), (ms0, n0) = after.get(name, (0.0, 0)), before.get(name, (0.0, 0))
        diff.append((name, ms - ms0, n - n0))
    return sorted(diff, key=lambda d: -abs(d[1]))


class GuardClock:
    """Wraps `cp_guard.check_on_every_rank` (the per-call argument agreement of every rank):
    host seconds it adds to the argument checks a call makes anyway, and calls made."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self.inner = cp_guard.check_on_every_rank

    def __call__(self, op, context, check):
        checking = 0.0

        def timed_check():
            nonlocal checking
            t = time.perf_counter()
            try:
                return check()
            finally:
                checking += time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            return self.inner(op, context, timed_check)
        finally:
            self.seconds += time.perf_counter() - t0 - checking
            self.calls += 1


def _guard_exchange_worker(rank: int, world: int, port: int, reps: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    record = torch.zeros(cp_guard.RECORD_BYTES, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cp_comm.all_gather_tensor(record, None)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(1e6 * statistics.median(times))
    dist.destroy_process_group()


def guard_exchange_us(world: int, reps: int = 200) -> float:
    """Median microseconds of the guard's exchange alone: a gloo all-gather of one
    RECORD_BYTES record among `world` CPU processes of this machine (what the emulated group
    leaves out)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_guard_exchange_worker, args=(r, world, port, reps, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    us = out.get(timeout=120)
    for proc in procs:
        proc.join(timeout=30)
    return us


def _fwd(spec: OpSpec, x: Tensors, **kw) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            spec.call(x, **kw)
    return run


def _fwd_bwd(spec: OpSpec, x: Tensors, do: torch.Tensor, **kw) -> Callable[[], None]:
    def run() -> None:
        for t in x.values():
            t.grad = None
        spec.call(x, **kw).backward(do)
    return run


def _local_leaves(x_global: Tensors, ctx: FLACPContext) -> Tensors:
    return {n: shard(t.detach(), ctx).clone().requires_grad_() for n, t in x_global.items()}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def captured_step(spec: OpSpec, x: Tensors, do: torch.Tensor,
                  ctx: FLACPContext) -> tuple[torch.Tensor, dict[str, list[mock._Call]]]:
    """Run one CP forward+backward, recording the arguments of its pre-process calls.

    Returns (o, {hook: [calls]}) for the hooks called (a rank takes one of KDA's alternatives;
    a rank of a zigzag layout calls a hook once per part). Raises if no hook of a direction
    was called: then the op's CP path changed and the replay would no longer time what a CP
    step runs.
    """
    with ExitStack() as stack:
        mocks = {h: stack.enter_context(mock.patch.object(mod, attr, wraps=getattr(mod, attr)))
                 for h, (mod, attr) in spec.hooks().items()}
        o = spec.call(x, cp_context=ctx)
        o.backward(do)
    calls = {h: m.call_args_list for h, m in mocks.items() if m.call_count}
    for direction in ("fwd:", "bwd:"):
        if not any(h.startswith(direction) for h in calls):
            raise RuntimeError(f"none of the {direction[:-1]} pre-process calls of {sorted(spec.hooks())} ran")
    return o.detach(), calls


def pre_process_fns(spec: OpSpec, calls: dict[str, list[mock._Call]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Replays of the captured forward and backward pre-process calls with their captured
    arguments (grad mode off, as inside the autograd Function). GLA's updates its states in
    place: a replay adds the incoming state once more, which changes values, not the work."""
    def replay(prefix: str) -> Callable[[], None]:
        todo = [(getattr(mod, attr), call) for h, (mod, attr) in spec.hooks().items()
                if h.startswith(prefix) and h in calls for call in calls[h]]

        def run() -> None:
            with torch.no_grad():
                for fn, call in todo:
                    fn(*call.args, **call.kwargs)
        return run

    return replay("fwd:"), replay("bwd:")


def bench_rank(name: str, spec: OpSpec, x_global: Tensors, do_global: torch.Tensor, ref: Tensors,
               ctx: FLACPContext, timer: Timer) -> dict:
    """Figures of the rank `ctx` describes. Its local call runs on the rank's own slice, so
    the CP call and the local call see the same values."""
    x, do = _local_leaves(x_global, ctx), shard(do_global, ctx)
    o, calls = captured_step(spec, x, do, ctx)
    err = max([_rel_err(o, shard(ref["o"], ctx))] + [_rel_err(t.grad, shard(ref[n], ctx)) for n, t in x.items()])
    cu_local = torch.tensor([0, ctx.local_len], dtype=torch.int64, device=do.device)
    local_fwd_bwd = _fwd_bwd(spec, x, do, cu_seqlens=cu_local)
    local_kernels = kernel_profile(local_fwd_bwd)
    pre_fwd, pre_bwd = pre_process_fns(spec, calls)
    cp_fwd_bwd = _fwd_bwd(spec, x, do, cp_context=ctx)
    pre_kernels = {d: kernel_profile(fn) for d, fn in (("fwd", pre_fwd), ("bwd", pre_bwd))}
    cp_kernels = kernel_profile(cp_fwd_bwd)
    guard = GuardClock()
    with mock.patch.object(cp_guard, "check_on_every_rank", guard):
        cp_fwd_bwd_ms = timer(cp_fwd_bwd)
    row = dict(op=name, layout=ctx.layout, D=ctx.world_size, rank=ctx.rank, tokens=ctx.local_len,
               local_fwd_ms=timer(_fwd(spec, x, cu_seqlens=cu_local)), local_fwd_bwd_ms=timer(local_fwd_bwd),
               pre_fwd_ms=timer(pre_fwd), pre_bwd_ms=timer(pre_bwd),
               cp_fwd_ms=timer(_fwd(spec, x, cp_context=ctx)), cp_fwd_bwd_ms=cp_fwd_bwd_ms,
               guard_us=1e6 * guard.seconds / max(1, guard.calls),
               local_fwd_bwd_kernel_ms=total_ms(local_kernels),
               **{f"pre_{d}_kernel_ms": total_ms(k) for d, k in pre_kernels.items()},
               **{f"pre_{d}_kernels": k for d, k in pre_kernels.items()},
               cp_fwd_bwd_kernel_ms=total_ms(cp_kernels), max_rel_err=err,
               cp_excess_kernels=None if cp_kernels is None else kernel_excess(cp_kernels, local_kernels))
    row["overhead_pct"] = 100 * (row["pre_fwd_ms"] + row["pre_bwd_ms"]) / row["local_fwd_bwd_ms"]
    row["cp_excess_pct"] = 100 * (row["cp_fwd_bwd_ms"] / row["local_fwd_bwd_ms"] - 1)
    if row["local_fwd_bwd_kernel_ms"] is not None:
        row["overhead_kernel_pct"] = 100 * (row["pre_fwd_kernel_ms"] + row["pre_bwd_kernel_ms"]) \
            / row["local_fwd_bwd_kernel_ms"]
        row["cp_excess_kernel_pct"] = 100 * (row["cp_fwd_bwd_kernel_ms"] / row["local_fwd_bwd_kernel_ms"] - 1)
    row["within_target"] = cp_cost_pct(row) <= TARGET_PCT
    return row


def bench_degree(name: str, spec: OpSpec, x_global: Tensors, do_global: torch.Tensor, ref: Tensors, D: int,
                 layout: str, timer: Timer) -> list[dict]:
    cu_global = torch.tensor([0, do_global.shape[1]], dtype=torch.int64, device=do_global.device)
    rows = []
    with mock.patch.object(cp_comm, "_all_gather_flat", EmulatedAllGather()):
        # Pass 1: every rank sends its messages once (and the kernels compile).
        for r in range(D):
            with emulated_rank(r, D):
                ctx = build_cp_context(cu_global, layout=layout)
                spec.call(_local_leaves(x_global, ctx), cp_context=ctx).backward(shard(do_global, ctx))
        # Pass 2: every gather now returns all ranks' true messages.
        for r in range(D):
            with emulated_rank(r, D):
                rows.append(bench_rank(name, spec, x_global, do_global, ref, build_cp_context(cu_global, layout=layout),
                                       timer))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_op(name: str, T: int, H: int, K: int, V: int, degrees: list[int], layouts: list[str],
             device: torch.device, dtype: torch.dtype, timer: Timer) -> list[dict]:
    spec = OPS[name]
    torch.manual_seed(0)
    x_global = {n: t.requires_grad_() for n, t in spec.inputs(T, H, K, V, device, dtype).items()}
    # The single-rank run of the whole sequence: what every CP rank's slice must reproduce.
    o = spec.call(x_global, cu_seqlens=torch.tensor([0, T], dtype=torch.int64, device=device))
    do_global = torch.randn_like(o)
    o.backward(do_global)
    ref = {"o": o.detach(), **{n: t.grad for n, t in x_global.items()}}
    rows = []
    for layout in layouts:
        for D in degrees:
            rows += bench_degree(name, spec, x_global, do_global, ref, D, layout, timer)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def cp_cost_pct(row: dict) -> float:
    """What CP costs a rank, judged against the target and ranking the ranks: the larger of
    the pre-process share and the CP excess, in kernel time (wall time without CUDA). The
    excess counts what the pre-process calls leave out (the work the local kernels do
    differently under CP)."""
    if row.get("overhead_kernel_pct") is not None:
        return max(row["overhead_kernel_pct"], row["cp_excess_kernel_pct"])
    return max(row["overhead_pct"], row["cp_excess_pct"])


def markdown(rows: list[dict]) -> str:
    """One line per (op, layout, D): the rank CP costs most (`cp_cost_pct`)."""
    def ms(x: float | None) -> str:
        return "" if x is None else f"{x:.3f}"

    def pct(x: float | None, sign: str = "") -> str:
        return "" if x is None else f"{x:{sign}.1f}%"

    lines = ["| op | layout | D | tokens/rank | worst rank | kernels: local f+b ms | pre f+b ms | pre / local | "
             f"<= {TARGET_PCT:.0f}% | CP excess | wall: local f+b ms | pre fwd ms | pre bwd ms | pre / local | "
             "CP f+b ms | CP excess | max rel err |",
             "|" + "---|" * 17]
    for op, layout, D in dict.fromkeys((r["op"], r["layout"], r["D"]) for r in rows):
        w = max((r for r in rows if (r["op"], r["layout"], r["D"]) == (op, layout, D)), key=cp_cost_pct)
        pre_k = None if w.get("pre_fwd_kernel_ms") is None else w["pre_fwd_kernel_ms"] + w["pre_bwd_kernel_ms"]
        lines.append(f"| {op} | {layout} | {D} | {w['tokens']} | {w['rank']} | {ms(w.get('local_fwd_bwd_kernel_ms'))} | "
                     f"{ms(pre_k)} | {pct(w.get('overhead_kernel_pct'))} | {'yes' if w['within_target'] else 'no'} | "
                     f"{pct(w.get('cp_excess_kernel_pct'), '+')} | {w['local_fwd_bwd_ms']:.3f} | "
                     f"{w['pre_fwd_ms']:.3f} | {w['pre_bwd_ms']:.3f} | {pct(w['overhead_pct'])} | "
                     f"{w['cp_fwd_bwd_ms']:.3f} | {pct(w['cp_excess_pct'], '+')} | {w['max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def worst_rank_kernels(rows: list[dict], top: int = 6) -> str:
    """The longest pre-process kernels of each (op, D)'s worst rank, and the kernels whose
    time differs most between its CP call and its local call, as markdown lines."""
    lines = []
    for op, layout, D in dict.fromkeys((r["op"], r["layout"], r["D"]) for r in rows):
        w = max((r for r in rows if (r["op"], r["layout"], r["D"]) == (op, layout, D)), key=cp_cost_pct)
        for d in ("fwd", "bwd"):
            kernels = w.get(f"pre_{d}_kernels")
            if kernels:
                listed = ", ".join(f"{name[:48]} {ms:.3f} ms x{n}" for name, ms, n in kernels[:top])
                lines.append(f"- {op} {layout} D={D} rank {w['rank']} pre {d}: {listed}")
        if w.get("cp_excess_kernels"):
            listed = ", ".join(f"{name[:48]} {ms:+.3f} ms {n:+d}" for name, ms, n in w["cp_excess_kernels"][:top])
            lines.append(f"- {op} {layout} D={D} rank {w['rank']} CP call minus local call: {listed}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, help="global tokens (default 32768; --smoke 256)")
    p.add_argument("--H", type=int, help="heads (default 16; --smoke 2)")
    p.add_argument("--K", type=int, help="key head dim (default 128; --smoke 32)")
    p.add_argument("--V", type=int, help="value head dim (default 128; --smoke 32)")
    p.add_argument("--degrees", type=int, nargs="+", help="CP degrees D (default 2 4 8; --smoke 2 4)")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    p.add_argument("--layouts", nargs="+", choices=["contiguous", "zigzag"], default=["contiguous", "zigzag"],
                   help="CP layouts (default both)")
    p.add_argument("--json", type=Path, help="write the meta data and every rank's figures here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script (CPU: TRITON_INTERPRET=1)")
    args = p.parse_args()
    small = args.smoke
    T = args.T or (256 if small else 32768)
    H, K, V = args.H or (2 if small else 16), args.K or (32 if small else 128), args.V or (32 if small else 128)
    degrees = args.degrees or ([2, 4] if small else [2, 4, 8])
    if min(degrees) < 2 or max(degrees) > T:
        p.error(f"--degrees must lie in [2, T={T}] (D=1 has no pre-process), got {degrees}")

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no CUDA device: run on the CPU under the Triton interpreter, TRITON_INTERPRET=1")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                command="python " + shlex.join(sys.argv), dtype=str(dtype).replace("torch.", ""),
                T=T, H=H, K=K, V=V, degrees=degrees, layouts=args.layouts,
                timer="triton.testing.do_bench median" if cuda else f"wall clock, median of {CPU_REPS}",
                note="communication not timed (one GPU has none); the emulated all-gather (device copies of "
                     "the D fp32 messages) is inside the pre-process figures")
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}")
    print(f"command: {meta['command']}")
    print(f"{meta['dtype']}, B=1, H={H}, K={K}, V={V}, T={T} as one sequence over D ranks; timer: {meta['timer']}",
          flush=True)

    timer = make_timer()
    rows = []
    for name in args.ops:
        rows += bench_op(name, T, H, K, V, degrees, args.layouts, device, dtype, timer)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print()
    print(f"CP pre-process per rank; {meta['note']}.")
    print("kernels: summed GPU kernel durations per call (torch.profiler), the target's measure; wall: "
          "do_bench medians, which include host launch gaps. pre / local = (pre fwd + pre bwd) / local fwd+bwd; "
          "CP excess = CP fwd+bwd / local fwd+bwd - 1; max rel err: the rank's output and gradients against "
          "the single-rank run of the whole sequence.")
    print()
    print(markdown(rows))
    print(worst_rank_kernels(rows))
    print("Per-call argument agreement of the ranks (cp/guard.py): host time only, no GPU kernel, no device sync.")
    print("| op | D | host us per call, emulated exchange (worst rank) | gloo all-gather of the record, "
          f"{os.cpu_count()}-core host, D processes: us | share of worst rank's local f+b wall |")
    print("|---|---|---|---|---|")
    exchange = {D: guard_exchange_us(D) for D in degrees}
    for op, D in dict.fromkeys((r["op"], r["D"]) for r in rows):
        w = max((r for r in rows if (r["op"], r["D"]) == (op, D)), key=lambda r: r["guard_us"])
        share = 100 * (w["guard_us"] + exchange[D]) / 1e3 / w["local_fwd_bwd_ms"]
        print(f"| {op} | {D} | {w['guard_us']:.0f} | {exchange[D]:.0f} | {share:.2f}% |")


if __name__ == "__main__":
    main()
