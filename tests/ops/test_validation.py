import pytest
import torch

from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.kda.naive import naive_recurrent_kda
from cp_linattn.ops.utils import (
    check_cu_seqlens, check_inputs, check_scale, prepare_chunk_indices, prepare_chunk_offsets, prepare_varlen_chunks,
)


def _qkvg(B=1, T=10, H=2, K=4, V=3, HV=None):
    HV = H if HV is None else HV
    return (torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, HV, V), -torch.rand(B, T, HV, K))


def test_valid_inputs_report_dims():
    q, k, v, g = _qkvg(HV=4)
    dims = check_inputs(q, k, v, g, torch.rand(1, 10, 4), allow_gva=True, cu_seqlens=torch.tensor([0, 3, 10]))
    assert (dims.B, dims.T, dims.H, dims.HV, dims.K, dims.V, dims.N) == (1, 10, 2, 4, 4, 3, 2)
    assert dims.cu_seqlens_cpu.tolist() == [0, 3, 10]


@pytest.mark.parametrize(
    "mutate, exc, pattern",
    [
        (lambda a: a.update(q=a["q"].tolist()), TypeError, r"q must be a torch.Tensor, got list"),
        (lambda a: a.update(q=a["q"][0]), ValueError, r"q must be 4-D, got 3-D"),
        (lambda a: a.update(q=a["q"].long()), TypeError, r"q must have dtype in .*got int64"),
        (lambda a: a.update(k=a["k"][:, :9]), ValueError, r"k must have shape \[1, 10, 2, 4\], got \[1, 9, 2, 4\]"),
        (lambda a: a.update(v=a["v"][:, :9]), ValueError, r"v must have shape \[1, 10, HV, V\]"),
        (lambda a: a.update(v=torch.randn(1, 10, 3, 3)), ValueError, r"v must have H=2 heads like q, got 3"),
        (lambda a: a.update(v=a["v"].half()), TypeError, r"q, k and v must share one dtype"),
        (lambda a: a.update(g=a["g"][..., :3]), ValueError, r"g must have shape \[1, 10, 2, 4\], got \[1, 10, 2, 3\]"),
        (lambda a: a.update(initial_state=torch.zeros(2, 2, 4, 3)), ValueError,
         r"initial_state must have shape \[1, 2, 4, 3\], got \[2, 2, 4, 3\]"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int16)), TypeError,
         r"cu_seqlens must have dtype int32 or int64, got int16"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0.0, 3.0, 10.0])), TypeError,
         r"cu_seqlens must have dtype int32 or int64, got float32"),
        (lambda a: a.update(cu_seqlens=torch.tensor([[0, 10]])), ValueError, r"cu_seqlens must be 1-D"),
        (lambda a: a.update(cu_seqlens=torch.tensor([1, 10])), ValueError, r"cu_seqlens must start at 0, got 1"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 6, 4, 10])), ValueError, r"cu_seqlens must be non-decreasing"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 9])), ValueError, r"cu_seqlens must end at T=10 \(the packed length\), got 9"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 10]).tolist()), TypeError, r"cu_seqlens must be a torch.Tensor"),
        (lambda a: a.update(scale=-1.0), ValueError, r"scale must be a positive finite number, got -1.0"),
        (lambda a: a.update(scale="x"), TypeError, r"scale must be a float or None, got str"),
    ],
)
def test_gla_bad_input_names_the_argument(mutate, exc, pattern):
    q, k, v, g = _qkvg()
    args = dict(q=q, k=k, v=v, g=g)
    mutate(args)
    with pytest.raises(exc, match=pattern):
        naive_recurrent_gla(**args)


def test_cu_seqlens_requires_batch_one():
    with pytest.raises(ValueError, match=r"batch size must be 1.*got B=2"):
        check_cu_seqlens(torch.tensor([0, 10]), batch_size=2, seq_len=10, device=torch.device("cpu"))


def test_cu_seqlens_device_mismatch():
    with pytest.raises(ValueError, match=r"cu_seqlens must be on device meta"):
        check_cu_seqlens(torch.tensor([0, 10]), batch_size=1, seq_len=10, device=torch.device("meta"))


