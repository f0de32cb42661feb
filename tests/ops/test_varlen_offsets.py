"""The host copy of cu_seqlens: read from the device once per tensor, shared by every op of a
batch, rebuilt after an in-place change; `cu_seqlens_cpu` replaces the read-back."""
from __future__ import annotations

import gc

import pytest
import torch

from cp_linattn import chunk_gla, chunk_kda
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.utils import _PACKED_OFFSETS, host_offsets, kernel_offsets, prepare_varlen_chunks
from tests.utils import random_qkvg


@pytest.fixture
def count_readbacks(monkeypatch):
    """Counts Tensor.cpu() calls (the device-to-host read of the offsets)."""
    calls = []
    original = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    return calls


def _gla_inputs(T, H=2, K=16, V=16, device="cpu", dtype=torch.float32):
    x = random_qkvg(torch.Generator().manual_seed(0), 1, T, H, K, V)
    return [x[n].to(device=device, dtype=dtype) for n in "qkvg"]


def test_read_back_once_per_tensor(count_readbacks):
    cu = torch.tensor([0, 30, 100])
    first = host_offsets(cu)
    assert host_offsets(cu) is first and len(count_readbacks) == 1
    tables = prepare_varlen_chunks(cu, first, 64)
    assert all(a is b for a, b in zip(prepare_varlen_chunks(cu, first, 64), tables))
    # an in-place change of the offsets is seen: new copy, new chunk tables
    cu.copy_(torch.tensor([0, 70, 100]))
    assert host_offsets(cu).tolist() == [0, 70, 100] and len(count_readbacks) == 2
    indices, offsets = prepare_varlen_chunks(cu, host_offsets(cu), 64)
    assert indices.tolist() == [[0, 0], [0, 1], [1, 0]] and offsets.tolist() == [0, 2, 3]


def test_given_cpu_copy_spares_the_read_back(count_readbacks):
    cu = torch.tensor([0, 30, 100])
    assert host_offsets(cu, torch.tensor([0, 30, 100])).tolist() == [0, 30, 100]
    assert not count_readbacks


def test_int32_offsets_are_converted_once(count_readbacks):
    """int32 offsets (and an int32 CPU copy): the int64 offsets the kernels read are made once per
    tensor and shared by every call (and so are their chunk tables), remade after an in-place change."""
    cu = torch.tensor([0, 30, 100], dtype=torch.int32)
    wide = kernel_offsets(cu, torch.tensor([0, 30, 100], dtype=torch.int32))
    assert wide.dtype == torch.int64 and wide.tolist() == [0, 30, 100] and not count_readbacks
    assert kernel_offsets(cu) is wide and host_offsets(cu).dtype == torch.int64
    assert kernel_offsets(torch.tensor([0, 30, 100])).dtype == torch.int64
    cu.copy_(torch.tensor([0, 70, 100]))
    assert kernel_offsets(cu).tolist() == [0, 70, 100]


def test_entry_goes_with_its_tensor():
    cu = torch.tensor([0, 30, 100])
    key = id(cu)
    host_offsets(cu)
    assert key in _PACKED_OFFSETS
    del cu
    gc.collect()
    assert key not in _PACKED_OFFSETS


@pytest.mark.interpreter
def test_ops_follow_an_in_place_change_of_the_offsets():
    """A stale host copy would run the second call with the first batch's sequence bounds."""
    q, k, v, g = _gla_inputs(100)
    cu = torch.tensor([0, 30, 100])
    chunk_gla(q, k, v, g, cu_seqlens=cu)
    cu.copy_(torch.tensor([0, 70, 100]))
    o, _ = chunk_gla(q, k, v, g, cu_seqlens=cu)
    ref, _ = naive_recurrent_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 70, 100]))
    assert torch.allclose(o, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
@pytest.mark.slow
def test_cu_seqlens_cpu_gives_the_same_result(count_readbacks):
    q, k, v, g = _gla_inputs(100)
    beta = torch.rand(1, 100, 2)
    cu = torch.tensor([0, 30, 100])
    ref, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu.clone())
    n = len(count_readbacks)
    o, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 30, 100]))
    assert torch.equal(o, ref) and len(count_readbacks) == n


def test_cu_seqlens_cpu_is_checked_against_offsets_on_the_cpu():
    """On the CPU the check is free, so a wrong copy fails even before any read-back."""
    q, k, v, g = _gla_inputs(100)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must hold the values of cu_seqlens \[0, 30, 100\], "
                                         r"got \[0, 40, 100\]"):
        chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 30, 100]), cu_seqlens_cpu=torch.tensor([0, 40, 100]))


@pytest.mark.parametrize(
    "cpu_copy, exc, match",
    [
        (torch.tensor([0, 40, 100]), ValueError, r"cu_seqlens_cpu must hold the values of cu_seqlens \[0, 30, 100\]"),
        (torch.tensor([0.0, 30.0, 100.0]), ValueError, r"cu_seqlens_cpu must be an int32 or int64 CPU tensor"),
        (torch.tensor([0, 100]), ValueError,
         r"cu_seqlens_cpu must be an int32 or int64 CPU tensor of cu_seqlens' shape \[3\]"),
        ([0, 30, 100], TypeError, r"cu_seqlens_cpu must be a torch.Tensor, got list"),
    ],
)
def test_bad_cu_seqlens_cpu(cpu_copy, exc, match):
    q, k, v, g = _gla_inputs(100)
    cu = torch.tensor([0, 30, 100])
    host_offsets(cu)
    with pytest.raises(exc, match=match):
        chunk_gla(q, k, v, g, cu_seqlens=cu, cu_seqlens_cpu=cpu_copy)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gla", "kda"])
