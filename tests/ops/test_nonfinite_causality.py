"""A NaN or Inf in one input at one token stays in its causal cone: the outputs before it (and
every other sequence's) are finite and match the fp32 reference, and every gradient is
non-finite only where the reference's (autograd through `ops/*/naive.py`) is, and matches it
elsewhere. chunk_gla, fused_chunk_gla and chunk_kda (also with the in-kernel gate), fp32,
varlen batches whose lengths are not multiples of the chunk size.

Two places are left out of the gradient check, where the chunked algorithms cannot follow the
reference whatever the masking:

- the gate gradient of the tokens up to t in t's chunk (fused_chunk_gla: in its sequence),
  for a non-finite k, v, g or beta: dg is the reverse cumulative sum of dL/db over the chunk
  (b the gate cumsum; fused_chunk_gla carries it over its whole walk), and dL/db of t and of
  the tokens after it is non-finite;
- dk and dv of the tokens from t to the end of t's chunk (KDA: dv), for a non-finite g: the
  decay between two of them is exp(b_s - b_r), a difference of two cumsums that both hold g_t.
"""
from __future__ import annotations

import pytest
import torch

from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.common.l2norm import l2norm
from tests.utils import chunk_local_cumsum_reference, logsigmoid_gate, op_and_reference, random_qkvg, run_with_grads

