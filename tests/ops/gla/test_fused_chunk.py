"""fused_chunk_gla against the fp32 token-by-token reference, forward and every gradient.

CPU cases run the Triton kernels in the interpreter (fp32: bf16 dots are wrong there), on
lengths that are not multiples of the 16-token chunk, shorter than one chunk, with head dims
that need several K/V blocks or masked ones, both layouts, with and without the initial
state, the final state and its gradient. GPU cases (bf16, fp32, T up to 8192, K = V = 128)
skip without CUDA.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cp_linattn.ops.gla import fused_chunk
from cp_linattn.ops.gla.fused_chunk import fused_chunk_gla
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from tests.utils import (
    assert_matches, assert_rms_close, diagonal_block_spans, logsigmoid_gate, mixed_gate, random_qkvg, run_with_grads,
    set_tile_caps,
)

GATES = {
    "logsigmoid": logsigmoid_gate,
    "strong": lambda shape, gen: -5 * torch.rand(*shape, generator=gen),
    "extreme": lambda shape, gen: -30 + torch.randn(*shape, generator=gen),
    # tokens 16..47 at about -8 per token, beyond the intra-chunk dot path's span limit
    "mixed": mixed_gate(16, 48),
}


def make_inputs(B, T, H, K, V, *, gate="logsigmoid", use_h0=True, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v, g `[B, T, H, *]`, initial state `[B, H, K, V]` (or None), do, dht."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = random_qkvg(gen, B, T, H, K, V, GATES[gate])
    x["h0"] = torch.randn(B, H, K, V, generator=gen) if use_h0 else None
    do, dht = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return dict({n: cast(t) for n, t in x.items()}, do=do.to(device), dht=dht.to(device))


def reference(inp, *, scale=None, output_final_state=True, use_dht=True):
    """Outputs and gradients of the fp32 recurrent reference, by torch.autograd."""
    def call(q, k, v, g, h0):
        return naive_recurrent_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=output_final_state)

    x = {n: None if inp[n] is None else inp[n].float() for n in ("q", "k", "v", "g", "h0")}
    return run_with_grads(call, x, inp["do"].float(), inp["dht"].float() if use_dht else None)


def fused(inp, *, head_first, scale=-1, output_final_state=True, use_dht=True):
    """Outputs and gradients of fused_chunk_gla, brought back to `[B, T, H, D]`."""
    layout = (lambda x: x.transpose(1, 2)) if head_first else (lambda x: x)

    def call(q, k, v, g, h0):
        o, ht = fused_chunk_gla(*(layout(x) for x in (q, k, v, g)), scale=scale, initial_state=h0,
                                output_final_state=output_final_state, head_first=head_first)
        assert o.dtype == inp["v"].dtype and o.shape == layout(v).shape
        if output_final_state:
            assert ht.dtype == torch.float32
        else:
            assert ht is None
        return layout(o), ht

    x = {n: inp[n] for n in ("q", "k", "v", "g", "h0")}
    return run_with_grads(call, x, inp["do"].float(), inp["dht"].float() if use_dht else None)


def assert_fp32_close(got, ref, *, tol=1e-4, floors=None):
    """Max abs error of every output/gradient below `tol` times the reference's max abs (raised
    only by `floors`); see tests.utils.assert_matches."""
    assert_matches(got, ref, tol, floor=0.0, floors=floors)


CPU_CASES = [
    # head_first, B, T, H, K, V, use_h0, output_final_state, use_dht
    pytest.param(True, 2, 100, 1, 32, 32, True, True, True, id="hf-T100-h0-dht"),
    pytest.param(False, 1, 100, 2, 32, 32, True, True, False, id="thd-T100-h0-ht-no-dht"),
    pytest.param(True, 1, 67, 2, 64, 48, False, True, True, id="hf-T67-V48-dht"),
    pytest.param(False, 1, 45, 1, 80, 100, True, True, True, id="thd-T45-K80-V100-multiblock"),
    pytest.param(False, 2, 130, 1, 16, 64, False, False, False, id="thd-T130-K16-plain"),
    pytest.param(True, 1, 32, 1, 32, 16, True, True, True, id="hf-T32-exact-chunks"),
    pytest.param(True, 2, 5, 1, 32, 32, True, True, True, id="hf-T5-shorter-than-chunk"),
    pytest.param(False, 1, 1, 2, 32, 32, True, True, True, id="thd-T1"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("head_first,B,T,H,K,V,use_h0,output_final_state,use_dht", CPU_CASES)
def test_matches_reference(head_first, B, T, H, K, V, use_h0, output_final_state, use_dht):
    inp = make_inputs(B, T, H, K, V, use_h0=use_h0, seed=T + K)
    kw = dict(output_final_state=output_final_state, use_dht=use_dht)
    assert_fp32_close(fused(inp, head_first=head_first, **kw), reference(inp, **kw))


@pytest.mark.interpreter
@pytest.mark.parametrize("head_first,gate", [(True, "strong"), pytest.param(False, "extreme", marks=pytest.mark.slow)])
def test_strongly_negative_gates(head_first, gate):
    """Log decays of -5 per token and below: every exponent must stay <= 0 (no inf/NaN).

    With -30 per token only each token's own term survives, and the true dg, the difference
    q*dq - k*dk of two O(1) terms, is about 1e-11: its error is measured against q*dq.
    """
    inp = make_inputs(1, 75, 2, 32, 32, gate=gate, seed=3)
    ref = reference(inp)
    floors = {"dg": (inp["q"] * ref["dq"]).abs().max().item()} if gate == "extreme" else None
    assert_fp32_close(fused(inp, head_first=head_first), ref, floors=floors)


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("head_first", [True, False])
def test_both_intra_chunk_paths_in_one_call(head_first):
    from cp_linattn.ops.common.intra import SAFE_SPAN
    inp = make_inputs(1, 75, 2, 32, 32, gate="mixed", seed=5)
    spans = diagonal_block_spans(inp["g"][..., 0, :], chunk=16)
    assert (spans <= SAFE_SPAN).any() and (spans > SAFE_SPAN).any(), spans
    assert_fp32_close(fused(inp, head_first=head_first), reference(inp))


@pytest.mark.interpreter
def test_explicit_scale():
    inp = make_inputs(1, 40, 1, 32, 32, seed=4)
    assert_fp32_close(fused(inp, head_first=False, scale=0.3), reference(inp, scale=0.3))


@pytest.mark.interpreter
def test_default_scale_spellings_agree():
    inp = make_inputs(1, 20, 1, 32, 32, use_h0=False, seed=5)
    args = [inp[n] for n in ("q", "k", "v", "g")]
    o_minus1, _ = fused_chunk_gla(*args, scale=-1, head_first=False)
    o_none, _ = fused_chunk_gla(*args, scale=None, head_first=False)
    o_explicit, _ = fused_chunk_gla(*args, scale=32 ** -0.5, head_first=False)
    o_other, _ = fused_chunk_gla(*args, scale=1.0, head_first=False)
    torch.testing.assert_close(o_minus1, o_explicit, rtol=0, atol=0)
    torch.testing.assert_close(o_none, o_explicit, rtol=0, atol=0)
    assert not torch.allclose(o_other, o_explicit)


@pytest.mark.interpreter
def test_fp16_inputs():
    """fp16 in, fp16 out; accumulation in fp32 keeps it close to the fp32 reference."""
    inp = make_inputs(1, 50, 1, 32, 32, dtype=torch.float16, seed=6)
    got = fused(inp, head_first=True)
    assert got["dq"].dtype == torch.float16 and got["dh0"].dtype == torch.float16
    assert_fp32_close(got, reference(inp), tol=1e-2)


@pytest.mark.interpreter
def test_no_grad_forward():
    inp = make_inputs(1, 30, 1, 32, 32, seed=7)
    with torch.no_grad():
        o, ht = fused_chunk_gla(inp["q"], inp["k"], inp["v"], inp["g"], initial_state=inp["h0"],
                                output_final_state=True, head_first=False)
    ref = reference(inp)
    assert_fp32_close({"o": o, "ht": ht}, {"o": ref["o"], "ht": ref["ht"]})


@pytest.mark.interpreter
def test_frozen_initial_state_and_gate():
    """Gradients reach q, k, v only when h0 and g do not require grad; h0 still shapes them."""
    inp = make_inputs(1, 40, 1, 32, 32, seed=8)
    ref = reference(inp, output_final_state=False, use_dht=False)
    q, k, v = (inp[n].clone().requires_grad_() for n in ("q", "k", "v"))
    o, _ = fused_chunk_gla(q, k, v, inp["g"], initial_state=inp["h0"], head_first=False)
    (o * inp["do"]).sum().backward()
    assert inp["g"].grad is None and inp["h0"].grad is None
    got = {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    assert_fp32_close(got, {n: ref[n] for n in got})


SEGMENT_CASES = [
    # head_first, B, T, H, K, V, count, use_h0, output_final_state, use_dht, gate
    # 7 chunks as 3 + 3 + 1, the last one partial.
    pytest.param(True, 2, 100, 1, 32, 32, 3, True, True, True, "logsigmoid", id="hf-B2-T100-S3"),
    # 10 chunks as 3 + 3 + 3 + 1; no initial state, no final-state gradient.
    pytest.param(False, 2, 150, 2, 32, 32, 4, False, True, False, "logsigmoid", id="thd-B2-T150-S4-no-h0",
                 marks=pytest.mark.slow),
    # Several K and V blocks; 6 chunks as 2 + 2 + 2, the last chunk partial; no final state.
    pytest.param(True, 1, 90, 1, 80, 100, 3, True, False, False, "logsigmoid", id="hf-T90-K80-V100-S3"),
    pytest.param(False, 1, 90, 1, 80, 100, 2, False, True, True, "logsigmoid", id="thd-T90-K80-V100-S2-dht"),
    # More segments asked for than there are chunks: one chunk each.
    pytest.param(False, 1, 40, 2, 32, 32, 10, True, True, True, "logsigmoid", id="thd-T40-S3-of-10"),
    # Segment decays that underflow to 0, and both intra-chunk paths.
    pytest.param(True, 1, 75, 2, 32, 32, 3, True, True, True, "strong", id="hf-T75-S3-strong", marks=pytest.mark.slow),
    pytest.param(False, 1, 75, 2, 32, 32, 2, True, True, True, "mixed", id="thd-T75-S2-mixed", marks=pytest.mark.slow),
]


def force_segments(monkeypatch, count):
    """Make every call cut its sequences into `count` segments (fewer if it has fewer chunks)."""
    monkeypatch.setattr(fused_chunk, "segment_count", lambda T, programs, device: count)


@pytest.mark.interpreter
@pytest.mark.parametrize("head_first,B,T,H,K,V,count,use_h0,output_final_state,use_dht,gate", SEGMENT_CASES)
def test_segments_match_reference(monkeypatch, head_first, B, T, H, K, V, count, use_h0, output_final_state,
                                  use_dht, gate):
    """Segments walked side by side and stitched by the scans give the single walk's results:
    output, final state and every gradient, dg included (its carry across segments)."""
    force_segments(monkeypatch, count)
    inp = make_inputs(B, T, H, K, V, gate=gate, use_h0=use_h0, seed=T + count)
    assert fused_chunk._segments(inp["q"], inp["v"], False)[0] > 1
    kw = dict(output_final_state=output_final_state, use_dht=use_dht)
    assert_fp32_close(fused(inp, head_first=head_first, **kw), reference(inp, **kw))


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("head_first", [True, False])
def test_segments_with_several_tiles(monkeypatch, head_first):
    """Segments on the program axis shared with the V-blocks, with 2 K-blocks and 2 V-blocks
    (the second one masked) in both kernels."""
    set_tile_caps(monkeypatch, ("fused_chunk_gla",), dict(BK=32, BV=32))
    force_segments(monkeypatch, 3)
    inp = make_inputs(2, 90, 1, 64, 48, seed=12)
    assert fused_chunk._segments(inp["q"], inp["v"], False)[0] == 3
    assert_fp32_close(fused(inp, head_first=head_first), reference(inp))


@pytest.mark.interpreter
def test_segments_fp16():
    """fp16 in, fp16 out under the default rule, which segments this shape on the CPU."""
    inp = make_inputs(1, 100, 1, 32, 32, dtype=torch.float16, seed=9)
    assert fused_chunk._segments(inp["q"], inp["v"], False)[0] > 1
    assert_fp32_close(fused(inp, head_first=False), reference(inp), tol=1e-2)


class _CountLaunches:
    """Stands in for a Triton kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.interpreter
