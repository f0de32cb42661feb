"""chunk_kda against the fp32 token-by-token reference: outputs, final states, every gradient.

CPU runs use the Triton interpreter in fp32 (and once fp16) with small shapes (it is slow);
lengths are never multiples of the chunk size (64, or 32 where chunk_size=32 is tested). GPU
tests (bf16, long sequences) are marked gpu. The delta-rule state walk KDA runs (cp_linattn/ops/common/chunk_delta_h.py) is
tested in tests/ops/common/test_chunk_delta_h.py.
"""
from __future__ import annotations

import pytest
import torch

from cp_linattn.ops.kda.chunk import ChunkKDAFunction, chunk_kda
from cp_linattn.ops.kda.chunk_fwd import chunk_kda_fwd_prepare
from cp_linattn.ops.common.l2norm import l2norm
from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate, naive_recurrent_kda
from cp_linattn.ops.utils import prepare_chunk_indices
from tests.utils import (
    assert_matches, assert_rms_close, diagonal_block_spans, kda_inputs as make_inputs, run_with_grads, set_tile_caps,
)

REL_TOL = 1e-4


def run_both(inp, cu_seqlens=None, use_h0=True, final=True, l2=False, gate_in_kernel=False, lower_bound=None,
             safe_gate=False, state_v_first=False, disable_recompute=False, beta_logits=False, allow_neg_eigval=False,
             cu_seqlens_cpu=None, chunk_size=64):
    """Runs chunk_kda and the reference on the same inputs and the same random cotangents.
    Returns (ours, reference): {name: tensor} for o, the final state ht (with `final`) and
    every gradient. beta_logits: inp's beta are logits (use_beta_sigmoid_in_kernel)."""
    names = ["q", "k", "v", "g", "beta"] + (["h0"] if use_h0 else [])
    if gate_in_kernel:
        names += ["A_log"] if inp["A_log"] is not None else []
        names += ["dt_bias"]
    B, T, HV, V = inp["v"].shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    K = inp["k"].shape[-1]
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(B, T, HV, V, generator=gen).to(inp["v"].dtype)
    dht = torch.randn(*((N, HV, V, K) if state_v_first else (N, HV, K, V)), generator=gen) if final else None
    do = do.to(inp["v"].device)
    dht = None if dht is None else dht.to(inp["v"].device)
    transpose = (lambda x: x.transpose(-1, -2)) if state_v_first else (lambda x: x)

    def ours(q, k, v, g, beta, h0=None, A_log=None, dt_bias=None):
        return chunk_kda(
            q, k, v, g, beta, initial_state=None if h0 is None else transpose(h0), output_final_state=final,
            use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            use_beta_sigmoid_in_kernel=beta_logits, allow_neg_eigval=allow_neg_eigval, chunk_size=chunk_size,
        )

    def reference(q, k, v, g, beta, h0=None, A_log=None, dt_bias=None):
        if l2:
            q, k = l2norm(q), l2norm(k)
        if gate_in_kernel:
            g = kda_lower_bound_gate(g, A_log, dt_bias, lower_bound) if lower_bound is not None else \
                kda_gate(g, A_log, dt_bias)
        return naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=final,
                                   cu_seqlens=cu_seqlens, use_beta_sigmoid_in_kernel=beta_logits,
                                   allow_neg_eigval=allow_neg_eigval)

    got = run_with_grads(ours, {n: inp[n] for n in names}, do, dht)
    ref = run_with_grads(reference, {n: inp[n].float() for n in names}, do.float(),
                         None if dht is None else transpose(dht))
    if final:
        got["ht"] = transpose(got["ht"])
    else:
        assert got.pop("ht") is None and ref.pop("ht") is None
    return got, ref


def assert_close(res, rel=REL_TOL):
    """Every entry of ours within `rel` of the reference's max abs (at least 1e-3); `res` is
    what run_both returns."""
    assert_matches(*res, rel, floor=1e-3)


