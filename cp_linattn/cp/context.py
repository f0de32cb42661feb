"""Context-parallel sharding metadata: which tokens and sequences each rank holds.

The packed token stream of a varlen batch (`B == 1`, global `cu_seqlens`, T tokens) is cut
into contiguous per-rank slices `[start, end)`; rank r holds `split[r] >= 1` tokens. A
sequence may start on one rank and end several ranks later; only a rank's FIRST local
sequence can continue from earlier ranks and only its LAST can continue on later ones.

Empty global sequences (repeated offsets) own no tokens, so they appear on no rank: the
local `cu_seqlens` lists only the non-empty sequences overlapping the slice, and
`seq_ids` maps each back to its global index (a consumer that assembles per-sequence
global states fills the empty ones itself: their final state is their initial state).

`build_cp_context` computes everything from the global metadata, which every rank must
pass identically; it checks that with one small all-gather, so that no rank is left
waiting in a later collective with inconsistent metadata. Notation: cp/README.md, section 1.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from cp_linattn.cp.comm import all_gather_tensor, backend_for
from cp_linattn.ops.utils import _fmt_shape, check_cu_seqlens, check_option, host_offsets

COMM_MODES = ("all_gather", "send_recv")


@dataclass(frozen=True, eq=False)
class FLACPContext:
    """This rank's share of a packed varlen batch under context parallelism.

    Field names follow `fla.ops.cp.FLACPContext` where they overlap. Frozen: derive a
    variant with `with_conv1d_kernel_size` (or `dataclasses.replace`) so that dependent
    fields are never stale. Build it with `build_cp_context`.

    group: the CP process group (None = the default group); rank, world_size: within it.
    comm: boundary-state transport, "all_gather" or "send_recv".
    split: tokens held by each rank (sum == T); this rank holds `[start, end)` of the
        global packed stream.
    global_cu_seqlens_cpu: int64 `[N_global + 1]` on the CPU.
    cu_seqlens / cu_seqlens_cpu: LOCAL int64 `[num_seqs + 1]` offsets (0 .. end - start) on
        `device` / on the CPU.
    seq_ids: int64 `[num_seqs]` (CPU), the global index of each local sequence.
    pre_num_ranks / post_num_ranks: how many earlier / later ranks hold a part of this
        rank's first / last local sequence.
    is_first_rank / is_last_rank: pre_num_ranks == 0 / post_num_ranks == 0 (FLA's meaning:
        this rank's first sequence starts here / its last sequence ends here).
    rank_first_seq / rank_last_seq: for every rank, the global id of its first / last
        local sequence; ranks i < j share a sequence iff rank_last_seq[i] == rank_first_seq[j].
    first_seq_offset: tokens of the first local sequence that lie before `start` (uncapped).
    conv1d_kernel_size: short-convolution width of the layers, or None.
    pre_num_conv_tokens: min(first_seq_offset, conv1d_kernel_size - 1), 0 when None: the
        tokens a short convolution must fetch from earlier ranks.
    device: the compute device (where `cu_seqlens` lives and received states arrive).
    """

    group: ProcessGroup | None
    rank: int
    world_size: int
    comm: str
    split: tuple[int, ...]
    start: int
    end: int
    global_cu_seqlens_cpu: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    seq_ids: torch.Tensor
    pre_num_ranks: int
    post_num_ranks: int
    is_first_rank: bool
    is_last_rank: bool
    rank_first_seq: tuple[int, ...]
    rank_last_seq: tuple[int, ...]
    first_seq_offset: int
    conv1d_kernel_size: int | None
    pre_num_conv_tokens: int
    device: torch.device

    @property
    def num_seqs(self) -> int:
        """Number of local (non-empty) sequences, >= 1."""
        return self.cu_seqlens_cpu.numel() - 1

    @property
    def global_num_seqs(self) -> int:
        return self.global_cu_seqlens_cpu.numel() - 1

    @property
    def total_tokens(self) -> int:
        """T, the length of the global packed stream."""
        return int(self.global_cu_seqlens_cpu[-1])

    @property
    def local_len(self) -> int:
        return self.end - self.start

    @functools.cached_property
    def batch_signature(self) -> str:
        """What every rank's context must agree on (the global offsets, split and transport),
        for the per-call check of `cp_linattn.cp.guard`: a context of another batch differs."""
        digest = _digest(self.global_cu_seqlens_cpu, self.split, self.comm)
        return f"T={self.total_tokens}, N={self.global_num_seqs}, hash={digest:x}"

    def with_conv1d_kernel_size(self, conv1d_kernel_size: int | None) -> FLACPContext:
        """A copy for layers with a short convolution of this width (recomputes pre_num_conv_tokens)."""
        _check_conv1d_kernel_size(conv1d_kernel_size)
        return dataclasses.replace(
            self,
            conv1d_kernel_size=conv1d_kernel_size,
            pre_num_conv_tokens=_pre_num_conv_tokens(self.first_seq_offset, conv1d_kernel_size),
        )

    def check_local(self, x, name: str = "x", dim: int = 1) -> None:
        """Raise unless `x` is this rank's shard of a packed tensor: `x.shape[0] == 1`
        (unless dim == 0) and `x.shape[dim] == end - start`."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() <= dim:
            raise ValueError(f"{name} must have more than {dim} dimensions, got shape {_fmt_shape(x.shape)}")
        if dim != 0 and x.shape[0] != 1:
            raise ValueError(
                f"{name} must have batch size 1 under context parallelism (a packed batch), got shape {_fmt_shape(x.shape)}"
            )
        if x.shape[dim] != self.local_len:
            raise ValueError(
                f"{name}.shape[{dim}] must be {self.local_len} (the tokens [{self.start}, {self.end}) this rank holds "
                f"under cp_context), got {x.shape[dim]} (shape {_fmt_shape(x.shape)}); "
                "pass the local shard, not the global tensor"
            )

    def check_group(self, group: ProcessGroup | None) -> None:
        """Raise ValueError unless `group` (None = default group) is the group this context was built for."""
        if _resolve(group) is not _resolve(self.group):
            raise ValueError(
                f"group does not match cp_context: the context was built for a group of {self.world_size} ranks "
                f"(this is rank {self.rank}), got a different group of {dist.get_world_size(group)} ranks"
            )


def _resolve(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _check_conv1d_kernel_size(k) -> None:
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"conv1d_kernel_size must be an int or None, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"conv1d_kernel_size must be >= 1, got {k}")


def _pre_num_conv_tokens(first_seq_offset: int, conv1d_kernel_size: int | None) -> int:
    return 0 if conv1d_kernel_size is None else min(first_seq_offset, conv1d_kernel_size - 1)


def default_split(total_tokens: int, world_size: int) -> tuple[int, ...]:
    """Equal shares; the first `T % world_size` ranks take one token more (none dropped)."""
    base, extra = divmod(total_tokens, world_size)
    return tuple(base + (r < extra) for r in range(world_size))


def _check_split(split, total_tokens: int, world_size: int) -> tuple[int, ...]:
    if split is None:
        if total_tokens < world_size:
            raise ValueError(
                f"cu_seqlens holds T={total_tokens} tokens, fewer than the world size {world_size}: "
                "every rank needs at least one token"
            )
        return default_split(total_tokens, world_size)
    if not isinstance(split, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) for s in split):
        raise TypeError(f"split must be a list or tuple of ints (tokens per rank), got {split!r}")
    if len(split) != world_size:
        raise ValueError(f"split must have one entry per rank ({world_size}), got {len(split)}: {list(split)}")
    if min(split) < 1:
        raise ValueError(f"split entries must all be >= 1 (every rank holds a token), got {list(split)}")
    if sum(split) != total_tokens:
        raise ValueError(f"split must sum to T={total_tokens} (cu_seqlens[-1]), got sum {sum(split)}: {list(split)}")
    return tuple(split)


@dataclass(frozen=True)
class _Plan:
    """The validated global metadata every rank agrees on."""

    cu: torch.Tensor  # int64 [N + 1], CPU
    split: tuple[int, ...]
    comm: str
    conv1d_kernel_size: int | None


def _make_plan(cu_seqlens, cu_seqlens_cpu, world_size: int, split, comm, conv1d_kernel_size) -> _Plan:
    if cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if (not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu"
                or cu_seqlens_cpu.shape != cu_seqlens.shape or cu_seqlens_cpu.dtype != cu_seqlens.dtype):
            got = (f"{_fmt_shape(cu_seqlens_cpu.shape)} {cu_seqlens_cpu.dtype} on {cu_seqlens_cpu.device}"
                   if isinstance(cu_seqlens_cpu, torch.Tensor) else type(cu_seqlens_cpu).__name__)
            raise ValueError(
                f"cu_seqlens_cpu must be a CPU copy of cu_seqlens ({_fmt_shape(cu_seqlens.shape)} {cu_seqlens.dtype}), got {got}"
            )
    # the host copy, when given, spares a device-to-host transfer (and is checked as the ops check it)
    host = cu_seqlens if cu_seqlens_cpu is None else host_offsets(cu_seqlens, cu_seqlens_cpu)
    ok_1d = isinstance(host, torch.Tensor) and host.dim() == 1 and host.numel() > 0
    seq_len = int(host[-1]) if ok_1d else -1
    cu = check_cu_seqlens(host, batch_size=1, seq_len=seq_len, device=host.device if ok_1d else None)
    check_option("comm", comm, COMM_MODES)
    _check_conv1d_kernel_size(conv1d_kernel_size)
    return _Plan(cu.clone(), _check_split(split, seq_len, world_size), comm, conv1d_kernel_size)


def _digest(*parts) -> int:
    """A signed 63-bit hash of tensors and reprs, stable across processes (unlike hash())."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little") >> 1


def _agree(plan: _Plan | None, error: Exception | None, raw: tuple, world_size: int, group: ProcessGroup | None) -> None:
    """All-gather a fingerprint of the arguments; raise the same verdict on every rank.

    plan: the validated arguments, or None with `error` when they were rejected; `raw`: the
    arguments as given, fingerprinted when they could not be validated.

    Invalid arguments do not raise before this exchange: a rank that raised alone would
    leave the others waiting in it. Identical invalid arguments raise their own error on
    every rank; any difference raises "cu_seqlens differ across ranks" on every rank.
    """
    if plan is not None and error is None:
        fp = [1, world_size, int(plan.cu[-1]), plan.cu.numel() - 1,
              _digest(plan.cu, plan.split, plan.comm, plan.conv1d_kernel_size)]
    else:
        fp = [0, world_size, -1, -1, _digest(*raw)]
    rows = all_gather_tensor(torch.tensor(fp, dtype=torch.int64), group).tolist()
    if all(row == rows[0] for row in rows):
        if error is not None:
            raise error
        return
    desc = "; ".join(
        f"rank {r}: " + (f"T={row[2]}, N={row[3]}, hash={row[4]:x}" if row[0] else "invalid arguments")
        for r, row in enumerate(rows)
    )
    msg = (
        "cu_seqlens differ across ranks: build_cp_context needs the same global cu_seqlens, split, comm, "
        f"conv1d_kernel_size and a valid device on every rank of the group, got {desc}"
    )
    if error is not None:
        msg += f" (this rank: {type(error).__name__}: {error})"
    raise ValueError(msg) from error


def _owner(split_ends: torch.Tensor, token: int) -> int:
    """The rank whose slice holds global token `token`."""
    return int(torch.searchsorted(split_ends, token, side="right"))


def _seq_of(cu: torch.Tensor, token: int) -> int:
    """The (necessarily non-empty) global sequence holding `token`: cu[i] <= token < cu[i + 1]."""
    return int(torch.searchsorted(cu[1:], token, side="right"))


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: ProcessGroup | None = None,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    split: Sequence[int] | None = None,
    comm: str = "all_gather",
    device: torch.device | str | None = None,
) -> FLACPContext:
    """Shard a packed varlen batch over the ranks of `group` and describe this rank's share.

    cu_seqlens: the GLOBAL offsets, int64 `[N + 1]` (CPU or GPU), starting at 0,
        non-decreasing, ending at T; empty sequences allowed. The same on every rank.
    group: the CP process group; None = the default group.
    split: tokens per rank (len == world size, each >= 1, sum == T); default: equal shares,
        the first `T % world_size` ranks one token more.
    comm: "all_gather" (default) or "send_recv", the transport for boundary states.
    device: where the local `cu_seqlens` and received states live; default
        `cu_seqlens.device` if it is a CUDA device, else the current CUDA device for an NCCL
        group, else the CPU.
    conv1d_kernel_size: short-convolution width, sets `pre_num_conv_tokens`.
    cu_seqlens_cpu: optional CPU copy of `cu_seqlens` (spares a device-to-host copy). Checked
        against cu_seqlens where that costs no wait for the device: cu_seqlens itself on the
        CPU, or its values read back earlier (`cp_linattn.ops.utils.host_offsets`); else
        trusted, as FLA does. The first four parameters match `fla.ops.cp.build_cp_context`.

    Collective: every rank of `group` must call it with the same arguments; they exchange
    one small fingerprint, and a mismatch raises ValueError on every rank (never a hang).
    Use `shard(x, ctx)` to cut the local inputs out of global tensors.
    """
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("build_cp_context needs torch.distributed to be initialised (dist.init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group")
    world_size = dist.get_world_size(group)

    plan, error = None, None
    try:
        plan = _make_plan(cu_seqlens, cu_seqlens_cpu, world_size, split, comm, conv1d_kernel_size)
        if device is not None:
            device = torch.device(device)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    raw = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, split, comm, conv1d_kernel_size, device)
    _agree(plan, error, raw, world_size, group)

    if device is None:
        if cu_seqlens.device.type == "cuda":
            device = cu_seqlens.device
        elif backend_for(group, "cuda") == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")

    cu, split = plan.cu, plan.split
    split_ends = torch.tensor(split, dtype=torch.int64).cumsum(0)
    starts = [int(e) - s for e, s in zip(split_ends, split)]
    ends = split_ends.tolist()
    rank_first_seq = tuple(_seq_of(cu, s) for s in starts)
    rank_last_seq = tuple(_seq_of(cu, e - 1) for e in ends)
    start, end = starts[rank], ends[rank]
    first, last = rank_first_seq[rank], rank_last_seq[rank]

    ids = torch.arange(first, last + 1)
    ids = ids[cu[ids + 1] > cu[ids]]
    local_cu = torch.cat([cu.new_zeros(1), cu[ids + 1].clamp(max=end) - start])
    first_seq_offset = start - int(cu[first])
    pre_num_ranks = rank - _owner(split_ends, int(cu[first]))
    post_num_ranks = _owner(split_ends, int(cu[last + 1]) - 1) - rank

    return FLACPContext(
        group=group,
        rank=rank,
        world_size=world_size,
        comm=plan.comm,
        split=split,
        start=start,
        end=end,
        global_cu_seqlens_cpu=cu,
        cu_seqlens=local_cu.to(device),
        cu_seqlens_cpu=local_cu,
        seq_ids=ids,
        pre_num_ranks=pre_num_ranks,
        post_num_ranks=post_num_ranks,
        is_first_rank=pre_num_ranks == 0,
        is_last_rank=post_num_ranks == 0,
        rank_first_seq=rank_first_seq,
        rank_last_seq=rank_last_seq,
        first_seq_offset=first_seq_offset,
        conv1d_kernel_size=plan.conv1d_kernel_size,
        pre_num_conv_tokens=_pre_num_conv_tokens(first_seq_offset, plan.conv1d_kernel_size),
        device=device,
    )


def shard(x: torch.Tensor, context: FLACPContext, dim: int = 1) -> torch.Tensor:
    """This rank's slice `x[:, start:end]` (along `dim`) of a global packed tensor.

    x: `[1, T, ...]` (any dtype; T along `dim`). Returns a view (differentiable), contiguous
    when dim == 1 and B == 1.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    T = context.total_tokens
    if x.dim() <= dim or x.shape[dim] != T:
        raise ValueError(f"x.shape[{dim}] must be T={T} (the global packed length), got shape {_fmt_shape(x.shape)}")
    return x.narrow(dim, context.start, context.local_len)


def unshard(local: torch.Tensor, context: FLACPContext, dim: int = 1) -> torch.Tensor:
    """Gather every rank's shard back into the global `[1, T, ...]` tensor (on every rank).

    local: this rank's `[1, end - start, ...]` (T along `dim`); every other dimension and the
    dtype must match across ranks. Uneven splits are padded for the all-gather. A
    collective over `context.group`; not differentiable (for tests and the harness: to
    check gradients, backpropagate `shard(dO, ctx)` through the local output).
    """
    context.check_local(local, "local", dim)
    pad = max(context.split) - context.local_len
    x = local.detach().movedim(dim, 0)
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    rows = all_gather_tensor(x, context.group)
    return torch.cat([rows[r, :n] for r, n in enumerate(context.split)]).movedim(0, dim)


def check_cp_call(context, cu_seqlens, cu_seqlens_cpu=None, **tensors: torch.Tensor) -> torch.Tensor:
    """Validate an op call under `context` and return the LOCAL cu_seqlens to run with.

    Each tensor must be this rank's shard (`[1, end - start, ...]`); `cu_seqlens` and
    `cu_seqlens_cpu`, if the caller passes them, must be the global offsets the context was
    built from (on its device / on the CPU); the context
    must have been built on this process for its group (a context handed between ranks or
    groups would silently compute another rank's slice).
    """
    if not isinstance(context, FLACPContext):
        raise TypeError(f"cp_context must be an FLACPContext (from build_cp_context), got {type(context).__name__}")
    if not dist.is_initialized():
        raise ValueError("cp_context requires an initialised torch.distributed process group")
    my_rank = dist.get_rank(context.group)
    if my_rank != context.rank or dist.get_world_size(context.group) != context.world_size:
        raise ValueError(
            f"cp_context was built for rank {context.rank} of a group of {context.world_size}, but this process is "
            f"rank {my_rank} of {dist.get_world_size(context.group)} in that group: build the context on every rank"
        )
    for name, x in tensors.items():
        context.check_local(x, name)
        if x.device != context.device:
            raise ValueError(f"{name} must be on the cp_context device {context.device}, got {x.device}")
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        host = host_offsets(x) if isinstance(x, torch.Tensor) and x.dtype == torch.int64 else None
        if host is None or (name == "cu_seqlens_cpu" and x.device.type != "cpu") \
                or not torch.equal(host, context.global_cu_seqlens_cpu):
            raise ValueError(
                f"{name} must be omitted under cp_context (the context carries the local offsets) or equal the "
                f"global offsets it was built from, {context.global_cu_seqlens_cpu.tolist()}"
            )
    return context.cu_seqlens


def empty_seq_ids(context: FLACPContext) -> torch.Tensor:
    """Global ids (CPU int64) of the empty sequences of the batch: they appear on no rank."""
    cu = context.global_cu_seqlens_cpu
    return torch.nonzero(cu[1:] == cu[:-1]).flatten()
