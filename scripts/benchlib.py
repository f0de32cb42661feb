"""What the benchmarks and the maintainer tools share: the benchmarked ops and their inputs, their
fp32 references and the error measure the accuracy pass uses, a warm forward+backward step, and a
per-kernel profile of a warm call.

A plain module beside the user benchmarks, not part of the package. `python scripts/bench_ops.py`
puts scripts/ on the path (Python does so for the script's own folder), so the benchmarks import it
as `benchlib`; the tools under scripts/tools/ run as modules from the repository root
(`python -m scripts.tools.tune_launch`) and import it as `scripts.benchlib`. No script edits
sys.path or imports another script.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

# The benchmark's shape: bf16, B=1, H heads, K = V = 128.
H, K, V = 16, 128, 128


def varlen_cu_seqlens(total: int, seed: int = 0) -> torch.Tensor:
    """Mixed document lengths (64..8192, log-uniform), packed to exactly `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        n = int(math.exp(torch.empty(1).uniform_(math.log(64), math.log(8192), generator=g).item()))
        n = min(n, left)
        lens.append(n)
        left -= n
    return torch.tensor([0] + lens).cumsum(0).cuda()


def _inputs(op: str, T: int, HV: int):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, T, H, K, device=dev, dtype=dt)
    k = torch.randn(1, T, H, K, device=dev, dtype=dt)
    if op.startswith("kda"):
        q, k = F.normalize(q.float(), dim=-1).to(dt), F.normalize(k.float(), dim=-1).to(dt)
    v = torch.randn(1, T, HV, V, device=dev, dtype=dt)
    g = F.logsigmoid(torch.randn(1, T, HV, K, device=dev, dtype=torch.float32)).to(dt)
    beta = torch.rand(1, T, HV, device=dev, dtype=dt)
    return q, k, v, g, beta


def accuracy_doc_lengths(total: int) -> list[int]:
    """Document lengths of the accuracy pass's packed batch of `total` tokens: four or five
    documents, one of about total / 50 tokens, all of odd length (none a multiple of the chunk
    size); a single document below 16 tokens."""
    if total < 16:
        return [total]
    # odd lengths: four documents when total is even, five when it is odd, so the last is odd too
    weights = (0.3, 0.02, 0.25) if total % 2 == 0 else (0.3, 0.02, 0.25, 0.1)
    lens = [int(w * total) | 1 for w in weights]
    return lens + [total - sum(lens)]


def op_inputs(name: str, T: int) -> dict[str, torch.Tensor]:
    """The inputs of op `name` on T tokens (seed 0): bf16 q, k, v, g, beta on the GPU (unit q
    and k for KDA); the in-kernel gate cases (kda_gate*) take g raw and add fp32 A_log `[HV]`
    and dt_bias `[HV * K]`."""
    HV = 2 * H if "gva" in name else H
    q, k, v, g, beta = _inputs(name, T, HV)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    if name.startswith("kda_gate"):
        x["g"] = torch.randn_like(g)
        if name == "kda_gate":  # strong decays, up to -29 per token: many diagonal blocks take the exact path
            A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
        else:  # as the KDA layer initialises them (decay rates in [1, 16], dt in [1e-3, 1e-1])
            from cp_linattn.layers.kda import init_gate_parameters
            A_log, dt_bias = init_gate_parameters(HV, K)
        x.update(A_log=A_log.cuda(), dt_bias=dt_bias.cuda())
    return x


def op_call(name: str, lib: str, cu_seqlens=None) -> Callable[..., torch.Tensor]:
    """Op `name` (gla, fused_gla, kda, kda_gva, kda_gate, kda_gate_init) of `lib` (ours, fla) as
    `fn(**op_inputs(name, T)) -> o`; GLA ignores beta. FLA has no fused_gla: its chunk_gla."""
    if lib == "fla":
        from fla.ops.gla import chunk_gla as fla_chunk_gla
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    if name in ("gla", "fused_gla"):
        if lib == "ours":
            from cp_linattn import chunk_gla, fused_chunk_gla
            if name == "fused_gla":
                return lambda q, k, v, g, **_: fused_chunk_gla(q, k, v, g, head_first=False)[0]
            return lambda q, k, v, g, **_: chunk_gla(q, k, v, g, cu_seqlens=cu_seqlens)[0]
        return lambda q, k, v, g, **_: fla_chunk_gla(q, k, v, g, cu_seqlens=cu_seqlens)[0]
    fn = None
    if lib == "ours":
        from cp_linattn import chunk_kda as fn
    else:
        fn = fla_chunk_kda
    if not name.startswith("kda_gate"):
        return lambda q, k, v, g, beta: fn(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]

    def gated(q, k, v, g, beta, A_log, dt_bias):
        return fn(q, k, v, g, beta, cu_seqlens=cu_seqlens, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)[0]

    return gated


def reference_call(name: str, cu_seqlens=None) -> Callable[..., torch.Tensor]:
    """The fp32 token-by-token reference (ops/*/naive.py) of op `name`, called as `op_call`'s
    functions; for the in-kernel gate it applies `kda_gate` to the raw g first."""
    from cp_linattn.ops.gla.naive import naive_recurrent_gla
    from cp_linattn.ops.kda.naive import kda_gate, naive_recurrent_kda

    if name in ("gla", "fused_gla"):
        return lambda q, k, v, g: naive_recurrent_gla(q, k, v, g, cu_seqlens=cu_seqlens)[0]

    def reference(q, k, v, g, beta, A_log=None, dt_bias=None):
        if A_log is not None:
            g = kda_gate(g, A_log, dt_bias)
        return naive_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]

    return reference


def outputs_and_grads(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                      do: torch.Tensor) -> dict[str, torch.Tensor]:
    """o = fn(**inputs) on detached copies of `inputs` and the gradients of sum(o * do) with
    respect to each: {"o", "d<name>" for every input}."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items()}
    o = fn(**leaves)
    grads = torch.autograd.grad((o.float() * do).sum(), list(leaves.values()))
    return {"o": o.detach(), **{"d" + n: g for n, g in zip(leaves, grads)}}


def rms_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS error relative to the reference's RMS."""
    ref = ref.float()
    return ((a.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def make_op(name: str, lib: str, T: int, cu_seqlens):
    """Op `name` (gla, fused_gla, kda, kda_gva, kda_gate, kda_gate_init, sdpa) of `lib` (ours,
    fla, torch) on T tokens: (callable producing the output, list of leaf tensors needing grad)."""
    x = op_inputs(name, T)
    leaves = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    if name == "sdpa":
        qh, kh, vh = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        return (lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)), leaves
    fn = op_call(name, lib, cu_seqlens)
    return (lambda: fn(**x)), leaves


def warm_fwd_bwd_step(op: str, T: int, varlen: bool = False, lib: str = "ours") -> Callable[[], None]:
    """One forward+backward of `make_op(op, lib, ...)`, already run once (compiled, warm, FLA's
    autotuning done); with `varlen` on the packed batch of T tokens of `varlen_cu_seqlens`."""
    fn, leaves = make_op(op, lib, T, varlen_cu_seqlens(T) if varlen else None)
    out = fn()
    do = torch.randn_like(out)
    out.backward(do)

    def step():
        for x in leaves:
            x.grad = None
        fn().backward(do)

    return step


def profile_kernels(step: Callable[[], object], reps: int = 5) -> list[tuple[str, float, int]]:
    """(kernel, CUDA ms per call, launches per call) of a warm callable, sorted by time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / reps, e.count // reps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])
