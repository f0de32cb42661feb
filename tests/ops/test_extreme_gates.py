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

from cp_linattn import chunk_gla, chunk_kda
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.common.l2norm import l2norm
from cp_linattn.ops.kda.naive import kda_gate, naive_recurrent_kda
from tests.multirank import run_ranks
from tests.utils import (
    assert_matches, chunk_local_cumsum_reference, logsigmoid_gate, op_and_reference, random_qkvg, run_with_grads,
)

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


@pytest.mark.interpreter
def test_chunk_local_cumsum_floors_log_gates():
    """The forward cumsum floors each gate at LOG_DECAY_FLOOR (NaN stays NaN); the reverse
    one, of gradients, sums them as they are."""
    from cp_linattn.ops.common.cumsum import LOG_DECAY_FLOOR

    x = -torch.rand(2, 50, 2, 8, generator=torch.Generator().manual_seed(0))
    x[0, 5, 0, :4] = torch.tensor([float("-inf"), -1e30, torch.finfo(torch.float32).min, -200.0])
    x[1, 20, 1, 3] = float("nan")
    floor = LOG_DECAY_FLOOR.value
    torch.testing.assert_close(chunk_local_cumsum(x, 16), chunk_local_cumsum_reference(torch.where(x < floor, floor, x), 16),
                               equal_nan=True)
    grads = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    grads[0, 5, 0, 0] = 2 * floor
    torch.testing.assert_close(chunk_local_cumsum(grads, 16, reverse=True), chunk_local_cumsum_reference(grads, 16, reverse=True),
                               rtol=1e-5, atol=1e-4)


def _base_gate(slow: bool):
    """The gate recipe (tests.utils.random_qkvg) of the tokens around the extreme ones: slow
    decays of about -0.01, or log-sigmoid ones."""
    if slow:
        return lambda shape, gen: -0.01 * (0.5 + torch.rand(*shape, generator=gen))
    return logsigmoid_gate


def _with_extreme(g: torch.Tensor, value: float) -> torch.Tensor:
    g = g.clone()
    for t in RESET_TOKENS:
        g[:, t, :, : g.shape[-1] // 2] = value
    return g


def _inputs(op: str, value: float | None, slow: bool, H: int = 1, K: int = 32, V: int = 32, seed: int = 0) -> dict:
    """Random inputs on CU; the log gates take `value` at RESET_TOKENS (unless None)."""
    gen = torch.Generator().manual_seed(seed)
    T = CU[-1]
    x = random_qkvg(gen, 1, T, H, K, V, _base_gate(slow))
    if value is not None:
        x["g"] = _with_extreme(x["g"], value)
    if op == "kda":
        x["k"] = l2norm(x["k"])
        x["beta"] = torch.rand(1, T, H, generator=gen)
    return x


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
    ours, reference = op_and_reference("fused_chunk_gla" if fused else "chunk_gla", torch.tensor(CU))
    assert_matches(run_with_grads(ours, x, do), run_with_grads(reference, x, do), _tol(slow))


CASES = [pytest.param(v, False, id=n) for n, v in EXTREMES.items()] + \
        [pytest.param(v, True, id=n) for n, v in MIXED.items()]


def _tol(slow: bool) -> float:
    return TOL_MIXED if slow else TOL


@pytest.mark.interpreter
@pytest.mark.parametrize("value, slow", CASES)
def test_chunk_gla_extreme_gates(value, slow):
    _check_gla(value, slow, fused=False)


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("value, slow", CASES)
def test_fused_chunk_gla_extreme_gates(value, slow):
    _check_gla(value, slow, fused=True)


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("value, slow", CASES)
def test_chunk_kda_extreme_gates(value, slow):
    x = _inputs("kda", value, slow)
    do = _cotangent(x["v"].shape)
    ours, reference = op_and_reference("chunk_kda", torch.tensor(CU))
    assert_matches(run_with_grads(ours, x, do), run_with_grads(reference, x, do), _tol(slow))


def _raw_gate_for(value: float, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The raw input x with `-exp(A_log) * softplus(x + dt_bias)` = value (softplus is the
    identity above 20; -inf and values that overflow take x = +inf), `[HV, K]`."""
    HV = A_log.numel()
    x = value / -A_log.exp().view(HV, 1) - dt_bias.view(HV, -1)
    return torch.where(torch.isfinite(x), x, float("inf"))


@pytest.mark.interpreter
@pytest.mark.slow
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
    do = _cotangent(x["v"].shape)
    ours, reference = op_and_reference("chunk_kda_gate", torch.tensor(CU))
    # the raw inputs give gates at least as extreme as the smallest MIXED value
    assert (kda_gate(raw, A_log, dt_bias)[0, list(RESET_TOKENS), :, : K // 2] < max(MIXED.values()) / 2).all()
    assert_matches(run_with_grads(ours, x, do), run_with_grads(reference, x, do), _tol(slow))


@pytest.mark.interpreter
@pytest.mark.parametrize("value, slow", [(float("-inf"), False), (torch.finfo(torch.float16).min, True)],
                         ids=["-inf", "fp16-min-next-to-0.01"])
@pytest.mark.parametrize("op", ["chunk_gla", "fused_chunk_gla", pytest.param("chunk_kda", marks=pytest.mark.slow)])
def test_fp16_extreme_gates(op, value, slow):
    """fp16 inputs (gates too) against the fp32 reference on the same values, within the fp16
    tolerance of tests/ops/gla/test_chunk.py (fp16 dot operands)."""
    x = _inputs("kda" if op == "chunk_kda" else "gla", value, slow)
    do = _cotangent(x["v"].shape)
    ours, reference = op_and_reference(op, torch.tensor(CU))
    half = {n: t.half() for n, t in x.items()}
    assert_matches(run_with_grads(ours, half, do),
                   run_with_grads(reference, {n: t.float() for n, t in half.items()}, do), 2e-3)


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
    x = random_qkvg(gen, 1, T, H, K, V, _base_gate(True))
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

    return run_with_grads(run, x, do)


def _cp_run_with(reference, x: dict) -> dict[str, torch.Tensor]:
    def run(h0, **tensors):
        return reference(**tensors, initial_state=h0, cu_seqlens=torch.tensor(CP_CU))[0]

    return run_with_grads(run, x, _cotangent(x["v"].shape, seed=7))


def _cp_worker(rank: int, world_size: int, op: str, value: float) -> dict[str, torch.Tensor]:
    from cp_linattn.cp import build_cp_context

    ctx = build_cp_context(torch.tensor(CP_CU), split=CP_SPLIT[world_size])
    return _cp_run(op, _cp_inputs(op, value, world_size), None, ctx)


@pytest.mark.interpreter
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op, value", [("gla", float("-inf")), ("kda", -1e30)])
def test_cp_extreme_gate_at_rank_boundary(op, value, world_size):
    per_rank = run_ranks(_cp_worker, world_size, op, value, timeout=300)
    x = _cp_inputs(op, value, world_size)
    single = _cp_run(op, x, torch.tensor(CP_CU), None)
    # the single-rank run is itself the reference's
    reference = naive_recurrent_gla if op == "gla" else naive_recurrent_kda
    assert_matches(single, _cp_run_with(reference, x), TOL)
    together = {n: sum(r[n] for r in per_rank) if n == "dh0" else torch.cat([r[n] for r in per_rank], 1)
                for n in single}
    assert_matches(together, single, TOL)