def test_gpu_varlen_steps_never_wait_for_the_device(op):
    """After the first call on a batch, forward and backward of a varlen call never
    synchronise with the device (torch raises on any synchronising call in this mode)."""
    q, k, v, g = (x.requires_grad_() for x in _gla_inputs(1000, K=64, V=64, device="cuda", dtype=torch.bfloat16))
    beta = torch.rand(1, 1000, 2, device="cuda", dtype=torch.bfloat16).requires_grad_()
    cu = torch.tensor([0, 300, 301, 1000], device="cuda")

    def step():
        if op == "gla":
            o, _ = chunk_gla(q, k, v, g, cu_seqlens=cu)
        else:
            o, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        o.sum().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.interpreter
def test_inference_mode_offsets_are_read_each_call():
    """Inference tensors carry no version counter: nothing is cached for them, every call reads them."""
    q, k, v, g = _gla_inputs(100)
    with torch.inference_mode():
        cu = torch.tensor([0, 30, 100])
        o, _ = chunk_gla(q, k, v, g, cu_seqlens=cu)
        assert id(cu) not in _PACKED_OFFSETS
    ref, _ = naive_recurrent_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 30, 100]))
    assert torch.allclose(o, ref, rtol=1e-4, atol=1e-4)


def _strided(values: list[int], how: str) -> torch.Tensor:
    """The offsets as a non-contiguous view: a column of a 2-D tensor, or every other entry."""
    if how == "column":
        return torch.tensor([[v, -1] for v in values])[:, 0]
    return torch.tensor([x for v in values for x in (v, 10 ** 6)])[::2]


@pytest.mark.interpreter
@pytest.mark.parametrize("how", ["column", "step"])
@pytest.mark.parametrize("op", ["chunk_gla", pytest.param("chunk_kda", marks=pytest.mark.slow), "GatedLinearAttention",
                                pytest.param("KimiDeltaAttention", marks=pytest.mark.slow)])
def test_strided_offsets_read_through_their_strides(op, how):
    """A strided view of the offsets (and of their CPU copy) gives the contiguous offsets'
    result exactly; read as contiguous memory it ran out of bounds (corrupt heap, segfault)."""
    from cp_linattn.layers import GatedLinearAttention, KimiDeltaAttention

    values = [0, 30, 61, 150]
    cu = _strided(values, how)
    assert not cu.is_contiguous()
    q, k, v, g = _gla_inputs(150)
    if op.startswith("chunk"):
        beta = torch.rand(1, 150, 2, generator=torch.Generator().manual_seed(1))
        run = (lambda **kw: chunk_gla(q, k, v, g, output_final_state=True, **kw)) if op == "chunk_gla" else \
            (lambda **kw: chunk_kda(q, k, v, g, beta, output_final_state=True, **kw))
    else:
        torch.manual_seed(0)
        layer = (GatedLinearAttention if op == "GatedLinearAttention" else KimiDeltaAttention)(32, 2, 16, 16)
        x = torch.randn(1, 150, 32)
        run = lambda **kw: (layer(x, cu_seqlens=kw["cu_seqlens"]), None)  # noqa: E731
    want = run(cu_seqlens=torch.tensor(values))
    variants = [dict(cu_seqlens=cu)]
    if op.startswith("chunk"):  # the layers take no cu_seqlens_cpu
        variants.append(dict(cu_seqlens=torch.tensor(values), cu_seqlens_cpu=_strided(values, how)))
    for kw in variants:
        got = run(**kw)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["chunk_gla", pytest.param("chunk_kda", marks=pytest.mark.slow)])
@pytest.mark.parametrize("write", ["data", "reused buffer"])
def test_writes_that_bypass_the_version_counter_are_seen(op, write):
    """`cu.data[...] = ...` (or a buffer refilled through `.data`) leaves the version counter
    as it was; a CPU cu_seqlens is compared with the cached copy on every call, so the second
    call runs with the new offsets (a stale copy gave final states off by 1.4 and gradients
    up to 1e37), forward and backward."""
    from cp_linattn.ops.kda.naive import naive_recurrent_kda

    q, k, v, g = _gla_inputs(100)
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(1, 100, 2, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 30, 100])

    def run(fn, offsets):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
        args = (*leaves, beta) if op == "chunk_kda" else leaves
        o, ht = fn(*args, output_final_state=True, cu_seqlens=offsets)
        (o.square().sum() + ht.square().sum()).backward()
        return o, ht, *(x.grad for x in leaves)

    fn = chunk_gla if op == "chunk_gla" else chunk_kda
    ref = naive_recurrent_gla if op == "chunk_gla" else naive_recurrent_kda
    run(fn, cu)
    if write == "data":
        cu.data[1] = 70
    else:
        cu.data.copy_(torch.tensor([0, 70, 100]))
    got = run(fn, cu)
    want = run(ref, torch.tensor([0, 70, 100]))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
