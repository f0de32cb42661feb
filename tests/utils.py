"""Helpers shared by the test modules; import them from `tests.utils` (conftest.py holds only
pytest hooks).

Inputs
    `random_qkvg`: q, k, v and a log gate from one generator; gate recipes `logsigmoid_gate`,
    `mixed_gate`; `kda_inputs`: every input of chunk_kda (and its reference).
Running
    `run_with_grads`: an op's outputs and every input's gradient through torch.autograd;
    `op_and_reference`: a public op next to its fp32 reference (`ops/*/naive.py`).
Comparing
    `max_rel_err`, `rms_rel_err`, `assert_matches` (fp32, max error), `assert_rms_close`
    (bf16, RMS error).
References and kernel settings
    `chunk_local_cumsum_reference`, `diagonal_block_excess`, `diagonal_block_spans`,
    `set_tile_caps` (the BK / BV caps of ops/launch.py for one test).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

Gate = Callable[[tuple, torch.Generator], torch.Tensor]

# ------------------------------------------------------------------------------------------
# Inputs


def logsigmoid_gate(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Log decays log(sigmoid(x)), x ~ N(0, 1): the ordinary gate of GLA and KDA."""
    return F.logsigmoid(torch.randn(*shape, generator=gen))


def mixed_gate(start: int, end: int) -> Gate:
    """`logsigmoid_gate`, but tokens [start, end) decay by about -8.5 per token: beyond the
    diagonal blocks' dot path (`cp_linattn.ops.common.intra.SAFE_SPAN`), so one call takes
    both intra-chunk paths."""
    def gate(shape: tuple, gen: torch.Generator) -> torch.Tensor:
        g = logsigmoid_gate(shape, gen)
        g[:, start:end] = -8.0 - torch.rand(shape[0], min(shape[1], end) - start, *shape[2:], generator=gen)
        return g

    return gate


def random_qkvg(gen: torch.Generator, B: int, T: int, H: int, K: int, V: int, gate: Gate = logsigmoid_gate,
                HV: int | None = None) -> dict[str, torch.Tensor]:
    """q, k `[B, T, H, K]`, v `[B, T, HV, V]` ~ N(0, 1) and g = gate(`[B, T, HV, K]`), drawn
    from `gen` in that order (fp32, CPU); HV defaults to H."""
    HV = H if HV is None else HV
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    return dict(q=q, k=k, v=v, g=gate((B, T, HV, K), gen))


def kda_inputs(T, H=1, HV=1, K=32, V=32, N=None, gate="log", gate_scale=1.0, normalise_k=True, seed=0,
               device="cpu", dtype=torch.float32) -> dict:
    """Random chunk_kda inputs q, k, v, g, beta, h0, A_log, dt_bias: two rows, or one packed row
    of N sequences. gate="log" gives log decays in (-gate_scale, 0) (A_log = dt_bias = None),
    otherwise raw gate inputs with A_log / dt_bias for the in-kernel gate."""
    from cp_linattn.ops.common.l2norm import l2norm

    gen = torch.Generator().manual_seed(seed)
    B = 1 if N else 2
    if gate == "log":
        recipe = lambda shape, gen: -torch.rand(*shape, generator=gen) * gate_scale  # noqa: E731
    else:
        recipe = lambda shape, gen: torch.randn(*shape, generator=gen) * gate_scale  # noqa: E731
    out = random_qkvg(gen, B, T, H, K, V, recipe, HV=HV)
    if normalise_k:
        out["k"] = l2norm(out["k"])
    out["A_log"] = out["dt_bias"] = None
    if gate != "log":
        out["A_log"], out["dt_bias"] = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV * K, generator=gen)
    out["beta"] = torch.rand(B, T, HV, generator=gen)
    out["h0"] = torch.randn(N or B, HV, K, V, generator=gen)
    return {n: (x.to(device=device, dtype=dtype if n not in ("h0", "A_log", "dt_bias") else torch.float32)
                if x is not None else None) for n, x in out.items()}


# ------------------------------------------------------------------------------------------
# Running