def test_tensor_device_mismatch():
    q, k, v, g = _qkvg()
    with pytest.raises(ValueError, match=r"k must be on device cpu \(the device of q\), got meta"):
        check_inputs(q, k.to("meta"), v, g)


def test_kda_bad_input():
    q, k, v, g = _qkvg(HV=4)
    beta = torch.rand(1, 10, 4)
    with pytest.raises(ValueError, match=r"HV=3 \(v.shape\[2\]\) must be a multiple of H=2"):
        naive_recurrent_kda(q, k, torch.randn(1, 10, 3, 3), -torch.rand(1, 10, 3, 4), torch.rand(1, 10, 3))
    with pytest.raises(ValueError, match=r"beta must have shape \[1, 10, 4\], got \[1, 10, 2\]"):
        naive_recurrent_kda(q, k, v, g, beta[..., :2])
    with pytest.raises(ValueError, match=r"initial_state must have shape \[1, 4, 3, 4\]"):
        naive_recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 4, 4, 3), state_v_first=True)


def test_scale_default():
    assert check_scale(None, 16) == 0.25
    assert check_scale(2, 16) == 2.0


def test_chunk_bookkeeping():
    cu = torch.tensor([0, 3, 3, 70, 200])
    assert prepare_chunk_offsets(cu, 64).tolist() == [0, 1, 1, 3, 6]
    idx = prepare_chunk_indices(cu, 64)
    assert idx.dtype == torch.int32
    assert idx.tolist() == [[0, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]


def test_varlen_chunks_from_the_host_copy():
    """The ops build their chunk tables from the CPU copy of the offsets (no device read-back)."""
    cu = torch.tensor([0, 3, 3, 70, 200])
    indices, offsets = prepare_varlen_chunks(cu, cu.clone(), 64)
    assert torch.equal(indices, prepare_chunk_indices(cu, 64)) and indices.dtype == torch.int32
    assert torch.equal(offsets, prepare_chunk_offsets(cu, 64))


def test_cu_seqlens_checked_on_the_given_cpu_copy():
    cu = torch.tensor([0, 5, 10])
    assert check_cu_seqlens(cu, batch_size=1, seq_len=10, device=cu.device, cpu_copy=cu.clone()).tolist() == [0, 5, 10]
    with pytest.raises(ValueError, match="must end at T=10"):
        check_cu_seqlens(torch.tensor([0, 5, 9]), batch_size=1, seq_len=10, device=cu.device,
                         cpu_copy=torch.tensor([0, 5, 9]))
    # offsets on the CPU cost nothing to compare with their copy
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must hold the values of cu_seqlens \[0, 5, 10\], got \[0, 5, 9\]"):
        check_cu_seqlens(torch.tensor([0, 5, 10]), batch_size=1, seq_len=10, device=cu.device,
                         cpu_copy=torch.tensor([0, 5, 9]))


@pytest.mark.parametrize("op", ["chunk_gla", "fused_chunk_gla", "chunk_kda"])
def test_bf16_on_the_cpu_is_refused_not_garbage(op):
    """On the CPU the kernels run in Triton's interpreter, whose bf16 dots are wrong: the ops
    refuse bf16 there, naming the dtype; the torch references still take it."""
    import cp_linattn

    q, k, v, g = (x.bfloat16() for x in _qkvg())
    args = (q, k, v, g, torch.rand(*q.shape[:3]).bfloat16()) if op == "chunk_kda" else (q, k, v, g)
    with pytest.raises(TypeError, match=r"bfloat16 need a CUDA device"):
        getattr(cp_linattn, op)(*args)
    o, _ = naive_recurrent_gla(q, k, v, g)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()


def _op_call(op: str, **kw):
    """A small call of one public op with grad-requiring inputs; returns (o, final state, leaves)."""
    import cp_linattn

    q, k, v, g = (x.requires_grad_() for x in _qkvg(T=70, K=16, V=16))
    if op == "fused_chunk_gla":
        kw.setdefault("head_first", False)
        return (*cp_linattn.fused_chunk_gla(q, k, v, g, **kw), (q, k, v, g))
    if op == "chunk_kda":
        return (*cp_linattn.chunk_kda(q, k, v, g, torch.rand(1, 70, 2), **kw), (q, k, v, g))
    return (*cp_linattn.chunk_gla(q, k, v, g, **kw), (q, k, v, g))


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["chunk_gla", "fused_chunk_gla", pytest.param("chunk_kda", marks=pytest.mark.slow)])
def test_second_order_gradients_raise_instead_of_dropping_terms(op):
    """With create_graph=True the first-order gradients carried no graph: a gradient penalty's
    own gradient silently missed every second-order term. Now the call says so; first-order
    gradients are unchanged."""
    o, _, (q, *_) = _op_call(op)
    with pytest.raises(RuntimeError, match=rf"{op} does not support second-order gradients.*create_graph"):
        torch.autograd.grad(o.square().sum(), q, create_graph=True)
    o, _, (q, *_) = _op_call(op)
    (dq,) = torch.autograd.grad(o.square().sum(), q)
    assert dq.grad_fn is None and torch.isfinite(dq).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["chunk_gla", "fused_chunk_gla", pytest.param("chunk_kda", marks=pytest.mark.slow)])
