"""The fp32 references are the ground truth of every kernel test, so they are checked
against independent formulations: here closed-form sums for GLA in float64 (KDA's:
tests/ops/kda/test_naive.py)."""
import torch

from cp_linattn.ops.gla.naive import naive_recurrent_gla


def _gla_inputs(B, T, H, K, V, seed=0):
    torch.manual_seed(seed)
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
    return q, k, v, g


def _gla_closed_form(q, k, v, g, scale, h0=None):
    """o_t = scale * q_t^T (exp(G_t) * h0 + sum_{s<=t} exp(G_t - G_s) k_s v_s^T) in float64."""
    q, k, v, g = (x.double() for x in (q, k, v, g))
    G = g.cumsum(1)  # [B, T, H, K]
    T = q.shape[1]
    decay = (G[:, :, None] - G[:, None, :]).exp()  # [B, t, s, H, K]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    decay = decay * causal[None, :, :, None, None]
    o = scale * torch.einsum("bthk,btshk,bshk,bshv->bthv", q, decay, k, v)
    if h0 is not None:
        o = o + scale * torch.einsum("bthk,bhkv->bthv", q * G.exp(), h0.double())
    return o


def test_gla_matches_closed_form_with_initial_state():
    q, k, v, g = _gla_inputs(2, 13, 2, 5, 3)
    h0 = torch.randn(2, 2, 5, 3)
    o, ht = naive_recurrent_gla(q, k, v, g, scale=0.7, initial_state=h0, output_final_state=True)
    ref = _gla_closed_form(q, k, v, g, 0.7, h0)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)
    G = g.double().cumsum(1)
    ht_ref = (G[:, -1:] - G).exp().mul(k.double()).transpose(1, 2).transpose(-1, -2) @ v.double().transpose(1, 2)
    ht_ref = ht_ref + G[:, -1].exp()[..., None] * h0.double()
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)


def test_gla_gradients_match_closed_form():
    q, k, v, g = (x.requires_grad_() for x in _gla_inputs(1, 9, 2, 4, 3, seed=1))
    do = torch.randn(1, 9, 2, 3)
    o, _ = naive_recurrent_gla(q, k, v, g)
    grads = torch.autograd.grad((o * do).sum(), (q, k, v, g))
    ref = _gla_closed_form(q, k, v, g, 4 ** -0.5)
    grads_ref = torch.autograd.grad((ref * do.double()).sum(), (q, k, v, g))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_gla_varlen_equals_separate_sequences():
    q, k, v, g = _gla_inputs(1, 20, 2, 4, 3, seed=2)
    cu = torch.tensor([0, 7, 7, 8, 20])
    h0 = torch.randn(4, 2, 4, 3)
    o, ht = naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(4):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, ht_n = naive_recurrent_gla(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], initial_state=h0[n:n + 1], output_final_state=True
        ) if e > s else (o[:, s:e], h0[n:n + 1])
        torch.testing.assert_close(o[:, s:e], o_n)
        torch.testing.assert_close(ht[n:n + 1], ht_n)


def test_gla_initial_state_chains():
    q, k, v, g = _gla_inputs(2, 16, 1, 4, 4, seed=3)
    o, ht = naive_recurrent_gla(q, k, v, g, output_final_state=True)
    o1, h1 = naive_recurrent_gla(q[:, :6], k[:, :6], v[:, :6], g[:, :6], output_final_state=True)
    o2, h2 = naive_recurrent_gla(q[:, 6:], k[:, 6:], v[:, 6:], g[:, 6:], initial_state=h1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2, ht, rtol=1e-5, atol=1e-5)
