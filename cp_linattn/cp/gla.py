"""GLA's state pass under context parallelism: correct after (cp/README.md, section 4).

A rank runs its local pass as if alone; what crosses its boundaries is added afterwards, since
GLA's diagonal recurrence is cheap to correct chunk by chunk (`add_decayed_state`).
"""
from __future__ import annotations

import torch

from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.exchange import (CPExchange, compress_h0, exchange_backward, exchange_forward, expand_h0,
                                    first_fragment, gather_final_state_grad, last_fragment, receive_final_state_grad,
                                    receive_state, scatter_final_state, send_final_state, send_first_state_grad)
from cp_linattn.cp.merge import add_decayed_state
from cp_linattn.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h


def gla_cp_fwd_h(
    k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, *, initial_state: torch.Tensor | None, output_final_state: bool,
    context: FLACPContext, chunk_size: int, **walk,
) -> tuple[torch.Tensor, torch.Tensor | None, CPExchange]:
    """`chunk_fwd_h` on this rank's shard, with the state the earlier ranks hand over.

    A rank that receives nothing sends its pass's last final state; one that receives and sends
    nothing more receives before its pass; a middle rank corrects its pass afterwards.

    Args:
        k, v, gk, chunk_size, walk: as in `chunk_fwd_h` (walk: cu_seqlens, chunk_indices,
            chunk_offsets, states_dtype).
        initial_state: the user's `[N_global, H, K, V]` states, or None.

    Returns:
        (h, the final state `[N_global, H, K, V]` with this rank's rows or None, the exchange).
    """
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    receives, sends = context.pre_num_ranks > 0, context.post_num_ranks > 0
    S_in = exchange = None
    if receives and not sends:
        S_in, exchange = receive_state(context, (H, K, V), diagonal=True)
    h, ht, decays = chunk_fwd_h(k, v, gk, h0=expand_h0(S_in, initial_state, context, (H, K, V)),
                                output_final_state=output_final_state or sends or not receives,
                                chunk_size=chunk_size, output_decays=receives and sends, **walk)
    if receives and sends:
        exchange = correct_incoming_state(h, ht, decays, context, chunk_size)
    elif not receives:
        exchange = send_final_state(ht, context, diagonal=True)
    ht = scatter_final_state(ht, context, context.global_num_seqs, initial_state) if output_final_state else None
    return h, ht, exchange


def gla_cp_bwd_dh(
    q: torch.Tensor, gk: torch.Tensor, do: torch.Tensor, scale: float, *, dht: torch.Tensor | None, need_dh0: bool,
    exchange: CPExchange, chunk_size: int, **walk,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_bwd_dh` on this rank's shard, with the gradient the later ranks hand back
    (the roles of `gla_cp_fwd_h`, mirrored).

    Args:
        q, gk, do, scale, chunk_size, walk: as in `chunk_bwd_dh`.
        dht: gradient of the `[N_global, H, K, V]` final state, or None.
        need_dh0: the user passed an initial state.

    Returns:
        (dh, the gradient of the user's `[N_global, H, K, V]` initial state or None).
    """
    context = exchange.context
    H, K, V = q.shape[2], q.shape[3], do.shape[3]
    receives, sends = context.post_num_ranks > 0, context.pre_num_ranks > 0
    if receives and not sends:
        dht_local = receive_final_state_grad(dht, exchange, (H, K, V))
    else:
        dht_local = gather_final_state_grad(dht, context)
    dh, dh0, decay = chunk_bwd_dh(q, gk, do, scale, dht=dht_local, need_dh0=need_dh0 or sends or not receives,
                                  chunk_size=chunk_size, output_decays=receives and sends, **walk)
    if receives and sends:
        correct_incoming_grad(dh, dh0, decay, exchange, chunk_size)
    elif not receives:
        send_first_state_grad(dh0, exchange)
    return dh, compress_h0(dh0, context, context.global_num_seqs, dht) if need_dh0 else None


def correct_incoming_state(h: torch.Tensor, ht: torch.Tensor, decays: tuple[torch.Tensor, torch.Tensor],
                            context: FLACPContext, chunk_size: int) -> CPExchange:
    """The forward exchange of a middle rank (`pre_num_ranks > 0`, `post_num_ranks > 0`), run
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
        The exchange, for the backward.
    """
    decay, total = decays
    S_in, exchange = exchange_forward(ht[-1], total[-1].exp(), context)
    end, ends_here = first_fragment(context)
    n = -(-end // chunk_size)
    add_decayed_state(h[0, :n], decay[0, :n], S_in)
    if ends_here:  # its final state is read
        ht[0] += total[0].exp()[..., None] * S_in
    return exchange


def correct_incoming_grad(dh: torch.Tensor, dh0: torch.Tensor, decay: torch.Tensor,
                           exchange: CPExchange, chunk_size: int) -> None:
    """The backward exchange of a middle rank, run after its local reverse pass (`chunk_bwd_dh`
    with the last row of dht zero): sends `dh0[0]`, then adds the received gradient to the last
    sequence's per-chunk gradients in place, `dh[c] += Diag(exp decay[c]) dS_in` (and to its
    dh0 when it starts here). cp/README.md, section 4 (correct after).

    Args:
        dh: fp32 `[1, NT, H, K, V]`; dh0: fp32 `[num_seqs, H, K, V]` (both updated in place);
            decay: `chunk_bwd_dh(output_decays=True)`'s `[1, NT, H, K]`.
        exchange: the forward's `CPExchange`.
    """
    context = exchange.context
    dS_in = exchange_backward(dh0[0], exchange)
    start, starts_here = last_fragment(context)
    NT = dh.shape[1]
    n = -(-(int(context.cu_seqlens_cpu[-1]) - start) // chunk_size)
    add_decayed_state(dh[0, NT - n:], decay[0, NT - n:], dS_in)
    if starts_here:  # its dh0 is read
        dh0[-1] += exchange.M_local[..., None] * dS_in
