"""Boundary states under context parallelism: the exchange between ranks and its fp32 merge,
shared by every op; the ops' own state passes under CP are in cp/gla.py and cp/kda.py.

Over a fragment the recurrence is affine in the entering state, `S -> M S + S_ext` (M `[H, K]`
for GLA, `[H, K, K]` for KDA). Each rank exchanges `(S_ext, M)` of its last fragment and folds
those of the earlier ranks that share its first sequence; the backward folds the gradients
of the later ranks with `M^T`. Which rank computes what and when (GLA's middle ranks correct
their states after the exchange, KDA's walk their fragment before it), the segments and the
initial/final states: cp/README.md, sections 2-5 and 7. Every exchanged state is fp32
`[H, K, V]` (K-first: the ops turn `state_v_first` states round before calling here).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cp_linattn.cp.comm import all_gather_tensor, send_recv_chain
from cp_linattn.cp.context import FLACPContext, empty_seq_ids
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
) -> tuple[torch.Tensor | None, CPExchange]:
    """Forward exchange and merge: the fp32 state entering this rank's first local sequence.

    Collective over `context.group`: every rank must call it (cp/README.md, sections 2 and 6).

    Args:
        S_ext: `[H, K, V]`, the last fragment's final state from a zero start; M: its
            transition, `[H, K]` or `[H, K, K]` (any values when `post_num_ranks == 0`:
            nobody reads them).

    Returns:
        (S_in fp32 `[H, K, V]`, or None when the first local sequence starts on this rank;
        the `CPExchange` for the backward).
    """
    S_ext, M = S_ext.float().contiguous(), M.float().contiguous()
    if context.comm == "all_gather":
        packed = all_gather_tensor(torch.cat([S_ext.flatten(), M.flatten()]), context.group)
        states = packed[:, : S_ext.numel()].view(-1, *S_ext.shape)
        transitions = packed[:, S_ext.numel():].view(-1, *M.shape)
        r, pre = context.rank, context.pre_num_ranks
        S_in = fold_states(states, transitions, range(r - pre, r)) if pre else None
        return S_in, CPExchange(context, M, transitions)

    def outgoing(S_in: torch.Tensor | None) -> torch.Tensor:
        continues_through = context.num_seqs == 1 and S_in is not None
        return apply_transition(M, S_in) + S_ext if continues_through else S_ext

    S_in = send_recv_chain(outgoing, context, shape=S_ext.shape, direction="forward")
    return S_in, CPExchange(context, M, None)


def exchange_backward(dS_ext: torch.Tensor, exchange: CPExchange) -> torch.Tensor | None:
    """Backward exchange and merge: the gradient arriving at the end of this rank's last
    local sequence from the later ranks (its `dht` row). Collective (cp/README.md, sections 2
    and 6).

    Args:
        dS_ext: `[H, K, V]`, the gradient leaving this rank's first fragment when none arrives
            from later ranks (any values when `pre_num_ranks == 0`).
        exchange: the forward's `CPExchange`.

    Returns:
        fp32 `[H, K, V]`, or None when the last local sequence ends here.
    """
    context = exchange.context
    dS_ext = dS_ext.float().contiguous()
    if context.comm == "all_gather":
        grads = all_gather_tensor(dS_ext, context.group)
        r, post = context.rank, context.post_num_ranks
        if not post:
            return None
        return fold_states(grads, exchange.M_all, range(r + post, r, -1), transpose=True)  # far to near

    def outgoing(dS_in: torch.Tensor | None) -> torch.Tensor:
        continues_through = context.num_seqs == 1 and dS_in is not None
        return apply_transition(exchange.M_local, dS_in, True) + dS_ext if continues_through else dS_ext

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


def last_fragment(context: FLACPContext) -> tuple[int, bool]:
    """(first local token of the last local sequence, whether that sequence starts here)."""
    return int(context.cu_seqlens_cpu[-2]), context.num_seqs > 1 or context.pre_num_ranks == 0


def first_fragment(context: FLACPContext) -> tuple[int, bool]:
    """(end of the first local sequence, whether that sequence ends here)."""
    return int(context.cu_seqlens_cpu[1]), context.num_seqs > 1 or context.post_num_ranks == 0


def user_state_of_last(initial_state: torch.Tensor | None, context: FLACPContext, v_first: bool):
    """The user's initial state `[1, H, K, V]` of the last local sequence if it starts here."""
    start, starts_here = last_fragment(context)
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


