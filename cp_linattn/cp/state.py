"""Boundary states under context parallelism: pre-processes, exchange and fp32 merge.

Over a fragment the recurrence is affine in the entering state, `S -> M S + S_ext` (M `[H, K]`
for GLA, `[H, K, K]` for KDA). Each rank exchanges `(S_ext, M)` of its last fragment and folds
those of the earlier ranks that share its first sequence; the backward folds the gradients
of the later ranks with `M^T`. Which rank computes what and when (GLA's middle ranks correct
their states after the exchange, KDA's walk their fragment before it), the segments and the
initial/final states: cp/README.md, sections 2-5 and 7. Every exchanged state is fp32
`[H, K, V]` (K-first: the ops turn `state_v_first` states round before calling here).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton

from cp_linattn.cp.comm import all_gather_tensor, send_recv_chain
from cp_linattn.cp.context import FLACPContext, empty_seq_ids
from cp_linattn.ops.common.chunk_delta_h import (chunk_delta_rule_bwd_dhu, chunk_delta_rule_fwd_h,
                                                 delta_state_block_sizes)
from cp_linattn.ops.common.chunk_h import add_decayed_state, fold_states
from cp_linattn.ops.utils import whole_chunk_segments

CHUNK_SIZE = 64
# Past 8 segments the fold's chained K x K products cost more than the shorter walks save
# (scripts/tools/bench_walks.py measures it).
MAX_SEGMENTS = 8


def apply_transition(M: torch.Tensor, S: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """`M S` (or `M^T S`) for a diagonal M `[H, K]` or a full M `[H, K, K]`; S `[H, K, V]`."""
    if M.dim() == S.dim() - 1:
        return M[..., None] * S
    return (M.transpose(-1, -2) if transpose else M) @ S


class BoundaryExchange:
    """What the forward exchange learnt, kept for the backward fold.

    Built in the op's forward by `exchange_forward`; `exchange_backward` uses the gathered
    transitions of the later ranks (all_gather) or this rank's own (send_recv).
    """

    def __init__(self, context: FLACPContext, M_local: torch.Tensor, M_all: torch.Tensor | None):
        self.context = context
        self.M_local = M_local
        self.M_all = M_all
        # KDA middle ranks: the segments their forward walk cut the fragment into, with each
        # segment's transition, for the backward walk of the same tokens (`FragmentSegments`).
        self.segments: FragmentSegments | None = None


def exchange_forward(
    S_ext: torch.Tensor, M: torch.Tensor, context: FLACPContext
) -> tuple[torch.Tensor | None, BoundaryExchange]:
    """Forward exchange and merge: the fp32 state entering this rank's first local sequence.

    Collective over `context.group`: every rank must call it (cp/README.md, sections 2 and 6).

    Args:
        S_ext: `[H, K, V]`, the last fragment's final state from a zero start; M: its
            transition, `[H, K]` or `[H, K, K]` (any values when `post_num_ranks == 0`:
            nobody reads them).

    Returns:
        (S_in fp32 `[H, K, V]`, or None when the first local sequence starts on this rank;
        the `BoundaryExchange` record for the backward).
    """
    S_ext, M = S_ext.float().contiguous(), M.float().contiguous()
    if context.comm == "all_gather":
        packed = all_gather_tensor(torch.cat([S_ext.flatten(), M.flatten()]), context.group)
        states = packed[:, : S_ext.numel()].view(-1, *S_ext.shape)
        transitions = packed[:, S_ext.numel():].view(-1, *M.shape)
        r, pre = context.rank, context.pre_num_ranks
        S_in = fold_states(states, transitions, range(r - pre, r)) if pre else None
        return S_in, BoundaryExchange(context, M, transitions)

    def outgoing(S_in: torch.Tensor | None) -> torch.Tensor:
        continues_through = context.num_seqs == 1 and S_in is not None
        return apply_transition(M, S_in) + S_ext if continues_through else S_ext

    S_in = send_recv_chain(outgoing, context, shape=S_ext.shape, direction="forward")
    return S_in, BoundaryExchange(context, M, None)


def exchange_backward(dS_ext: torch.Tensor, record: BoundaryExchange) -> torch.Tensor | None:
    """Backward exchange and merge: the gradient arriving at the end of this rank's last
    local sequence from the later ranks (its `dht` row). Collective (cp/README.md, sections 2
    and 6).

    Args:
        dS_ext: `[H, K, V]`, the gradient leaving this rank's first fragment when none arrives
            from later ranks (any values when `pre_num_ranks == 0`).
        record: the forward's `BoundaryExchange`.

    Returns:
        fp32 `[H, K, V]`, or None when the last local sequence ends here.
    """
    context = record.context
    dS_ext = dS_ext.float().contiguous()
    if context.comm == "all_gather":
        grads = all_gather_tensor(dS_ext, context.group)
        r, post = context.rank, context.post_num_ranks
        if not post:
            return None
        return fold_states(grads, record.M_all, range(r + post, r, -1), transpose=True)  # far to near

    def outgoing(dS_in: torch.Tensor | None) -> torch.Tensor:
        continues_through = context.num_seqs == 1 and dS_in is not None
        return apply_transition(record.M_local, dS_in, True) + dS_ext if continues_through else dS_ext

    return send_recv_chain(outgoing, context, shape=dS_ext.shape, direction="backward")


def expand_h0(
    S_in: torch.Tensor | None, initial_state: torch.Tensor | None, context: FLACPContext, state_shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The local `[num_seqs, *state_shape]` initial states (cp/README.md, section 7).

    Row i is the user's state of global sequence `seq_ids[i]` when it starts on this rank
    (`initial_state`: `[N_global, *state_shape]`, the same on every rank); row 0 of a sequence
    begun on an earlier rank is S_in (zero when S_in is None: GLA's middle ranks add it
    afterwards). None when every row would be zero (saves the kernels a read).
    """
    if S_in is None and initial_state is None:
        return None
    if initial_state is None:
        h0 = S_in.new_zeros(context.num_seqs, *state_shape)
    else:
        h0 = initial_state.float()[context.seq_ids.to(initial_state.device)].clone()
    if S_in is not None:
        h0[0] = S_in.view(state_shape)
    elif context.pre_num_ranks:
        h0[0] = 0
    return h0


