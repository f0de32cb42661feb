"""The state kernels of cp_linattn/ops/common/chunk_h.py that chunk_gla runs (chunk_fwd_h,
chunk_bwd_dh) against the fp32 GLA reference: the per-chunk states and their gradients, as
the CP runtime asks them of a rank's piece. The CP merge kernels of the same file
(add_decayed_state, fold_states) are tested in tests/cp/test_merge_kernels.py."""
import pytest
import torch

from cp_linattn.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from tests.utils import max_rel_err, random_qkvg


@pytest.mark.interpreter
@pytest.mark.parametrize("T", [1, 50, 64, 130])
def test_state_kernels_on_a_fragment(T):
    """What the CP runtime asks of a rank's piece: the state it makes from a zero state, the
    gradient it sends back from a zero incoming gradient, and every per-chunk snapshot."""
    H, K, V, scale = 1, 32, 48, 0.3
    q, k, v, g = random_qkvg(torch.Generator().manual_seed(0), 1, T, H, K, V).values()
    do = torch.randn(1, T, H, V)
    gk = chunk_local_cumsum(g, 64)
    h, ht, _ = chunk_fwd_h(k, v, gk, output_final_state=True)
    dh, dh0, _ = chunk_bwd_dh(q, gk, do, scale, need_dh0=True)
    NT = (T + 63) // 64
    assert h.shape == dh.shape == (1, NT, H, K, V)

    _, ref_ht = naive_recurrent_gla(q, k, v, g, scale=scale, output_final_state=True)
    assert max_rel_err(ht, ref_ht) <= 1e-5
    for c in range(NT):
        _, before = naive_recurrent_gla(q[:, :c * 64], k[:, :c * 64], v[:, :c * 64], g[:, :c * 64],
                                        scale=scale, output_final_state=True)
        assert max_rel_err(h[:, c], before) <= 1e-5

    def grad_of_state_entering(t0):
        if t0 == T:
            return torch.zeros(1, H, K, V)
        s0 = torch.zeros(1, H, K, V, requires_grad=True)
        o, _ = naive_recurrent_gla(q[:, t0:], k[:, t0:], v[:, t0:], g[:, t0:], scale=scale, initial_state=s0)
        (o * do[:, t0:]).sum().backward()
        return s0.grad

    assert max_rel_err(dh0, grad_of_state_entering(0)) <= 1e-5
    for c in range(NT):
        # dh[c] is the gradient of the state leaving chunk c (the outputs of later chunks).
        assert max_rel_err(dh[:, c], grad_of_state_entering(min((c + 1) * 64, T))) <= 1e-5


@pytest.mark.interpreter
def test_state_kernels_with_incoming_state_and_gradient():
    cu = torch.tensor([0, 10, 100])
    H, K, V, scale = 1, 32, 32, 0.5
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = random_qkvg(gen, 1, 100, H, K, V).values()
    h0 = torch.randn(2, H, K, V, generator=gen)
    dht = torch.randn(2, H, K, V)
    gk = chunk_local_cumsum(g, 64, cu_seqlens=cu)
    _, ht, _ = chunk_fwd_h(k, v, gk, h0=h0, output_final_state=True, cu_seqlens=cu)
    _, ref_ht = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert max_rel_err(ht, ref_ht) <= 1e-5
    # Zero outputs' gradient: the initial state's gradient is dht carried back through the decay.
    dh, dh0, _ = chunk_bwd_dh(q, gk, torch.zeros(1, 100, H, V), scale, dht=dht, need_dh0=True, cu_seqlens=cu)
    expected = torch.stack([dht[n] * g[0, cu[n]:cu[n + 1]].sum(0).exp()[..., None] for n in range(2)])
    assert max_rel_err(dh0, expected) <= 1e-5
    assert dh.shape[1] == 3 and max_rel_err(dh[0, 0], dht[0]) <= 1e-6 and max_rel_err(dh[0, 2], dht[1]) <= 1e-6


@pytest.mark.interpreter
def test_state_v_first_layout():
    """state_v_first: h0 / dht read and ht / dh0 written `[N, H, V, K]`, the very values of the
    K-first walk turned round; the per-chunk states stay K-first."""
    cu = torch.tensor([0, 10, 100])
    H, K, V = 2, 32, 48
    gen = torch.Generator().manual_seed(1)
    q, k, v, g = random_qkvg(gen, 1, 100, H, K, V).values()
    h0, dht = torch.randn(2, H, K, V, generator=gen), torch.randn(2, H, K, V, generator=gen)
    do = torch.randn(1, 100, H, V, generator=gen)
    gk = chunk_local_cumsum(g, 64, cu_seqlens=cu)
    turn = lambda x: x.transpose(-1, -2).contiguous()  # noqa: E731
    h, ht, _ = chunk_fwd_h(k, v, gk, h0=h0, output_final_state=True, cu_seqlens=cu)
    h_vf, ht_vf, _ = chunk_fwd_h(k, v, gk, h0=turn(h0), output_final_state=True, cu_seqlens=cu, state_v_first=True)
    assert torch.equal(h_vf, h) and ht_vf.shape == (2, H, V, K) and torch.equal(turn(ht_vf), ht)
    dh, dh0, _ = chunk_bwd_dh(q, gk, do, 0.5, dht=dht, need_dh0=True, cu_seqlens=cu)
    dh_vf, dh0_vf, _ = chunk_bwd_dh(q, gk, do, 0.5, dht=turn(dht), need_dh0=True, cu_seqlens=cu, state_v_first=True)
    assert torch.equal(dh_vf, dh) and torch.equal(turn(dh0_vf), dh0)
    with pytest.raises(ValueError, match=r"^h0 must have shape \[2, 2, 48, 32\]"):
        chunk_fwd_h(k, v, gk, h0=h0, cu_seqlens=cu, state_v_first=True)


def test_state_kernels_validate_shapes():
    k, v, g = torch.randn(1, 20, 1, 16), torch.randn(1, 20, 1, 16), torch.zeros(1, 20, 1, 16)
    with pytest.raises(ValueError, match=r"^h0 must have shape"):
        chunk_fwd_h(k, v, g, h0=torch.zeros(2, 1, 16, 16))
    with pytest.raises(TypeError, match=r"^gk must have dtype"):
        chunk_bwd_dh(k, g.half(), v, 1.0)
