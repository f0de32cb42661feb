"""Boundary states under context parallelism: exchange and fp32 merge.

A rank's last local sequence may continue on later ranks; its first may have started on
earlier ones. Over a fragment the recurrence is affine in the entering state,
`S -> M S + S_ext`, with M `[H, K]` (GLA: the diagonal of the total gate product) or
`[H, K, K]` (KDA: the product of the chunks' delta-rule transitions). Each rank computes
`(S_ext, M)` of its last fragment with the op's own state kernels (ops/common), the ranks
exchange them, and every rank folds the fragments of the earlier ranks that share its first
sequence: `S = 0; for j in prev: S = M_j S + S_ext_j`. The backward is the same fold in
reverse time with transposed transitions: `dS = 0; for j in later (far to near):
dS = M_j^T dS + dS_ext_j`, where dS_ext_j is the gradient leaving rank j's first fragment
with no gradient arriving from beyond rank j.

Every state here is fp32 `[H, K, V]` per sequence (KDA's `state_v_first` layout is turned
into `[K, V]` by the op before it gets here).
"""
from __future__ import annotations

import torch

from cp_linattn.cp.comm import all_gather_tensor, send_recv_chain
from cp_linattn.cp.context import FLACPContext, empty_seq_ids


def apply_transition(M: torch.Tensor, S: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """`M S` (or `M^T S`) for a diagonal M `[H, K]` or a full M `[H, K, K]`; S `[H, K, V]`."""
    if M.dim() == S.dim() - 1:
        return M[..., None] * S
    return (M.transpose(-1, -2) if transpose else M) @ S


def _fold(states: list[torch.Tensor], transitions: list[torch.Tensor], transpose: bool) -> torch.Tensor:
    S = torch.zeros_like(states[0])
    for S_ext, M in zip(states, transitions):
        S = apply_transition(M, S, transpose) + S_ext
    return S


class BoundaryExchange:
    """What the forward exchange learnt, kept for the backward fold.

    Built in the op's forward by `exchange_forward`; `exchange_backward` uses the gathered
    transitions of the later ranks (all_gather) or this rank's own (send_recv).
    """

    def __init__(self, context: FLACPContext, M_local: torch.Tensor, M_all: torch.Tensor | None):
        self.context = context
        self.M_local = M_local
        self.M_all = M_all


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
        S_in = _fold(list(states[r - pre: r]), list(transitions[r - pre: r]), False) if pre else None
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
        later = range(r + post, r, -1)
        return _fold([grads[j] for j in later], [record.M_all[j] for j in later], True)

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
    incoming state S_in for a first sequence that started on an earlier rank. None when every
    row would be zero (saves the kernels a read).
    """
    if S_in is None and initial_state is None:
        return None
    if initial_state is None:
        h0 = S_in.new_zeros(context.num_seqs, *state_shape)
    else:
        h0 = initial_state.float()[context.seq_ids.to(initial_state.device)].clone()
    if S_in is not None:
        h0[0] = S_in.view(state_shape)
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
