"""Transports for CP boundary states over any torch.distributed backend.

Two ways to move one small state per rank:

- `all_gather_tensor`: every rank gets every rank's tensor (LASP-2 style, the default).
- `send_recv_chain`: point-to-point messages along the chain of ranks that share a
  sequence (LASP-1 style): a rank receives the already-folded state from its neighbour,
  lets the caller fold its own fragment in, and passes the result on.

Backends: NCCL moves CUDA tensors, gloo moves CPU tensors. Tensors on the other kind of
device are staged (copied to a device the backend accepts and back), so a caller never
needs to know the backend: CUDA tensors over gloo (one GPU shared by several ranks)
travel through the CPU, CPU tensors over NCCL travel through the current CUDA device.

None of these functions is differentiable: they run inside the forward/backward of our
autograd Functions on detached tensors, and their outputs carry no autograd history.
What each transport carries: cp/README.md, section 6.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cp_linattn.ops.utils import check_option

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from cp_linattn.cp.context import FLACPContext

# torch >= 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same call).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_for(group: ProcessGroup | None, device_type: str) -> str:
    """Name of the backend that `group` uses for tensors on `device_type` ("cpu", "cuda").

    `dist.get_backend` answers "nccl", "gloo" or, for a group with one backend per device,
    "cpu:gloo,cuda:nccl".
    """
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    per_device = dict(item.split(":", 1) for item in name.split(","))
    return per_device.get(device_type, name)


def wire_device(backend: str, device: torch.device) -> torch.device:
    """The device a tensor living on `device` must be copied to before `backend` can move it."""
    if backend == "gloo" and device.type != "cpu":
        return torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _to_wire(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return x.detach().to(wire_device(backend_for(group, x.device.type), x.device)).contiguous()


def all_gather_tensor(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Gather `x` from every rank of `group`.

    x: any shape and dtype, the same on every rank. Returns `[world_size, *x.shape]` on
    `x.device`, row r holding rank r's tensor (r = rank within `group`). Uses the flat
    all-gather (gloo needs the output concatenated on dim 0). Not differentiable.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    world_size = dist.get_world_size(group)
    wire = _to_wire(x, group)
    out = torch.empty((world_size * wire.numel(),), dtype=wire.dtype, device=wire.device)
    _all_gather_flat(out, wire.reshape(-1), group=group)
    return out.view(world_size, *x.shape).to(x.device)


def all_gather_parts(x: torch.Tensor, context: FLACPContext) -> torch.Tensor:
    """Gather one row per part: `x` `[P, ...]` holds this rank's local parts' rows; returns
    `[num_slots, ...]`, every part's row in chain order (`context.chain`). Ranks with fewer
    parts pad; with one part per rank, rank order is chain order and nothing is copied."""
    P_max = max(len(r) for r in context.all_ranges)
    if x.shape[0] < P_max:
        x = torch.cat([x, x.new_zeros(P_max - x.shape[0], *x.shape[1:])])
    flat = all_gather_tensor(x, context.group).flatten(0, 1)
    if P_max == 1:
        return flat
    return flat.index_select(0, context.chain_rows.to(flat.device))


# gloo companions of NCCL-only groups, by (default group, member ranks): made once, kept for the job.
_HOST_GROUPS: dict[tuple[int, tuple[int, ...]], ProcessGroup] = {}


def host_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """A group over the ranks of `group` that moves CPU tensors without the device: `group`
    itself unless its CPU backend is NCCL (which would stage them through the GPU and wait for
    its queue), else a gloo group over the same ranks, made on first use (a collective over
    those ranks only) and reused."""
    if backend_for(group, "cpu") != "nccl":
        return group
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    key = (id(world), ranks)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[key]


def _global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def send_recv_chain(
    step: Callable[[int, torch.Tensor | None], torch.Tensor],
    context: FLACPContext,
    *,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    direction: str = "forward",
) -> list[torch.Tensor | None]:
    """Fold a state along the chain of parts that share a sequence, one hop at a time.

    direction="forward" (the state entering each local part's first sequence, LASP-1 style),
    for each local part i in token order:
      1. if it receives (`pre_num_parts > 0`), receive the state from the previous part of the
         chain (on another rank), else None;
      2. if it sends (`post_num_parts > 0`), call `step(i, received)` and send the result to
         the next part of the chain.
    direction="backward" mirrors it in reverse token order (the gradient of each part's last
    sequence): receive from the next part when it sends, send `step(i, received)` to the
    previous part when it receives.

    For the forward fold, `step(i, S_in)` returns part i's outgoing state `M_i S_in + S_ext_i`
    when its first and last sequences are one sequence, else just `S_ext_i`. Messages go only
    between parts sharing a sequence, so a part whose first sequence starts in it never
    waits. Each rank takes its parts in chain order and every message goes one slot along the
    chain, so the waits always resolve (sends do not block; tags name the receiving slot).

    shape, dtype: of every message (e.g. `[H, K, V]` float32), the same on every rank.
    `step` is called only for parts that send, after their receive; it must return a tensor
    of exactly `shape` and `dtype`. Messages are staged to and from `context.device`.
    Returns, per local part, the received tensor on `context.device`, or None. Not differentiable.
    """
    check_option("direction", direction, ("forward", "backward"))
    shape = tuple(int(s) for s in shape)
    group, chain, forward = context.group, context.chain, direction == "forward"
    received: list[torch.Tensor | None] = [None] * len(context.parts)
    pending = []
    order = range(len(context.parts)) if forward else range(len(context.parts) - 1, -1, -1)
    for i in order:
        part = context.parts[i]
        has_src, has_dst = (part.receives, part.sends) if forward else (part.sends, part.receives)
        hop = 1 if forward else -1
        if has_src:
            buf = torch.empty(shape, dtype=dtype, device=wire_device(backend_for(group, context.device.type),
                                                                     context.device))
            src = chain[part.slot - hop][0]
            dist.recv(buf, src=_global_rank(group, src), group=group, tag=2 * part.slot + (not forward))
            received[i] = buf.to(context.device)
        if has_dst:
            out = step(i, received[i])
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
                got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"send_recv_chain: step must return a tensor of shape {shape} and dtype {dtype}, "
                                 f"got {got}")
            out = _to_wire(out, group)
            dst_slot = part.slot + hop
            pending.append((dist.isend(out, dst=_global_rank(group, chain[dst_slot][0]), group=group,
                                       tag=2 * dst_slot + (not forward)), out))
    for work, _ in pending:
        work.wait()
    return received