def test_float64_initial_state_is_accepted_with_its_gradient(op):
    """The docstrings promise any float dtype for initial_state (read in fp32); float64 was refused."""
    h0 = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    torch.manual_seed(0)
    leaf = h0.clone().requires_grad_()
    o, ht, _ = _op_call(op, initial_state=leaf, output_final_state=True)
    (o.sum() + ht.sum()).backward()
    torch.manual_seed(0)
    leaf32 = h0.float().requires_grad_()
    o32, ht32, _ = _op_call(op, initial_state=leaf32, output_final_state=True)
    (o32.sum() + ht32.sum()).backward()
    assert leaf.grad.dtype == torch.float64 and torch.equal(leaf.grad.float(), leaf32.grad)
    assert torch.equal(o, o32) and torch.equal(ht, ht32)


@pytest.mark.parametrize("op", ["chunk_gla", "fused_chunk_gla", "chunk_kda"])
@pytest.mark.parametrize("value", [1, "yes", None, torch.tensor(True)])
def test_flags_take_one_rule_a_bool(op, value):
    """One rule for every op: an on/off argument is a bool (fused_chunk_gla refused what the
    others silently took as truthy)."""
    with pytest.raises(TypeError, match=r"output_final_state must be a bool, got"):
        _op_call(op, output_final_state=value)


def test_kda_missing_beta_and_zero_heads_name_the_argument():
    from cp_linattn import chunk_kda

    q, k, v, g = _qkvg(T=20)
    with pytest.raises(TypeError, match=r"beta must be a torch.Tensor of shape \[B, T, HV\].*got NoneType"):
        chunk_kda(q, k, v, g, None)
    with pytest.raises(ValueError, match=r"q must have at least one head, got H=0"):
        chunk_kda(*(x[:, :, :0] for x in (q, k, v, g)), torch.rand(1, 20, 0))


@pytest.mark.interpreter
def test_fused_chunk_gla_layout_proven_wrong_by_the_initial_state():
    """head_first=True (the default) reads [B, T, H, K] tensors with T and H swapped; an
    initial_state with the heads of the other layout proves it and raises, naming head_first."""
    from cp_linattn import fused_chunk_gla

    q, k, v, g = _qkvg(T=20, H=2, K=16, V=16)  # [B, T, H, K]
    with pytest.raises(ValueError, match=r"initial_state must have 20 heads .*got 2, .*pass head_first=False"):
        fused_chunk_gla(q, k, v, g, initial_state=torch.zeros(1, 2, 16, 16))
    o, _ = fused_chunk_gla(q, k, v, g, initial_state=torch.zeros(1, 2, 16, 16), head_first=False)
    ref, _ = naive_recurrent_gla(q, k, v, g, initial_state=torch.zeros(1, 2, 16, 16))
    assert torch.allclose(o, ref, rtol=1e-4, atol=1e-4)
