"""Extreme log gates (a hard reset of -inf, huge finite decays, huge next to tiny in one chunk)
against the fp32 references: forward and every gradient of chunk_gla, fused_chunk_gla and
chunk_kda (also with the in-kernel gate), on varlen batches whose lengths are not multiples of
the chunk size; and chunk_gla / chunk_kda under context parallelism with such a gate next to
a rank boundary, against the single-rank run.

Every decay below about -104 is exactly 0 in fp32, so the references are exact for all of
them; the kernels floor each log gate before the cumulative sum
(`cp_linattn.ops.common.cumsum.LOG_DECAY_FLOOR`).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_linattn import chunk_gla, chunk_kda, fused_chunk_gla
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.kda.naive import kda_gate, l2norm, naive_recurrent_kda
from tests.multirank import run_ranks

TOL = 1e-4
# three sequences (37, 113, 65 tokens): chunks of 64 restart at 37 and 150
CU = [0, 37, 150, 215]
# tokens that take the extreme gate: the middle of a chunk of the second sequence, and the first
# token of the last one, on half of the key channels
RESET_TOKENS = (80, 150)
EXTREMES = {
    "-inf": float("-inf"),
    "-1e5": -1e5,
    "-1e8": -1e8,
    "-1e30": -1e30,
    "finfo.min": torch.finfo(torch.float32).min,
}
# huge next to tiny gates (about -0.01) in the same chunk
MIXED = {"-1e3-next-to-0.01": -1e3, "-1e5-next-to-0.01": -1e5}
# For MIXED a precision test: the decays after the huge gate are differences of cumsums of its
# magnitude, so they carry its rounding (an ulp of 1e3 is 6e-5, of the floor's 110 is 8e-6).
TOL_MIXED = 3e-5


def _chunk_sums(x: torch.Tensor, chunk: int, reverse: bool) -> torch.Tensor:
    """Chunk-local (reverse) cumulative sums of x `[B, T, ...]` along T, token by token, in
    fp32 (a NaN reaches the tokens after it, or before it if reverse, in its chunk only)."""
    y = torch.empty_like(x)
    for c in range(0, x.shape[1], chunk):
        piece = x[:, c:c + chunk]
        y[:, c:c + chunk] = piece.flip(1).cumsum(1).flip(1) if reverse else piece.cumsum(1)
    return y


def test_chunk_local_cumsum_floors_log_gates():
    """The forward cumsum floors each gate at LOG_DECAY_FLOOR (NaN stays NaN); the reverse
    one, of gradients, sums them as they are."""
    from cp_linattn.ops.common.cumsum import LOG_DECAY_FLOOR

    x = -torch.rand(2, 50, 2, 8, generator=torch.Generator().manual_seed(0))
    x[0, 5, 0, :4] = torch.tensor([float("-inf"), -1e30, torch.finfo(torch.float32).min, -200.0])
    x[1, 20, 1, 3] = float("nan")
    floor = LOG_DECAY_FLOOR.value
    torch.testing.assert_close(chunk_local_cumsum(x, 16), _chunk_sums(torch.where(x < floor, floor, x), 16, False),
                               equal_nan=True)
    grads = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    grads[0, 5, 0, 0] = 2 * floor
    torch.testing.assert_close(chunk_local_cumsum(grads, 16, reverse=True), _chunk_sums(grads, 16, True),
                               rtol=1e-5, atol=1e-4)


def _base_gates(T: int, H: int, K: int, slow: bool, gen: torch.Generator) -> torch.Tensor:
    if slow:
        return -0.01 * (0.5 + torch.rand(1, T, H, K, generator=gen))
    return F.logsigmoid(torch.randn(1, T, H, K, generator=gen))


def _with_extreme(g: torch.Tensor, value: float) -> torch.Tensor:
    g = g.clone()
    for t in RESET_TOKENS:
        g[:, t, :, : g.shape[-1] // 2] = value
    return g


def _inputs(op: str, value: float | None, slow: bool, H: int = 1, K: int = 32, V: int = 32, seed: int = 0) -> dict:
    """Random inputs on CU; the log gates take `value` at RESET_TOKENS (unless None)."""
    gen = torch.Generator().manual_seed(seed)
    T = CU[-1]
    x = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
             v=torch.randn(1, T, H, V, generator=gen))
    x["g"] = _base_gates(T, H, K, slow, gen)
    if value is not None:
        x["g"] = _with_extreme(x["g"], value)
    if op == "kda":
        x["k"] = l2norm(x["k"])
        x["beta"] = torch.rand(1, T, H, generator=gen)
    return x


def _grads(fn, inputs: dict, do: torch.Tensor) -> dict[str, torch.Tensor]:
    """o and the gradient of every input of `fn(**leaves) -> o` for the cotangent do."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    o = fn(**leaves)
    grads = torch.autograd.grad((o.float() * do).sum(), list(leaves.values()))
    return {"o": o.detach(), **{"d" + n: gr for n, gr in zip(leaves, grads)}}


