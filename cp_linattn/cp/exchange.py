"""Boundary states under context parallelism: the exchange between ranks and its fp32 merge,
shared by every op; the ops' own state passes under CP are in cp/gla.py and cp/kda.py.

Over a fragment the recurrence is affine in the entering state, `S -> M S + S_ext` (M `[H, K]`
for GLA, `[H, K, K]` for KDA). Every part (a range of the layout, `CPPart`) exchanges
`(S_ext, M)` of its last fragment, and each part folds those of the earlier parts of the chain
that share its first sequence; the backward folds the gradients of the later parts with `M^T`.
A rank sends and receives for all its parts at once: its messages are stacked `[P, ...]`,
one row per local part. Which rank computes what and when (GLA's middle ranks correct
their states after the exchange, KDA's walk their fragment before it), the segments and the
initial/final states: cp/README.md, sections 2-5 and 7. Every exchanged state is fp32
`[H, K, V]` (K-first: the ops turn `state_v_first` states round before calling here).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cp_linattn.cp.comm import all_gather_parts, send_recv_chain
from cp_linattn.cp.context import CPPart, FLACPContext, empty_seq_ids
from cp_linattn.cp.merge import fold_states

if TYPE_CHECKING:
    from cp_linattn.cp.kda import FragmentSegments

CHUNK_SIZE = 64


def apply_transition(M: torch.Tensor, S: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """`M S` (or `M^T S`) for a diagonal M `[H, K]` or a full M `[H, K, K]`; S `[H, K, V]`."""
    if M.dim() == S.dim() - 1:
        return M[..., None] * S
    return (M.transpose(-1, -2) if transpose else M) @ S


class CPExchange:
    """What the forward exchange learnt, kept for the backward fold.

    Built in the op's forward by `exchange_forward`; `exchange_backward` uses the gathered
    transitions in chain order (all_gather) or this rank's own (send_recv).
    """

    def __init__(self, context: FLACPContext, M_local: torch.Tensor, M_chain: torch.Tensor | None):
        self.context = context
        self.M_local = M_local  # [P, H, K] or [P, H, K, K]: each local part's transition
        self.M_chain = M_chain  # every part's, in chain order (all_gather only)
        # KDA: the segments a part's forward walk cut its fragment into (with each segment's
        # transition), by local part index, for the backward walk of the same tokens.
        self.segments: dict[int, FragmentSegments] = {}


def exchange_forward(
    S_ext: torch.Tensor, M: torch.Tensor, context: FLACPContext
) -> tuple[list[torch.Tensor | None], CPExchange]:
    """Forward exchange and merge: the fp32 state entering each local part's first sequence.

    Collective over `context.group`: every rank must call it (cp/README.md, sections 2 and 6).

    Args:
        S_ext: `[P, H, K, V]`, each local part's last fragment's final state from a zero start;
            M: its transition, `[P, H, K]` or `[P, H, K, K]` (any values for a part that
            does not send: nobody reads them).

    Returns:
        (per local part: S_in fp32 `[H, K, V]`, or None when its first sequence starts in it;
        the `CPExchange` for the backward).
    """
    S_ext, M = S_ext.float().contiguous(), M.float().contiguous()
    parts = context.parts
    if context.comm == "all_gather":
        H = S_ext.shape[1]
        packed = all_gather_parts(torch.cat([S_ext.flatten(1), M.flatten(1)], 1), context)
        states = packed[:, : S_ext[0].numel()].view(-1, *S_ext.shape[1:])
        transitions = packed[:, S_ext[0].numel():].view(-1, H, *M.shape[2:])
        S_in = [fold_states(states, transitions, range(p.slot - p.pre_num_parts, p.slot)) if p.receives else None
                for p in parts]
        return S_in, CPExchange(context, M, transitions)

    def outgoing(i: int, S_in: torch.Tensor | None) -> torch.Tensor:
        continues_through = parts[i].num_seqs == 1 and S_in is not None
        return apply_transition(M[i], S_in) + S_ext[i] if continues_through else S_ext[i]

    S_in = send_recv_chain(outgoing, context, shape=S_ext.shape[1:], direction="forward")
    return S_in, CPExchange(context, M, None)


def exchange_backward(dS_ext: torch.Tensor, exchange: CPExchange) -> list[torch.Tensor | None]:
    """Backward exchange and merge: the gradient arriving at the end of each local part's
    last sequence from the later parts (its `dht` row). Collective (cp/README.md, sections 2
    and 6).

    Args:
        dS_ext: `[P, H, K, V]`, the gradient leaving each local part's first fragment when none
            arrives from later parts (any values for a part that does not receive).
        exchange: the forward's `CPExchange`.

    Returns:
        per local part: fp32 `[H, K, V]`, or None when its last sequence ends in it.
    """
    context = exchange.context
    dS_ext = dS_ext.float().contiguous()
    parts = context.parts
    if context.comm == "all_gather":
        grads = all_gather_parts(dS_ext, context)
        return [fold_states(grads, exchange.M_chain, range(p.slot + p.post_num_parts, p.slot, -1), transpose=True)
                if p.sends else None for p in parts]  # far to near

    def outgoing(i: int, dS_in: torch.Tensor | None) -> torch.Tensor:
        continues_through = parts[i].num_seqs == 1 and dS_in is not None
        return apply_transition(exchange.M_local[i], dS_in, True) + dS_ext[i] if continues_through else dS_ext[i]

    return send_recv_chain(outgoing, context, shape=dS_ext.shape[1:], direction="backward")


def part_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`x[rows]` as `[len(rows), ...]`: a view for one row (one part per rank), else a copy."""
    return x[rows[0]:rows[0] + 1] if len(rows) == 1 else x[rows]


