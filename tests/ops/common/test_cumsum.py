"""chunk_local_cumsum (cp_linattn/ops/common/cumsum.py) and the in-kernel KDA gate's cumsum
against loops in torch, with the marks of the diagonal blocks too wide for the dot path."""
import pytest
import torch

from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from tests.utils import chunk_local_cumsum_reference, diagonal_block_excess


@pytest.mark.interpreter
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 70, 100]])
def test_chunk_local_cumsum_matches_loop(reverse, cu):
    torch.manual_seed(0)
    B = 2 if cu is None else 1
    x = torch.randn(B, 100, 3, 20)
    cu_t = None if cu is None else torch.tensor(cu)
    y = chunk_local_cumsum(x, 16, reverse=reverse, cu_seqlens=cu_t)
    torch.testing.assert_close(y, chunk_local_cumsum_reference(x, 16, reverse, cu), rtol=1e-5, atol=1e-5)


def _exact_blocks_reference(gk, chunk, block, limit, cu):
    """int32 `[NT_all, H]`: bit s of (chunk, head) set when |gk - gk_mid| exceeds `limit` in
    diagonal block s (mid its middle row, clipped to the chunk)."""
    spans = [(b, 0, gk.shape[1]) for b in range(gk.shape[0])] if cu is None else [
        (0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    rows = []
    for b, s, e in spans:
        for c in range(s, e, chunk):
            too_wide = (diagonal_block_excess(gk[b, c:min(c + chunk, e)], block) > limit).to(torch.int32)
            rows.append((too_wide << torch.arange(too_wide.shape[0])[:, None]).sum(0, dtype=torch.int32))
    return torch.stack(rows)


@pytest.mark.interpreter
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 70, 200]])
def test_exact_diagonal_blocks_match_reference(cu):
    """The bits of the diagonal blocks too wide for the dot path, over several key tiles
    (D = 100: two tiles of 64, the second partly masked) and partial chunks."""
    torch.manual_seed(1)
    B, T = (2, 150) if cu is None else (1, 200)
    x = -torch.rand(B, T, 3, 100) * 0.6
    x[..., 1, :, 97] *= 8.0  # one channel of one head decays fast: only the last tile sees it
    cu_t = None if cu is None else torch.tensor(cu)
    NT = B * ((T + 63) // 64) if cu is None else sum((e - s + 63) // 64 for s, e in zip(cu[:-1], cu[1:]))
    exact_blocks = torch.zeros(NT, 3, dtype=torch.int32)
    y = chunk_local_cumsum(x, 64, cu_seqlens=cu_t, exact_blocks=exact_blocks, sub_chunk_size=16, span_limit=3.0)
    ref = _exact_blocks_reference(y, 64, 16, 3.0, cu)
    assert (ref != 0).any() and (ref != 15).any(), ref
    assert torch.equal(exact_blocks, ref), (exact_blocks, ref)


@pytest.mark.interpreter
def test_exact_diagonal_blocks_never_miss_a_wide_block_of_mixed_sign_gates():
    """Outside the ops' domain (gates of both signs; D = 8, below one tile) the marks may
    flag more blocks than the exact span does, never fewer (the interpreter's dot is fp32;
    on a GPU its tf32 rounding may move a span by 0.05%)."""
    torch.manual_seed(3)
    x = torch.randn(1, 130, 2, 8) * 0.5
    exact_blocks = torch.zeros(3, 2, dtype=torch.int32)
    y = chunk_local_cumsum(x, 64, exact_blocks=exact_blocks, sub_chunk_size=16, span_limit=2.0)
    ref = _exact_blocks_reference(y, 64, 16, 2.0, None)
    assert (ref != 0).any() and (ref != 15).any(), ref
    assert torch.equal(exact_blocks & ref, ref), (exact_blocks, ref)


@pytest.mark.interpreter
def test_exact_diagonal_blocks_of_the_in_kernel_gate():
    from cp_linattn.ops.kda.gate import kda_gate_fwd_cumsum
    from cp_linattn.ops.kda.naive import kda_gate

    torch.manual_seed(2)
    g, A_log, dt_bias = torch.randn(1, 140, 2, 80), torch.tensor([-2.0, 1.0]), torch.randn(160)
    exact_blocks = torch.zeros(3, 2, dtype=torch.int32)
    gk = kda_gate_fwd_cumsum(g, A_log, dt_bias, chunk_size=64, exact_blocks=exact_blocks, sub_chunk_size=16, span_limit=4.0)
    torch.testing.assert_close(gk, chunk_local_cumsum_reference(kda_gate(g, A_log, dt_bias), 64), rtol=1e-5,
                               atol=1e-4)
    ref = _exact_blocks_reference(gk, 64, 16, 4.0, None)
    assert (ref[:, 0] == 0).all() and (ref[:, 1] != 0).any(), ref
    assert torch.equal(exact_blocks, ref)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpreter),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_in_kernel_gate_forward_and_backward(device, lower_bound):
    """The gate kernel's cumsum and its gradients (g, A_log, dt_bias) against autograd of the
    torch gate, fp32. On the GPU its softplus takes the log by PTX lg2.approx."""
    from cp_linattn.ops.kda.gate import kda_gate_fwd_cumsum, kda_gate_bwd_cumsum
    from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate

    torch.manual_seed(3)
    # the spread reaches the softplus's identity branch (x > 20) and its far negative tail
    g = (torch.randn(1, 150, 2, 80) * 8).to(device).requires_grad_()
    A_log = torch.tensor([-1.0, 0.5], device=device, requires_grad=True)
    dt_bias = torch.randn(160, device=device, requires_grad=True)
    gate = kda_gate(g, A_log, dt_bias) if lower_bound is None else kda_lower_bound_gate(g, A_log, dt_bias, lower_bound)
    ref = chunk_local_cumsum_reference(gate, 64)
    dg_cum = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * dg_cum).sum(), [g, A_log, dt_bias])
    with torch.no_grad():
        gk = kda_gate_fwd_cumsum(g, A_log, dt_bias, lower_bound, chunk_size=64)
        grads = kda_gate_bwd_cumsum(g, A_log, dt_bias, dg_cum, lower_bound, chunk_size=64)
    torch.testing.assert_close(gk, ref, rtol=1e-5, atol=1e-4)
    for name, ours, want in zip(("g", "A_log", "dt_bias"), grads, ref_grads):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_exact_blocks_need_a_forward_cumsum():
    with pytest.raises(ValueError, match="exact_blocks"):
        chunk_local_cumsum(torch.zeros(1, 8, 1, 4), 4, reverse=True, exact_blocks=torch.zeros(2, 1, dtype=torch.int32))