def compress_h0(
    dh0_local: torch.Tensor | None, context: FLACPContext, num_global: int, dht_global: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Gradient of the user's `[N_global, ...]` initial_state from the local `[num_seqs, ...]`
    one: the rows of the sequences that start on this rank, zeros elsewhere (the sum over the
    group is the full gradient); rank 0 gives the empty sequences `dht_global`'s rows
    (cp/README.md, section 7).
    """
    if dh0_local is None:
        return None
    out = dh0_local.new_zeros(num_global, *dh0_local.shape[1:])
    first = 1 if context.pre_num_ranks else 0
    out[context.seq_ids[first:].to(out.device)] = dh0_local[first:]
    empty = empty_seq_ids(context).to(out.device)
    if context.rank == 0 and dht_global is not None and empty.numel():
        out[empty] = dht_global[empty].to(out.dtype)
    return out


def scatter_final_state(
    ht_local: torch.Tensor, context: FLACPContext, num_global: int, initial_state: torch.Tensor | None = None
) -> torch.Tensor:
    """`[N_global, ...]` final states from the local `[num_seqs, ...]` ones: rows of the
    sequences that END on this rank; zeros for the others (their state is not final here).
    Summing over the ranks of the group gives every sequence's final state; rank 0 fills the
    empty sequences (final state = initial state, or zero). cp/README.md, section 7."""
    out = ht_local.new_zeros(num_global, *ht_local.shape[1:])
    n_own = context.num_seqs - (1 if context.post_num_ranks else 0)
    out[context.seq_ids[:n_own].to(out.device)] = ht_local[:n_own]
    empty = empty_seq_ids(context).to(out.device)
    if context.rank == 0 and initial_state is not None and empty.numel():
        out[empty] = initial_state[empty].float()
    return out


def gather_final_state_grad(dht_global: torch.Tensor | None, context: FLACPContext) -> torch.Tensor | None:
    """Local `[num_seqs, ...]` dht from the gradient of `scatter_final_state`'s output; the row
    of a last sequence that continues on later ranks is left zero (the exchange fills it)."""
    if dht_global is None:
        return None
    dht = dht_global.float()[context.seq_ids.to(dht_global.device)].clone()
    if context.post_num_ranks:
        dht[-1] = 0
    return dht


# ---------------------------------------------------------------------------------------
# The pre-processes: (S_ext, M) of the last fragment and dS_ext of the first. KDA's middle
# ranks compute them with the state kernels on that fragment alone (chunks restart at every
# sequence start, so a fragment is a standalone single-sequence batch); GLA's read them off
# their local passes and correct those passes afterwards.


def _last_fragment(context: FLACPContext) -> tuple[int, bool]:
    """(first local token of the last local sequence, whether that sequence starts here)."""
    return int(context.cu_seqlens_cpu[-2]), context.num_seqs > 1 or context.pre_num_ranks == 0


def _first_fragment(context: FLACPContext) -> tuple[int, bool]:
    """(end of the first local sequence, whether that sequence ends here)."""
    return int(context.cu_seqlens_cpu[1]), context.num_seqs > 1 or context.post_num_ranks == 0


def _user_state_of_last(initial_state: torch.Tensor | None, context: FLACPContext, v_first: bool):
    """The user's initial state `[1, H, K, V]` of the last local sequence if it starts here."""
    start, starts_here = _last_fragment(context)
    if initial_state is None or not starts_here:
        return None
    h0 = initial_state[context.seq_ids[-1:].to(initial_state.device)].float()
    return h0.transpose(-1, -2) if v_first else h0


def _with_incoming_grad(dht: torch.Tensor | None, dS_in: torch.Tensor | None, context: FLACPContext,
                        state_shape: tuple[int, ...], v_first: bool) -> torch.Tensor | None:
    if dS_in is None:
        return dht
    if dht is None:
        dht = dS_in.new_zeros(context.num_seqs, *state_shape)
    dht[-1] = dS_in.transpose(-1, -2) if v_first else dS_in
    return dht


def receive_final_state_grad(dht_global: torch.Tensor | None, record: BoundaryExchange,
                             state_shape: tuple[int, int, int], v_first: bool = False,
                             message: Callable[[int, torch.Tensor | None], torch.Tensor] | None = None,
                             ) -> torch.Tensor | None:
    """Backward exchange of a rank that receives a gradient (`post_num_ranks > 0`), run
    before its local reverse pass (cp/README.md, sections 3 and 4).

    Args:
        dht_global: gradient of the `[N_global, ...]` final state, or None.
        record: the forward's `BoundaryExchange`.
        state_shape: the local states' shape per sequence, `(H, K, V)` (`(H, V, K)` if v_first).
        message: `message(end, dht_first)` -> fp32 `[H, K, V]`, the gradient leaving the
            first local sequence (tokens `[0, end)`) with dht_first (its dht row, layout as the
            states, or None) arriving at its end; required when `pre_num_ranks > 0`, else
            zeros go out.

    Returns:
        The local dht `[num_seqs, *state_shape]`, the gradient from later ranks in the last row.
    """
    context = record.context
    dht = gather_final_state_grad(dht_global, context)
    if context.pre_num_ranks:
        end, ends_here = _first_fragment(context)
        dS_ext = message(end, dht[0] if ends_here and dht is not None else None)
    else:
        H, K, V = (state_shape[0], state_shape[2], state_shape[1]) if v_first else state_shape
        dS_ext = torch.zeros(H, K, V, dtype=torch.float32, device=context.device)
    return _with_incoming_grad(dht, exchange_backward(dS_ext, record), context, state_shape, v_first)


def gla_apply_incoming_state(h: torch.Tensor, ht: torch.Tensor, decays: tuple[torch.Tensor, torch.Tensor],
                             context: FLACPContext) -> BoundaryExchange:
    """GLA forward exchange of a middle rank (`pre_num_ranks > 0`, `post_num_ranks > 0`), run
    after its local pass (`chunk_fwd_h`, the first sequence started from zero): sends that
    pass's last final state and total decay, then adds the received state to the first
    sequence's states in place, `h[c] += Diag(exp decay[c]) S_in` (and to its final state when
    it ends here). cp/README.md, section 4 (correct after).

    Args:
        h: `[1, NT, H, K, V]` per-chunk states of the local pass (updated in place).
        ht: fp32 `[num_seqs, H, K, V]` final states of the local pass (row 0 updated in place).
        decays: `chunk_fwd_h(output_decays=True)`'s (decay `[1, NT, H, K]`, total
            `[num_seqs, H, K]`).

    Returns:
        The `BoundaryExchange` record for the backward.
    """
    decay, total = decays
    S_in, record = exchange_forward(ht[-1], total[-1].exp(), context)
    end, ends_here = _first_fragment(context)
    n = -(-end // CHUNK_SIZE)
    add_decayed_state(h[0, :n], decay[0, :n], S_in)
    if ends_here:  # its final state is read
        ht[0] += total[0].exp()[..., None] * S_in
    return record


def gla_apply_incoming_grad(dh: torch.Tensor, dh0: torch.Tensor, decay: torch.Tensor,
                            record: BoundaryExchange) -> None:
    """GLA backward exchange of a middle rank, run after its local reverse pass (`chunk_bwd_dh`
    with the last row of dht zero): sends `dh0[0]`, then adds the received gradient to the last
    sequence's per-chunk gradients in place, `dh[c] += Diag(exp decay[c]) dS_in` (and to its
    dh0 when it starts here). cp/README.md, section 4 (correct after).

    Args:
        dh: fp32 `[1, NT, H, K, V]`; dh0: fp32 `[num_seqs, H, K, V]` (both updated in place);
            decay: `chunk_bwd_dh(output_decays=True)`'s `[1, NT, H, K]`.
        record: the forward's `BoundaryExchange`.
    """
    context = record.context
    dS_in = exchange_backward(dh0[0], record)
    start, starts_here = _last_fragment(context)
    NT = dh.shape[1]
    n = -(-(int(context.cu_seqlens_cpu[-1]) - start) // CHUNK_SIZE)
    add_decayed_state(dh[0, NT - n:], decay[0, NT - n:], dS_in)
    if starts_here:  # its dh0 is read
        dh0[-1] += record.M_local[..., None] * dS_in


def receive_state(context: FLACPContext, state_shape: tuple[int, int, int],
                  diagonal: bool) -> tuple[torch.Tensor, BoundaryExchange]:
    """Forward exchange of a rank that receives a state and sends none (`pre_num_ranks > 0`,
    `post_num_ranks == 0`), run before its local pass: zeros go out (nobody reads them), with
    the transition's shape of the op (`[H, K]` for a `diagonal` one, else `[H, K, K]`).
    state_shape: `(H, K, V)`. Returns (S_in fp32 `[H, K, V]`, record)."""
    zeros = torch.zeros(state_shape, dtype=torch.float32, device=context.device)
    return exchange_forward(zeros, _zero_transition(zeros, diagonal), context)


def _zero_transition(S: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """The transition a rank sends whose fragment starts a sequence (nothing crosses it)."""
    H, K = S.shape[:2]
    return S.new_zeros((H, K) if diagonal else (H, K, K))


def send_final_state(final_state: torch.Tensor, context: FLACPContext, diagonal: bool,
                     state_v_first: bool = False) -> BoundaryExchange:
    """Forward exchange of a rank that receives no state (`pre_num_ranks == 0`), run after its
    local state pass: that pass started every local sequence from its own state, so the last
    one's final state (fp32 `final_state[-1]`, layout as the states) is the message, and that
    sequence starts here (no transition: zeros, `[H, K]` for a `diagonal` one, else
    `[H, K, K]`). No walk of its own. Returns the record."""
    S_ext = final_state[-1].transpose(-1, -2) if state_v_first else final_state[-1]
    _, record = exchange_forward(S_ext, _zero_transition(S_ext, diagonal), context)
    return record


def send_first_state_grad(dh0: torch.Tensor, record: BoundaryExchange, state_v_first: bool = False) -> None:
    """Backward exchange of a rank that receives no gradient (`post_num_ranks == 0`), run
    after its local reverse pass: with nothing arriving, that pass's gradient of the first
    local sequence's initial state (`dh0[0]`, fp32, layout as the states) is the message
    (read only when that sequence began on an earlier rank). No walk of its own."""
    exchange_backward(dh0[0].transpose(-1, -2) if state_v_first else dh0[0], record)


class FragmentSegments:
    """A fragment cut into segments of whole chunks, walked side by side by the state kernels
    as independent sequences and folded with the segments' transitions: a walk whose programs
    do not fill the device then takes less time (cp/README.md, section 5).

    Attributes:
        count: S, at most one per chunk (fewer when the chunks do not divide evenly).
        cu_seqlens, chunk_offsets: int64 `[S + 1]` on the device, the kernels' varlen
            arguments (None for S = 1, the plain walk).
        transitions: fp32 `[S, HV, K, K]`, set by `walk_fragment_state` (None for S = 1).
    """

    def __init__(self, n_tokens: int, count: int, device: torch.device):
        n_chunks = -(-n_tokens // CHUNK_SIZE)
        self.count, per_segment = whole_chunk_segments(n_chunks, count)
        self.cu_seqlens = self.chunk_offsets = None
        if self.count > 1:
            self.cu_seqlens, self.chunk_offsets = _segment_offsets(n_tokens, per_segment, self.count, device)
        self.transitions: torch.Tensor | None = None

    @classmethod
    def filling(cls, n_tokens: int, programs: int, device: torch.device) -> FragmentSegments:
        """As many segments of a walk of `programs` programs as fit the SMs side by side (1
        when one walk fills them: no fold, no extra launch), at most MAX_SEGMENTS."""
        return cls(n_tokens, min(MAX_SEGMENTS, _parallel_slots(device) // programs), device)


def _parallel_slots(device: torch.device) -> int:
    """Programs the device runs at once, one per SM. The interpreter has none; 4 there keeps
    the CPU tests on the segmented path."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=64)
def _segment_offsets(n_tokens: int, per_segment: int, count: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached: every layer of a step walks the same fragment."""
    starts = torch.arange(count + 1, device=device)
    n_chunks = -(-n_tokens // CHUNK_SIZE)
    return ((starts * (per_segment * CHUNK_SIZE)).clamp_(max=n_tokens),
            (starts * per_segment).clamp_(max=n_chunks))


def _fold_segments(states: torch.Tensor, transitions: torch.Tensor | None, reverse: bool,
                   input_columns: int | None = None) -> torch.Tensor:
    """The fold of per-segment results `[S, H, K, C]` into the fragment's `[H, K, C]`:
    forward over the segments, or backward with transposed transitions (None for S = 1);
    `input_columns` as in `fold_states`."""
    S = states.shape[0]
    if S == 1:
        return states[0]
    order = range(S - 1, -1, -1) if reverse else range(S)
    return fold_states(states, transitions, order, transpose=reverse, input_columns=input_columns)


def walk_fragment_state(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gk: torch.Tensor,
                        segments: FragmentSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_ext fp32 `[HV, K, V]`, M fp32 `[HV, K, K]`) of a fragment `[1, T_frag, HV, *]` (kg,
    w, gk: K; u: V): its final state from zero and its transition, `final(S) = M S + S_ext`.

    The recurrence is linear in the state, so one walk of the delta-rule state kernel on
    `[u, 0]` from `[0, I]` yields `[S_ext, M]`; per segment, then folded. Keeps the segments'
    transitions in `segments` for `walk_fragment_grad` (views of the walk's final states).
    """
    K, V = kg.shape[3], u.shape[3]
    _, _, ht = chunk_delta_rule_fwd_h(kg, w, u, gk, None, True, cu_seqlens=segments.cu_seqlens,
                                      chunk_offsets=segments.chunk_offsets, chunk_size=CHUNK_SIZE,
                                      store_chunk_states=False, state_columns=V + K, identity_tail=True,
                                      launch="fragment_state_walk")
    if segments.count > 1:
        segments.transitions = ht[..., V:]
    # Segment s > 0 maps the fold's [S_ext, M] to M_s [S_ext, M] + [S_ext_s, 0]: its identity
    # start is the map, not an input, so only its first V columns enter the fold.
    SM = _fold_segments(ht, segments.transitions, reverse=False, input_columns=V)
    return SM[..., :V], SM[..., V:]


def walk_fragment_grad(qg: torch.Tensor, kg: torch.Tensor, w: torch.Tensor, gk: torch.Tensor, do: torch.Tensor,
                       dv: torch.Tensor, scale: float, segments: FragmentSegments) -> torch.Tensor:
    """fp32 `[HV, K, V]`: the gradient leaving the start of a fragment (arguments as in
    `chunk_delta_rule_bwd_dhu`) with none arriving at its end: a reverse dhu walk per
    segment, folded with the transitions `walk_fragment_state` kept in `segments`."""
    if segments.count > 1 and segments.transitions is None:
        raise ValueError(f"segments ({segments.count}) must have been walked by walk_fragment_state first: "
                         "the fold needs their transitions")
    _, dS, _ = chunk_delta_rule_bwd_dhu(qg, kg, w, gk, do, dv, scale, None, True, cu_seqlens=segments.cu_seqlens,
                                        chunk_offsets=segments.chunk_offsets, chunk_size=CHUNK_SIZE,
                                        store_chunk_grads=False, launch="fragment_grad_walk")
    return _fold_segments(dS, segments.transitions, reverse=True)


def kda_incoming_state(kg, w, u, gk, initial_state, context: FLACPContext, state_v_first: bool):
    """KDA forward exchange of a rank that receives a state (`pre_num_ranks > 0`), run before
    its local state pass. A middle rank first walks its last fragment for the message: with
    `walk_fragment_state` (in segments, kept in the record for the backward) when its only
    sequence continues through it, else from the user's state on u alone (M sent as zeros).
    cp/README.md, section 4 (walk before).

    Args:
        kg, w, gk: `[1, T, HV, K]`; u: `[1, T, HV, V]`; from the intra-chunk WY stage.
        initial_state: the user's `[N_global, ...]` states or None, laid out as `state_v_first`.

    Returns:
        (S_in fp32 `[HV, K, V]`, K-first; the `BoundaryExchange` record).
    """
    HV, K, V = kg.shape[2], kg.shape[3], u.shape[3]
    if not context.post_num_ranks:
        return receive_state(context, (HV, K, V), diagonal=False)
    start, starts_here = _last_fragment(context)
    fragment = (kg[:, start:], w[:, start:])
    if starts_here:
        _, _, ht = chunk_delta_rule_fwd_h(*fragment, u[:, start:], gk[:, start:],
                                          _user_state_of_last(initial_state, context, state_v_first), True,
                                          chunk_size=CHUNK_SIZE, store_chunk_states=False)
        return exchange_forward(ht[0], ht.new_zeros(HV, K, K), context)
    # Sized for the backward walk (V columns), which reuses these segments; the forward's
    # V + K columns give it twice the programs, which the SMs then run in two rounds.
    _, BV = delta_state_block_sizes("fragment_grad_walk", K, V)
    segments = FragmentSegments.filling(kg.shape[1] - start, HV * triton.cdiv(V, BV), kg.device)
    S_ext, M = walk_fragment_state(*fragment, u[:, start:], gk[:, start:], segments)
    S_in, record = exchange_forward(S_ext, M, context)
    record.segments = segments
    return S_in, record


def kda_final_state_grad(qg, kg, w, gk, do, dv, scale: float, dht_global, record: BoundaryExchange,
                         state_v_first: bool):
    """KDA backward exchange of a rank that receives a gradient (`post_num_ranks > 0`), run
    before its local reverse pass. A middle rank's message is a dhu pass over its first
    fragment from a zero gradient (`walk_fragment_grad` over the forward's segments when the
    rank holds one sequence). cp/README.md, section 4 (walk before).

    Args:
        qg, kg, w, gk, do, scale: as in `chunk_delta_rule_bwd_dhu`; dv: the intra-chunk
            gradient of v_new (`Aqk^T do`) of the local tokens.
        dht_global: gradient of the `[N_global, ...]` final state, or None.
        record: the forward's `BoundaryExchange`.

    Returns:
        The local dht (layout as the states), the gradient from later ranks in the last row.
    """
    def message(end: int, dht_first: torch.Tensor | None) -> torch.Tensor:
        if record.segments is not None:  # the forward walked these tokens (the rank's only sequence)
            return walk_fragment_grad(qg, kg, w, gk, do, dv, scale, record.segments)
        if dht_first is not None:
            dht_first = (dht_first.transpose(-1, -2) if state_v_first else dht_first)[None].contiguous()
        _, dS_ext, _ = chunk_delta_rule_bwd_dhu(qg[:, :end], kg[:, :end], w[:, :end], gk[:, :end], do[:, :end],
                                                dv[:, :end], scale, dht_first, True, chunk_size=CHUNK_SIZE,
                                                store_chunk_grads=False)
        return dS_ext[0]

    HV, K, V = kg.shape[2], kg.shape[3], do.shape[3]
    return receive_final_state_grad(dht_global, record, (HV, V, K) if state_v_first else (HV, K, V), state_v_first,
                                     message)
