"""Causal softmax attention over a packed varlen batch under context parallelism.

Each rank holds some global token ranges of the packed stream (its layout, from the same
`FLACPContext` the linear layers read). A token attends to the earlier-or-equal tokens of
its own sequence (document masking), wherever they are held. The CP algorithm gathers
keys and values, as Llama 3 did:

1. every rank all-gathers the K/V rows of every rank (padded to the largest share) and
   reorders them into global token order (`gather_tokens`, differentiable: its backward
   scatters dK/dV back into the gathered layout and reduce-scatters them to their owners);
2. each rank runs its own queries, at global positions `token_positions`, against the
   global K/V with the mask `doc_start(q) <= k <= q` (`document_causal_attention`).

Documents are contiguous in the packed stream, so the mask of a query needs only two
numbers: the global index of its document's first token (`q_lo`) and its own (`q_pos`).
Kernels: torch's `flex_attention` (compiled) with a block-sparse mask computed directly from
those bounds (`document_block_mask`, no dense mask is ever built), the default on CUDA; and
`scaled_dot_product_attention` with an explicit boolean mask, the reference and CPU path.
Why all-gather rather than a ring, and the costs: cp/README.md, section "Softmax attention".
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_linattn.cp.comm import all_gather_tensor, backend_for, wire_device
from cp_linattn.cp.context import gather_index
from cp_linattn.ops.utils import check_option

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext

KERNELS = ("auto", "flex", "sdpa")
BLOCK = 128  # flex_attention's tile along both sequence dims

# torch >= 2.13 deprecates reduce_scatter_tensor in favour of reduce_scatter_single (same call).
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------------------------------
# Where every token is


def document_starts(cu_seqlens_cpu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 `[L]`: the global index of the first token of the sequence holding each of the
    global token indices `positions` `[L]`, by the global offsets `cu_seqlens_cpu` `[N + 1]`."""
    cu = cu_seqlens_cpu.to(positions.device)
    return cu[torch.bucketize(positions, cu[1:], right=True)]


@dataclass(eq=False)
class AttentionPlan:
    """The masking metadata of one batch on one rank, shared by every attention layer.

    q_pos: int64 `[L]` the global index of each local query (keys are indexed globally).
    q_lo: int64 `[L]` the global index of the first token of each query's sequence; query i
        attends keys j with `q_lo[i] <= j <= q_pos[i]`; `q_pos - q_lo` is its RoPE position.
    kv_len: T, the length of the key axis (the whole packed stream).
    index: int64 `[T]` the row of the padded all-gather holding each global token, under CP
        (`gather_index`); None without CP.
    rows: the tokens per rank of the padded all-gather (the largest share); 0 without CP.
    All tensors live on the compute device.
    """

    q_pos: torch.Tensor
    q_lo: torch.Tensor
    kv_len: int
    index: torch.Tensor | None = None
    rows: int = 0
    _block_masks: dict = field(default_factory=dict, repr=False)

    @property
    def positions_in_doc(self) -> torch.Tensor:
        """int64 `[L]`: each query's position within its own sequence (0 at its first token)."""
        return self.q_pos - self.q_lo

    @property
    def pairs(self) -> int:
        """How many (query, key) pairs the mask allows: the causal work of this rank."""
        return int((self.q_pos - self.q_lo + 1).sum())

    def block_mask(self, block: int = BLOCK):
        """The flex_attention `BlockMask` of this plan (built once, then reused)."""
        if block not in self._block_masks:
            self._block_masks[block] = document_block_mask(self.q_pos, self.q_lo, self.kv_len, block)
        return self._block_masks[block]


def plan_from_ranges(cu_seqlens_cpu: torch.Tensor, all_ranges, rank: int,
                     device: torch.device | str = "cpu") -> AttentionPlan:
    """The plan of rank `rank` when the ranks hold `all_ranges` of the packed batch with
    global offsets `cu_seqlens_cpu` (int64 `[N + 1]`, CPU). Needs no process group: the
    benchmark uses it to emulate one rank."""
    ranges = all_ranges[rank]
    q_pos = torch.cat([torch.arange(s, e) for s, e in ranges])
    q_lo = document_starts(cu_seqlens_cpu, q_pos)
    rows = max(sum(e - s for s, e in rs) for rs in all_ranges)
    return AttentionPlan(q_pos.to(device), q_lo.to(device), int(cu_seqlens_cpu[-1]),
                         gather_index(all_ranges, rows).to(device), rows)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attention_plan(context: FLACPContext) -> AttentionPlan:
    """The plan of this rank under `context`, built on first use and kept as long as the
    context lives: every attention layer of a step reads the same one."""
    plan = _PLANS.get(context)
    if plan is None:
        plan = plan_from_ranges(context.global_cu_seqlens_cpu, context.all_ranges, context.rank, context.device)
        _PLANS[context] = plan
    return plan


