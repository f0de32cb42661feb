"""KDA's state pass under context parallelism: walk before (cp/README.md, sections 4 and 5).

The delta rule's transition is a full `[K, K]` map, too costly to apply per chunk afterwards,
so a rank first walks the fragment that crosses its boundary for its message, then runs its
local pass once from the right state.
"""
from __future__ import annotations

import functools

import torch
import triton

from cp_linattn.cp.context import FLACPContext
from cp_linattn.cp.exchange import (CPExchange, compress_h0, exchange_forward, expand_h0, gather_final_state_grad,
                                    receive_final_state_grad, receive_state, receives_any, scatter_final_state,
                                    send_final_state, send_first_state_grad, sends_any, user_state_of_last)
from cp_linattn.cp.merge import fold_states
from cp_linattn.ops.common.chunk_delta_h import (chunk_delta_rule_bwd_dhu, chunk_delta_rule_fwd_h,
                                                 delta_state_block_sizes)
from cp_linattn.ops.common.index import whole_chunk_segments


def kda_cp_fwd_h(
    kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gk: torch.Tensor, *, initial_state: torch.Tensor | None,
    output_final_state: bool, context: FLACPContext, state_v_first: bool, chunk_size: int, **walk,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, CPExchange]:
    """`chunk_delta_rule_fwd_h` on this rank's shard, from the state the earlier ranks hand over.

    A rank some part of which receives a state walks for its messages and exchanges before its
    local pass; one that receives none runs its pass first, and that pass's final states are
    its messages.

    Args:
        kg, w, u, gk, chunk_size, walk: as in `chunk_delta_rule_fwd_h` (walk: cu_seqlens,
            chunk_indices, chunk_offsets).
        initial_state: the user's `[N_global, ...]` states or None, laid out as `state_v_first`.

    Returns:
        (h, v_new, the final state `[N_global, ...]` with this rank's rows or None, the exchange).
    """
    HV, K, V = kg.shape[2], kg.shape[3], u.shape[3]
    sends_after_pass = not receives_any(context)
    S_in, exchange = [None] * context.num_parts, None
    if not sends_after_pass:
        S_in, exchange = walk_incoming_state(kg, w, u, gk, initial_state, context, state_v_first, chunk_size)
        if state_v_first:
            S_in = [s if s is None else s.transpose(-1, -2) for s in S_in]
    h0 = expand_h0(S_in, initial_state, context, (HV, V, K) if state_v_first else (HV, K, V))
    h, v_new, ht = chunk_delta_rule_fwd_h(kg, w, u, gk, initial_state=h0,
                                          output_final_state=output_final_state or sends_after_pass,
                                          chunk_size=chunk_size, state_v_first=state_v_first, **walk)
    if sends_after_pass:
        exchange = send_final_state(ht, context, diagonal=False, state_v_first=state_v_first)
    ht = scatter_final_state(ht, context, context.global_num_seqs, initial_state) if output_final_state else None
    return h, v_new, ht, exchange