def split_off(res, names):
    """(res without `names`, res of only those of `names` it has), both (ours, reference)."""
    got, ref = res
    names = [n for n in names if n in ref]
    rest = tuple({n: t for n, t in d.items() if n not in names} for d in (got, ref))
    return rest, tuple({n: d[n] for n in names} for d in (got, ref))


@pytest.mark.interpreter
@pytest.mark.slow
def test_plain_every_gradient():
    res = run_both(make_inputs(T=150), use_h0=False, final=False)
    assert set(res[0]) == set(res[1]) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert_close(res)


@pytest.mark.interpreter
def test_qk_l2norm_in_kernel_initial_and_final_state():
    assert_close(run_both(make_inputs(T=100, normalise_k=False), l2=True))


@pytest.mark.interpreter
def test_gate_in_kernel_softplus_unequal_head_dims():
    inp = make_inputs(T=90, K=32, V=64, gate="raw")
    res = run_both(inp, gate_in_kernel=True, final=False)
    assert {"dA_log", "ddt_bias"} <= set(res[0])
    assert_close(res)


@pytest.mark.interpreter
@pytest.mark.slow
def test_safe_gate_lower_bound_strong_decay():
    # positive raw inputs put the gate near lower_bound = -5 per step: chunk totals near -300
    # would overflow any exp(-gk) factorisation (the gate is kept short of saturation, where
    # sigmoid' of the fp32 reference itself loses digits)
    inp = make_inputs(T=140, gate="raw", gate_scale=0.5)
    inp["g"] = inp["g"].abs() + 3.0
    inp["dt_bias"] = inp["dt_bias"] * 0.1
    res = run_both(inp, gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    # dA_log / ddt_bias sum T * K per-token terms whose chunked form (reverse cumsums of
    # q dq - k dk) cancels about 1000-fold under this decay: measured against a float64
    # recurrence the fp32 reference is exact to 1e-7 and we are off by 1.5e-4 relative
    res, param_grads = split_off(res, ("dA_log", "ddt_bias"))
    assert set(param_grads[0]) == {"dA_log", "ddt_bias"}
    assert_close(res)
    assert_close(param_grads, rel=5e-4)


@pytest.mark.interpreter
def test_lower_bound_gate_without_A_log():
    inp = make_inputs(T=70, gate="raw")
    inp["A_log"] = None
    assert_close(run_both(inp, gate_in_kernel=True, lower_bound=-3.0, use_h0=False))


@pytest.mark.interpreter
@pytest.mark.slow
def test_unbounded_strong_decay_is_finite():
    inp = make_inputs(T=130, gate="log", gate_scale=60.0)
    inp["g"][..., :4] = -1e4
    assert_close(run_both(inp))


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("disable_recompute", [False, True])
def test_both_diagonal_paths_in_one_call(disable_recompute):
    """Sub-chunks within and beyond the diagonal dot path's span limit in one call."""
    from cp_linattn.ops.common.intra import SAFE_SPAN
    inp = make_inputs(T=200, HV=2, N=2, gate="log")
    inp["g"][:, 64:128] *= 20.0
    spans = diagonal_block_spans(inp["g"][..., 0, :])
    assert (spans <= SAFE_SPAN).any() and (spans > SAFE_SPAN).any(), spans
    cu = torch.tensor([0, 90, 200], dtype=torch.long)
    assert_close(run_both(inp, cu_seqlens=cu, disable_recompute=disable_recompute))


@pytest.mark.interpreter
@pytest.mark.slow
def test_gva_group_with_one_wide_value_head():
    """One value head of a GVA group beyond the span limit from the second chunk on: the
    group's sub-chunks take the exact launch of the intra backward for both of its heads,
    while the WY forward splits the heads."""
    inp = make_inputs(T=150, H=2, HV=4, gate="log")
    inp["g"][:, 64:, 1] *= 20.0
    spans = diagonal_block_spans(inp["g"][..., 1, :])
    assert (spans[0] <= 40.0) and (spans[1:] > 40.0).all(), spans
    assert (diagonal_block_spans(inp["g"][..., 0, :]) <= 40.0).all()
    assert_close(run_both(inp))


@pytest.mark.interpreter
@pytest.mark.slow
def test_varlen_gva_gate_in_kernel_states_l2norm():
    cu = torch.tensor([0, 37, 37, 38, 100, 150], dtype=torch.long)
    inp = make_inputs(T=150, H=1, HV=2, N=5, gate="raw", normalise_k=False)
    assert_close(run_both(inp, cu_seqlens=cu, gate_in_kernel=True, l2=True))


@pytest.mark.interpreter
@pytest.mark.slow
def test_gva_groups_of_three_value_heads():
    """dq, dk summed over groups of three value heads inside the intra backward kernel."""
    assert_close(run_both(make_inputs(T=80, H=2, HV=6, gate="log", gate_scale=3.0)))


@pytest.mark.interpreter
def test_state_v_first():
    cu = torch.tensor([0, 20, 100], dtype=torch.long)
    assert_close(run_both(make_inputs(T=100, N=2), cu_seqlens=cu, state_v_first=True))


@pytest.mark.interpreter
@pytest.mark.slow
def test_disable_recompute_is_identical():
    inp = make_inputs(T=70, HV=2, N=1, gate="raw", normalise_k=False)
    kw = dict(gate_in_kernel=True, l2=True)
    a = run_both(inp, disable_recompute=True, **kw)
    b = run_both(inp, disable_recompute=False, **kw)
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name]), name
    assert_close(a)


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("HV, gate_in_kernel, l2", [(1, False, False), (2, True, False), (1, True, True)])
def test_fp16_gradients_in_input_dtype(monkeypatch, HV, gate_in_kernel, l2):
    """fp16 inputs: the backward returns every gradient in its input's dtype as the kernels
    wrote it (no cast after them), close to the fp32 reference. Autograd would silently cast
    a gradient of the wrong dtype, so what `backward` itself returns is checked."""
    returned = []
    backward = ChunkKDAFunction.backward

    def recording_backward(ctx, *grads):
        returned.append(backward(ctx, *grads))
        return returned[-1]

    monkeypatch.setattr(ChunkKDAFunction, "backward", staticmethod(recording_backward))
    inp = make_inputs(T=70, HV=HV, gate="raw" if gate_in_kernel else "log", normalise_k=not l2,
                      dtype=torch.float16)
    res = run_both(inp, gate_in_kernel=gate_in_kernel, l2=l2)
    # backward's gradients in the order of forward's arguments
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")
    for name, grad in zip(names, returned[0]):
        assert (grad is None) == ("d" + name not in res[0]), name
        if grad is not None:
            assert grad.dtype == inp[name].dtype, f"d{name}: {grad.dtype}, input {inp[name].dtype}"
    # fp16 operands: measured up to 1.4e-3; dA_log and ddt_bias, sums of T * K per-token terms
    # that partly cancel, up to 7e-3
    res, param_grads = split_off(res, ("dA_log", "ddt_bias"))
    assert_close(res, rel=5e-3)
    assert_close(param_grads, rel=2e-2)


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_strided_inputs(name):
    """A non-contiguous input (a transposed view) gives the same output and gradients as its
    contiguous copy, with the in-kernel gate (kernels once allocated outputs with an input's
    strides but wrote flat offsets: the gate cumsum for g, u for v)."""
    inp = make_inputs(T=40, HV=2, gate="raw")
    out = []
    for strided in (True, False):
        x = inp[name]
        if strided:
            x = x.transpose(1, -1).contiguous().transpose(1, -1)
        args = {n: (x if n == name else inp[n]).clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
        assert args[name].is_contiguous() != strided
        o, _ = chunk_kda(*args.values(), use_gate_in_kernel=True, A_log=inp["A_log"], dt_bias=inp["dt_bias"])
        o.square().sum().backward()
        out.append((o.detach(), *(t.grad for t in args.values())))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


@pytest.mark.interpreter
@pytest.mark.slow
def test_head_dims_not_powers_of_two():
    """K = 80 spans several key tiles (the last one partly masked) and V = 48 a partly masked
    value tile: every kernel's tile loop and masks, against the reference."""
    assert_close(run_both(make_inputs(T=100, K=80, V=48, gate_scale=0.3)))


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("caps", [dict(BK=16, BV=16), dict(BK=32, BV=64), dict(BK=64, BV=128)])
def test_tile_caps_of_the_launch_table(monkeypatch, caps):
    """scripts/tools/tune_launch.py may set the BK / BV caps of ops/launch.py to any of its choices;
    the KDA kernels stay exact from the smallest to the largest, equal or not (K = 80, V = 48:
    several tiles, masked tails)."""
    set_tile_caps(monkeypatch, ("chunk_kda_", "chunk_delta_rule_"), caps)
    assert_close(run_both(make_inputs(T=100, K=80, V=48, gate_scale=0.3)))


@pytest.mark.interpreter
def test_short_sequence():
    assert_close(run_both(make_inputs(T=23)))


def _beta_logits(inp, seed=5):
    """inp with beta replaced by logits ~ 2 N(0, 1) (steps from near 0 to near 1, or 2)."""
    beta = inp["beta"]
    logits = 2 * torch.randn(beta.shape, generator=torch.Generator().manual_seed(seed))
    return dict(inp, beta=logits.to(dtype=beta.dtype, device=beta.device))


@pytest.mark.interpreter
@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_sigmoid_in_kernel(allow_neg_eigval):
    """use_beta_sigmoid_in_kernel: beta are logits, the steps sigmoid(beta) (2 sigmoid(beta)
    with allow_neg_eigval, as FLA: reflections of the state); dbeta is the logits' gradient.
    Varlen, GVA, initial and final states, every gradient."""
    cu = torch.tensor([0, 37, 38, 130], dtype=torch.long)
    inp = _beta_logits(make_inputs(T=130, H=1, HV=2, N=3))
    assert_close(run_both(inp, cu_seqlens=cu, beta_logits=True, allow_neg_eigval=allow_neg_eigval))


@pytest.mark.interpreter
@pytest.mark.slow
def test_beta_sigmoid_fp16_logits_gradient_dtype():
    """fp16 logits: the kernels run with fp32 steps, the logits' gradient comes back in fp16."""
    inp = _beta_logits(make_inputs(T=70, HV=2, dtype=torch.float16))
    res = run_both(inp, beta_logits=True, allow_neg_eigval=True)
    assert res[0]["dbeta"].dtype == torch.float16
    assert_close(res, rel=5e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("with_cpu_copy", [False, True])
def test_int32_offsets(with_cpu_copy):
    """int32 cu_seqlens (and an int32 cu_seqlens_cpu), as FLA's own tests pass them: the
    reference's result, and exactly the int64 offsets' result."""
    offsets = [0, 37, 37, 100]
    cu = torch.tensor(offsets, dtype=torch.int32)
    cpu_copy = torch.tensor(offsets, dtype=torch.int32) if with_cpu_copy else None
    inp = make_inputs(T=100, HV=2, N=3)
    res = run_both(inp, cu_seqlens=cu, cu_seqlens_cpu=cpu_copy, l2=True)
    assert_close(res)
    wide = run_both(inp, cu_seqlens=torch.tensor(offsets), l2=True)
    for name, x in wide[0].items():
        assert torch.equal(res[0][name], x), name


@pytest.mark.interpreter
@pytest.mark.parametrize("HV, gate_in_kernel, disable_recompute", [(2, True, False), (1, False, True)])
def test_chunk_size_32(HV, gate_in_kernel, disable_recompute):
    """chunk_size=32 (two sub-chunks per chunk): varlen with sequences shorter than, across and
    longer than a chunk, initial and final states, every gradient; GVA with the in-kernel gate
    and l2norm, or the stored intermediates. The same results as chunk_size=64 up to rounding."""
    cu = torch.tensor([0, 20, 21, 75, 140], dtype=torch.long)
    inp = make_inputs(T=140, H=1, HV=HV, N=4, gate="raw" if gate_in_kernel else "log", normalise_k=False)
    kw = dict(cu_seqlens=cu, gate_in_kernel=gate_in_kernel, l2=True, disable_recompute=disable_recompute)
    res = run_both(inp, chunk_size=32, **kw)
    assert_close(res)
    wide = run_both(inp, chunk_size=64, **kw)[0]
    assert_matches(res[0], wide, REL_TOL, floor=1e-3)


@pytest.mark.interpreter
@pytest.mark.slow
def test_chunk_size_32_exact_diagonal_path():
    """chunk_size=32 with sub-chunks beyond the dot path's span (the exact launches of the WY
    forward and the intra backward) next to ones within it."""
    from cp_linattn.ops.common.intra import SAFE_SPAN
    inp = make_inputs(T=100, HV=2, N=2, gate="log")
    inp["g"][:, 32:64] *= 20.0
    spans = diagonal_block_spans(inp["g"][..., 0, :], chunk=32)
    assert (spans <= SAFE_SPAN).any() and (spans > SAFE_SPAN).any(), spans
    assert_close(run_both(inp, cu_seqlens=torch.tensor([0, 45, 100]), chunk_size=32))


@pytest.mark.interpreter
@pytest.mark.parametrize("varlen, state_v_first, chunk_size", [(False, False, 64), (True, True, 64), (True, False, 32)])
def test_return_intermediate_states(varlen, state_v_first, chunk_size):
    """return_intermediate_states (inference mode): the states entering every chunk, laid out
    as FLA returns them (`[B, NT, HV, K, V]`, V-first with state_v_first, k's dtype), against
    the reference's; o and the final state are the training call's."""
    cu = torch.tensor([0, 70, 71, 150]) if varlen else None
    inp = make_inputs(T=150, HV=2, N=3 if varlen else None)
    h0 = inp["h0"].transpose(-1, -2).contiguous() if state_v_first else inp["h0"]
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    kw = dict(initial_state=h0, output_final_state=True, state_v_first=state_v_first, cu_seqlens=cu)
    with torch.inference_mode():
        o, ht, h = chunk_kda(*args, return_intermediate_states=True, chunk_size=chunk_size, use_graph=False,
                             max_num_seqs=None, **kw)
    ref = naive_recurrent_kda(*args, return_intermediate_states=True, chunk_size=chunk_size, **kw)
    NT = {64: 5 if varlen else 3, 32: 7 if varlen else 5}[chunk_size]
    assert h.shape == ((inp["v"].shape[0], NT, 2, 32, 32)) and h.dtype == inp["k"].dtype
    assert_matches(dict(o=o, ht=ht, h=h), dict(o=ref[0], ht=ref[1], h=ref[2]), REL_TOL, floor=1e-3)
    o_train, ht_train = chunk_kda(*args, chunk_size=chunk_size, **kw)
    assert torch.equal(o, o_train) and torch.equal(ht, ht_train)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cp_context=object()), "cp_context must be an FLACPContext"),
        (dict(use_gate_in_kernel=True), "A_log"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), "A_log"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(1), dt_bias=torch.zeros(5)), "dt_bias"),
        (dict(use_gate_in_kernel=True, A_log=torch.zeros(1), safe_gate=True), "lower_bound"),
        (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0), "lower_bound"),
        (dict(lower_bound=1.0), "lower_bound"),
        (dict(A_log=torch.zeros(1)), "A_log"),
        (dict(allow_neg_eigval=True), "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"),
        (dict(use_beta_sigmoid_in_kernel=1), "use_beta_sigmoid_in_kernel must be a bool"),
        (dict(chunk_size=16), "chunk_size must be 32 or 64 .*got 16"),
        (dict(chunk_size=128), "chunk_size must be 32 or 64 .*got 128"),
        (dict(chunk_size=64.0), "chunk_size must be an int"),
        (dict(use_graph=True), "use_graph=True is not supported.*Pass use_graph=False"),
        (dict(max_num_seqs=4), "max_num_seqs is only used with use_graph=True"),
        (dict(return_intermediate_states=True), "return_intermediate_states=True is only allowed in inference mode"),
    ],
)
def test_validation(kwargs, match):
    q = torch.randn(1, 10, 1, 32)
    args = (q, q, torch.randn(1, 10, 1, 32), -torch.rand(1, 10, 1, 32), torch.rand(1, 10, 1))
    with pytest.raises((ValueError, TypeError), match=match):
        chunk_kda(*args, **kwargs)


