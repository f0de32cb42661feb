"""The CP merge kernels (cp_linattn/ops/common/chunk_h.py, used by cp/gla.py, cp/kda.py):
`add_decayed_state`, GLA's late addition of a handed-over state to the stored states and
gradients of a local pass, and `fold_states`, the fold `S = M_j S + S_j` over the rows of an
all-gathered table; against reruns of the state kernels and loops in torch."""
import pytest
import torch

from cp_linattn.cp.merge import add_decayed_state, fold_states
from cp_linattn.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from tests.utils import max_rel_err, random_qkvg

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("states_dtype", [torch.float32, torch.float16])
def test_late_state_addition_equals_rerun(states_dtype):
    """GLA under CP: the local passes run a continued sequence from zero and return the log
    decays they sum; `add_decayed_state` with those decays then gives the states and
    gradients of passes run from the handed-over state (the first of two packed sequences
    forwards, the last backwards); fp16 h is rounded once more."""
    cu = torch.tensor([0, 150, 230])
    T, H, K, V, scale = 230, 2, 32, 48, 0.5
    q, k, v, g = random_qkvg(torch.Generator().manual_seed(0), 1, T, H, K, V).values()
    S, dS, do = torch.randn(H, K, V), torch.randn(H, K, V), torch.randn(1, T, H, V)
    zero = torch.zeros(H, K, V)
    gk = chunk_local_cumsum(g, 64, cu_seqlens=cu)
    h, ht, (decay, total) = chunk_fwd_h(k, v, gk, output_final_state=True, states_dtype=states_dtype,
                                        output_decays=True, cu_seqlens=cu)
    assert decay.shape == (1, 5, H, K) and total.shape == (2, H, K)
    add_decayed_state(h[0, :3], decay[0, :3], S)
    h_ref, ht_ref, _ = chunk_fwd_h(k, v, gk, h0=torch.stack([S, zero]), output_final_state=True, cu_seqlens=cu)
    tol = 1e-6 if states_dtype == torch.float32 else 2e-3
    assert h.dtype == states_dtype and max_rel_err(h.float(), h_ref) <= tol
    assert max_rel_err(ht[0] + total[0].exp()[..., None] * S, ht_ref[0]) <= 1e-6
    dh, _, decay_after = chunk_bwd_dh(q, gk, do, scale, output_decays=True, cu_seqlens=cu)
    add_decayed_state(dh[0, 3:], decay_after[0, 3:], dS)
    dh_ref, _, _ = chunk_bwd_dh(q, gk, do, scale, dht=torch.stack([zero, dS]), cu_seqlens=cu)
    assert max_rel_err(dh, dh_ref) <= 1e-6
    with pytest.raises(ValueError, match=r"^decay must have shape"):
        add_decayed_state(h[0], decay[0, :2], S)
    with pytest.raises(ValueError, match=r"^states_dtype must be"):
        chunk_fwd_h(k, v, gk, states_dtype=torch.int32)


def test_add_decayed_state_skips_only_channels_decayed_to_zero():
    """The correction leaves a channel bit-for-bit untouched exactly where its factor
    exp(decay) is 0 in fp32 (it would add zeros there) and still adds tiny nonzero factors:
    exp(-80) = 1.8e-35 times a state of 1e33 is 1.8e-2."""
    n, H, K, V = 3, 2, 24, 40
    x0 = torch.randn(n, H, K, V)
    decay = torch.full((n, H, K), -1.0)
    decay[:, :, ::3] = float("-inf")
    decay[:, :, 1::3] = -80.0
    S = torch.full((H, K, V), 1e33)
    x = x0.clone()
    add_decayed_state(x, decay, S)
    assert torch.equal(x[:, :, ::3], x0[:, :, ::3])
    added = (decay.double().exp()[..., None] * S.double()).float()
    for rows in (slice(1, None, 3), slice(2, None, 3)):  # tiny and ordinary factors, each to scale
        assert max_rel_err((x - x0)[:, :, rows], added[:, :, rows]) <= 1e-4
    assert float(added[:, :, 1::3].min()) > 1e-2