@pytest.mark.parametrize("count,launches", [(1, 1), (3, 2)])
def test_one_segment_is_one_launch_each_way(monkeypatch, count, launches):
    """S = 1 is the plain walk; S > 1 adds exactly one state-only (forward) and one dh-only
    (backward) launch."""
    force_segments(monkeypatch, count)
    fwd = _CountLaunches(fused_chunk.fused_chunk_gla_fwd_kernel)
    bwd = _CountLaunches(fused_chunk.fused_chunk_gla_bwd_kernel)
    monkeypatch.setattr(fused_chunk, "fused_chunk_gla_fwd_kernel", fwd)
    monkeypatch.setattr(fused_chunk, "fused_chunk_gla_bwd_kernel", bwd)
    inp = make_inputs(1, 100, 1, 32, 32, seed=10)
    assert_fp32_close(fused(inp, head_first=False), reference(inp))
    assert (fwd.launches, bwd.launches) == (launches, launches)


def test_segment_count_rule(monkeypatch):
    """One segment for short sequences or when one walk fills the GPU, several for long ones,
    capped; the interpreter's rule segments the CPU tests' shapes."""
    cuda = torch.device("cuda")
    sms = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=sms))
    rule = fused_chunk.segment_count
    assert rule(100, 64, cuda) == 1
    assert rule(16 * (4 * fused_chunk.MIN_SEGMENT_CHUNKS - 1), 64, cuda) == 3
    assert rule(32768, 64, cuda) == fused_chunk.PROGRAMS_PER_SM * sms // 64 > 1
    assert rule(32768, 2 * fused_chunk.PROGRAMS_PER_SM * sms, cuda) == 1
    assert rule(32768, 1, cuda) == fused_chunk.MAX_SEGMENTS
    cpu = torch.device("cpu")
    assert rule(20, 2, cpu) == 1 and rule(100, 2, cpu) > 1