def receive_final_state_grad(dht_global: torch.Tensor | None, exchange: CPExchange,
                             state_shape: tuple[int, int, int], v_first: bool = False,
                             message: Callable[[int, torch.Tensor | None], torch.Tensor] | None = None,
                             ) -> torch.Tensor | None:
    """Backward exchange of a rank that receives a gradient (`post_num_ranks > 0`), run
    before its local reverse pass (cp/README.md, sections 3 and 4).

    Args:
        dht_global: gradient of the `[N_global, ...]` final state, or None.
        exchange: the forward's `CPExchange`.
        state_shape: the local states' shape per sequence, `(H, K, V)` (`(H, V, K)` if v_first).
        message: `message(end, dht_first)` -> fp32 `[H, K, V]`, the gradient leaving the
            first local sequence (tokens `[0, end)`) with dht_first (its dht row, layout as the
            states, or None) arriving at its end; required when `pre_num_ranks > 0`, else
            zeros go out.

    Returns:
        The local dht `[num_seqs, *state_shape]`, the gradient from later ranks in the last row.
    """
    context = exchange.context
    dht = gather_final_state_grad(dht_global, context)
    if context.pre_num_ranks:
        end, ends_here = first_fragment(context)
        dS_ext = message(end, dht[0] if ends_here and dht is not None else None)
    else:
        H, K, V = (state_shape[0], state_shape[2], state_shape[1]) if v_first else state_shape
        dS_ext = torch.zeros(H, K, V, dtype=torch.float32, device=context.device)
    return _with_incoming_grad(dht, exchange_backward(dS_ext, exchange), context, state_shape, v_first)


def receive_state(context: FLACPContext, state_shape: tuple[int, int, int],
                  diagonal: bool) -> tuple[torch.Tensor, CPExchange]:
    """Forward exchange of a rank that receives a state and sends none (`pre_num_ranks > 0`,
    `post_num_ranks == 0`), run before its local pass: zeros go out (nobody reads them), with
    the transition's shape of the op (`[H, K]` for a `diagonal` one, else `[H, K, K]`).
    state_shape: `(H, K, V)`. Returns (S_in fp32 `[H, K, V]`, exchange)."""
    zeros = torch.zeros(state_shape, dtype=torch.float32, device=context.device)
    return exchange_forward(zeros, _zero_transition(zeros, diagonal), context)


def _zero_transition(S: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """The transition a rank sends whose fragment starts a sequence (nothing crosses it)."""
    H, K = S.shape[:2]
    return S.new_zeros((H, K) if diagonal else (H, K, K))


def send_final_state(final_state: torch.Tensor, context: FLACPContext, diagonal: bool,
                     state_v_first: bool = False) -> CPExchange:
    """Forward exchange of a rank that receives no state (`pre_num_ranks == 0`), run after its
    local state pass: that pass started every local sequence from its own state, so the last
    one's final state (fp32 `final_state[-1]`, layout as the states) is the message, and that
    sequence starts here (no transition: zeros, `[H, K]` for a `diagonal` one, else
    `[H, K, K]`). No walk of its own. Returns the exchange."""
    S_ext = final_state[-1].transpose(-1, -2) if state_v_first else final_state[-1]
    _, exchange = exchange_forward(S_ext, _zero_transition(S_ext, diagonal), context)
    return exchange


def send_first_state_grad(dh0: torch.Tensor, exchange: CPExchange, state_v_first: bool = False) -> None:
    """Backward exchange of a rank that receives no gradient (`post_num_ranks == 0`), run
    after its local reverse pass: with nothing arriving, that pass's gradient of the first
    local sequence's initial state (`dh0[0]`, fp32, layout as the states) is the message
    (read only when that sequence began on an earlier rank). No walk of its own."""
    exchange_backward(dh0[0].transpose(-1, -2) if state_v_first else dh0[0], exchange)


