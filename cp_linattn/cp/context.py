"""Context-parallel sharding metadata: which tokens and sequences each rank holds.

The packed token stream of a varlen batch (`B == 1`, global `cu_seqlens`, T tokens) is cut
into *parts*, global token ranges `[start, end)`; each rank holds one or more of them (its
*layout*: one range per rank for `contiguous`, the front and back part for `zigzag`, any
disjoint cover of `[0, T)` through `ranges=`), and its local tensor is their concatenation in
token order. The parts in token order form the *chain*: a sequence may start in one part and
end several parts later, and a rank may hold several fragments of it. Only a part's FIRST
local sequence can continue from earlier parts and only its LAST can continue on later ones.

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
LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class CPPart:
    """One range of a rank's layout, as the state chain sees it.

    start, end: its global tokens `[start, end)`; offset: where they begin in the local tensor.
    seq_begin, seq_end: its local sequences `[seq_begin, seq_end)` (indices into the local
        `cu_seqlens`; at least one).
    slot: its position in the chain of all parts in token order (`FLACPContext.chain`).
    pre_num_parts / post_num_parts: how many earlier / later parts hold a piece of its first /
        last sequence: that sequence enters from (leaves to) the neighbouring slot iff > 0.
    first_seq_end / last_seq_start: local tokens where its first sequence's fragment ends and
        its last sequence's fragment begins.
    first_seq_offset: tokens of its first sequence before `start`.
    conv_tokens: min(first_seq_offset, conv1d_kernel_size - 1), 0 without a convolution.
    """

    start: int
    end: int
    offset: int
    seq_begin: int
    seq_end: int
    slot: int
    pre_num_parts: int
    post_num_parts: int
    first_seq_end: int
    last_seq_start: int
    first_seq_offset: int
    conv_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seq_end - self.seq_begin

    @property
    def receives(self) -> bool:
        """Its first sequence began in an earlier part (a state arrives, a gradient leaves)."""
        return self.pre_num_parts > 0

    @property
    def sends(self) -> bool:
        """Its last sequence goes on in a later part (a state leaves, a gradient arrives)."""
        return self.post_num_parts > 0

    @property
    def first_seq_ends_here(self) -> bool:
        return self.num_seqs > 1 or not self.sends

    @property
    def last_seq_starts_here(self) -> bool:
        return self.num_seqs > 1 or not self.receives


@dataclass(frozen=True, eq=False)
class FLACPContext:
    """This rank's share of a packed varlen batch under context parallelism.

    Field names follow `fla.ops.cp.FLACPContext` where they overlap. Frozen: derive a
    variant with `with_conv1d_kernel_size` (or `dataclasses.replace`) so that dependent
    fields are never stale. Build it with `build_cp_context`.

    group: the CP process group (None = the default group); rank, world_size: within it.
    comm: boundary-state transport, "all_gather" or "send_recv".
    layout: "contiguous", "zigzag" or "ranges" (given explicitly).
    ranges: this rank's global token ranges `((start, end), ...)`, ascending, non-empty,
        adjacent ones merged; the local tensor is their concatenation.
    all_ranges: every rank's `ranges`, indexed by rank.
    parts: one `CPPart` per range of `ranges`: where it sits in the chain and its sequences.
    split: tokens held by each rank (sum == T).
    global_cu_seqlens_cpu: int64 `[N_global + 1]` on the CPU.
    cu_seqlens / cu_seqlens_cpu: LOCAL int64 `[num_seqs + 1]` offsets (0 .. local_len) on
        `device` / on the CPU, cut at every part boundary too.
    seq_ids: int64 `[num_seqs]` (CPU), the global index of each local sequence (a sequence
        held in two parts appears twice).
    pre_num_ranks / post_num_ranks: how many earlier / later parts hold a piece of this
        rank's first / last local sequence (ranks, under a contiguous layout).
    is_first_rank / is_last_rank: pre_num_ranks == 0 / post_num_ranks == 0 (FLA's meaning:
        this rank's first sequence starts here / its last sequence ends here).
    first_seq_offset: tokens of the first local sequence before this rank's first token.
    conv1d_kernel_size: short-convolution width of the layers, or None.
    pre_num_conv_tokens: min(first_seq_offset, conv1d_kernel_size - 1), 0 when None: the
        tokens a short convolution must fetch for the first part (`CPPart.conv_tokens` for
        every part).
    device: the compute device (where `cu_seqlens` lives and received states arrive).
    """

    group: ProcessGroup | None
    rank: int
    world_size: int
    comm: str
    layout: str
    ranges: tuple[tuple[int, int], ...]
    all_ranges: tuple[tuple[tuple[int, int], ...], ...]
    parts: tuple[CPPart, ...]
    split: tuple[int, ...]
    global_cu_seqlens_cpu: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    seq_ids: torch.Tensor
    pre_num_ranks: int
    post_num_ranks: int
    is_first_rank: bool
    is_last_rank: bool
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
        return self.split[self.rank]

    @property
    def start(self) -> int:
        """First global token of this rank (its slice is `[start, end)` when it holds one range)."""
        return self.ranges[0][0]

    @property
    def end(self) -> int:
        """One past the last global token of this rank."""
        return self.ranges[-1][1]

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    @property
    def pre_num_ranks_by_part(self) -> tuple[int, ...]:
        """FLA's zigzag field: earlier parts sharing each local part's first sequence."""
        return tuple(p.pre_num_parts for p in self.parts)

    @property
    def post_num_ranks_by_part(self) -> tuple[int, ...]:
        """FLA's zigzag field: later parts sharing each local part's last sequence."""
        return tuple(p.post_num_parts for p in self.parts)

    @functools.cached_property
    def chain(self) -> tuple[tuple[int, int], ...]:
        """The parts of every rank in token order, as `(rank, index among its parts)`."""
        slots = [(rs[0], r, i) for r, ranks in enumerate(self.all_ranges) for i, rs in enumerate(ranks)]
        return tuple((r, i) for _, r, i in sorted(slots))

    @functools.cached_property
    def chain_rows(self) -> torch.Tensor:
        """int64 `[num_slots]` on `device`: where each chain slot's row lies in an all-gather of
        every rank's per-part rows padded to the largest part count (`comm.all_gather_parts`)."""
        P = max(len(r) for r in self.all_ranges)
        return torch.tensor([r * P + i for r, i in self.chain], device=self.device)

    @functools.cached_property
    def token_positions(self) -> torch.Tensor:
        """int64 `[local_len]` (CPU): the global index of each local token."""
        return torch.cat([torch.arange(s, e) for s, e in self.ranges])

    @functools.cached_property
    def batch_signature(self) -> str:
        """What every rank's context must agree on (the global offsets, split and transport),
        for the per-call check of `cp_linattn.cp.guard`: a context of another batch differs."""
        digest = _digest(self.global_cu_seqlens_cpu, self.all_ranges, self.comm)
        return f"T={self.total_tokens}, N={self.global_num_seqs}, hash={digest:x}"

    def with_conv1d_kernel_size(self, conv1d_kernel_size: int | None) -> FLACPContext:
        """A copy for layers with a short convolution of this width (recomputes pre_num_conv_tokens)."""
        _check_conv1d_kernel_size(conv1d_kernel_size)
        return dataclasses.replace(
            self,
            conv1d_kernel_size=conv1d_kernel_size,
            pre_num_conv_tokens=_pre_num_conv_tokens(self.first_seq_offset, conv1d_kernel_size),
            parts=tuple(dataclasses.replace(p, conv_tokens=_pre_num_conv_tokens(p.first_seq_offset, conv1d_kernel_size))
                        for p in self.parts),
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
            held = ", ".join(f"[{s}, {e})" for s, e in self.ranges)
            raise ValueError(
                f"{name}.shape[{dim}] must be {self.local_len} (the tokens {held} this rank holds "
                f"under cp_context), got {x.shape[dim]} (shape {_fmt_shape(x.shape)}); "
                "pass the local shard (cp_linattn.cp.context.shard), not the global tensor"
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


def _check_ranges(ranges, total_tokens: int, world_size: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Validate explicit per-rank ranges: a disjoint cover of [0, T), each rank's ascending."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(ranges, (list, tuple)) or len(ranges) != world_size:
        n = len(ranges) if isinstance(ranges, (list, tuple)) else type(ranges).__name__
        raise ValueError(f"ranges must hold one list of (start, end) pairs per rank ({world_size}), got {n}")
    out = []
    for r, held in enumerate(ranges):
        if not isinstance(held, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_int, p)) for p in held):
            raise TypeError(f"ranges[{r}] must be a list of (start, end) int pairs, got {held!r}")
        pairs = [tuple(p) for p in held]
        for s, e in pairs:
            if not 0 <= s <= e <= total_tokens:
                raise ValueError(f"ranges[{r}] has ({s}, {e}), outside 0 <= start <= end <= T={total_tokens}")
        if any(b[0] < a[1] for a, b in zip(pairs, pairs[1:])):
            raise ValueError(f"ranges[{r}] must be ascending and disjoint (the local tensor is their "
                             f"concatenation in token order), got {pairs}")
        out.append(pairs)
    flat = sorted((s, e, r) for r, pairs in enumerate(out) for s, e in pairs if e > s)
    covered = 0
    for s, e, r in flat:
        if s != covered:
            what = f"tokens [{covered}, {s}) are on no rank" if s > covered else f"token {s} is on two ranks"
            raise ValueError(f"ranges must cover [0, T={total_tokens}) exactly once: {what} (rank {r} holds ({s}, {e}))")
        covered = e
    if covered != total_tokens:
        raise ValueError(f"ranges must cover [0, T={total_tokens}) exactly once: tokens [{covered}, {total_tokens}) "
                         "are on no rank")
    return tuple(tuple(pairs) for pairs in out)


def layout_ranges(total_tokens: int, world_size: int, layout: str = "contiguous", split=None,
                  ranges=None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's global token ranges under a layout (the general form every layout reduces to).

    contiguous: one range per rank, `split` tokens each (default: equal shares, the first
    `T % W` ranks one more). zigzag: 2W parts of equal length (the first `T % 2W` one token
    longer), rank r holds parts r and 2W-1-r. ranges: explicit, any disjoint cover of `[0, T)`
    (each rank's list ascending; layout must stay "contiguous" and split None). Empty ranges
    are dropped and adjacent ones of a rank merged; every rank must hold a token.
    """
    check_option("layout", layout, LAYOUTS)
    W, T = world_size, total_tokens
    if ranges is not None:
        if layout != "contiguous" or split is not None:
            raise ValueError(f"ranges= is the layout itself: pass it without layout= ({layout!r}) and split= ({split!r})")
        per_rank = _check_ranges(ranges, T, W)
    elif layout == "zigzag":
        if split is not None:
            raise ValueError(f"split= applies to the contiguous layout only, got split={split!r} with layout='zigzag'")
        bounds = [0, *torch.tensor(default_split(T, 2 * W)).cumsum(0).tolist()]
        per_rank = tuple(((bounds[r], bounds[r + 1]), (bounds[2 * W - 1 - r], bounds[2 * W - r])) for r in range(W))
    else:
        if split is None and T < W:
            raise ValueError(f"cu_seqlens holds T={T} tokens, fewer than the world size {W}: every rank needs at "
                             "least one token")
        sizes = _check_split(split, T, W)
        ends = torch.tensor(sizes).cumsum(0).tolist()
        per_rank = tuple(((e - n, e),) for e, n in zip(ends, sizes))
    merged = []
    for r, pairs in enumerate(per_rank):
        held: list[tuple[int, int]] = []
        for s, e in pairs:
            if e == s:
                continue
            if held and held[-1][1] == s:
                held[-1] = (held[-1][0], e)
            else:
                held.append((s, e))
        if not held:
            raise ValueError(f"rank {r} holds no token under layout {layout if ranges is None else 'ranges'} "
                             f"(T={T}, world size {W}): every rank needs at least one token")
        merged.append(tuple(held))
    return tuple(merged)


@dataclass(frozen=True)
class _Plan:
    """The validated global metadata every rank agrees on."""

    cu: torch.Tensor  # int64 [N + 1], CPU
    layout: str
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    comm: str
    conv1d_kernel_size: int | None


def _make_plan(cu_seqlens, cu_seqlens_cpu, world_size: int, layout, split, ranges, comm, conv1d_kernel_size) -> _Plan:
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
    per_rank = layout_ranges(seq_len, world_size, layout, split, ranges)
    return _Plan(cu.clone(), "ranges" if ranges is not None else layout, per_rank, comm, conv1d_kernel_size)


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
              _digest(plan.cu, plan.ranges, plan.comm, plan.conv1d_kernel_size)]
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
        "cu_seqlens differ across ranks: build_cp_context needs the same global cu_seqlens, layout, split, ranges, comm, "
        f"conv1d_kernel_size and a valid device on every rank of the group, got {desc}"
    )
    if error is not None:
        msg += f" (this rank: {type(error).__name__}: {error})"
    raise ValueError(msg) from error


def _seq_of(cu: torch.Tensor, token: int) -> int:
    """The (necessarily non-empty) global sequence holding `token`: cu[i] <= token < cu[i + 1]."""
    return int(torch.searchsorted(cu[1:], token, side="right"))


def _parts(cu: torch.Tensor, all_ranges, rank: int, conv1d_kernel_size: int | None
           ) -> tuple[tuple[CPPart, ...], torch.Tensor, torch.Tensor]:
    """This rank's parts, its local cu_seqlens (cut at every part boundary) and seq_ids."""
    starts = sorted(s for ranges in all_ranges for s, _ in ranges)
    slot_starts = torch.tensor(starts, dtype=torch.int64)

    def slot_of(token: int) -> int:
        return int(torch.searchsorted(slot_starts, token, side="right")) - 1

    parts, offsets, ids_all, offset, n_seqs = [], [cu.new_zeros(1)], [], 0, 0
    for start, end in all_ranges[rank]:
        first, last = _seq_of(cu, start), _seq_of(cu, end - 1)
        ids = torch.arange(first, last + 1)
        ids = ids[cu[ids + 1] > cu[ids]]
        local = cu[ids + 1].clamp(max=end) - start
        slot = slot_of(start)
        first_seq_offset = start - int(cu[first])
        parts.append(CPPart(
            start=start, end=end, offset=offset, seq_begin=n_seqs, seq_end=n_seqs + len(ids), slot=slot,
            pre_num_parts=slot - slot_of(int(cu[first])), post_num_parts=slot_of(int(cu[last + 1]) - 1) - slot,
            first_seq_end=offset + int(local[0]), last_seq_start=offset + (int(local[-2]) if len(ids) > 1 else 0),
            first_seq_offset=first_seq_offset, conv_tokens=_pre_num_conv_tokens(first_seq_offset, conv1d_kernel_size)))
        offsets.append(local + offset)
        ids_all.append(ids)
        offset += end - start
        n_seqs += len(ids)
    return tuple(parts), torch.cat(offsets), torch.cat(ids_all)


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: ProcessGroup | None = None,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_tf32x3_affine_chain: bool = True,
    layout: str = "contiguous",
    *,
    split: Sequence[int] | None = None,
    ranges: Sequence[Sequence[tuple[int, int]]] | None = None,
    comm: str = "all_gather",
    device: torch.device | str | None = None,
) -> FLACPContext:
    """Shard a packed varlen batch over the ranks of `group` and describe this rank's share.

    cu_seqlens: the GLOBAL offsets, int64 `[N + 1]` (CPU or GPU), starting at 0,
        non-decreasing, ending at T; empty sequences allowed. The same on every rank.
    group: the CP process group; None = the default group.
    layout: "contiguous" (default: rank r holds one slice, `split[r]` tokens) or "zigzag"
        (the stream cut into 2W parts whose lengths differ by at most one token; rank r holds
        parts r and 2W-1-r, its local tensor `[front; back]`: balances causal softmax attention).
    split: tokens per rank for the contiguous layout (len == world size, each >= 1, sum == T);
        default: equal shares, the first `T % world_size` ranks one token more.
    ranges: the general form instead of a named layout: per rank, a list of global
        `(start, end)` token ranges in ascending order; together a disjoint cover of `[0, T)`
        (e.g. balanced by document). See `layout_ranges`.
    comm: "all_gather" (default) or "send_recv", the transport for boundary states.
    device: where the local `cu_seqlens` and received states live; default
        `cu_seqlens.device` if it is a CUDA device, else the current CUDA device for an NCCL
        group, else the CPU.
    conv1d_kernel_size: short-convolution width, sets `pre_num_conv_tokens`.
    cu_seqlens_cpu: optional CPU copy of `cu_seqlens` (spares a device-to-host copy). Checked
        against cu_seqlens where that costs no wait for the device: cu_seqlens itself on the
        CPU, or its values read back earlier (`cp_linattn.ops.utils.host_offsets`); else
        trusted, as FLA does.
    use_tf32x3_affine_chain: FLA's precision switch, accepted for compatibility: the merges
        always run in fp32 (tf32x3 dots); False raises, as in FLA 0.6.0.
    The first six parameters match `fla.ops.cp.build_cp_context`, positions included.

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
        if use_tf32x3_affine_chain is not True:
            raise ValueError(f"use_tf32x3_affine_chain must be True (the state merges always run in fp32), "
                             f"got {use_tf32x3_affine_chain!r}")
        plan = _make_plan(cu_seqlens, cu_seqlens_cpu, world_size, layout, split, ranges, comm, conv1d_kernel_size)
        if device is not None:
            device = torch.device(device)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    raw = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, layout, split, ranges, comm, conv1d_kernel_size,
           device)
    _agree(plan, error, raw, world_size, group)

    if device is None:
        if cu_seqlens.device.type == "cuda":
            device = cu_seqlens.device
        elif backend_for(group, "cuda") == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")

    parts, local_cu, ids = _parts(plan.cu, plan.ranges, rank, plan.conv1d_kernel_size)
    first, last = parts[0], parts[-1]
    return FLACPContext(
        group=group,
        rank=rank,
        world_size=world_size,
        comm=plan.comm,
        layout=plan.layout,
        ranges=plan.ranges[rank],
        all_ranges=plan.ranges,
        parts=parts,
        split=tuple(sum(e - s for s, e in held) for held in plan.ranges),
        global_cu_seqlens_cpu=plan.cu,
        cu_seqlens=local_cu.to(device),
        cu_seqlens_cpu=local_cu,
        seq_ids=ids,
        pre_num_ranks=first.pre_num_parts,
        post_num_ranks=last.post_num_parts,
        is_first_rank=first.pre_num_parts == 0,
        is_last_rank=last.post_num_parts == 0,
        first_seq_offset=first.first_seq_offset,
        conv1d_kernel_size=plan.conv1d_kernel_size,
        pre_num_conv_tokens=first.conv_tokens,
        device=device,
    )


def gather_index(all_ranges, rows: int) -> torch.Tensor:
    """int64 `[T]` (CPU): for global token t, its row in the flattened all-gather buffer
    `[W * rows]`, where rank r's local tokens (its ranges concatenated) fill rows
    `[r * rows, r * rows + local_len_r)`."""
    index = torch.empty(sum(e - s for ranges in all_ranges for s, e in ranges), dtype=torch.int64)
    for r, ranges in enumerate(all_ranges):
        offset = r * rows
        for s, e in ranges:
            index[s:e] = torch.arange(offset, offset + e - s)
            offset += e - s
    return index


def shard(x: torch.Tensor, context: FLACPContext, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a global packed tensor: the concatenation of `x[:, s:e]` over its
    ranges (along `dim`), in the layout's local order.

    x: `[1, T, ...]` (any dtype; T along `dim`). Differentiable; a view when the rank holds one
    range (contiguous when dim == 1 and B == 1), else a copy.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    T = context.total_tokens
    if x.dim() <= dim or x.shape[dim] != T:
        raise ValueError(f"x.shape[{dim}] must be T={T} (the global packed length), got shape {_fmt_shape(x.shape)}")
    pieces = [x.narrow(dim, s, e - s) for s, e in context.ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard(local: torch.Tensor, context: FLACPContext, dim: int = 1) -> torch.Tensor:
    """Gather every rank's shard back into the global `[1, T, ...]` tensor (on every rank).

    local: this rank's `[1, local_len, ...]` (T along `dim`); every other dimension and the
    dtype must match across ranks. Uneven shares are padded for the all-gather. A
    collective over `context.group`; not differentiable (for tests and the harness: to
    check gradients, backpropagate `shard(dO, ctx)` through the local output).
    """
    context.check_local(local, "local", dim)
    pad = max(context.split) - context.local_len
    x = local.detach().movedim(dim, 0)
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    rows = all_gather_tensor(x, context.group).flatten(0, 1)  # [W * max(split), ...]
    return rows[gather_index(context.all_ranges, x.shape[0]).to(x.device)].movedim(0, dim)


def check_cp_call(context, cu_seqlens, cu_seqlens_cpu=None, **tensors: torch.Tensor) -> torch.Tensor:
    """Validate an op call under `context` and return the LOCAL cu_seqlens to run with.

    Each tensor must be this rank's shard (`[1, local_len, ...]`); `cu_seqlens` and
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
        host = host_offsets(x) if isinstance(x, torch.Tensor) and x.dtype in (torch.int32, torch.int64) else None
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
