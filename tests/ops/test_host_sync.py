"""No host synchronisation: with `cu_seqlens_cpu` given (or no cu_seqlens), a forward and
backward of chunk_gla / chunk_kda never reads device data on the host.

CPU (interpreter): every tensor that would live on the GPU (the inputs, cu_seqlens, and every
tensor a kernel touches) is tracked through torch's dispatcher, and any op that hands its data
to the host (`.item()`, `int()`, `bool()`, `torch.equal`, `.tolist()`, `.cpu()`) or whose output
shape depends on its data (`nonzero`, boolean indexing, ...) is recorded: on a GPU each of them
is a device-to-host wait. GPU: the same calls under `torch.cuda.set_sync_debug_mode("error")`,
and captured in a CUDA graph, replayed on new inputs and compared with eager calls.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import triton.runtime.interpreter as triton_interpreter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cp_linattn import chunk_gla, chunk_kda
from tests.utils import kda_inputs

aten = torch.ops.aten
# ops whose output shape depends on tensor data: a host wait on a GPU
DATA_DEPENDENT_SHAPE = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                        aten.unique_consecutive.default, aten.unique_dim.default, aten.repeat_interleave.Tensor}
BOOL_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostReads(TorchDispatchMode):
    """Records the host reads of "device" data during a call, on CPU tensors.

    Device data: the storages of `device_tensors`, of every tensor passed to a Triton kernel
    launch, and of every op output computed from device data; any other output (a factory,
    or computed from host data only, such as cu_seqlens_cpu) is host data. `reads` lists
    (what read it, the innermost cp_linattn frame)."""

    def __init__(self, device_tensors):
        super().__init__()
        self.device: set[int] = set()
        self.reads: list[tuple[str, str]] = []
        self.in_kernel = False
        for t in device_tensors:
            self._mark(t, True)

    def _mark(self, t: torch.Tensor, on_device: bool) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            (self.device.add if on_device else self.device.discard)(ptr)

    def on_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.device

    def record(self, what: str) -> None:
        if self.in_kernel:  # the interpreter reading a kernel's arguments runs where a GPU runs the kernel
            return
        ours = [f for f in traceback.extract_stack() if "cp_linattn" in f.filename]
        self.reads.append((what, f"{ours[-1].name} ({ours[-1].filename.split('cp_linattn')[-1]}:{ours[-1].lineno})"
                           if ours else "outside cp_linattn"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_kernel:  # the interpreter's host copies of the kernel's arguments: not ours
            return func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_device = any(self.on_device(t) for t in inputs)
        bool_index = func in BOOL_INDEXING and any(t.dtype == torch.bool for t in inputs[1:])
        if from_device and (func in DATA_DEPENDENT_SHAPE or bool_index):
            self.record(str(func))
        out = func(*args, **kwargs)
        leaves = tree_leaves(out)
        if from_device and any(not isinstance(x, torch.Tensor) and x is not None for x in leaves):
            self.record(str(func))  # a Python number / bool made of device data
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._mark(t, from_device)
        return out


@pytest.fixture
def host_reads(monkeypatch):
    """Makes `HostReads(device_tensors)` modes that also see kernel launches and the Tensor
    methods that read data without the dispatcher (tolist, numpy, cpu)."""
    modes: list[HostReads] = []
    launch = triton_interpreter.GridExecutor.__call__

    def kernel_launch(self, *args, **kwargs):
        mode = modes[-1]
        mode.in_kernel = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.in_kernel = False
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    mode._mark(t, True)  # every kernel argument lives on the device

    monkeypatch.setattr(triton_interpreter.GridExecutor, "__call__", kernel_launch)
    for name in ("tolist", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def reader(self, *args, _original=original, _name=name, **kwargs):
            if modes and modes[-1].on_device(self):
                modes[-1].record(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, reader)

    def make(device_tensors) -> HostReads:
        modes.append(HostReads(device_tensors))
        return modes[-1]

    return make


# On the CPU, host_offsets compares a CPU cu_seqlens with its copy (free there); for device
# offsets that branch is skipped, so it is no host read on a GPU.
CPU_ONLY_CHECK = ("aten.equal.default", "host_offsets")


def _fwd_bwd(op: str, inp: dict, offsets: str):
    """One forward and backward of `op` over every option the path has (initial and final
    state; for KDA l2norm, the in-kernel gate, beta from logits, GVA), on a varlen batch with
    cu_seqlens_cpu ("varlen" int64, "varlen32" int32) or a dense one ("dense")."""
    kw = {}
    if offsets != "dense":
        dtype = torch.int32 if offsets == "varlen32" else torch.int64
        kw = dict(cu_seqlens=inp["cu"], cu_seqlens_cpu=torch.tensor(inp["cu_list"], dtype=dtype))
    leaves = {n: inp[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "h0")}
    if op == "gla":
        o, ht = chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], initial_state=leaves["h0"],
                          output_final_state=True, **kw)
    else:
        leaves.update({n: inp[n].clone().requires_grad_() for n in ("beta", "A_log", "dt_bias")})
        o, ht = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                          initial_state=leaves["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                          A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], **kw)
    loss = (o.float() * inp["do"]).sum() + (ht * inp["dht"]).sum()
    return (o, ht, *torch.autograd.grad(loss, list(leaves.values())))


def _inputs(op: str, offsets: str, T: int, H: int, K: int, device="cpu", dtype=torch.float32, seed=0) -> dict:
    """Inputs of `_fwd_bwd`: GLA with H heads, KDA with 2H value heads (GVA)."""
    cu_list = [0, T // 3, T // 3 + 1, T] if offsets != "dense" else None
    N = None if cu_list is None else len(cu_list) - 1
    HV = H if op == "gla" else 2 * H
    inp = kda_inputs(T=T, H=H, HV=HV, K=K, V=K, N=N, gate="log" if op == "gla" else "raw", seed=seed,
                     device=device, dtype=dtype)
    inp["beta"] = inp["beta"] * 4 - 2  # logits
    B = inp["q"].shape[0]
    gen = torch.Generator().manual_seed(seed + 1)
    inp["do"] = torch.randn(B, T, HV, K, generator=gen).to(device)
    inp["dht"] = torch.randn(*inp["h0"].shape, generator=gen).to(device)
    inp["cu_list"] = cu_list
    inp["cu"] = None if cu_list is None else torch.tensor(cu_list, device=device, dtype=torch.int32
                                                          if offsets == "varlen32" else torch.int64)
    return inp


@pytest.mark.interpreter
@pytest.mark.parametrize("op, offsets", [("gla", "varlen"), ("gla", "dense"), ("kda", "varlen32"),
                                         pytest.param("kda", "dense", marks=pytest.mark.slow)])
def test_no_host_read_of_device_data(host_reads, op, offsets):
    """A first call (no warm-up: the host tables come from cu_seqlens_cpu) reads no device
    data on the host, forward or backward."""
    inp = _inputs(op, offsets, T=90, H=1, K=16)
    device = [x for n, x in inp.items() if isinstance(x, torch.Tensor) and n != "cu_list"]
    with host_reads(device) as mode:
        _fwd_bwd(op, inp, offsets)
    reads = [r for r in mode.reads if (r[0], r[1].split(" ")[0]) != CPU_ONLY_CHECK]
    assert not reads, reads


@pytest.mark.interpreter
def test_host_reads_are_seen(host_reads):
    """The check is not vacuous: without cu_seqlens_cpu the one read-back of cu_seqlens (and
    its checks) is recorded, as is an `.item()` of a kernel's output."""
    inp = _inputs("gla", "varlen", T=90, H=1, K=16)
    q, k, v, g = (inp[n] for n in "qkvg")
    with host_reads([q, k, v, g, inp["cu"]]) as mode:
        o, _ = chunk_gla(q, k, v, g, cu_seqlens=inp["cu"])
        assert ("Tensor.cpu", "_packed_offsets") in [(r[0], r[1].split(" ")[0]) for r in mode.reads], mode.reads
        n = len(mode.reads)
        o[0, 0, 0, 0].item()
    assert len(mode.reads) == n + 1 and mode.reads[-1][0] == "aten._local_scalar_dense.default"


