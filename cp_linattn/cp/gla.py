"""GLA's state pass under context parallelism: correct after (cp/README.md, section 4).

A rank runs its local pass as if alone; what crosses its boundaries is added afterwards, since
GLA's diagonal recurrence is cheap to correct chunk by chunk (`add_decayed_state`).
"""
from __future__ import annotations

import torch

from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.exchange import (CPExchange, compress_h0, exchange_backward, exchange_forward, expand_h0,
                                    first_rows, gather_final_state_grad, last_rows, part_rows, receive_final_state_grad,
                                    receive_state, receives_any, scatter_final_state, send_final_state,
                                    send_first_state_grad, sends_any)
from cp_linattn.cp.merge import add_decayed_state
from cp_linattn.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h


def gla_cp_fwd_h(
    k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, *, initial_state: torch.Tensor | None, output_final_state: bool,
    context: FLACPContext, chunk_size: int, **walk,
) -> tuple[torch.Tensor, torch.Tensor | None, CPExchange]:
    """`chunk_fwd_h` on this rank's shard, with the state the earlier ranks hand over.

    A rank none of whose parts receives sends its pass's final states; one that receives and
    sends nothing receives before its pass; any other corrects its pass afterwards.

    Args:
        k, v, gk, chunk_size, walk: as in `chunk_fwd_h` (walk: cu_seqlens, chunk_indices,
            chunk_offsets, states_dtype).
        initial_state: the user's `[N_global, H, K, V]` states, or None.

    Returns:
        (h, the final state `[N_global, H, K, V]` with this rank's rows or None, the exchange).
    """
    H, K, V = k.shape[2], k.shape[3], v.shape[3]
    receives, sends = receives_any(context), sends_any(context)
    S_in, exchange = [None] * context.num_parts, None
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
    receives, sends = sends_any(context), receives_any(context)
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


def _chunk_span(context: FLACPContext, seq: int, chunk_size: int) -> slice:
    """The chunks of local sequence `seq` in the `[1, NT, ...]` per-chunk tensors (chunks
    restart at every local sequence start)."""
    n = (context.cu_seqlens_cpu.diff() + chunk_size - 1) // chunk_size
    first = int(n[:seq].sum())
    return slice(first, first + int(n[seq]))


def correct_incoming_state(h: torch.Tensor, ht: torch.Tensor, decays: tuple[torch.Tensor, torch.Tensor],
                            context: FLACPContext, chunk_size: int) -> CPExchange:
    """The forward exchange of a rank that both receives and sends, run after its local pass
    (`chunk_fwd_h`, each part's first sequence started from zero): sends each part's last
    final state and total decay, then adds the received state to a receiving part's first
    sequence's states in place, `h[c] += Diag(exp decay[c]) S_in` (and to its final state when
    it ends in the part). cp/README.md, section 4 (correct after).

    Args:
        h: `[1, NT, H, K, V]` per-chunk states of the local pass (updated in place).
        ht: fp32 `[num_seqs, H, K, V]` final states of the local pass (updated in place).
        decays: `chunk_fwd_h(output_decays=True)`'s (decay `[1, NT, H, K]`, total
            `[num_seqs, H, K]`).

    Returns:
        The exchange, for the backward.
    """
    decay, total = decays
    last = last_rows(context)
    S_in, exchange = exchange_forward(part_rows(ht, last), part_rows(total, last).exp(), context)
    for part, s in zip(context.parts, S_in):
        if s is None:
            continue
        span = _chunk_span(context, part.seq_begin, chunk_size)
        add_decayed_state(h[0, span], decay[0, span], s)
        if part.first_seq_ends_here:  # its final state is read
            ht[part.seq_begin] += total[part.seq_begin].exp()[..., None] * s
    return exchange


def correct_incoming_grad(dh: torch.Tensor, dh0: torch.Tensor, decay: torch.Tensor,
                           exchange: CPExchange, chunk_size: int) -> None:
    """The backward exchange of a rank that both receives and sends, run after its local
    reverse pass (`chunk_bwd_dh` with the rows of the parts' continuing last sequences of dht
    zero): sends each part's first-sequence `dh0` row, then adds the received gradient to a
    sending part's last sequence's per-chunk gradients in place, `dh[c] += Diag(exp decay[c])
    dS_in` (and to its dh0 when it starts in the part). cp/README.md, section 4.

    Args:
        dh: fp32 `[1, NT, H, K, V]`; dh0: fp32 `[num_seqs, H, K, V]` (both updated in place);
            decay: `chunk_bwd_dh(output_decays=True)`'s `[1, NT, H, K]`.
        exchange: the forward's `CPExchange`.
    """
    context = exchange.context
    dS_in = exchange_backward(part_rows(dh0, first_rows(context)), exchange)
    for i, (part, g) in enumerate(zip(context.parts, dS_in)):
        if g is None:
            continue
        span = _chunk_span(context, part.seq_end - 1, chunk_size)
        add_decayed_state(dh[0, span], decay[0, span], g)
        if part.last_seq_starts_here:  # its dh0 is read
            dh0[part.seq_end - 1] += exchange.M_local[i][..., None] * g