def kda_cp_bwd_dhu(
    qg: torch.Tensor, kg: torch.Tensor, w: torch.Tensor, gk: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
    scale: float, *, dht: torch.Tensor | None, need_dh0: bool, exchange: CPExchange, state_v_first: bool,
    chunk_size: int, **walk,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`chunk_delta_rule_bwd_dhu` on this rank's shard, with the gradient the later ranks hand
    back (the roles of `kda_cp_fwd_h`, mirrored).

    Args:
        qg, kg, w, gk, do, dv, scale, chunk_size, walk: as in `chunk_delta_rule_bwd_dhu`.
        dht: gradient of the `[N_global, ...]` final state, or None.
        need_dh0: the user passed an initial state.

    Returns:
        (dh, the gradient of the user's `[N_global, ...]` initial state (fp32) or None, dv2).
    """
    context = exchange.context
    sends_after_pass = not sends_any(context)
    if sends_after_pass:
        dht_local = gather_final_state_grad(dht, context)
    else:
        dht_local = walk_incoming_grad(qg, kg, w, gk, do, dv, scale, dht, exchange, state_v_first, chunk_size)
    dh, dh0, dv2 = chunk_delta_rule_bwd_dhu(qg, kg, w, gk, do, dv, scale, dht=dht_local,
                                            need_dh0=need_dh0 or sends_after_pass, chunk_size=chunk_size,
                                            state_v_first=state_v_first, **walk)
    if sends_after_pass:
        send_first_state_grad(dh0, exchange, state_v_first)
    return dh, compress_h0(dh0, context, context.global_num_seqs, dht) if need_dh0 else None, dv2


# Past 8 segments the fold's chained K x K products cost more than the shorter walks save
# (scripts/tools/bench_walks.py measures it).
MAX_SEGMENTS = 8


class FragmentSegments:
    """A fragment cut into segments of whole chunks, walked side by side by the state kernels
    as independent sequences and folded with the segments' transitions: a walk whose programs
    do not fill the device then takes less time (cp/README.md, section 5).

    Attributes:
        count: S, at most one per chunk (fewer when the chunks do not divide evenly).
        chunk_size: the walks' chunk size.
        cu_seqlens, chunk_offsets: int64 `[S + 1]` on the device, the kernels' varlen
            arguments (None for S = 1, the plain walk).
        transitions: fp32 `[S, HV, K, K]`, set by `cp_fwd_fragment_h` (None for S = 1).
    """

    def __init__(self, n_tokens: int, count: int, device: torch.device, chunk_size: int):
        n_chunks = -(-n_tokens // chunk_size)
        self.chunk_size = chunk_size
        self.count, per_segment = whole_chunk_segments(n_chunks, count)
        self.cu_seqlens = self.chunk_offsets = None
        if self.count > 1:
            self.cu_seqlens, self.chunk_offsets = _segment_offsets(n_tokens, per_segment, self.count, device,
                                                                   chunk_size)
        self.transitions: torch.Tensor | None = None

    @classmethod
    def filling(cls, n_tokens: int, programs: int, device: torch.device, chunk_size: int) -> FragmentSegments:
        """As many segments of a walk of `programs` programs as fit the SMs side by side (1
        when one walk fills them: no fold, no extra launch), at most MAX_SEGMENTS."""
        return cls(n_tokens, min(MAX_SEGMENTS, _parallel_slots(device) // programs), device, chunk_size)


def _parallel_slots(device: torch.device) -> int:
    """Programs the device runs at once, one per SM. The interpreter has none; 4 there keeps
    the CPU tests on the segmented path."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=64)
def _segment_offsets(n_tokens: int, per_segment: int, count: int, device: torch.device, chunk_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached: every layer of a step walks the same fragment."""
    starts = torch.arange(count + 1, device=device)
    n_chunks = -(-n_tokens // chunk_size)
    return ((starts * (per_segment * chunk_size)).clamp_(max=n_tokens),
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


def cp_fwd_fragment_h(kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gk: torch.Tensor,
                        segments: FragmentSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_ext fp32 `[HV, K, V]`, M fp32 `[HV, K, K]`) of a fragment `[1, T_frag, HV, *]` (kg,
    w, gk: K; u: V): its final state from zero and its transition, `final(S) = M S + S_ext`.

    The recurrence is linear in the state, so one walk of the delta-rule state kernel on
    `[u, 0]` from `[0, I]` yields `[S_ext, M]`; per segment, then folded. Keeps the segments'
    transitions in `segments` for `cp_bwd_fragment_dhu` (views of the walk's final states).
    """
    K, V = kg.shape[3], u.shape[3]
    _, _, ht = chunk_delta_rule_fwd_h(kg, w, u, gk, output_final_state=True, cu_seqlens=segments.cu_seqlens,
                                      chunk_offsets=segments.chunk_offsets, chunk_size=segments.chunk_size,
                                      store_chunk_states=False, state_columns=V + K, identity_tail=True,
                                      launch="cp_fwd_fragment_h")
    if segments.count > 1:
        segments.transitions = ht[..., V:]
    # Segment s > 0 maps the fold's [S_ext, M] to M_s [S_ext, M] + [S_ext_s, 0]: its identity
    # start is the map, not an input, so only its first V columns enter the fold.
    SM = _fold_segments(ht, segments.transitions, reverse=False, input_columns=V)
    return SM[..., :V], SM[..., V:]


def cp_bwd_fragment_dhu(qg: torch.Tensor, kg: torch.Tensor, w: torch.Tensor, gk: torch.Tensor, do: torch.Tensor,
                       dv: torch.Tensor, scale: float, segments: FragmentSegments) -> torch.Tensor:
    """fp32 `[HV, K, V]`: the gradient leaving the start of a fragment (arguments as in
    `chunk_delta_rule_bwd_dhu`) with none arriving at its end: a reverse dhu walk per
    segment, folded with the transitions `cp_fwd_fragment_h` kept in `segments`."""
    if segments.count > 1 and segments.transitions is None:
        raise ValueError(f"segments ({segments.count}) must have been walked by cp_fwd_fragment_h first: "
                         "the fold needs their transitions")
    _, dS, _ = chunk_delta_rule_bwd_dhu(qg, kg, w, gk, do, dv, scale, need_dh0=True, cu_seqlens=segments.cu_seqlens,
                                        chunk_offsets=segments.chunk_offsets, chunk_size=segments.chunk_size,
                                        store_chunk_grads=False, launch="cp_bwd_fragment_dhu")
    return _fold_segments(dS, segments.transitions, reverse=True)


def walk_incoming_state(kg, w, u, gk, initial_state, context: FLACPContext, state_v_first: bool, chunk_size: int):
    """The forward exchange of a rank that receives a state (some part receives), run before
    its local state pass. Each part that sends first walks its last fragment for its message:
    with `cp_fwd_fragment_h` (in segments, kept in the exchange for the backward) when its only
    sequence continues through it, else from the user's state on u alone (M sent as zeros).
    cp/README.md, section 4 (walk before).

    Args:
        kg, w, gk: `[1, T, HV, K]`; u: `[1, T, HV, V]`; from the intra-chunk WY stage.
        initial_state: the user's `[N_global, ...]` states or None, laid out as `state_v_first`.

    Returns:
        (per local part: S_in fp32 `[HV, K, V]` (K-first) or None; the `CPExchange`).
    """
    HV, K, V = kg.shape[2], kg.shape[3], u.shape[3]
    if not sends_any(context):
        return receive_state(context, (HV, K, V), diagonal=False)
    S_ext = kg.new_zeros(context.num_parts, HV, K, V, dtype=torch.float32)
    M = kg.new_zeros(context.num_parts, HV, K, K, dtype=torch.float32)
    segments = {}
    for i, part in enumerate(context.parts):
        if not part.sends:
            continue
        end = part.offset + part.end - part.start
        start = part.last_seq_start
        fragment = (kg[:, start:end], w[:, start:end], u[:, start:end], gk[:, start:end])
        if part.last_seq_starts_here:
            _, _, ht = chunk_delta_rule_fwd_h(*fragment,
                                              initial_state=user_state_of_last(initial_state, context, part,
                                                                               state_v_first),
                                              output_final_state=True, chunk_size=chunk_size, store_chunk_states=False)
            S_ext[i] = ht[0]
            continue
        # Sized for the backward walk (V columns), which reuses these segments; the forward's
        # V + K columns give it twice the programs, which the SMs then run in two rounds.
        _, BV = delta_state_block_sizes("cp_bwd_fragment_dhu", K, V)
        segments[i] = FragmentSegments.filling(end - start, HV * triton.cdiv(V, BV), kg.device, chunk_size)
        S_ext[i], M[i] = cp_fwd_fragment_h(*fragment, segments[i])
    S_in, exchange = exchange_forward(S_ext, M, context)
    exchange.segments = segments
    return S_in, exchange


def walk_incoming_grad(qg, kg, w, gk, do, dv, scale: float, dht_global, exchange: CPExchange,
                       state_v_first: bool, chunk_size: int):
    """The backward exchange of a rank that receives a gradient (some part sends), run before
    its local reverse pass. A receiving part's message is a dhu pass over its first fragment
    from a zero gradient (`cp_bwd_fragment_dhu` over the forward's segments when the part
    holds one sequence). cp/README.md, section 4 (walk before).

    Args:
        qg, kg, w, gk, do, scale: as in `chunk_delta_rule_bwd_dhu`; dv: the intra-chunk
            gradient of v_new (`Aqk^T do`) of the local tokens.
        dht_global: gradient of the `[N_global, ...]` final state, or None.
        exchange: the forward's `CPExchange`.

    Returns:
        The local dht (layout as the states), the gradients from later parts in the rows of
        the parts' last sequences.
    """
    parts = exchange.context.parts

    def message(i: int, dht_first: torch.Tensor | None) -> torch.Tensor:
        part = parts[i]
        a = part.offset
        if i in exchange.segments:  # the forward walked these tokens (the part's only sequence)
            b = a + part.end - part.start
            return cp_bwd_fragment_dhu(qg[:, a:b], kg[:, a:b], w[:, a:b], gk[:, a:b], do[:, a:b], dv[:, a:b], scale,
                                       exchange.segments[i])
        if dht_first is not None:
            dht_first = (dht_first.transpose(-1, -2) if state_v_first else dht_first)[None].contiguous()
        b = part.first_seq_end
        _, dS_ext, _ = chunk_delta_rule_bwd_dhu(qg[:, a:b], kg[:, a:b], w[:, a:b], gk[:, a:b], do[:, a:b], dv[:, a:b],
                                                scale, dht=dht_first, need_dh0=True, chunk_size=chunk_size,
                                                store_chunk_grads=False)
        return dS_ext[0]

    HV, K, V = kg.shape[2], kg.shape[3], do.shape[3]
    return receive_final_state_grad(dht_global, exchange, (HV, V, K) if state_v_first else (HV, K, V), state_v_first,
                                     message)
