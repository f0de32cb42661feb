"""chunk_gla and the shared state kernels against the fp32 recurrent reference.

Every case checks the output, the final state and every gradient (q, k, v, g, initial state)
against torch.autograd through `naive_recurrent_gla`, on lengths that are not multiples of
the chunk size. CPU runs use the Triton interpreter in fp32 (fp16 loosely); the GPU cases
(bf16 and fp32, long T, K = V = 128) need CUDA.
"""
import pytest
import torch
import torch.nn.functional as F

from cp_linattn.ops.common.chunk_h import add_decayed_state, chunk_bwd_dh, chunk_fwd_h, fold_states
from cp_linattn.ops.common.cumsum import chunk_local_cumsum
from cp_linattn.ops.gla.chunk import chunk_gla
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from tests.conftest import diagonal_block_spans, requires_cuda, set_tile_caps

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dh0")


def max_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's scale (1 at least)."""
    return (a.float() - ref.float()).abs().max().item() / max(1.0, ref.float().abs().max().item())


def rms_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((a.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def make_inputs(B, T, H, K, V, N, dtype, device, gate="logsigmoid", with_h0=True, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    if gate == "logsigmoid":
        g = F.logsigmoid(randn(B, T, H, K))
    elif gate == "strong":
        # Log decay of about -5 per token: exp(-b) over a chunk is far beyond fp32 range.
        g = -4.0 - torch.rand(B, T, H, K, generator=gen)
    elif gate == "mixed":
        # About -8.5 per token in the second chunk only (beyond the diagonal blocks' dot path,
        # which "strong" still fits): chunks of both intra-chunk paths in one call.
        g = F.logsigmoid(randn(B, T, H, K))
        g[:, 64:128] = -8.0 - torch.rand(B, min(T, 128) - 64, H, K, generator=gen)
    else:
        raise AssertionError(gate)
    h0 = randn(N, H, K, V) if with_h0 else None
    to = dict(device=device)
    q, k, v = (x.to(dtype=dtype, **to) for x in (q, k, v))
    return q, k, v, g.to(**to), None if h0 is None else h0.to(**to)


def run_with_grads(fn, q, k, v, g, h0, cu, do, dht, output_final_state=True):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    h0_leaf = None if h0 is None else h0.detach().clone().requires_grad_()
    o, ht = fn(*leaves, initial_state=h0_leaf, output_final_state=output_final_state, cu_seqlens=cu)
    loss = (o.float() * do).sum()
    if dht is not None:
        loss = loss + (ht * dht).sum()
    wrt = leaves + ([h0_leaf] if h0_leaf is not None else [])
    grads = torch.autograd.grad(loss, wrt)
    return o, ht, dict(zip(GRAD_NAMES, grads))


def compare_with_reference(B, T, H, K, V, cu=None, with_h0=True, with_dht=True, output_final_state=True,
                           gate="logsigmoid", dtype=torch.float32, device="cpu", tol=1e-4):
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device=device)
    q, k, v, g, h0 = make_inputs(B, T, H, K, V, N, dtype, device, gate, with_h0)
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(1)).to(device)
    dht = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(2)).to(device) if with_dht else None
    o, ht, grads = run_with_grads(chunk_gla, q, k, v, g, h0, cu_t, do, dht, output_final_state)
    ref_o, ref_ht, ref_grads = run_with_grads(
        naive_recurrent_gla, q.float(), k.float(), v.float(), g, h0, cu_t, do, dht, output_final_state)
    assert o.dtype == q.dtype and o.shape == (B, T, H, V)
    errors = {"o": max_rel_err(o, ref_o)}
    if output_final_state:
        assert ht.dtype == torch.float32 and ht.shape == (N, H, K, V)
        errors["ht"] = max_rel_err(ht, ref_ht)
    else:
        assert ht is None
    for name, ref in ref_grads.items():
        assert grads[name].dtype == (torch.float32 if name in ("dg", "dh0") else dtype), name
        assert torch.isfinite(grads[name]).all(), name
        errors[name] = max_rel_err(grads[name], ref)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errors})"
    return errors


CPU_CASES = [
    # B, T, H, K, V, cu_seqlens, with_h0, with_dht, output_final_state
    pytest.param(2, 100, 1, 32, 32, None, True, True, True, id="batch2-T100-h0-dht"),
    pytest.param(1, 150, 2, 32, 48, [0, 1, 70, 150], True, True, True, id="varlen-len1-V48"),
    pytest.param(1, 37, 1, 64, 64, None, False, False, False, id="T37-no-state"),
    pytest.param(2, 130, 1, 64, 32, None, False, False, True, id="final-state-no-dht"),
    pytest.param(1, 90, 1, 16, 16, [0, 64, 65, 90], True, False, True, id="K16-exact-chunk-seq"),
    pytest.param(1, 70, 1, 48, 24, None, True, True, True, id="non-pow2-dims"),
    pytest.param(1, 20, 1, 128, 128, None, True, True, True, id="K128"),
    pytest.param(1, 18, 1, 256, 256, [0, 5, 18], True, True, True, id="K256-varlen"),
]


