"""chunk_gla against the fp32 recurrent reference.

Every case checks the output, the final state and every gradient (q, k, v, g, initial state)
against torch.autograd through `naive_recurrent_gla`, on lengths that are not multiples of
the chunk size. CPU runs use the Triton interpreter in fp32 (fp16 loosely); the GPU cases
(bf16 and fp32, long T, K = V = 128) need CUDA. The state kernels chunk_gla shares with KDA
are tested in tests/ops/common/test_chunk_h.py, the CP merge kernels in
tests/cp/test_merge_kernels.py.
"""
import pytest
import torch

from cp_linattn.ops.gla.chunk import chunk_gla
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from tests.utils import (
    assert_matches, assert_rms_close, diagonal_block_spans, logsigmoid_gate, max_rel_err, mixed_gate, random_qkvg,
    run_with_grads, set_tile_caps,
)

GATES = {
    "logsigmoid": logsigmoid_gate,
    # Log decay of about -5 per token: exp(-b) over a chunk is far beyond fp32 range.
    "strong": lambda shape, gen: -4.0 - torch.rand(*shape, generator=gen),
    # About -8.5 per token in the second chunk only (beyond the diagonal blocks' dot path,
    # which "strong" still fits): chunks of both intra-chunk paths in one call.
    "mixed": mixed_gate(64, 128),
}


def make_inputs(B, T, H, K, V, N, dtype, device, gate="logsigmoid", with_h0=True, seed=0):
    """q, k, v (in dtype), g (fp32) `[B, T, H, *]` and, with_h0, initial states `[N, H, K, V]`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = random_qkvg(gen, B, T, H, K, V, GATES[gate])
    h0 = torch.randn(N, H, K, V, generator=gen) if with_h0 else None
    q, k, v = (x[n].to(dtype=dtype, device=device) for n in "qkv")
    return q, k, v, x["g"].to(device=device), None if h0 is None else h0.to(device=device)


def run_gla(fn, q, k, v, g, h0, cu, do, dht, output_final_state=True, **kw) -> dict:
    """o, ht and the gradients dq, dk, dv, dg (and dh0 with h0) of `fn` (chunk_gla or the
    reference); kw: further arguments of fn."""
    def call(q, k, v, g, h0):
        return fn(q, k, v, g, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu, **kw)

    return run_with_grads(call, dict(q=q, k=k, v=v, g=g, h0=h0), do, dht)


def _v_first(x):
    return None if x is None else x.transpose(-1, -2).contiguous()


def compare_with_reference(B, T, H, K, V, cu=None, with_h0=True, with_dht=True, output_final_state=True,
                           gate="logsigmoid", dtype=torch.float32, device="cpu", tol=1e-4, state_v_first=False,
                           offsets_dtype=torch.long, cpu_copy=False):
    """chunk_gla against the reference, every output and gradient. state_v_first: our states
    (h0, ht, dht, dh0) laid out `[N, H, V, K]`, compared after turning them round.
    offsets_dtype: of cu_seqlens, and of its CPU copy passed as cu_seqlens_cpu with cpu_copy."""
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=offsets_dtype, device=device)
    kw = dict(cu_seqlens_cpu=torch.tensor(cu, dtype=offsets_dtype)) if cpu_copy else {}
    q, k, v, g, h0 = make_inputs(B, T, H, K, V, N, dtype, device, gate, with_h0)
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(1)).to(device)
    dht = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(2)).to(device) if with_dht else None
    if state_v_first:
        got = run_gla(chunk_gla, q, k, v, g, _v_first(h0), cu_t, do, _v_first(dht), output_final_state,
                      state_v_first=True, **kw)
        got.update({n: _v_first(got[n]) for n in ("ht", "dh0") if n in got})
    else:
        got = run_gla(chunk_gla, q, k, v, g, h0, cu_t, do, dht, output_final_state, **kw)
    ref = run_gla(naive_recurrent_gla, q.float(), k.float(), v.float(), g, h0, cu_t, do, dht, output_final_state)
    assert got["o"].dtype == q.dtype and got["o"].shape == (B, T, H, V)
    if output_final_state:
        assert got["ht"].dtype == torch.float32 and got["ht"].shape == (N, H, K, V)
    else:
        assert got["ht"] is None
    for name in ("dq", "dk", "dv", "dg", "dh0"):
        if name in ref:
            assert got[name].dtype == (torch.float32 if name in ("dg", "dh0") else dtype), name
    return assert_matches(got, ref, tol)


CPU_CASES = [
    # B, T, H, K, V, cu_seqlens, with_h0, with_dht, output_final_state
    pytest.param(2, 100, 1, 32, 32, None, True, True, True, id="batch2-T100-h0-dht"),
    pytest.param(1, 150, 2, 32, 48, [0, 1, 70, 150], True, True, True, id="varlen-len1-V48"),
    pytest.param(1, 37, 1, 64, 64, None, False, False, False, id="T37-no-state"),
    pytest.param(2, 130, 1, 64, 32, None, False, False, True, id="final-state-no-dht"),
    pytest.param(1, 90, 1, 16, 16, [0, 64, 65, 90], True, False, True, id="K16-exact-chunk-seq"),
    pytest.param(1, 70, 1, 48, 24, None, True, True, True, id="non-pow2-dims"),
    pytest.param(1, 20, 1, 128, 128, None, True, True, True, id="K128"),
    pytest.param(1, 18, 1, 256, 256, [0, 5, 18], True, True, True, id="K256-varlen", marks=pytest.mark.slow),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("B, T, H, K, V, cu, with_h0, with_dht, output_final_state", CPU_CASES)
def test_chunk_gla_matches_reference(B, T, H, K, V, cu, with_h0, with_dht, output_final_state):
    compare_with_reference(B, T, H, K, V, cu, with_h0, with_dht, output_final_state)


@pytest.mark.interpreter
def test_strong_decay_is_finite_and_exact():
    compare_with_reference(1, 200, 1, 32, 32, cu=[0, 3, 133, 200], gate="strong")


@pytest.mark.interpreter
def test_both_diagonal_paths_in_one_call():
    """Chunks within and beyond the dot path's span limit in one sequence, every gradient."""
    from cp_linattn.ops.common.intra import SAFE_SPAN
    _, _, _, g, _ = make_inputs(1, 200, 1, 32, 32, 1, torch.float32, "cpu", gate="mixed")
    spans = diagonal_block_spans(g)
    assert (spans <= SAFE_SPAN).any() and (spans > SAFE_SPAN).any(), spans
    compare_with_reference(1, 200, 1, 32, 32, gate="mixed")
    compare_with_reference(1, 200, 1, 32, 32, cu=[0, 100, 101, 200], gate="mixed")