@pytest.mark.parametrize("T", [1, 15, 16, 17, 100, 160, 1000])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 64])
def test_segments_cover_every_chunk(monkeypatch, T, count):
    """At most `count` segments of whole chunks: none empty, the last one possibly shorter."""
    force_segments(monkeypatch, count)
    x = torch.empty(1, T, 1, 16)
    S, seg_chunks = fused_chunk._segments(x, x, False)
    chunks = -(-T // 16)
    assert 1 <= S <= count and (S - 1) * seg_chunks < chunks <= S * seg_chunks


def _bad_call_cases():
    B, T, H, K, V = 1, 20, 2, 16, 16
    good = dict(q=torch.randn(B, H, T, K), k=torch.randn(B, H, T, K), v=torch.randn(B, H, T, V),
                g=-torch.rand(B, H, T, K), initial_state=torch.randn(B, H, K, V))
    thd = {n: x.transpose(1, 2).contiguous() for n, x in good.items() if n != "initial_state"}
    return [
        pytest.param(dict(q=torch.randn(B, T, K)), {}, ValueError, r"^q must be 4-D", id="q-3d"),
        pytest.param(dict(k=torch.randn(B, H, T + 1, K)), {}, ValueError, r"^k must have shape", id="k-T"),
        pytest.param(dict(v=torch.randn(B, H, T - 1, V)), {}, ValueError, r"^v must have shape", id="v-T"),
        pytest.param(dict(g=torch.randn(B, H, T, K + 1)), {}, ValueError, r"^g must have shape", id="g-K"),
        pytest.param(dict(initial_state=torch.randn(B, H, V + 1, K)), {}, ValueError, r"^initial_state must",
                     id="h0-shape"),
        pytest.param({**thd, "initial_state": good["initial_state"]}, {}, ValueError, r"^initial_state must",
                     id="thd-tensors-with-head_first"),
        pytest.param(dict(k=good["k"].half()), {}, TypeError, r"share one dtype", id="k-dtype"),
        pytest.param(dict(q=good["q"].long()), {}, TypeError, r"^q must have dtype", id="q-int"),
        pytest.param({}, dict(scale=0.0), ValueError, r"^scale must", id="scale-zero"),
        pytest.param({}, dict(scale="1"), TypeError, r"^scale must", id="scale-str"),
        pytest.param({}, dict(head_first=1), TypeError, r"^head_first must", id="head_first-int"),
        pytest.param({}, dict(output_final_state=None), TypeError, r"^output_final_state must", id="ofs-none"),
    ], good


BAD_CASES, GOOD_ARGS = _bad_call_cases()


@pytest.mark.parametrize("tensors,options,error,match", BAD_CASES)
def test_bad_input_raises_naming_the_argument(tensors, options, error, match):
    args = {**GOOD_ARGS, **tensors}
    with pytest.raises(error, match=match):
        fused_chunk_gla(args["q"], args["k"], args["v"], args["g"], initial_state=args["initial_state"],
                        **options)


@pytest.mark.interpreter
def test_good_arguments_of_bad_input_cases_run():
    """The bad-input cases differ from a valid call only in the broken argument."""
    o, ht = fused_chunk_gla(GOOD_ARGS["q"], GOOD_ARGS["k"], GOOD_ARGS["v"], GOOD_ARGS["g"],
                            initial_state=GOOD_ARGS["initial_state"], output_final_state=True)
    assert o.shape == GOOD_ARGS["v"].shape and torch.isfinite(o).all() and torch.isfinite(ht).all()


# --------------------------------------------------------------------------------------
# GPU: real sizes, bf16. Errors are measured against the fp32 reference fed the same
# (rounded) inputs.


@pytest.mark.gpu
@pytest.mark.parametrize("head_first,dtype,T,K,V,gate", [
    pytest.param(False, torch.bfloat16, 8192, 128, 128, "logsigmoid", id="bf16-T8192"),
    pytest.param(True, torch.bfloat16, 1000, 128, 128, "strong", id="bf16-T1000-strong-hf"),
    pytest.param(False, torch.bfloat16, 777, 256, 256, "logsigmoid", id="bf16-T777-K256"),
    pytest.param(True, torch.float32, 8192, 128, 128, "logsigmoid", id="fp32-T8192-hf"),
    pytest.param(False, torch.float32, 1000, 128, 128, "strong", id="fp32-T1000-strong"),
    pytest.param(False, torch.bfloat16, 1000, 128, 128, "mixed", id="bf16-T1000-mixed"),
])
def test_gpu_matches_reference(head_first, dtype, T, K, V, gate):
    inp = make_inputs(1, T, 2, K, V, gate=gate, dtype=dtype, device="cuda", seed=11)
    got = fused(inp, head_first=head_first)
    ref = reference(inp)
    if dtype == torch.float32:
        assert_fp32_close(got, ref, tol=1e-4)
    else:
        assert_rms_close(got, ref, 1e-2)