@pytest.mark.parametrize("B, T, H, K, V, cu, with_h0, with_dht, output_final_state", CPU_CASES)
def test_chunk_gla_matches_reference(B, T, H, K, V, cu, with_h0, with_dht, output_final_state):
    compare_with_reference(B, T, H, K, V, cu, with_h0, with_dht, output_final_state)


def test_strong_decay_is_finite_and_exact():
    compare_with_reference(1, 200, 1, 32, 32, cu=[0, 3, 133, 200], gate="strong")


def test_both_diagonal_paths_in_one_call():
    """Chunks within and beyond the dot path's span limit in one sequence, every gradient."""
    from cp_linattn.ops.common.intra import SAFE_SPAN
    _, _, _, g, _ = make_inputs(1, 200, 1, 32, 32, 1, torch.float32, "cpu", gate="mixed")
    spans = diagonal_block_spans(g)
    assert (spans <= SAFE_SPAN).any() and (spans > SAFE_SPAN).any(), spans
    compare_with_reference(1, 200, 1, 32, 32, gate="mixed")
    compare_with_reference(1, 200, 1, 32, 32, cu=[0, 100, 101, 200], gate="mixed")


@pytest.mark.parametrize("caps", [dict(BK=16, BV=16), dict(BK=32, BV=64), dict(BK=64, BV=128)])
def test_tile_caps_of_the_launch_table(monkeypatch, caps):
    """scripts/tools/tune_launch.py may set the BK / BV caps of ops/launch.py to any of its choices;
    the GLA kernels stay exact from the smallest to the largest, equal or not (K = 80, V = 48:
    several tiles, masked tails; BK=32 / BV=64 is a setting of the dq/dk/dg kernel worth
    keeping exact)."""
    set_tile_caps(monkeypatch, ("chunk_state_", "add_decayed_state", "gla_"), caps)
    compare_with_reference(1, 150, 1, 80, 48, cu=[0, 70, 150])


def test_fp16_inputs():
    compare_with_reference(1, 100, 1, 32, 32, cu=[0, 40, 100], dtype=torch.float16, tol=2e-3)


def test_varlen_equals_separate_calls():
    """Packing must not leak state or gradient between sequences."""
    cu = [0, 70, 71, 160]
    q, k, v, g, h0 = make_inputs(1, 160, 1, 32, 32, 3, torch.float32, "cpu")
    o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                      cu_seqlens=torch.tensor(cu))
    for n in range(3):
        s, e = cu[n], cu[n + 1]
        o_n, ht_n = chunk_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], initial_state=h0[n:n + 1],
                              output_final_state=True)
        assert max_rel_err(o[:, s:e], o_n) <= 1e-5
        assert max_rel_err(ht[n:n + 1], ht_n) <= 1e-5


@pytest.mark.parametrize("T", [1, 50, 64, 130])
def test_state_kernels_on_a_fragment(T):
    """What the CP runtime asks of a rank's piece: the state it makes from a zero state, the
    gradient it sends back from a zero incoming gradient, and every per-chunk snapshot."""
    H, K, V, scale = 1, 32, 48, 0.3
    q, k, v, g, _ = make_inputs(1, T, H, K, V, 1, torch.float32, "cpu", with_h0=False)
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


def test_state_kernels_with_incoming_state_and_gradient():
    cu = torch.tensor([0, 10, 100])
    H, K, V, scale = 1, 32, 32, 0.5
    q, k, v, g, h0 = make_inputs(1, 100, H, K, V, 2, torch.float32, "cpu")
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


@pytest.mark.parametrize("states_dtype", [torch.float32, torch.float16])
def test_late_state_addition_equals_rerun(states_dtype):
    """GLA under CP: the local passes run a continued sequence from zero and return the log
    decays they sum; `add_decayed_state` with those decays then gives the states and
    gradients of passes run from the handed-over state (the first of two packed sequences
    forwards, the last backwards); fp16 h is rounded once more."""
    cu = torch.tensor([0, 150, 230])
    T, H, K, V, scale = 230, 2, 32, 48, 0.5
    q, k, v, g, _ = make_inputs(1, T, H, K, V, 1, torch.float32, "cpu", with_h0=False)
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


def _args(**over):
    q, k, v, g, h0 = make_inputs(1, 20, 2, 16, 16, 1, torch.float32, "cpu")
    args = dict(q=q, k=k, v=v, g=g, initial_state=h0)
    args.update(over)
    return args