def expand_h0(
    S_in: list[torch.Tensor | None], initial_state: torch.Tensor | None, context: FLACPContext,
    state_shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The local `[num_seqs, *state_shape]` initial states (cp/README.md, section 7).

    Row i is the user's state of global sequence `seq_ids[i]` when it starts in its part
    (`initial_state`: `[N_global, *state_shape]`, the same on every rank); the first row of a
    part whose first sequence began in an earlier part is its S_in (zero when None: GLA's
    middle ranks add it afterwards). None when every row would be zero (saves the kernels a read).
    """
    if all(s is None for s in S_in) and initial_state is None:
        return None
    if initial_state is None:
        h0 = next(s for s in S_in if s is not None).new_zeros(context.num_seqs, *state_shape)
    else:
        h0 = initial_state.float()[context.seq_ids.to(initial_state.device)].clone()
    for part, s in zip(context.parts, S_in):
        if part.receives:
            h0[part.seq_begin] = 0 if s is None else s.view(state_shape)
    return h0


def _starts_here(context: FLACPContext) -> torch.Tensor:
    """bool `[num_seqs]` (CPU): the local sequences that start in their part."""
    mask = torch.ones(context.num_seqs, dtype=torch.bool)
    mask[[p.seq_begin for p in context.parts if p.receives]] = False
    return mask


def _ends_here(context: FLACPContext) -> torch.Tensor:
    """bool `[num_seqs]` (CPU): the local sequences that end in their part."""
    mask = torch.ones(context.num_seqs, dtype=torch.bool)
    mask[[p.seq_end - 1 for p in context.parts if p.sends]] = False
    return mask


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
    own = _starts_here(context)
    out[context.seq_ids[own].to(out.device)] = dh0_local[own.to(out.device)]
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
    own = _ends_here(context)
    out[context.seq_ids[own].to(out.device)] = ht_local[own.to(out.device)]
    empty = empty_seq_ids(context).to(out.device)
    if context.rank == 0 and initial_state is not None and empty.numel():
        out[empty] = initial_state[empty].float()
    return out


def gather_final_state_grad(dht_global: torch.Tensor | None, context: FLACPContext) -> torch.Tensor | None:
    """Local `[num_seqs, ...]` dht from the gradient of `scatter_final_state`'s output; the row
    of a part's last sequence that continues in later parts is left zero (the exchange fills it)."""
    if dht_global is None:
        return None
    dht = dht_global.float()[context.seq_ids.to(dht_global.device)].clone()
    dht[~_ends_here(context).to(dht.device)] = 0
    return dht


# ---------------------------------------------------------------------------------------
# The pre-processes: (S_ext, M) of the last fragment and dS_ext of the first. KDA's middle
# ranks compute them with the state kernels on that fragment alone (chunks restart at every
# sequence start, so a fragment is a standalone single-sequence batch); GLA's read them off
# their local passes and correct those passes afterwards.


def user_state_of_last(initial_state: torch.Tensor | None, context: FLACPContext, part: CPPart, v_first: bool):
    """The user's initial state `[1, H, K, V]` of a part's last sequence if it starts there."""
    if initial_state is None or not part.last_seq_starts_here:
        return None
    h0 = initial_state[context.seq_ids[part.seq_end - 1:part.seq_end].to(initial_state.device)].float()
    return h0.transpose(-1, -2) if v_first else h0


def receives_any(context: FLACPContext) -> bool:
    """Some local part's first sequence began in an earlier part (a state arrives)."""
    return any(p.receives for p in context.parts)


def sends_any(context: FLACPContext) -> bool:
    """Some local part's last sequence goes on in a later part (a gradient arrives)."""
    return any(p.sends for p in context.parts)


def _k_first(x: torch.Tensor, v_first: bool) -> torch.Tensor:
    return x.transpose(-1, -2) if v_first else x


def _with_incoming_grad(dht: torch.Tensor | None, dS_in: list[torch.Tensor | None], context: FLACPContext,
                        state_shape: tuple[int, ...], v_first: bool) -> torch.Tensor | None:
    for part, g in zip(context.parts, dS_in):
        if g is None:
            continue
        if dht is None:
            dht = g.new_zeros(context.num_seqs, *state_shape)
        dht[part.seq_end - 1] = _k_first(g, v_first)
    return dht


def receive_final_state_grad(dht_global: torch.Tensor | None, exchange: CPExchange,
                             state_shape: tuple[int, int, int], v_first: bool = False,
                             message: Callable[[int, torch.Tensor | None], torch.Tensor] | None = None,
                             ) -> torch.Tensor | None:
    """Backward exchange of a rank that receives a gradient (some part sends), run before its
    local reverse pass (cp/README.md, sections 3 and 4).

    Args:
        dht_global: gradient of the `[N_global, ...]` final state, or None.
        exchange: the forward's `CPExchange`.
        state_shape: the local states' shape per sequence, `(H, K, V)` (`(H, V, K)` if v_first).
        message: `message(i, dht_first)` -> fp32 `[H, K, V]`, the gradient leaving local part
            i's first fragment (tokens `[part.offset, part.first_seq_end)`) with dht_first (its
            dht row, layout as the states, or None) arriving at its end; called for every
            part that receives (zeros go out for the others).

    Returns:
        The local dht `[num_seqs, *state_shape]`, the gradients from later parts in the rows of
        the parts' last sequences.
    """
    context = exchange.context
    dht = gather_final_state_grad(dht_global, context)
    H, K, V = (state_shape[0], state_shape[2], state_shape[1]) if v_first else state_shape
    dS_ext = torch.zeros(context.num_parts, H, K, V, dtype=torch.float32, device=context.device)
    for i, part in enumerate(context.parts):
        if part.receives:
            first = dht[part.seq_begin] if part.first_seq_ends_here and dht is not None else None
            dS_ext[i] = message(i, first)
    return _with_incoming_grad(dht, exchange_backward(dS_ext, exchange), context, state_shape, v_first)


def receive_state(context: FLACPContext, state_shape: tuple[int, int, int],
                  diagonal: bool) -> tuple[list[torch.Tensor | None], CPExchange]:
    """Forward exchange of a rank that receives a state and sends none (no part sends), run
    before its local pass: zeros go out (nobody reads them), with the transition's shape of
    the op (`[H, K]` for a `diagonal` one, else `[H, K, K]`). state_shape: `(H, K, V)`.
    Returns (per local part: S_in fp32 `[H, K, V]` or None, exchange)."""
    zeros = torch.zeros(context.num_parts, *state_shape, dtype=torch.float32, device=context.device)
    return exchange_forward(zeros, _zero_transition(zeros, diagonal), context)


def _zero_transition(S: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """The transitions `[P, ...]` of parts whose last fragment starts a sequence (nothing
    crosses it) or that send nothing; S `[P, H, K, V]`."""
    P, H, K = S.shape[:3]
    return S.new_zeros((P, H, K) if diagonal else (P, H, K, K))


def last_rows(context: FLACPContext) -> list[int]:
    """The local row of each part's last sequence."""
    return [p.seq_end - 1 for p in context.parts]


def first_rows(context: FLACPContext) -> list[int]:
    """The local row of each part's first sequence."""
    return [p.seq_begin for p in context.parts]


def send_final_state(final_state: torch.Tensor, context: FLACPContext, diagonal: bool,
                     state_v_first: bool = False) -> CPExchange:
    """Forward exchange of a rank that receives no state (no part receives), run after its
    local state pass: that pass started every local sequence from its own state, so each
    part's last final state (fp32 rows of `final_state`, layout as the states) is its
    message, and that sequence starts in the part (no transition: zeros). No walk of its own.
    Returns the exchange."""
    S_ext = _k_first(part_rows(final_state, last_rows(context)), state_v_first)
    _, exchange = exchange_forward(S_ext, _zero_transition(S_ext, diagonal), context)
    return exchange


def send_first_state_grad(dh0: torch.Tensor, exchange: CPExchange, state_v_first: bool = False) -> None:
    """Backward exchange of a rank that receives no gradient (no part sends), run after its
    local reverse pass: with nothing arriving, that pass's gradient of each part's first
    sequence's initial state (rows of `dh0`, fp32, layout as the states) is its message
    (read only when that sequence began in an earlier part). No walk of its own."""
    exchange_backward(_k_first(part_rows(dh0, first_rows(exchange.context)), state_v_first), exchange)