def run_with_grads(fn: Callable, inputs: dict, do: torch.Tensor, dht: torch.Tensor | None = None) -> dict:
    """`fn(**leaves)`, returning o or (o, ht), on detached clones of `inputs` that require grad
    (None entries are passed as None). Returns {"o", "ht" (when fn returns a pair), "d<name>"
    for every input that is not None}: the gradients of sum(o * do) (+ sum(ht * dht))."""
    leaves = {n: None if t is None else t.detach().clone().requires_grad_() for n, t in inputs.items()}
    out = fn(**leaves)
    o, ht = out if isinstance(out, tuple) else (out, None)
    loss = (o.float() * do).sum()
    if dht is not None:
        loss = loss + (ht * dht).sum()
    wrt = {n: t for n, t in leaves.items() if t is not None}
    grads = torch.autograd.grad(loss, list(wrt.values()))
    res = {"o": o.detach()}
    if isinstance(out, tuple):
        res["ht"] = None if ht is None else ht.detach()
    res.update({"d" + n: g for n, g in zip(wrt, grads)})
    return res


def op_and_reference(op: str, cu_seqlens: torch.Tensor | None = None) -> tuple[Callable, Callable]:
    """(ours, reference), each `fn(**inputs) -> o`, for one public op and its fp32 reference:
    chunk_gla and chunk_kda (on `cu_seqlens`), fused_chunk_gla (rows `[B, T, H, D]`: no
    cu_seqlens), chunk_kda_gate (chunk_kda with the in-kernel gate: inputs q, k, v, g, beta,
    A_log, dt_bias)."""
    from cp_linattn import chunk_gla, chunk_kda, fused_chunk_gla
    from cp_linattn.ops.gla.naive import naive_recurrent_gla
    from cp_linattn.ops.kda.naive import kda_gate, naive_recurrent_kda

    cu = cu_seqlens
    if op == "chunk_gla":
        return (lambda **a: chunk_gla(**a, cu_seqlens=cu)[0],
                lambda **a: naive_recurrent_gla(**a, cu_seqlens=cu)[0])
    if op == "fused_chunk_gla":
        return lambda **a: fused_chunk_gla(**a, head_first=False)[0], lambda **a: naive_recurrent_gla(**a)[0]
    if op == "chunk_kda":
        return (lambda **a: chunk_kda(**a, cu_seqlens=cu)[0],
                lambda **a: naive_recurrent_kda(**a, cu_seqlens=cu)[0])
    if op != "chunk_kda_gate":
        raise ValueError(f"unknown op {op!r}")

    def ours(q, k, v, g, beta, A_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)[0]

    def reference(q, k, v, g, beta, A_log, dt_bias):
        return naive_recurrent_kda(q, k, v, kda_gate(g, A_log, dt_bias), beta, cu_seqlens=cu)[0]

    return ours, reference


# ------------------------------------------------------------------------------------------
# Comparing


def max_rel_err(a: torch.Tensor, ref: torch.Tensor, floor: float = 1.0) -> float:
    """Max abs error relative to the reference's max abs, raised to `floor` (0 when empty)."""
    a, ref = a.float().cpu(), ref.float().cpu()
    if not ref.numel():
        return 0.0
    return (a - ref).abs().max().item() / max(floor, ref.abs().max().item())