def test_cp_context_is_not_silently_ignored():
    # A wrong object is refused; real contexts are tested in test_cp_ops.py.
    with pytest.raises(TypeError, match="cp_context must be an FLACPContext"):
        chunk_gla(**_args(), cp_context=object())


@pytest.mark.parametrize(
    "over, exc, pattern",
    [
        (dict(k=torch.randn(1, 19, 2, 16)), ValueError, r"^k must have shape"),
        (dict(v=torch.randn(1, 20, 3, 16)), ValueError, r"^v must have H=2 heads"),
        (dict(g=torch.randn(1, 20, 2, 8)), ValueError, r"^g must have shape"),
        (dict(initial_state=torch.zeros(2, 2, 16, 16)), ValueError, r"^initial_state must have shape"),
        (dict(cu_seqlens=torch.tensor([0, 7, 19])), ValueError, r"^cu_seqlens must end at T=20"),
        (dict(scale=-1.0), ValueError, r"^scale must be a positive"),
        (dict(q=torch.randn(1, 20, 2, 16, dtype=torch.float64)), TypeError, r"^q must have dtype"),
    ],
)
def test_bad_inputs_name_the_argument(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        chunk_gla(**_args(**over))


def test_state_kernels_validate_shapes():
    k, v, g = torch.randn(1, 20, 1, 16), torch.randn(1, 20, 1, 16), torch.zeros(1, 20, 1, 16)
    with pytest.raises(ValueError, match=r"^h0 must have shape"):
        chunk_fwd_h(k, v, g, h0=torch.zeros(2, 1, 16, 16))
    with pytest.raises(TypeError, match=r"^gk must have dtype"):
        chunk_bwd_dh(k, g.half(), v, 1.0)


# ------------------------------------------------------------------------------------------
# GPU: real dtypes and sizes.


@requires_cuda
@pytest.mark.parametrize("T, cu", [(1000, None), (2047, [0, 1, 500, 1300, 2047]), (8192, None)])
def test_gpu_fp32(T, cu):
    compare_with_reference(1, T, 2, 128, 128, cu, device="cuda", tol=1e-4)


@requires_cuda
@pytest.mark.parametrize("T, cu, gate", [(1000, None, "logsigmoid"), (2047, [0, 1, 500, 1300, 2047], "logsigmoid"),
                                         (1000, None, "strong"), (1000, None, "mixed"),
                                         (8192, None, "logsigmoid")])
def test_gpu_bf16_against_fp32_reference(T, cu, gate):
    """bf16 inputs; the reference runs in fp32 on the same (rounded) inputs."""
    B, H, K, V = 1, 2, 128, 128
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device="cuda")
    q, k, v, g, h0 = make_inputs(B, T, H, K, V, N, torch.bfloat16, "cuda", gate)
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(N, H, K, V, device="cuda")
    o, ht, grads = run_with_grads(chunk_gla, q, k, v, g, h0, cu_t, do, dht)
    ref_o, ref_ht, ref_grads = run_with_grads(naive_recurrent_gla, q.float(), k.float(), v.float(), g, h0,
                                              cu_t, do, dht)
    assert o.dtype == torch.bfloat16
    pairs = {"o": (o, ref_o), "ht": (ht, ref_ht), **{n: (grads[n], ref_grads[n]) for n in GRAD_NAMES}}
    for name, (a, ref) in pairs.items():
        assert torch.isfinite(a).all(), name
        assert rms_rel_err(a, ref) <= 2e-2, (name, rms_rel_err(a, ref))
        assert max_rel_err(a, ref) <= 5e-2, (name, max_rel_err(a, ref))


@requires_cuda
def test_gpu_bf16_long_against_fp32_kernel():
    """H = 16 at T = 8192 in bf16 against our fp32 kernel on the same inputs (the recurrent
    reference would be slow); the fp32 kernel itself is checked against it above."""
    B, T, H, K, V = 1, 8192, 16, 128, 128
    q, k, v, g, h0 = make_inputs(B, T, H, K, V, B, torch.bfloat16, "cuda")
    do = torch.randn(B, T, H, V, device="cuda")
    o, ht, grads = run_with_grads(chunk_gla, q, k, v, g, h0, None, do, None)
    ref_o, ref_ht, ref_grads = run_with_grads(chunk_gla, q.float(), k.float(), v.float(), g, h0, None, do, None)
    for name, (a, ref) in {"o": (o, ref_o), "ht": (ht, ref_ht),
                           **{n: (grads[n], ref_grads[n]) for n in GRAD_NAMES}}.items():
        assert torch.isfinite(a).all(), name
        assert rms_rel_err(a, ref) <= 2e-2, (name, rms_rel_err(a, ref))
