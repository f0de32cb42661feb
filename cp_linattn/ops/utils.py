"""Input validation and varlen bookkeeping shared by every public op.

Every public op validates its arguments here *before* launching a kernel or joining a
collective, so a bad call fails with a message that names the argument, the expected
value and the actual one, identically on every rank.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field, fields

import torch

from cp_linattn.ops.common.index import prepare_chunk_indices, prepare_chunk_offsets

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# varlen offsets: FLA's own tests pass int32; the kernels and host tables use int64 (`kernel_offsets`)
OFFSET_DTYPES = (torch.int32, torch.int64)
# recurrent states are read in fp32, so any float dtype, float64 included, is accepted for them
STATE_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    x,
    *,
    ndim: int | None = None,
    shape: tuple | None = None,
    dtypes: tuple[torch.dtype, ...] | None = FLOAT_DTYPES,
    device: torch.device | None = None,
) -> None:
    """Raise TypeError/ValueError unless `x` is a tensor of the given rank, shape, dtype, device.

    `shape` entries may be None to accept any size along that dimension.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {x.dim()}-D with shape {_fmt_shape(x.shape)}")
    if shape is not None:
        want = _fmt_shape("*" if s is None else s for s in shape)
        if x.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, x.shape)):
            raise ValueError(f"{name} must have shape {want}, got {_fmt_shape(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on device {device} (the device of q), got {x.device}")


@dataclass
class _PackedOffsets:
    """What every op of one packed batch shares: the host copy of its offsets and its chunk tables."""

    ref: weakref.ref
    version: int
    cpu: torch.Tensor  # a contiguous int64 copy, never an alias of the caller's buffer
    chunk_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kernel_offsets: torch.Tensor | None = None  # contiguous int64 on the device, for int32 / strided offsets


# Keyed by id(cu_seqlens); an entry goes with its tensor (weakref callback). It is used only while
# provably current: same tensor, same version counter, and the same values wherever those are
# known without waiting for the device (a CPU cu_seqlens, or a cu_seqlens_cpu passed with it).
_PACKED_OFFSETS: dict[int, _PackedOffsets] = {}


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous int64 copy of a CPU tensor's values (a strided view is read through its strides)."""
    return x.detach().to(torch.int64).clone(memory_format=torch.contiguous_format)


def _packed_offsets(cu_seqlens: torch.Tensor, cpu_copy: torch.Tensor | None) -> _PackedOffsets | None:
    """The cache entry of `cu_seqlens`, made on first use from `cpu_copy` or, without one, from
    one device read-back: so a model's layers, forward and backward, wait for the device at most
    once per batch, not once per op. None for inference tensors (no version counter).

    The values known without waiting for the device (`cpu_copy`, or a CPU cu_seqlens itself)
    are compared with the entry on every call (N + 1 integers), so a write that bypasses the
    version counter (`cu.data[...] = ...`, a reused buffer) is seen and the entry rebuilt."""
    try:
        version = cu_seqlens._version
    except RuntimeError:
        return None
    known = cpu_copy if cpu_copy is not None else cu_seqlens if cu_seqlens.device.type == "cpu" else None
    key = id(cu_seqlens)
    entry = _PACKED_OFFSETS.get(key)
    if (entry is not None and entry.ref() is cu_seqlens and entry.version == version
            and (known is None or torch.equal(known, entry.cpu))):
        return entry
    # .cpu() of a device tensor is a host sync, once per tensor and version
    cpu = _contiguous_copy(cpu_copy if cpu_copy is not None else cu_seqlens.cpu())
    entry = _PackedOffsets(weakref.ref(cu_seqlens, lambda _, key=key: _PACKED_OFFSETS.pop(key, None)), version, cpu)
    _PACKED_OFFSETS[key] = entry
    return entry


def host_offsets(cu_seqlens: torch.Tensor, cpu_copy: torch.Tensor | None = None) -> torch.Tensor:
    """The values of `cu_seqlens` on the CPU (contiguous int64; do not modify), read back from its
    device once per tensor (and after each in-place change), not on every call. `cpu_copy`: the
    same values already on the CPU; it replaces the read-back (and is checked against
    cu_seqlens when that is on the CPU: a free check).

    In-place changes of a device tensor are seen through its version counter; writes that
    bypass it (through `.data`) cannot be seen without waiting for the device: give such
    offsets as a new tensor each time, or pass `cpu_copy` with the new values."""
    if cpu_copy is not None and cu_seqlens.device.type == "cpu" and not torch.equal(cpu_copy, cu_seqlens):
        _mismatch(cu_seqlens, cpu_copy)
    entry = _packed_offsets(cu_seqlens, cpu_copy)
    if entry is None:  # an inference tensor: without cpu_copy, a host sync on every call (nothing to cache by)
        return _contiguous_copy(cu_seqlens.cpu() if cpu_copy is None else cpu_copy)
    return entry.cpu