def local_plan(cu_seqlens_cpu: torch.Tensor | None, T: int, device: torch.device) -> AttentionPlan:
    """The plan without CP: T tokens, one sequence per batch row when `cu_seqlens_cpu` is None."""
    q_pos = torch.arange(T)
    q_lo = torch.zeros(T, dtype=torch.int64) if cu_seqlens_cpu is None else document_starts(cu_seqlens_cpu, q_pos)
    return AttentionPlan(q_pos.to(device), q_lo.to(device), T)


# ------------------------------------------------------------------------------------------
# The K/V all-gather


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` `[W, rows, ...]` over the ranks of `group` and return this rank's row
    `[rows, ...]` (on x.device), staged through a device the backend accepts."""
    wire = x.to(wire_device(backend_for(group, x.device.type), x.device)).contiguous()
    out = wire.new_empty(wire.shape[1:])
    _reduce_scatter_flat(out, wire.flatten(0, 1), group=group)
    return out.to(x.device)


class _GatherTokens(torch.autograd.Function):
    """`[L, ...]` local rows -> `[T, ...]` every rank's rows in global token order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, index: torch.Tensor, rows: int) -> torch.Tensor:
        padded = x.new_zeros(rows, *x.shape[1:])  # [rows, ...]
        padded[: x.shape[0]] = x
        gathered = all_gather_tensor(padded, group)  # [W, rows, ...]
        ctx.group, ctx.local_len, ctx.world_size, ctx.rows = group, x.shape[0], gathered.shape[0], rows
        ctx.save_for_backward(index)
        return gathered.flatten(0, 1).index_select(0, index)  # [T, ...]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (index,) = ctx.saved_tensors
        W, rows = ctx.world_size, ctx.rows
        flat = dy.new_zeros(W * rows, *dy.shape[1:]).index_copy_(0, index, dy.contiguous())  # [W * rows, ...]
        mine = _reduce_scatter_rows(flat.view(W, rows, *dy.shape[1:]), ctx.group)  # [rows, ...]
        return mine[: ctx.local_len], None, None, None


def gather_tokens(x: torch.Tensor, context: FLACPContext, plan: AttentionPlan | None = None) -> torch.Tensor:
    """Every rank's tokens in global order, differentiably.

    x: `[L, ...]` this rank's local rows (its ranges concatenated); every other dimension and
    the dtype must match across ranks. Returns `[T, ...]` on x.device. The backward sums the
    gradient of every rank's copy of a row and returns it to the row's owner (a
    reduce-scatter). A collective over `context.group`: every rank must call it.
    """
    plan = attention_plan(context) if plan is None else plan
    if x.shape[0] != plan.q_pos.numel():
        raise ValueError(f"x must hold this rank's {plan.q_pos.numel()} local tokens along dim 0, got shape "
                         f"{list(x.shape)}")
    return _GatherTokens.apply(x, context.group, plan.index, plan.rows)


# ------------------------------------------------------------------------------------------
# The attention kernels


def document_mask(q_pos: torch.Tensor, q_lo: torch.Tensor, kv_start: int, kv_end: int) -> torch.Tensor:
    """bool `[L, kv_end - kv_start]`: query i may read key j (global index kv_start + j)."""
    kv = torch.arange(kv_start, kv_end, device=q_pos.device)
    return (kv[None, :] >= q_lo[:, None]) & (kv[None, :] <= q_pos[:, None])


def _pad_to(x: torch.Tensor, block: int, value: int) -> torch.Tensor:
    """`x` `[L]` followed by copies of `value` up to a multiple of `block`."""
    extra = -x.numel() % block
    return torch.cat([x, x.new_full((extra,), value)]) if extra else x


def _block_bounds(x: torch.Tensor, block: int, pad: int, reduce: str) -> torch.Tensor:
    """min or max of `x` `[L]` over each block of `block` queries (`[ceil(L / block)]`), the
    tail padded with `pad` (a value that does not change the result)."""
    padded = _pad_to(x, block, pad).view(-1, block)
    return padded.amin(1) if reduce == "min" else padded.amax(1)


def document_block_mask(q_pos: torch.Tensor, q_lo: torch.Tensor, kv_len: int, block: int = BLOCK):
    """flex_attention's `BlockMask` for `q_lo[i] <= j <= q_pos[i]`, from per-block bounds.

    q_pos, q_lo: int64 `[L]` (see `AttentionPlan`); kv_len: keys `[0, kv_len)`. Queries of a
    block at consecutive positions form a *segment* (a block holds one, or more where it
    straddles two ranges of the layout); the keys a segment reads are exactly
    `[q_lo[first], q_pos[last]]` (its queries' intervals overlap or touch), so a key block is
    visited iff it meets one of its block's segment intervals. It is *full* (no mask_mod
    applied) when every query of the block reads every key of it: `max q_lo <= first key` and
    `last key <= min q_pos`; edge blocks cut by L or kv_len never are. Cost: about
    `ceil(L / block) * ceil(kv_len / block)` booleans; no per-token pair is evaluated here.
    """
    from torch.nn.attention.flex_attention import BlockMask

    L, device = q_pos.numel(), q_pos.device
    nq, nkv = -(-L // block), -(-kv_len // block)
    kv_first = torch.arange(nkv, device=device) * block  # [nkv]
    kv_last = kv_first + block - 1

    starts = torch.arange(L, device=device) % block == 0
    starts[1:] |= q_pos[1:] != q_pos[:-1] + 1
    seg_first = torch.nonzero(starts).flatten()  # [S]
    seg_last = torch.cat([seg_first[1:] - 1, seg_first.new_full((1,), L - 1)])
    seg_lo, seg_hi = q_lo[seg_first], q_pos[seg_last]
    meets = (kv_first[None] <= seg_hi[:, None]) & (kv_last[None] >= seg_lo[:, None])  # [S, nkv]
    touched = torch.zeros(nq, nkv, dtype=torch.int32, device=device).index_add_(
        0, seg_first // block, meets.to(torch.int32)) > 0  # [nq, nkv]

    big = torch.iinfo(torch.int64).max
    lo_max, pos_min = _block_bounds(q_lo, block, -1, "max"), _block_bounds(q_pos, block, big, "min")  # [nq]
    full = (kv_first[None] >= lo_max[:, None]) & (kv_last[None] <= pos_min[:, None])
    full &= (kv_last < kv_len)[None]
    q_whole = torch.ones(nq, dtype=torch.bool, device=device)
    q_whole[-1] = L % block == 0
    full &= q_whole[:, None]
    partial = touched & ~full

    def blocks(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count `[1, 1, nq]`, indices `[1, 1, nq, nkv]` with the set blocks first), int32."""
        order = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True)
        return mask.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    # the mask_mod reads per-query bounds padded to whole blocks: rows past L read nothing
    pos_pad, lo_pad = _pad_to(q_pos, block, -1), _pad_to(q_lo, block, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo_pad[q_idx]) & (kv_idx <= pos_pad[q_idx])

    (num, idx), (full_num, full_idx) = blocks(partial), blocks(full)
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(L, kv_len))


_COMPILED_FLEX = None


def _flex():
    """flex_attention compiled (once per process): uncompiled it materialises every score."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


# flex_attention's compiled kernel needs head dims of at least this many
FLEX_MIN_HEAD_DIM = 16


def resolve_kernel(kernel: str, device: torch.device, head_dims: tuple[int, int] = (FLEX_MIN_HEAD_DIM,) * 2) -> str:
    """"flex" or "sdpa": `kernel`, with "auto" meaning flex on CUDA when both head dims
    `(Dk, Dv)` are at least FLEX_MIN_HEAD_DIM, else sdpa; "flex" with smaller dims raises."""
    check_option("kernel", kernel, KERNELS)
    small = min(head_dims) < FLEX_MIN_HEAD_DIM
    if kernel == "auto":
        return "flex" if device.type == "cuda" and not small else "sdpa"
    if kernel == "flex" and small:
        raise ValueError(f"kernel='flex' needs head dims >= {FLEX_MIN_HEAD_DIM} (flex_attention's kernel), got "
                         f"(head_dim, head_v_dim) = {tuple(head_dims)}; use kernel='sdpa' or 'auto'")
    return kernel


def document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                              q_lo: torch.Tensor, *, scale: float | None = None, kernel: str = "auto",
                              block_mask=None) -> torch.Tensor:
    """Softmax attention of queries at global positions `q_pos` over keys `0 .. S-1`.

    q: `[B, L, H, Dk]`; k: `[B, S, Hkv, Dk]`, v: `[B, S, Hkv, Dv]` with H a multiple of Hkv
    (grouped-query attention: query head h reads key head h // (H / Hkv)); q_pos, q_lo: int64
    `[L]` on q's device, query i reading keys `q_lo[i] .. q_pos[i]` (each must read at least
    itself: `q_lo <= q_pos < S`). scale: default `Dk ** -0.5`. kernel: "flex" (compiled
    flex_attention with `block_mask`, default `document_block_mask`), "sdpa" (an explicit
    boolean mask over the keys the queries can reach, `[L, S']`), "auto" (flex on CUDA).
    Returns `[B, L, H, Dv]` in q's dtype.
    """
    H, Hkv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, tokens, dim]
    if resolve_kernel(kernel, q.device, (q.shape[-1], v.shape[-1])) == "flex":
        if block_mask is None:
            block_mask = document_block_mask(q_pos, q_lo, k.shape[1])
        with torch.autocast(q.device.type, enabled=False):  # the inputs already carry the compute dtype
            o = _flex()(qh, kh.to(q.dtype), vh.to(q.dtype), block_mask=block_mask, scale=scale, enable_gqa=H != Hkv)
        return o.transpose(1, 2)
    # only the keys some query reads: [min q_lo, max q_pos]
    kv_start, kv_end = int(q_lo.min()), int(q_pos.max()) + 1
    kh, vh = kh[:, :, kv_start:kv_end], vh[:, :, kv_start:kv_end]
    if H != Hkv:
        kh, vh = kh.repeat_interleave(H // Hkv, dim=1), vh.repeat_interleave(H // Hkv, dim=1)
    mask = document_mask(q_pos, q_lo, kv_start, kv_end)  # [L, S']
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)