def test_intermediate_states_need_recompute_as_in_fla():
    q = torch.randn(1, 10, 1, 32)
    args = (q, q, torch.randn(1, 10, 1, 32), -torch.rand(1, 10, 1, 32), torch.rand(1, 10, 1))
    with torch.inference_mode(), pytest.raises(ValueError, match=r"return_intermediate_states=True must be used "
                                                                 r"with disable_recompute=False"):
        chunk_kda(*args, return_intermediate_states=True, disable_recompute=True)


@pytest.mark.interpreter
def test_prepare_indices_cover_varlen_fragment():
    cu = torch.tensor([0, 5, 70], dtype=torch.long)
    inp = make_inputs(T=70, N=2)
    p = chunk_kda_fwd_prepare(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 32 ** -0.5, cu_seqlens=cu,
                              chunk_indices=prepare_chunk_indices(cu, 64))
    # chunks restart at each sequence start, so the gate cumsum restarts there too
    assert torch.allclose(p.gk[0, 5], inp["g"][0, 5])
    assert torch.allclose(p.gk[0, 68], inp["g"][0, 5:69].sum(0), atol=1e-5)
    assert torch.allclose(p.gk[0, 69], inp["g"][0, 69])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1000, 8192])
def test_gpu_bf16_long(T):
    cu = torch.tensor([0, T // 3, T // 3 + 1, T], dtype=torch.long, device="cuda")
    inp = make_inputs(T=T, H=2, HV=4, K=128, V=128, N=3, gate="raw", normalise_k=False, device="cuda",
                      dtype=torch.bfloat16)
    res = run_both(inp, cu_seqlens=cu, gate_in_kernel=True, l2=True)
    # bf16 operands: ~1e-2 on outputs, gradients pass through two more bf16 rounds
    assert_rms_close(*res, lambda name: 3e-2 if name in ("o", "ht") else 5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    # the largest shared-memory ask: varlen, safe gate, stored intermediates
    dict(gate_in_kernel=True, lower_bound=-5.0, safe_gate=True, disable_recompute=True),
    dict(gate_in_kernel=True, l2=True, state_v_first=True),
    dict(l2=True, chunk_size=32),
    dict(disable_recompute=True, use_h0=False, final=False),
], ids=["safe-gate-no-recompute", "gate-l2norm-v-first", "chunk-size-32", "no-states"])
def test_gpu_head_dims_256(options):
    """K = V = 256 (the largest head dim) on a varlen batch with GVA: every launch fits the
    device's shared memory (stages stepped down where needed, ops/launch.py), forward and
    every gradient against the fp32 reference."""
    cu = torch.tensor([0, 300, 301, 777], dtype=torch.long, device="cuda")
    gated = options.get("gate_in_kernel", False)
    inp = make_inputs(T=777, H=2, HV=4, K=256, V=256, N=3, gate="raw" if gated else "log",
                      normalise_k=not options.get("l2", False), device="cuda", dtype=torch.bfloat16)
    res = run_both(inp, cu_seqlens=cu, **options)
    assert_rms_close(*res, lambda name: 3e-2 if name in ("o", "ht") else 5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, None])  # None: the softplus gate, its log by lg2.approx
def test_gpu_fp32_tight(lower_bound):
    inp = make_inputs(T=700, H=2, HV=2, K=128, V=64, gate="raw", normalise_k=False, device="cuda")
    assert_close(run_both(inp, gate_in_kernel=True, l2=True, lower_bound=lower_bound,
                          safe_gate=lower_bound is not None), rel=1e-3)