def _assert_matches(got: dict, ref: dict, tol: float = TOL) -> None:
    assert set(got) == set(ref)
    bad = {}
    for name, r in ref.items():
        assert torch.isfinite(r).all(), f"the reference's {name} is not finite"
        assert torch.isfinite(got[name]).all(), f"{name} has {(~torch.isfinite(got[name])).sum()} non-finite values"
        err = (got[name].float() - r).abs().max().item() / max(1.0, r.abs().max().item())
        if not err <= tol:
            bad[name] = err
    assert not bad, f"relative errors above {tol}: {bad}"


def _cotangent(shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_gla(value: float, slow: bool, fused: bool) -> None:
    x = _inputs("gla", value, slow)
    do = _cotangent(x["v"].shape)
    if fused:
        # fused_chunk_gla takes no cu_seqlens: the sequences as a batch of rows (of 215 tokens)
        x = {n: t.expand(2, *t.shape[1:]).clone() for n, t in x.items()}
        x["g"][1] = x["g"][1].flip(0)
        do = do.expand(2, *do.shape[1:]).clone()
        got = _grads(lambda **a: fused_chunk_gla(**a, head_first=False)[0], x, do)
        ref = _grads(lambda **a: naive_recurrent_gla(**a)[0], x, do)
    else:
        cu = torch.tensor(CU)
        got = _grads(lambda **a: chunk_gla(**a, cu_seqlens=cu)[0], x, do)
        ref = _grads(lambda **a: naive_recurrent_gla(**a, cu_seqlens=cu)[0], x, do)
    _assert_matches(got, ref, _tol(slow))


CASES = [pytest.param(v, False, id=n) for n, v in EXTREMES.items()] + \
        [pytest.param(v, True, id=n) for n, v in MIXED.items()]


def _tol(slow: bool) -> float:
    return TOL_MIXED if slow else TOL


@pytest.mark.parametrize("value, slow", CASES)
def test_chunk_gla_extreme_gates(value, slow):
    _check_gla(value, slow, fused=False)


@pytest.mark.parametrize("value, slow", CASES)
def test_fused_chunk_gla_extreme_gates(value, slow):
    _check_gla(value, slow, fused=True)


@pytest.mark.parametrize("value, slow", CASES)
def test_chunk_kda_extreme_gates(value, slow):
    x = _inputs("kda", value, slow)
    cu = torch.tensor(CU)
    do = _cotangent(x["v"].shape)
    got = _grads(lambda **a: chunk_kda(**a, cu_seqlens=cu)[0], x, do)
    ref = _grads(lambda **a: naive_recurrent_kda(**a, cu_seqlens=cu)[0], x, do)
    _assert_matches(got, ref, _tol(slow))


def _raw_gate_for(value: float, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The raw input x with `-exp(A_log) * softplus(x + dt_bias)` = value (softplus is the
    identity above 20; -inf and values that overflow take x = +inf), `[HV, K]`."""
    HV = A_log.numel()
    x = value / -A_log.exp().view(HV, 1) - dt_bias.view(HV, -1)
    return torch.where(torch.isfinite(x), x, float("inf"))


@pytest.mark.parametrize("value, slow", CASES)
def test_chunk_kda_gate_in_kernel_extreme_gates(value, slow):
    """The in-kernel gate driven to the extreme values by its raw input (x = +inf for -inf):
    dA_log and ddt_bias too."""
    x = _inputs("kda", None, False)
    gen = torch.Generator().manual_seed(3)
    HV, K = x["g"].shape[2:]
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV * K, generator=gen)
    # slow: softplus(-6 + noise) ~ 2.5e-3, gates of about -0.0025 exp(A_log)
    raw = torch.randn(x["g"].shape, generator=gen) + (-6.0 if slow else 0.0)
    for t in RESET_TOKENS:
        raw[0, t, :, : K // 2] = _raw_gate_for(value, A_log, dt_bias)[:, : K // 2]
    x.update(g=raw, A_log=A_log, dt_bias=dt_bias)
    cu = torch.tensor(CU)
    do = _cotangent(x["v"].shape)

    def ours(q, k, v, g, beta, A_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu)[0]

    def reference(q, k, v, g, beta, A_log, dt_bias):
        return naive_recurrent_kda(q, k, v, kda_gate(g, A_log, dt_bias), beta, cu_seqlens=cu)[0]

    # the raw inputs give gates at least as extreme as the smallest MIXED value
    assert (kda_gate(raw, A_log, dt_bias)[0, list(RESET_TOKENS), :, : K // 2] < max(MIXED.values()) / 2).all()
    _assert_matches(_grads(ours, x, do), _grads(reference, x, do), _tol(slow))


@pytest.mark.parametrize("value, slow", [(float("-inf"), False), (torch.finfo(torch.float16).min, True)],
                         ids=["-inf", "fp16-min-next-to-0.01"])
@pytest.mark.parametrize("op", ["chunk_gla", "fused_chunk_gla", "chunk_kda"])
def test_fp16_extreme_gates(op, value, slow):
    """fp16 inputs (gates too) against the fp32 reference on the same values, within the fp16
    tolerance of test_chunk_gla (fp16 dot operands)."""
    x = _inputs("kda" if op == "chunk_kda" else "gla", value, slow)
    cu = torch.tensor(CU)
    do = _cotangent(x["v"].shape)
    if op == "fused_chunk_gla":
        ours = lambda **a: fused_chunk_gla(**a, head_first=False)[0]  # noqa: E731
        reference = lambda **a: naive_recurrent_gla(**a)[0]  # noqa: E731
    elif op == "chunk_gla":
        ours = lambda **a: chunk_gla(**a, cu_seqlens=cu)[0]  # noqa: E731
        reference = lambda **a: naive_recurrent_gla(**a, cu_seqlens=cu)[0]  # noqa: E731
    else:
        ours = lambda **a: chunk_kda(**a, cu_seqlens=cu)[0]  # noqa: E731
        reference = lambda **a: naive_recurrent_kda(**a, cu_seqlens=cu)[0]  # noqa: E731
    half = {n: t.half() for n, t in x.items()}
    _assert_matches(_grads(ours, half, do), _grads(reference, {n: t.float() for n, t in half.items()}, do), 2e-3)


def test_reference_gate_gradient_is_zero_at_an_infinite_input():
    """kda_gate at x = +inf: the gate is -inf and the gradients through it (A_log's included)
    are 0, not the 0 * inf = NaN of a plain product."""
    A_log = torch.zeros(1, requires_grad=True)
    g = torch.tensor([[float("inf"), 1.0]], requires_grad=True)
    gate = kda_gate(g, A_log)
    assert gate[0, 0] == float("-inf")
    gate.exp().sum().backward()
    assert torch.isfinite(A_log.grad).all() and torch.isfinite(g.grad).all()
    assert g.grad[0, 0] == 0


# ---- under context parallelism ----------------------------------------------------------
# One sequence over the ranks plus a short one; the extreme gate sits on the last token of
# rank 0 / the first token of rank 1 (and of rank 2): the state and its decay cross the
# boundary right there.
CP_CU = [0, 170, 211]
CP_SPLIT = {2: [101, 110], 3: [70, 71, 70]}


def _cp_inputs(op: str, value: float, world_size: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    T, H, K, V = CP_CU[-1], 1, 32, 32
    x = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
             v=torch.randn(1, T, H, V, generator=gen), g=_base_gates(T, H, K, True, gen))
    edges = torch.tensor(CP_SPLIT[world_size]).cumsum(0)[:-1].tolist()
    for e in edges:
        x["g"][0, e - 1, :, : K // 3] = value   # last token of a rank
        x["g"][0, e, :, K // 3: 2 * K // 3] = value  # first token of the next
    if op == "kda":
        x["k"] = l2norm(x["k"])
        x["beta"] = torch.rand(1, T, H, generator=gen)
    x["h0"] = torch.randn(len(CP_CU) - 1, H, K, V, generator=gen)
    return x


def _cp_run(op: str, x: dict, cu_seqlens, cp_context) -> dict[str, torch.Tensor]:
    do = _cotangent(x["v"].shape, seed=7)
    if cp_context is not None:
        from cp_linattn.cp import shard
        do = shard(do, cp_context)
        x = {n: t if n == "h0" else shard(t, cp_context) for n, t in x.items()}
    fn = chunk_gla if op == "gla" else chunk_kda

    def run(h0, **tensors):
        return fn(**tensors, initial_state=h0, cu_seqlens=cu_seqlens, cp_context=cp_context)[0]

    return _grads(run, x, do)


def _cp_run_with(reference, x: dict) -> dict[str, torch.Tensor]:
    def run(h0, **tensors):
        return reference(**tensors, initial_state=h0, cu_seqlens=torch.tensor(CP_CU))[0]

    return _grads(run, x, _cotangent(x["v"].shape, seed=7))


def _cp_worker(rank: int, world_size: int, op: str, value: float) -> dict[str, torch.Tensor]:
    from cp_linattn.cp import build_cp_context

    ctx = build_cp_context(torch.tensor(CP_CU), split=CP_SPLIT[world_size])
    return _cp_run(op, _cp_inputs(op, value, world_size), None, ctx)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op, value", [("gla", float("-inf")), ("kda", -1e30)])
def test_cp_extreme_gate_at_rank_boundary(op, value, world_size):
    per_rank = run_ranks(_cp_worker, world_size, op, value, timeout=300)
    x = _cp_inputs(op, value, world_size)
    single = _cp_run(op, x, torch.tensor(CP_CU), None)
    # the single-rank run is itself the reference's
    reference = naive_recurrent_gla if op == "gla" else naive_recurrent_kda
    _assert_matches(single, _cp_run_with(reference, x))
    together = {n: sum(r[n] for r in per_rank) if n == "dh0" else torch.cat([r[n] for r in per_rank], 1)
                for n in single}
    _assert_matches(together, single)