def rms_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS error relative to the reference's RMS."""
    ref = ref.float()
    return ((a.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def assert_matches(got: dict, ref: dict, tol: float, *, floor: float = 1.0,
                   floors: dict[str, float] | None = None) -> dict[str, float]:
    """Every entry of `got` (name -> tensor, or None where the reference has None) has the
    reference's shape, is finite (as the reference must be) and within `tol` of it:
    `max_rel_err` with the scale raised to `floor`, or to `floors[name]` (a gradient that is
    a difference of much larger terms: its error is relative to those terms). Returns the
    errors by name."""
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    errors = {}
    for name, r in ref.items():
        a = got[name]
        if r is None:
            assert a is None, f"{name}: a tensor where the reference has None"
            continue
        assert a.shape == r.shape, (name, a.shape, r.shape)
        assert torch.isfinite(r).all(), f"the reference's {name} is not finite"
        assert torch.isfinite(a).all(), f"{name} has {(~torch.isfinite(a)).sum()} non-finite values"
        scale_floor = max(floor, (floors or {}).get(name, 0.0))
        assert max(scale_floor, r.abs().max().item()) > 0, \
            f"{name}: reference is identically zero, the comparison would be vacuous"
        errors[name] = max_rel_err(a, r, scale_floor)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"
    return errors


def assert_rms_close(got: dict, ref: dict, ratio: float | Callable[[str], float], *,
                     max_ratio: float | None = None) -> None:
    """Low precision (bf16): every entry of `got` present in `ref` (None skipped) is finite,
    its `rms_rel_err` at most `ratio` (or `ratio(name)`), and with `max_ratio` its
    `max_rel_err` at most that."""
    for name, r in ref.items():
        if r is None:
            continue
        a = got[name]
        assert torch.isfinite(a).all(), f"{name} is not finite"
        limit = ratio(name) if callable(ratio) else ratio
        assert rms_rel_err(a, r) <= limit, f"{name}: rms err ratio {rms_rel_err(a, r):.3e} > {limit:g}"
        if max_ratio is not None:
            assert max_rel_err(a, r) <= max_ratio, f"{name}: max err ratio {max_rel_err(a, r):.3e} > {max_ratio:g}"


# ------------------------------------------------------------------------------------------
# References and kernel settings


def chunk_local_cumsum_reference(x: torch.Tensor, chunk: int, reverse: bool = False, cu_seqlens=None) -> torch.Tensor:
    """Chunk-local (reverse) cumulative sums of x `[B, T, ...]` along T in fp32, token by token;
    chunks restart at every sequence start of `cu_seqlens` (a list or tensor, B = 1). A NaN
    reaches the tokens after it (before it if reverse) in its chunk only."""
    y = torch.zeros_like(x, dtype=torch.float32)
    cu = cu_seqlens
    spans = [(b, 0, x.shape[1]) for b in range(x.shape[0])] if cu is None else [
        (0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    for b, s, e in spans:
        for c in range(s, e, chunk):
            piece = x[b, c:min(c + chunk, e)].float()
            y[b, c:c + piece.shape[0]] = piece.flip(0).cumsum(0).flip(0) if reverse else piece.cumsum(0)
    return y


def diagonal_block_excess(b: torch.Tensor, block: int = 16) -> torch.Tensor:
    """For the chunk-local gate cumsum b `[L, H, K]` of one chunk, per `block`-token diagonal
    block and head, the largest |b - b_mid| over its rows and keys, mid the block's middle row
    (clipped to the chunk): `[cdiv(L, block), H]`, what the kernels compare with the dot path's
    span limit (cp_linattn/ops/common/intra.py)."""
    rows = []
    for r in range(0, b.shape[0], block):
        mid = min(r + block // 2, b.shape[0] - 1)
        rows.append((b[r:r + block] - b[mid:mid + 1]).abs().amax(dim=(0, 2)))
    return torch.stack(rows)


def diagonal_block_spans(g: torch.Tensor, chunk: int = 64, block: int = 16) -> torch.Tensor:
    """Per chunk (of one row, all heads and keys), the largest `diagonal_block_excess` of the
    log gate g's chunk-local cumsum: what decides between the dot and the exact path of the diagonal
    blocks."""
    T = g.shape[1]
    chunks = (g[0, c0:c0 + chunk].float().cumsum(0) for c0 in range(0, T, chunk))
    return torch.tensor([diagonal_block_excess(b.reshape(b.shape[0], 1, -1), block).max().item() for b in chunks])


def set_tile_caps(monkeypatch: pytest.MonkeyPatch, prefixes: tuple[str, ...], caps: dict[str, int]) -> None:
    """Sets the BK / BV caps of every entry of ops/launch.py whose kernel name starts with one
    of `prefixes` (those that have the key) for one test."""
    from cp_linattn.ops.launch import LAUNCH

    for kernel, entry in LAUNCH.items():
        if kernel.startswith(prefixes):
            for key, cap in caps.items():
                if key in entry:
                    monkeypatch.setitem(entry, key, cap)
