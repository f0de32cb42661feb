"""The fp32 references are the ground truth of every kernel test, so they are checked
against independent formulations: here explicit products of transition matrices for KDA, in
float64 (GLA's: tests/ops/gla/test_naive.py)."""
import math

import pytest
import torch

from cp_linattn.ops.common.l2norm import l2norm
from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate, naive_recurrent_kda


def _kda_inputs(B, T, H, HV, K, V, seed=0):
    torch.manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K))
    k = l2norm(torch.randn(B, T, H, K))
    v = torch.randn(B, T, HV, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K))
    beta = torch.rand(B, T, HV)
    return q, k, v, g, beta


def _kda_by_transition_matrices(q, k, v, g, beta, scale, h0=None):
    """S_t = A_t S_{t-1} + b_t k_t v_t^T with the explicit A_t = (I - b_t k_t k_t^T) Diag(exp g_t)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    rep = HV // H
    q, k = (x.double().repeat_interleave(rep, 2) for x in (q, k))
    v, g, beta = (x.double() for x in (v, g, beta))
    eye = torch.eye(K, dtype=torch.float64)
    S = torch.zeros(B, HV, K, v.shape[-1], dtype=torch.float64) if h0 is None else h0.double()
    outs = []
    for t in range(T):
        kk = torch.einsum("bhi,bhj->bhij", k[:, t], k[:, t])
        A = (eye - beta[:, t, :, None, None] * kk) @ torch.diag_embed(g[:, t].exp())
        S = A @ S + beta[:, t, :, None, None] * torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3)])
def test_kda_matches_transition_matrices(H, HV):
    q, k, v, g, beta = _kda_inputs(2, 11, H, HV, 4, 3)
    h0 = torch.randn(2, HV, 4, 3)
    o, ht = naive_recurrent_kda(q, k, v, g, beta, scale=0.9, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = _kda_by_transition_matrices(q, k, v, g, beta, 0.9, h0)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)


def test_kda_gradients_match_transition_matrices():
    q, k, v, g, beta = (x.requires_grad_() for x in _kda_inputs(1, 7, 1, 2, 4, 3, seed=4))
    h0 = torch.randn(1, 2, 4, 3, requires_grad=True)
    do, dht = torch.randn(1, 7, 2, 3), torch.randn(1, 2, 4, 3)
    o, ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    inputs = (q, k, v, g, beta, h0)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)
    o_ref, ht_ref = _kda_by_transition_matrices(q, k, v, g, beta, 0.5, h0)
    grads_ref = torch.autograd.grad((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum(), inputs)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_kda_state_v_first_is_the_transpose():
    q, k, v, g, beta = _kda_inputs(1, 9, 2, 2, 4, 3, seed=5)
    h0 = torch.randn(1, 2, 4, 3)
    o, ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_t, ht_t = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True, state_v_first=True
    )
    torch.testing.assert_close(o_t, o)
    torch.testing.assert_close(ht_t, ht.transpose(-1, -2))


def test_kda_varlen_and_chaining():
    q, k, v, g, beta = _kda_inputs(1, 18, 1, 2, 4, 4, seed=6)
    cu = torch.tensor([0, 5, 18])
    o, ht = naive_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    for n in range(2):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, ht_n = naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], output_final_state=True)
        torch.testing.assert_close(o[:, s:e], o_n)
        torch.testing.assert_close(ht[n:n + 1], ht_n)
    # [5:11] then [11:18] with the carried state equals [5:18]
    sl = lambda a, b: tuple(x[:, a:b] for x in (q, k, v, g, beta))  # noqa: E731
    o1, h1 = naive_recurrent_kda(*sl(5, 11), output_final_state=True)
    o2, h2 = naive_recurrent_kda(*sl(11, 18), initial_state=h1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o[:, 5:18], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2, ht[1:2], rtol=1e-5, atol=1e-5)


def test_kda_gates():
    torch.manual_seed(7)
    g = torch.randn(2, 5, 3, 4)
    A_log = torch.randn(3)
    dt_bias = torch.randn(12)
    out = kda_gate(g, A_log, dt_bias)
    x = g + dt_bias.view(3, 4)
    expected = -A_log.exp().view(3, 1) * torch.log1p(x.exp())
    torch.testing.assert_close(out, expected)
    lb = kda_lower_bound_gate(g, A_log, dt_bias, lower_bound=-5.0)
    expected_lb = -5.0 / (1 + torch.exp(-A_log.exp().view(3, 1) * x))
    torch.testing.assert_close(lb, expected_lb)
    assert bool((lb > -5).all() and (lb < 0).all())
    torch.testing.assert_close(kda_lower_bound_gate(g, None, None, -3.0), -3.0 * torch.sigmoid(g))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g, torch.randn(4), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(g, A_log, torch.randn(5))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_lower_bound_gate(g, A_log, dt_bias, lower_bound=1.0)


def test_l2norm_unit_rows():
    x = torch.randn(3, 7) * 5
    assert torch.allclose(l2norm(x).norm(dim=-1), torch.ones(3), atol=1e-5)
    assert math.isclose(float(l2norm(torch.zeros(1, 4)).abs().sum()), 0.0)


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_logits_match_transition_matrices(allow_neg_eigval):
    """use_beta_sigmoid_in_kernel: beta holds logits, the steps are sigmoid(beta) (2 sigmoid(beta)
    with allow_neg_eigval: a reflection when beta reaches 2), against explicit matrices."""
    q, k, v, g, _ = _kda_inputs(1, 9, 1, 2, 4, 3, seed=2)
    logits = torch.randn(1, 9, 2) * 3
    o, ht = naive_recurrent_kda(q, k, v, g, logits, output_final_state=True, use_beta_sigmoid_in_kernel=True,
                                allow_neg_eigval=allow_neg_eigval)
    steps = torch.sigmoid(logits) * (2 if allow_neg_eigval else 1)
    o_ref, ht_ref = _kda_by_transition_matrices(q, k, v, g, steps, 0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"):
        naive_recurrent_kda(q, k, v, g, logits, allow_neg_eigval=True)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_intermediate_states_are_the_prefix_states(state_v_first):
    """return_intermediate_states: the state entering every chunk of each sequence (chunks
    restart at each sequence start; an empty sequence has none) is the final state of the
    sequence's prefix up to it."""
    q, k, v, g, beta = _kda_inputs(1, 23, 1, 2, 4, 3, seed=3)
    cu = torch.tensor([0, 9, 9, 10, 23], dtype=torch.int32)
    h0 = torch.randn(4, 2, 4, 3)
    h0_given = h0.transpose(-1, -2) if state_v_first else h0
    _, _, h = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0_given, cu_seqlens=cu, state_v_first=state_v_first,
                                  return_intermediate_states=True, chunk_size=4)
    starts = [(n, t) for n in range(4) for t in range(int(cu[n]), int(cu[n + 1]), 4)]
    assert h.shape == ((1, len(starts), 2, 3, 4) if state_v_first else (1, len(starts), 2, 4, 3))
    for c, (n, t) in enumerate(starts):
        s = int(cu[n])
        _, before = naive_recurrent_kda(q[:, s:t], k[:, s:t], v[:, s:t], g[:, s:t], beta[:, s:t],
                                        initial_state=h0[n:n + 1], output_final_state=True)
        got = h[0, c].transpose(-1, -2) if state_v_first else h[0, c]
        torch.testing.assert_close(got, before[0], rtol=1e-6, atol=1e-6)