def kernel_offsets(cu_seqlens: torch.Tensor, cpu_copy: torch.Tensor | None = None) -> torch.Tensor:
    """`cu_seqlens` as the kernels and the chunk tables read it: contiguous int64 on its device.
    An int32 (or strided) tensor is converted on the device once per tensor and version (its
    `host_offsets` entry keeps the copy, so the ops of one batch share it and its chunk
    tables); no host read. Inference tensors (no version counter) are converted per call."""
    if cu_seqlens.dtype == torch.int64 and cu_seqlens.is_contiguous():
        return cu_seqlens
    entry = _packed_offsets(cu_seqlens, cpu_copy)
    if entry is None:
        return cu_seqlens.to(torch.int64).contiguous()
    if entry.kernel_offsets is None:
        entry.kernel_offsets = cu_seqlens.to(torch.int64).contiguous()
    return entry.kernel_offsets


def _mismatch(values: torch.Tensor, cpu_copy: torch.Tensor):
    raise ValueError(f"cu_seqlens_cpu must hold the values of cu_seqlens {values.tolist()}, got {cpu_copy.tolist()}")


def check_cu_seqlens(cu_seqlens, *, batch_size: int, seq_len: int, device: torch.device,
                     cpu_copy: torch.Tensor | None = None) -> torch.Tensor:
    """Validate packed-varlen offsets and return them as a CPU int64 tensor.

    cu_seqlens: int32 or int64 `[N + 1]`, starting at 0, non-decreasing, ending at T; requires B == 1.
    cpu_copy: the same offsets already on the CPU (the `cu_seqlens_cpu` argument of the ops, or
    a CP context's copy; int32 or int64), read instead of copying cu_seqlens back, which would
    wait for the device. Without it the copy is read back once per cu_seqlens tensor (`host_offsets`).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in OFFSET_DTYPES:
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {str(cu_seqlens.dtype).replace('torch.', '')}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {_fmt_shape(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on device {device} (the device of q), got {cu_seqlens.device}")
    if batch_size != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (a packed batch), got B={batch_size}")
    if cpu_copy is not None:
        if not isinstance(cpu_copy, torch.Tensor):
            raise TypeError(f"cu_seqlens_cpu must be a torch.Tensor, got {type(cpu_copy).__name__}")
        if cpu_copy.device.type != "cpu" or cpu_copy.dtype not in OFFSET_DTYPES or cpu_copy.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must be an int32 or int64 CPU tensor of cu_seqlens' shape "
                             f"{_fmt_shape(cu_seqlens.shape)}, got {_fmt_shape(cpu_copy.shape)} "
                             f"{str(cpu_copy.dtype).replace('torch.', '')} on {cpu_copy.device}")
    cpu = host_offsets(cu_seqlens, cpu_copy)
    if int(cpu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cpu[0])}")
    if bool((cpu[1:] < cpu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cpu.tolist()}")
    if int(cpu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens must end at T={seq_len} (the packed length), got {int(cpu[-1])}")
    return cpu


def check_scale(scale, head_dim: int) -> float:
    """Default scale is K ** -0.5; an explicit scale must be a positive finite number."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


