"""Boundary states under context parallelism: exchange and fp32 merge.

A rank's last local sequence may continue on later ranks; its first may have started on
earlier ones. Over a fragment the recurrence is affine in the entering state,
`S -> M S + S_ext`, with M `[H, K]` (GLA: the diagonal of the total gate product) or
`[H, K, K]` (KDA: the product of the chunks' delta-rule transitions). Each rank computes
`(S_ext, M)` of its last fragment, the ranks exchange them, and every rank folds the
fragments of the earlier ranks that share its first
sequence: `S = 0; for j in prev: S = M_j S + S_ext_j`. The backward is the same fold in
reverse time with transposed transitions: `dS = 0; for j in later (far to near):
dS = M_j^T dS + dS_ext_j`, where dS_ext_j is the gradient leaving rank j's first fragment
with no gradient arriving from beyond rank j.

Where the messages come from. In each direction, a rank that receives nothing runs its
local pass first and sends that pass's result, with no pass of its own; a rank that sends
nothing receives first and starts its local pass from what it received. A rank that does
both (a middle rank) needs its message before what it receives is known: KDA walks the
fragment with its state kernel before its local pass (forward: its last fragment; backward:
its first, in reverse; cut into segments walked side by side where the device has room,
`FragmentSegments`); GLA runs its local pass from zero, sends that pass's result, and adds
the received state to the stored states afterwards (the recurrence is linear and its
transitions diagonal; KDA's state enters v_new, which cannot be corrected that way). M is
only read for a fragment that continues through its rank (the folds start from an origin
rank's S_ext), so KDA sends zeros for the others.

Every exchanged state is fp32 `[H, K, V]` per sequence (KDA's `state_v_first` layout is
turned into `[K, V]` by the op before it gets here).
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
# The forward fold chains the segments one K x K product after another: past 8 segments it
# cost more than the shorter walks saved (H200, HV=4: 16 segments took both walks from 0.24
# to 0.44 ms; scripts/bench_walks.py).
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
    """Forward pre-process merge: the fp32 state entering this rank's first local sequence.

    S_ext `[H, K, V]`, M `[H, K]` or `[H, K, K]`: this rank's last fragment's contribution and
    transition (any values when `post_num_ranks == 0`: nobody reads them). Collective over
    `context.group`: every rank must call it. Returns (None if the first local sequence
    starts on this rank, and the record for the backward).
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
    """Backward pre-process merge: the gradient arriving at the end of this rank's last
    local sequence from the later ranks (its `dht`), or None when that sequence ends here.

    dS_ext `[H, K, V]`: the gradient leaving this rank's first fragment when no gradient
    arrives from later ranks (any values when `pre_num_ranks == 0`). Collective.
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
    """The local `[num_seqs, *state_shape]` initial states of this rank's sequences.

    Row i is the user's state of global sequence `seq_ids[i]` when that sequence starts on this
    rank (`initial_state` is `[N_global, *state_shape]`, the same on every rank), and the merged
    incoming state S_in for a first sequence that started on an earlier rank (zero with S_in
    None: the state is added afterwards, as GLA's middle ranks do). None when every row would
    be zero (saves the kernels a read).
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
    """Gradient of the user's `[N_global, ...]` initial_state from the local `[num_seqs, ...]` one.

    Only rows of sequences that start on this rank carry a gradient here (summing the result
    over the ranks of the group gives the full gradient; the incoming row of a continued
    sequence belongs to the boundary exchange, not to the user). Rank 0 also owns the empty
    sequences, whose final state is their initial state: their rows get `dht_global`'s.
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
    empty sequences (final state = initial state, or zero)."""
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
    before its local reverse pass, around the op's message: `message(end, dht_first)`, fp32
    `[H, K, V]`, the gradient leaving the first local sequence (tokens [0, end)) with
    dht_first (its row of dht, layout as the states, or None) arriving at its end; required
    when an earlier rank reads it (`pre_num_ranks > 0`), else zeros go out. Returns the local
    dht `[num_seqs, *state_shape]` with the gradient from later ranks in the last sequence's
    row."""
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
    """GLA forward pre-process and merge of a rank that both receives and sends a state
    (`pre_num_ranks > 0`, `post_num_ranks > 0`), run after its local state pass.

    The local pass (`chunk_fwd_h`) started the first local sequence, which began on an
    earlier rank, from zero; so it already yields this rank's message: the last fragment's
    contribution S_ext (its final state from the state it starts with here) and its diagonal
    transition `exp(total log decay)`. After the exchange, the state S_in entering the first
    sequence is added to its per-chunk states (and to its final state when it ends here) in
    place: the recurrence is linear, so `h[c] += Diag(exp decay[c]) S_in` is the rerun from
    S_in, one pass over those states instead of a walk of the fragment before the local
    pass. (Adding it inside the kernels that read h, with no pass of its own, measured
    slower: BENCHMARKS.md.) Ranks that only send run their local pass first and send its
    final state (`send_final_state`); ranks that only receive receive first and start their
    local pass from it (`receive_state`).

    Args:
        h: `[1, NT, H, K, V]` per-chunk states of the local pass (updated in place).
        ht: fp32 `[num_seqs, H, K, V]` final states of the local pass (row 0 updated in place).
        decays: `chunk_fwd_h(output_decays=True)`'s (decay `[1, NT, H, K]`, total
            `[num_seqs, H, K]`).
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
    """GLA backward pre-process and merge of a rank that both receives and sends a gradient,
    run after its local reverse pass (`chunk_bwd_dh` with the last row of dht zero: that
    sequence continues on a later rank).

    The local pass's dh0 of the first local sequence is this rank's message, the gradient
    leaving its first fragment with none arriving from beyond this rank. The gradient dS_in
    arriving at the end of the last local sequence is then added to that sequence's per-chunk
    gradients (`dh[c] += Diag(exp decay[c]) dS_in`) and, when it starts here, to its dh0, in
    place. The other ranks: `send_first_state_grad`, `receive_final_state_grad`.

    Args:
        dh: fp32 `[1, NT, H, K, V]`; dh0: fp32 `[num_seqs, H, K, V]`; decay:
            `chunk_bwd_dh(output_decays=True)`'s `[1, NT, H, K]`.
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
    """A fragment cut into segments of whole chunks, for the state kernels to walk side by side.

    One walk of a fragment runs one program per (head, column block), each stepping through
    every chunk in turn, so its time is its length in chunks whenever the programs do not
    fill the SMs: 32 programs at HV=16, V=128 (64 columns each, `fragment_grad_walk`) leave
    three quarters of an H200's 132 SMs idle. Cut into S segments walked as independent
    sequences (the kernels' varlen path; chunks restart at each segment start, which is a
    chunk boundary of the fragment, so every chunk is the one of the unsplit walk) and then
    folded with the segments' transitions, it takes less: at HV=16 and 8192 tokens, 4
    segments of 64-column tiles walk the gradient in 0.12 ms against 0.26 ms for one walk of
    16-column tiles (BENCHMARKS.md).

    count: S, at most one per chunk (fewer when the chunks do not divide evenly);
    cu_seqlens, chunk_offsets: int64 `[S + 1]` on the device (the kernels' varlen arguments;
    None for S = 1, the plain walk); transitions: fp32 `[S, HV, K, K]`, set by
    `walk_fragment_state` (None for S = 1).
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
    """KDA forward pre-process and merge of a rank that receives a state (`pre_num_ranks >
    0`), run before its local state pass. kg, w, gk `[1, T, HV, K]`, u `[1, T, HV, V]` from
    the intra-chunk WY stage. Returns (S_in `[HV, K, V]` K-first; record).

    The message is the last local sequence's state from a zero start (S_ext) and, when that
    sequence continues through this rank (its only sequence, from an earlier rank to a later
    one), its transition M (`walk_fragment_state`, in as many segments as fit the SMs; the
    record keeps them for the backward walk). A last sequence that starts here needs no
    transition (the folds start from it: M is sent as zeros), so its pass runs on u alone,
    from the user's state: half the columns. Ranks that receive nothing run their local pass
    first and send its final state instead (`send_final_state`).
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
    """KDA backward (dhu) pre-process and merge of a rank that receives a gradient
    (`post_num_ranks > 0`), run before its local reverse pass: the local dht (layout as the
    states) with the gradient from later ranks in the last local sequence's row. dv: the
    intra-chunk gradient of v_new (`Aqk^T do`) of the local tokens. The message, when an
    earlier rank reads it, is a dhu pass over the first fragment from a zero gradient. Ranks
    that receive nothing run their local pass first and send its dh0
    (`send_first_state_grad`)."""
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