# the interpreter's numpy warns of the NaN arithmetic these tests are about
pytestmark = [pytest.mark.interpreter,
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

TOL = 1e-4
CU = [0, 37, 150, 215]  # three sequences, none a multiple of 64 (or 16) tokens
CHUNK = {"chunk_gla": 64, "fused_chunk_gla": 16, "chunk_kda": 64, "chunk_kda_gate": 64}
# the middle of chunks of the second sequence, and of 16-token blocks within them
POSITIONS = (57, 88)
CHANNEL = 3  # the poisoned channel of the token (one of K, or of V)


def test_reverse_chunk_cumsum_keeps_a_nan_before_it():
    """The reverse chunk-local cumsum (KDA's gate gradient) puts a NaN or Inf into the tokens
    at or before it in its chunk, and nowhere else."""
    x = torch.randn(1, 100, 2, 8, generator=torch.Generator().manual_seed(0))
    x[0, 40, 0, 3] = float("nan")
    x[0, 70, 1, 5] = float("inf")
    y = chunk_local_cumsum(x, 32, reverse=True)
    expected = torch.zeros_like(x, dtype=torch.bool)
    expected[0, 32:41, 0, 3] = True
    expected[0, 64:71, 1, 5] = True
    got = ~torch.isfinite(y)
    assert torch.equal(got, expected), f"non-finite at {got.nonzero().tolist()}, expected {expected.nonzero().tolist()}"
    finite = ~expected
    ref = chunk_local_cumsum_reference(x, 32, reverse=True)
    torch.testing.assert_close(y[finite], ref[finite])


def _inputs(op: str, strong: bool, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T, H, K, V = CU[-1], 1, 32, 32
    B = 2 if op == "fused_chunk_gla" else 1  # fused_chunk_gla has no cu_seqlens: two rows
    # strong: about -6 per token, past the span limit of the diagonal blocks' dot path (the
    # exact paths); else log-sigmoid gates (the dot paths)
    strong_gate = lambda shape, gen: -6.0 - torch.rand(*shape, generator=gen)  # noqa: E731
    x = random_qkvg(gen, B, T, H, K, V, strong_gate if strong else logsigmoid_gate)
    if op.startswith("chunk_kda"):
        x["k"] = l2norm(x["k"])
        x["beta"] = torch.rand(B, T, H, generator=gen)
    if op == "chunk_kda_gate":
        x["g"] = torch.randn(B, T, H, K, generator=gen) + (8.0 if strong else -2.0)
        x["A_log"] = torch.randn(H, generator=gen) * 0.5
        x["dt_bias"] = torch.randn(H * K, generator=gen)
    return x


def _sequence_of(op: str, t: int) -> tuple[int, int]:
    if op == "fused_chunk_gla":
        return 0, CU[-1]
    i = max(i for i in range(len(CU) - 1) if CU[i] <= t)
    return CU[i], CU[i + 1]


def _excused(op: str, name: str, grad: str, t: int, shape) -> torch.Tensor:
    """The tokens (a bool `[B, T]` mask) of the two places the module docstring leaves out of
    the gradient check."""
    start, end = _sequence_of(op, t)
    chunk_start = start + (t - start) // CHUNK[op] * CHUNK[op]
    chunk_end = min(chunk_start + CHUNK[op], end)
    tokens = torch.zeros(shape[1], dtype=torch.bool)
    if grad == "dg" and name in ("k", "v", "g", "beta"):
        tokens[start if op == "fused_chunk_gla" else chunk_start: t + 1] = True
    if name == "g" and grad in (("dv",) if op.startswith("chunk_kda") else ("dk", "dv")):
        tokens[t:chunk_end] = True
    mask = torch.zeros(shape[:2], dtype=torch.bool)
    mask[0, tokens] = True
    return mask


def _check(op: str, name: str, value: float, t: int, strong: bool) -> None:
    x = _inputs(op, strong)
    x[name] = x[name].clone()
    if x[name].dim() == 4:
        x[name][0, t, :, CHANNEL] = value
    else:
        x[name][0, t] = value
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(1))
    ours, reference = op_and_reference(op, torch.tensor(CU))
    got, ref = run_with_grads(ours, x, do), run_with_grads(reference, x, do)

    # forward: finite before t in its sequence and everywhere in the others, as the reference;
    # non-finite at t
    start, end = _sequence_of(op, t)
    before = torch.ones(x["v"].shape[:2], dtype=torch.bool)
    before[0, t:end] = False
    assert torch.isfinite(ref["o"][before]).all(), "the reference must be finite before t"
    leaked = sorted(set((~torch.isfinite(got["o"]) & before[..., None, None]).nonzero()[:, 1].tolist()))
    assert not leaked, f"o is non-finite before t={t} at {len(leaked)} tokens from {leaked[0]} (last {leaked[-1]})"
    assert not torch.isfinite(got["o"][0, t]).all(), f"o is finite at t={t}, where the input is not"

    errors, leaks = {}, {}
    for key, r in ref.items():
        g = got[key]
        allowed = ~torch.isfinite(r)
        if key != "o" and r.dim() == g.dim() and r.dim() >= 2:
            allowed |= _excused(op, name, key, t, r.shape).view(r.shape[:2] + (1,) * (r.dim() - 2)).expand_as(r)
        bad = ~torch.isfinite(g) & ~allowed
        if bad.any():
            leaks[key] = sorted(set(bad.nonzero()[:, 1].tolist())) if g.dim() >= 2 else "all"
        both = torch.isfinite(g) & torch.isfinite(r)
        if both.any():
            scale = max(1.0, r[both].abs().max().item())
            errors[key] = (g[both] - r[both]).abs().max().item() / scale
    assert not leaks, f"non-finite where the reference is finite (tokens): {leaks}"
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL} where both are finite: {bad}"


INPUTS = {"chunk_gla": "qkvg", "fused_chunk_gla": "qkvg", "chunk_kda": ("q", "k", "v", "g", "beta"),
          "chunk_kda_gate": ("q", "k", "v", "g", "beta")}
# the fast subset (-m "not slow") keeps chunk_gla's cases on the dot paths
CASES = [pytest.param(op, name, t, strong, id=f"{op}-{name}-t{t}{'-strong' if strong else ''}",
                      marks=pytest.mark.slow if strong or op != "chunk_gla" else ())
         for op, names in INPUTS.items() for name in names for t in POSITIONS for strong in (False, True)
         if not (strong and name == "g")]  # a non-finite gate takes the exact paths anyway


@pytest.mark.parametrize("op, name, t, strong", CASES)
def test_nan_stays_in_its_cone(op, name, t, strong):
    _check(op, name, float("nan"), t, strong)


@pytest.mark.parametrize("op, name", [pytest.param(op, name, marks=pytest.mark.slow if op != "chunk_gla" else ())
                                      for op, names in INPUTS.items() for name in names if name != "g"])
def test_inf_stays_in_its_cone(op, name):
    _check(op, name, float("inf"), POSITIONS[1], False)
