"""The delta-rule state walk (cp_linattn/ops/common/chunk_delta_h.py) on chunk_kda's prepared
inputs, as the CP runtime uses it: the final state as an affine map of the initial one, and
walks of extra state columns."""
import pytest
import torch

from cp_linattn.ops.common.chunk_delta_h import chunk_delta_rule_fwd_h
from cp_linattn.ops.kda.chunk_fwd import chunk_kda_fwd_prepare
from cp_linattn.ops.kda.naive import naive_recurrent_kda
from tests.utils import kda_inputs as make_inputs

pytestmark = pytest.mark.interpreter

REL_TOL = 1e-4


def test_delta_rule_transition_composes():
    """The CP runtime's use of fwd_h: final(h0) == M h0 + S_ext, with M from u = 0, h0 = I."""
    # short enough that M is far from zero (and from symmetric): a transposed M fails here
    inp = make_inputs(T=20, N=1, K=32, V=32)
    p = chunk_kda_fwd_prepare(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 32 ** -0.5)
    eye = torch.eye(32).expand(1, 1, 32, 32).contiguous()
    _, _, M = chunk_delta_rule_fwd_h(p.kg, p.w, torch.zeros_like(p.w), p.gk, eye, True)
    _, _, s_ext = chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, None, True)
    _, _, full = chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, inp["h0"], True)
    _, ref = naive_recurrent_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["h0"],
                                 output_final_state=True)
    assert (full - ref).abs().max() <= REL_TOL * ref.abs().max()
    composed = M[0, 0] @ inp["h0"][0, 0] + s_ext[0, 0]
    assert (composed - full[0, 0]).abs().max() <= REL_TOL * full.abs().max()
    # One walk of [u, 0] from [0, I] (state_columns: u feeds the first 32 columns) gives both.
    h0 = torch.cat([torch.zeros(1, 1, 32, 32), eye], -1)
    _, _, both = chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, h0, True, store_chunk_states=False,
                                        state_columns=64)
    assert torch.allclose(both[..., :32], s_ext, rtol=0, atol=1e-6) and torch.allclose(both[..., 32:], M, rtol=0,
                                                                                           atol=1e-6)
    # identity_tail: the same walk with [0, I] made in-kernel.
    _, _, same = chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, None, True, store_chunk_states=False,
                                        state_columns=64, identity_tail=True)
    assert torch.equal(same, both)
    with pytest.raises(ValueError, match=r"^state_columns must be at least"):
        chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, None, True, state_columns=16)
    for columns, h0_ in ((48, None), (64, h0)):
        with pytest.raises(ValueError, match=r"^identity_tail needs state_columns = u's width \+ K = 64"):
            chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, h0_, True, state_columns=columns,
                                   identity_tail=True)


def test_delta_rule_state_columns_beyond_u():
    """With `state_columns`, the stored chunk states and new values of the first columns are
    those of the plain walk; the others are the walk of zero input (over several chunks)."""
    inp = make_inputs(T=150, N=1, K=32, V=32)
    p = chunk_kda_fwd_prepare(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 32 ** -0.5)
    h0 = torch.randn(1, 1, 32, 48)
    h, v_new, ht = chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, h0, True, state_columns=48)
    ref_h, ref_v, ref_ht = chunk_delta_rule_fwd_h(p.kg, p.w, p.u, p.gk, h0[..., :32].contiguous(), True)
    zero_u = torch.zeros(1, 150, 1, 16)
    z_h, z_v, z_ht = chunk_delta_rule_fwd_h(p.kg, p.w, zero_u, p.gk, h0[..., 32:].contiguous(), True)
    assert h.shape == (1, 3, 1, 32, 48) and v_new.shape == (1, 150, 1, 48)
    for got, ref, zero in ((h, ref_h, z_h), (v_new, ref_v, z_v), (ht, ref_ht, z_ht)):
        assert torch.allclose(got, torch.cat([ref, zero], -1), rtol=0, atol=1e-5)