@pytest.mark.interpreter
@pytest.mark.parametrize("caps", [pytest.param(dict(BK=16, BV=16), marks=pytest.mark.slow), dict(BK=32, BV=64),
                                  dict(BK=64, BV=128)])
def test_tile_caps_of_the_launch_table(monkeypatch, caps):
    """scripts/tools/tune_launch.py may set the BK / BV caps of ops/launch.py to any of its choices;
    the GLA kernels stay exact from the smallest to the largest, equal or not (K = 80, V = 48:
    several tiles, masked tails; BK=32 / BV=64 is a setting of the dq/dk/dg kernel worth
    keeping exact)."""
    set_tile_caps(monkeypatch, ("chunk_fwd_h", "chunk_bwd_dh", "add_decayed_state", "chunk_gla_"), caps)
    compare_with_reference(1, 150, 1, 80, 48, cu=[0, 70, 150])


@pytest.mark.interpreter
@pytest.mark.parametrize("cu", [None, [0, 1, 70, 150]])
def test_state_v_first(cu):
    """state_v_first (FLA's flag): initial and final states `[N, H, V, K]`, their gradients too."""
    compare_with_reference(1 if cu else 2, 150, 2, 32, 48, cu=cu, state_v_first=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("cpu_copy", [False, True])
def test_int32_offsets(cpu_copy):
    """int32 cu_seqlens (and an int32 cu_seqlens_cpu), as FLA's own tests pass them."""
    compare_with_reference(1, 150, 1, 32, 32, cu=[0, 64, 64, 150], offsets_dtype=torch.int32, cpu_copy=cpu_copy)


@pytest.mark.interpreter
def test_fp16_inputs():
    compare_with_reference(1, 100, 1, 32, 32, cu=[0, 40, 100], dtype=torch.float16, tol=2e-3)


@pytest.mark.interpreter
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


def _args(**over):
    q, k, v, g, h0 = make_inputs(1, 20, 2, 16, 16, 1, torch.float32, "cpu")
    args = dict(q=q, k=k, v=v, g=g, initial_state=h0)
    args.update(over)
    return args


def test_cp_context_is_not_silently_ignored():
    # A wrong object is refused; real contexts are tested in tests/cp/test_ops.py.
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


# ------------------------------------------------------------------------------------------
# GPU: real dtypes and sizes.


@pytest.mark.gpu
@pytest.mark.parametrize("T, cu", [(1000, None), (2047, [0, 1, 500, 1300, 2047]), (8192, None)])
def test_gpu_fp32(T, cu):
    compare_with_reference(1, T, 2, 128, 128, cu, device="cuda", tol=1e-4)


@pytest.mark.gpu
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
    got = run_gla(chunk_gla, q, k, v, g, h0, cu_t, do, dht)
    ref = run_gla(naive_recurrent_gla, q.float(), k.float(), v.float(), g, h0, cu_t, do, dht)
    assert got["o"].dtype == torch.bfloat16
    assert_rms_close(got, ref, 2e-2, max_ratio=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cu, gate, dtype", [(None, "logsigmoid", torch.bfloat16),
                                             ([0, 1, 300, 777], "mixed", torch.bfloat16),
                                             ([0, 400, 777], "strong", torch.float32)])
def test_gpu_head_dims_256(cu, gate, dtype):
    """K = V = 256, the largest head dim: every launch fits the device's shared memory (stages
    stepped down where needed, ops/launch.py), dense and varlen, both diagonal paths, bf16 and
    fp32, against the fp32 reference."""
    B, T, H, K, V = 1, 777, 2, 256, 256
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device="cuda")
    q, k, v, g, h0 = make_inputs(B, T, H, K, V, N, dtype, "cuda", gate)
    do = torch.randn(B, T, H, V, device="cuda")
    dht = torch.randn(N, H, K, V, device="cuda")
    got = run_gla(chunk_gla, q, k, v, g, h0, cu_t, do, dht)
    ref = run_gla(naive_recurrent_gla, q.float(), k.float(), v.float(), g, h0, cu_t, do, dht)
    assert_rms_close(got, ref, 2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
def test_gpu_bf16_long_against_fp32_kernel():
    """H = 16 at T = 8192 in bf16 against our fp32 kernel on the same inputs (the recurrent
    reference would be slow); the fp32 kernel itself is checked against it above."""
    B, T, H, K, V = 1, 8192, 16, 128, 128
    q, k, v, g, h0 = make_inputs(B, T, H, K, V, B, torch.bfloat16, "cuda")
    do = torch.randn(B, T, H, V, device="cuda")
    got = run_gla(chunk_gla, q, k, v, g, h0, None, do, None)
    ref = run_gla(chunk_gla, q.float(), k.float(), v.float(), g, h0, None, do, None)
    assert_rms_close(got, ref, 2e-2)