@pytest.mark.parametrize("n", [1, 8, 19])
def test_add_decayed_state_blocks_of_chunks(n):
    """Programs of BC chunks (launch.py's, 4) share one read of the state tile: every chunk of
    a last, partial block is corrected, each with its own heads' decay, in x's dtype (bf16
    here, as GLA's stored states), and nothing past the n chunks is written."""
    H, K, V = 3, 24, 40
    buffer = torch.randn(n + 2, H, K, V).to(torch.bfloat16)
    x0 = buffer.clone()
    decay = -torch.rand(n, H, K) * 3
    S = torch.randn(H, K, V)
    add_decayed_state(buffer[:n], decay, S)
    ref = x0[:n].float() + decay.exp()[..., None] * S
    assert torch.allclose(buffer[:n].float(), ref, rtol=2 ** -7, atol=1e-6)  # within one bf16 ulp
    assert torch.equal(buffer[n:], x0[n:])


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # the interpreter's 0 * nan
def test_add_decayed_state_carries_non_finite_states_into_dead_channels():
    """A NaN or an infinity in the incoming state reaches every row, as in the rerun the pass
    stands for (0 * NaN and 0 * inf are NaN): a dead channel skipped there would hide it."""
    n, H, K, V = 2, 2, 24, 40
    x0 = torch.randn(n, H, K, V)
    decay = torch.full((n, H, K), float("-inf"))
    decay[:, :, 1] = -1.0
    S = torch.randn(H, K, V)
    S[0, 3, 5], S[1, 7, 0] = float("nan"), float("inf")
    x = x0.clone()
    add_decayed_state(x, decay, S)
    rerun = (x0.double() + decay.double().exp()[..., None] * S.double()).float()
    assert torch.equal(x.isnan(), rerun.isnan()) and x[:, 0, 3, 5].isnan().all() and x[:, 1, 7, 0].isnan().all()
    assert torch.allclose(x.nan_to_num(), rerun.nan_to_num(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("diagonal", [True, False])
@pytest.mark.parametrize("order", [range(1, 4), range(4, 0, -1), range(2, 3)])
def test_fold_states_in_one_launch(order, diagonal):
    """The CP merge (`fold_states`): the loop `S = M_j S + S_j` (`M_j^T` backwards) over rows
    of an all-gathered table (strided rows, as `exchange_forward` views them), diagonal (GLA)
    and full (KDA) transitions, forwards and backwards, against the loop in torch."""
    D, H, K, V = 5, 2, 40, 24
    M_size = H * K if diagonal else H * K * K
    table = torch.randn(D, H * K * V + M_size + 7)
    states = table[:, :H * K * V].view(D, H, K, V)
    transitions = table[:, H * K * V:H * K * V + M_size].view(D, H, K, *(() if diagonal else (K,)))
    transitions = transitions.sigmoid() if diagonal else transitions * K ** -0.5
    transpose = order.step < 0
    ref = torch.zeros(H, K, V)
    for j in order:
        M = transitions[j]
        ref = M[..., None] * ref + states[j] if diagonal else (M.transpose(-1, -2) if transpose else M) @ ref + states[j]
    got = fold_states(states, transitions, order, transpose)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^order must index the 5 rows"):
        fold_states(states, transitions, range(3, 6))
    with pytest.raises(ValueError, match=r"^transitions must have shape"):
        fold_states(states, transitions[:, :, :4], order)
    with pytest.raises(ValueError, match=r"^input_columns must be in \[0, 24\]"):
        fold_states(states, transitions, order, transpose, input_columns=25)


@pytest.mark.parametrize("order", [range(0, 4), range(3, -1, -1)])
def test_fold_states_of_segment_walks(order):
    """How the KDA middle-rank walk folds its segments: transitions read in place from the
    walk's final states `[D, H, K, V + K]` (rows of K strided by V + K), and past the first
    term only the first V columns are inputs (the others hold each segment's own map)."""
    D, H, K, V = 4, 2, 16, 24
    walked = torch.randn(D, H, K, V + K)
    walked[..., V:] *= K ** -0.5
    transitions = walked[..., V:]
    transpose = order.step < 0
    ref = torch.zeros(H, K, V + K)
    for i, j in enumerate(order):
        M = transitions[j].transpose(-1, -2) if transpose else transitions[j]
        x = walked[j].clone()
        if i:
            x[..., V:] = 0
        ref = M @ ref + x
    got = fold_states(walked, transitions, order, transpose, input_columns=V)
    assert not transitions.is_contiguous()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