@dataclass(frozen=True)
class Dims:
    """Sizes of a validated call: q/k `[B, T, H, K]`, v `[B, T, HV, V]`, N sequences."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    cu_seqlens: torch.Tensor | None  # contiguous int64, as the kernels index it (`kernel_offsets`)
    cu_seqlens_cpu: torch.Tensor | None  # int64


def check_inputs(
    q,
    k,
    v,
    g,
    beta=None,
    *,
    initial_state=None,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    allow_gva: bool = False,
    state_v_first: bool = False,
    g_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    num_states: int | None = None,
) -> Dims:
    """Validate the inputs of a gated linear-attention op.

    q, k: `[B, T, H, K]`; v: `[B, T, HV, V]`; g: `[B, T, HV, K]`; beta (KDA): `[B, T, HV]`;
    initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), any float dtype,
    N = `num_states` if given (under CP: the global sequence count), else the call's own.
    HV == H unless `allow_gva`, in which case HV must be a multiple of H. cu_seqlens_cpu: an
    existing CPU copy of cu_seqlens (see `check_cu_seqlens`).
    """
    check_tensor("q", q, ndim=4)
    B, T, H, K = q.shape
    dev = q.device
    if H < 1:
        raise ValueError(f"q must have at least one head, got H=0 (q.shape={_fmt_shape(q.shape)})")
    check_tensor("k", k, shape=(B, T, H, K), device=dev)
    check_tensor("v", v, ndim=4, device=dev)
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape [{B}, {T}, HV, V] (B, T of q), got {_fmt_shape(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if allow_gva:
        if HV % H != 0:
            raise ValueError(f"the number of value heads HV={HV} (v.shape[2]) must be a multiple of H={H} (q.shape[2])")
    elif HV != H:
        raise ValueError(f"v must have H={H} heads like q, got {HV} (v.shape={_fmt_shape(v.shape)})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if min(K, V) < 1:
        raise ValueError(f"head dims must be positive, got K={K}, V={V}")
    check_tensor("g", g, shape=(B, T, HV, K), device=dev, dtypes=g_dtypes)
    if beta is not None:
        check_tensor("beta", beta, shape=(B, T, HV), device=dev)
    cu_cpu = None
    if cu_seqlens is not None:
        cu_cpu = check_cu_seqlens(cu_seqlens, batch_size=B, seq_len=T, device=dev, cpu_copy=cu_seqlens_cpu)
        N = cu_cpu.numel() - 1
    else:
        N = B
    if initial_state is not None:
        n = N if num_states is None else num_states
        state_shape = (n, HV, V, K) if state_v_first else (n, HV, K, V)
        check_tensor("initial_state", initial_state, shape=state_shape, device=dev, dtypes=STATE_DTYPES)
    return Dims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, cu_seqlens_cpu=cu_cpu,
                cu_seqlens=None if cu_seqlens is None else kernel_offsets(cu_seqlens, cu_cpu))


def check_kernel_dtype(q: torch.Tensor) -> None:
    """The Triton kernels run on the CPU only in Triton's interpreter, whose `tl.dot` takes
    bfloat16 operands as raw bits (triton-lang/triton#11584, unsupported there): refuse
    bfloat16 q/k/v on the CPU rather than return garbage. The torch references (naive.py)
    take any float dtype anywhere."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise TypeError("q, k and v in bfloat16 need a CUDA device: on the CPU the kernels run in Triton's "
                        "interpreter, which does not support bfloat16 dots; use float32 or float16 there")


def compiled_for_nvidia(x: torch.Tensor) -> bool:
    """Whether a kernel launched on `x` is compiled for an NVIDIA GPU (so inline PTX may be
    used), rather than run by Triton's interpreter (`TRITON_INTERPRET=1`, or a CPU tensor)
    or compiled for ROCm."""
    return x.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") != "1"


def refuse_double_backward(op: str) -> None:
    """Called first in a backward that is not itself differentiable: with create_graph=True
    (grad mode on in the backward) its gradients would carry no graph and every
    second-order term would silently be dropped."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op} does not support second-order gradients: its backward is not differentiable, "
                           "so create_graph=True (gradient penalties, double backward) would silently drop "
                           "the second-order terms; call backward/autograd.grad with create_graph=False")


def kernel_state(initial_state: torch.Tensor | None) -> torch.Tensor | None:
    """A validated initial state as the kernels read it: contiguous, float64 narrowed to fp32
    (they accumulate in fp32); differentiable, so its gradient comes back in the caller's dtype."""
    if initial_state is None:
        return None
    return initial_state.float().contiguous() if initial_state.dtype == torch.float64 else initial_state.contiguous()


def transpose_state(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """A `[..., K, V]` state as `[..., V, K]` and back when `state_v_first` (FLA's layout
    flag); contiguous, as the user's states and the kernels' are. None stays None."""
    if state is None or not state_v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def check_flag(name: str, value) -> bool:
    """One rule for every on/off argument: a bool (a truthy string or tensor would be a guess)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_option(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


# ---------------------------------------------------------------------------------------
# Varlen chunk bookkeeping (host side; the result is moved to the compute device once).




def prepare_varlen_chunks(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                          chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`prepare_chunk_indices`, `prepare_chunk_offsets`) on cu_seqlens' device, built on the
    host from its CPU copy (no read-back of device offsets, so the host never waits for the
    GPU), once per cu_seqlens tensor and chunk size: the ops of one batch share them."""
    entry = _packed_offsets(cu_seqlens, cu_seqlens_cpu)
    if entry is not None and chunk_size in entry.chunk_tables:
        return entry.chunk_tables[chunk_size]
    device = cu_seqlens.device
    tables = (prepare_chunk_indices(cu_seqlens_cpu, chunk_size).to(device, non_blocking=True),
              prepare_chunk_offsets(cu_seqlens_cpu, chunk_size).to(device, non_blocking=True))
    if entry is not None:
        entry.chunk_tables[chunk_size] = tables
    return tables


def save_for_backward(ctx, saved) -> None:
    """Saves the tensors of the dataclass `saved` (fields: tensors or None) through
    `ctx.save_for_backward`, so that saved-tensor hooks (checkpointing, offloading) see them."""
    ctx.saved_type = type(saved)
    ctx.save_for_backward(*(getattr(saved, f.name) for f in fields(saved)))


def saved_tensors(ctx):
    """The dataclass `save_for_backward` stored."""
    return ctx.saved_type(*ctx.saved_tensors)