# ------------------------------------------------------------------------------------------
# GPU: the device's own checks.

GPU_CASES = [("gla", "varlen"), ("gla", "dense"), ("kda", "varlen32"), ("kda", "varlen"), ("kda", "dense")]


@pytest.mark.gpu
@pytest.mark.parametrize("op, offsets", GPU_CASES)
def test_gpu_fwd_bwd_never_synchronises(op, offsets):
    """torch raises on any synchronising CUDA call in this mode (after one warm-up call, which
    compiles the kernels)."""
    inp = _inputs(op, offsets, T=1000, H=2, K=128, device="cuda", dtype=torch.bfloat16)
    _fwd_bwd(op, inp, offsets)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(op, inp, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("op, offsets", GPU_CASES)
def test_gpu_cuda_graph_capture_and_replay(op, offsets):
    """Forward and backward captured in a CUDA graph on static inputs (cu_seqlens and its CPU
    copy kept); new inputs copied in and replayed give the eager call's outputs and gradients."""
    static = _inputs(op, offsets, T=1000, H=2, K=128, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compiles, builds the cached chunk tables
        for _ in range(2):
            _fwd_bwd(op, static, offsets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _fwd_bwd(op, static, offsets)
    fresh = _inputs(op, offsets, T=1000, H=2, K=128, device="cuda", dtype=torch.bfloat16, seed=7)
    for name, x in fresh.items():
        if isinstance(x, torch.Tensor) and name != "cu":
            static[name].copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    eager = _fwd_bwd(op, fresh, offsets)
    assert len(captured) == len(eager)
    for i, (a, b) in enumerate(zip(captured, eager)):
        assert torch.equal(a, b), f"output {i}: replay differs from eager by {(a.float() - b.float()).abs().max()}"
