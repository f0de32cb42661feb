"""Inter-chunk state recurrence with per-key-channel (diagonal) gates, forward and backward.

Within one sequence, split into chunks of C tokens, with `b` the chunk-local cumsum of the
log gate g (so `b_last`, the value at a chunk's last token, is the chunk's total decay):

    forward    h_{c+1} = Diag(exp b_last) h_c + (k * exp(b_last - b))^T v
    backward   dh_{c-1} = Diag(exp b_last) dh_c + scale * (q * exp b)^T do      (over chunk c)

Every exponent is <= 0 because b is non-increasing within a chunk, so nothing overflows
however strong the decay. One program owns one [BK, BV] tile of one (sequence, head) state,
keeps it in fp32 registers and walks the sequence's chunks, so the states never round-trip
through memory except for the per-chunk snapshot the chunked kernels read.

Both functions work on any fragment of a sequence (any length, also shorter than a chunk):
the context-parallel runtime calls them on a rank's piece to get the state a piece produces
from a zero state, and the gradient a piece sends backwards from a zero incoming gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.launch import LAUNCH, launch_options, tile, tiles
from cp_linattn.ops.utils import check_option, check_tensor, prepare_chunk_offsets


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get true fp32 products (tf32 would cost ~1e-3 relative error); fp16/bf16
    operands are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fp32_dot_precision(dtype: torch.dtype) -> str:
    """For dots whose operands are kept in fp32 because rounding them to the input dtype costs
    too much (terms that later cancel): fp32-accurate in every mode (tf32x3 = three tf32 passes)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


@triton.jit
def sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(first token, length, index of the first chunk in the h tensors) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        first_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)
        seq_len = (eos - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        seq_len = T
        first_chunk = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, seq_len, first_chunk


@triton.jit
def state_tile(i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               V_FIRST: tl.constexpr):
    """Offsets and masks of the [BK, BV] tile (i_k, i_v) of a `[K, V]` state: (o_k, o_v, m_k,
    m_v, m_kv, its offsets in a K-first state, its offsets in a state stored V-first if
    V_FIRST, else K-first)."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    k_first = o_k[:, None] * V + o_v[None, :]
    if V_FIRST:
        stored = o_v[None, :] * K + o_k[:, None]
    else:
        stored = k_first
    return o_k, o_v, m_k, m_v, m_k[:, None] & m_v[None, :], k_first, stored


@triton.jit
def chunk_state_walk_kernel(
    x, y, gk, states, init, final, decay, decay_total,
    cu_seqlens, chunk_offsets,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_CHUNKS: tl.constexpr,
    STORE_DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """GLA's diagonal-decay recurrence over one [BK, BV] state tile, chunk by chunk; grid
    (cdiv(V, BV), cdiv(K, BK), N * H). b is the chunk-local gate cumsum, b_last its last row.

    Forward (x = k, y = v), from the sequence start: `S <- Diag(exp b_last) S + (k exp(b_last
    - b))^T v`; states[c] is the state entering chunk c (in states' dtype), final the last.
    REVERSE (x = q, y = do), from the sequence end: `dS <- Diag(exp b_last) dS + (scale q
    exp(b))^T do`; states[c] is the gradient of the state leaving chunk c, final dh0.
    init: the state (gradient) the walk starts from. With STORE_DECAY, the first V tile
    writes the log decay from the walk's start to each stored state (decay) and, forward,
    over the whole sequence (decay_total)."""
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len, first_chunk = sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)

    o_k, o_v, m_k, m_v, m_kv, state_offs, _ = state_tile(i_k, i_v, K, V, BK, BV, False)

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        b_s += tl.load(init + i_nh.to(tl.int64) * K * V + state_offs, mask=m_kv, other=0).to(tl.float32)
    b_decay = tl.zeros([BK], dtype=tl.float32)
    m_decay = m_k & (i_v == 0)

    # A unit-step loop even in reverse: negative-step loops are not trusted to the GPU pipeliner.
    n_steps = tl.cdiv(seq_len, BT)
    for i_step in range(0, n_steps):
        if REVERSE:
            i_t = n_steps - 1 - i_step
        else:
            i_t = i_step
        if STORE_CHUNKS:
            tl.store(states + ((first_chunk + i_t) * H + i_h) * K * V + state_offs,
                     b_s.to(states.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < seq_len
        rows = (bos + o_t) * H + i_h
        b_x = tl.load(x + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        b_g = tl.load(gk + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        b_y = tl.load(y + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
        last = bos + tl.minimum(i_t * BT + BT, seq_len) - 1
        b_g_last = tl.load(gk + (last * H + i_h) * K + o_k, mask=m_k, other=0)
        # Padded rows would see exp(b_last - 0) > 1 forward; zero them instead of trusting x == 0.
        if REVERSE:
            b_x_scaled = tl.where(m_t[:, None], b_x * tl.exp(b_g) * scale, 0)
        else:
            b_x_scaled = tl.where(m_t[:, None], b_x * tl.exp(b_g_last[None, :] - b_g), 0)
        b_s = b_s * tl.exp(b_g_last)[:, None] + tl.dot(
            tl.trans(b_x_scaled.to(b_y.dtype)), b_y, input_precision=DOT_PREC)
        if STORE_DECAY:
            tl.store(decay + ((first_chunk + i_t) * H + i_h) * K + o_k, b_decay, mask=m_decay)
            b_decay += b_g_last

    if STORE_FINAL:
        tl.store(final + i_nh.to(tl.int64) * K * V + state_offs, b_s, mask=m_kv)
    if STORE_DECAY and not REVERSE:
        tl.store(decay_total + i_nh.to(tl.int64) * K + o_k, b_decay, mask=m_decay)


def sequences_and_chunks(x, cu_seqlens, chunk_indices, chunk_offsets, chunk_size, count_chunks: bool):
    """(N sequences, chunks per batch row, chunk_offsets) of a [B, T, ...] batch or a packed
    one (B == 1). The chunk count of a packed batch is only read (from chunk_indices, or from
    the device) when `count_chunks`, i.e. when per-chunk tensors are allocated (else None):
    the CP pre-process, which stores none, passes device offsets and must not wait for the
    device."""
    B, T = x.shape[:2]
    if cu_seqlens is None:
        return B, triton.cdiv(T, chunk_size), None
    if chunk_offsets is None:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    n_chunks = None
    if count_chunks:
        n_chunks = chunk_indices.shape[0] if chunk_indices is not None else int(chunk_offsets[-1])
    return cu_seqlens.numel() - 1, n_chunks, chunk_offsets


def chunk_fwd_h(
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    h0: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    chunk_size: int = 64,
    store_chunk_states: bool = True,
    states_dtype: torch.dtype = torch.float32,
    output_decays: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """States entering every chunk, and the final states.

    Args:
        k: `[B, T, H, K]`, v: `[B, T, H, V]` (fp32/fp16/bf16, one dtype).
        gk: `[B, T, H, K]` fp32, the chunk-local cumsum of the log gate over chunks of
            `chunk_size` (`chunk_local_cumsum(g, chunk_size, cu_seqlens=...)`).
        h0: optional initial states `[N, H, K, V]` (any float dtype; read as fp32).
        cu_seqlens: int64 `[N + 1]` offsets of a packed batch (B == 1); else N = B.
        chunk_indices, chunk_offsets: optional precomputed `prepare_chunk_indices` /
            `prepare_chunk_offsets(cu_seqlens, chunk_size)`, to skip the host work.
        store_chunk_states: False when only the final states are wanted (the CP pre-process):
            h is then neither allocated nor written, and None is returned for it.
        states_dtype: dtype of the stored per-chunk states. The recurrence always runs in
            fp32; a kernel that casts h to its dot operands' dtype anyway (GLA's output) loses
            nothing when h is stored in that dtype, and reads half the bytes.
        output_decays: also return the gate's log decays the walk sums on its way (the CP
            runtime needs them to account for a state entering a sequence).

    Returns:
        h: `[B, NT, H, K, V]` in `states_dtype`, h[:, c] the state before chunk c (NT = chunks
            per row, or the total number of chunks of the packed batch with `cu_seqlens`), or None;
        ht: fp32 `[N, H, K, V]` state after each sequence's last token, or None.
        decays: with `output_decays`, (fp32 `[B, NT, H, K]` log decay from the sequence's
            start to the start of each chunk, fp32 `[N, H, K]` over each whole sequence);
            else None. A state S entering sequence n adds `Diag(exp decay[c]) S` to h[c] and
            `Diag(exp total[n]) S` to ht[n].
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    check_tensor("v", v, shape=(B, T, H, None), device=k.device)
    check_tensor("gk", gk, shape=(B, T, H, K), device=k.device, dtypes=(torch.float32,))
    check_option("states_dtype", states_dtype, (torch.float32, torch.float16, torch.bfloat16))
    N, NT, chunk_offsets = sequences_and_chunks(k, cu_seqlens, chunk_indices, chunk_offsets, chunk_size,
                                                store_chunk_states or output_decays)
    if h0 is not None:
        check_tensor("h0", h0, shape=(N, H, K, V), device=k.device)
    k, v, gk = k.contiguous(), v.contiguous(), gk.contiguous()
    h0 = h0.contiguous() if h0 is not None else None
    h = k.new_empty(B, NT, H, K, V, dtype=states_dtype) if store_chunk_states else None
    ht = k.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    decays = (k.new_empty(B, NT, H, K, dtype=torch.float32), k.new_empty(N, H, K, dtype=torch.float32)) \
        if output_decays else None
    BK, BV = tiles("chunk_state_forward", K, V)
    grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), N * H)
    if N * H > 0:
        chunk_state_walk_kernel[grid](
            k, v, gk, h, h0, ht, *(decays or (None, None)), cu_seqlens, chunk_offsets, 1.0, T,
            H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, REVERSE=False,
            HAS_INIT=h0 is not None, STORE_FINAL=output_final_state, STORE_CHUNKS=store_chunk_states,
            STORE_DECAY=output_decays, IS_VARLEN=cu_seqlens is not None,
            DOT_PREC=dot_precision(v.dtype), **launch_options("chunk_state_forward"),
        )
    return h, ht, decays


def chunk_bwd_dh(
    q: torch.Tensor,
    gk: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    dht: torch.Tensor | None = None,
    need_dh0: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    chunk_size: int = 64,
    store_chunk_grads: bool = True,
    output_decays: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of the chunk states, for outputs `o_t = scale * S_t^T q_t`.

    Args:
        q: `[B, T, H, K]`, do: `[B, T, H, V]` (the output gradient, q's dtype).
        gk: `[B, T, H, K]` fp32 chunk-local cumsum of the log gate (as in `chunk_fwd_h`).
        dht: optional gradient of the final states `[N, H, K, V]` (read as fp32).
        cu_seqlens, chunk_indices, chunk_offsets: as in `chunk_fwd_h`.
        store_chunk_grads: False when only dh0 is wanted (the CP pre-process): dh is then
            neither allocated nor written, and None is returned for it.
        output_decays: also return the log decays the reverse walk sums (for the CP runtime).

    Returns:
        dh: fp32 `[B, NT, H, K, V]`; dh[:, c] is the gradient w.r.t. the state at the END of
            chunk c (= h[:, c + 1], or the final state for a sequence's last chunk) from the
            outputs of all later chunks of the sequence plus `dht`. It excludes chunk c's own
            outputs, which is what the gradients of chunk c's k and v need.
        dh0: fp32 `[N, H, K, V]`, the gradient w.r.t. each sequence's initial state (from all
            its outputs and `dht`), or None unless `need_dh0`.
        decay: with `output_decays`, fp32 `[B, NT, H, K]`, the log decay from the end of each
            chunk to its sequence's end (a gradient dS arriving at the end of a sequence adds
            `Diag(exp decay[c]) dS` to dh[c]); else None.
    """
    B, T, H, K = q.shape
    V = do.shape[-1]
    check_tensor("do", do, shape=(B, T, H, None), device=q.device)
    check_tensor("gk", gk, shape=(B, T, H, K), device=q.device, dtypes=(torch.float32,))
    N, NT, chunk_offsets = sequences_and_chunks(q, cu_seqlens, chunk_indices, chunk_offsets, chunk_size,
                                                store_chunk_grads or output_decays)
    if dht is not None:
        check_tensor("dht", dht, shape=(N, H, K, V), device=q.device)
    q, gk = q.contiguous(), gk.contiguous()
    do = do.to(q.dtype).contiguous()
    dht = dht.contiguous() if dht is not None else None
    dh = q.new_empty(B, NT, H, K, V, dtype=torch.float32) if store_chunk_grads else None
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    decay = q.new_empty(B, NT, H, K, dtype=torch.float32) if output_decays else None
    BK, BV = tiles("chunk_state_backward", K, V)
    grid = (triton.cdiv(V, BV), triton.cdiv(K, BK), N * H)
    if N * H > 0:
        chunk_state_walk_kernel[grid](
            q, do, gk, dh, dht, dh0, decay, None, cu_seqlens, chunk_offsets, float(scale), T,
            H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, REVERSE=True,
            HAS_INIT=dht is not None, STORE_FINAL=need_dh0, STORE_CHUNKS=store_chunk_grads,
            STORE_DECAY=output_decays, IS_VARLEN=cu_seqlens is not None,
            DOT_PREC=dot_precision(q.dtype), **launch_options("chunk_state_backward"),
        )
    return dh, dh0, decay


@triton.jit
def add_decayed_state_kernel(
    x, decay, S, n,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
):
    """x[c, h] += Diag(exp decay[c, h]) S[h] for one [BK, BV] tile of BC chunks c; grid
    (cdiv(V, BV), cdiv(K, BK), cdiv(n, BC) * H).

    Rows whose factor exp(decay) is exactly 0 (a channel the state no longer reaches) would add
    exact zeros: they are neither read nor written, so the pass moves only the live rows of x.
    Except where S holds a NaN or an infinity: 0 * NaN is NaN, and the rerun this pass stands
    for would carry it, so those entries are added too."""
    i_v, i_k, i_ch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, i_cb = i_ch % H, i_ch // H
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_tile = m_k[:, None] & (o_v < V)[None, :]
    state_offs = o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(S + i_h * K * V + state_offs, mask=m_tile, other=0)
    # |S| < inf is false exactly for NaN and infinities.
    m_s = ~(tl.abs(b_s) < float("inf")) & m_tile
    for j in range(BC):
        c = (i_cb * BC + j).to(tl.int64)
        m_c = c < n
        b_factor = tl.exp(tl.load(decay + (c * H + i_h) * K + o_k, mask=m_k & m_c, other=float("-inf")))
        m_kv = ((b_factor > 0)[:, None] & m_tile | m_s) & m_c
        p_x = x + (c * H + i_h) * K * V + state_offs
        b_x = tl.load(p_x, mask=m_kv, other=0).to(tl.float32) + b_factor[:, None] * b_s
        tl.store(p_x, b_x.to(x.dtype.element_ty), mask=m_kv)


def add_decayed_state(x: torch.Tensor, decay: torch.Tensor, S: torch.Tensor) -> None:
    """In place `x[c] += Diag(exp decay[c]) S` for every c: the per-chunk states of a sequence
    after the fact, once the state S entering it (or, in reverse, the gradient leaving it) is
    known. The diagonal recurrences are linear, so this equals rerunning them from S.

    Args:
        x: `[n, H, K, V]` contiguous states (any float dtype; the sum is formed in fp32).
        decay: fp32 `[n, H, K]`, the log decay from S's point to each state.
        S: fp32 `[H, K, V]`.
    """
    n, H, K, V = x.shape
    check_tensor("decay", decay, shape=(n, H, K), device=x.device, dtypes=(torch.float32,))
    check_tensor("S", S, shape=(H, K, V), device=x.device, dtypes=(torch.float32,))
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (it is updated in place)")
    BK, BV = tiles("add_decayed_state", K, V)
    BC = LAUNCH["add_decayed_state"]["BC"]
    if n * H > 0:
        add_decayed_state_kernel[(triton.cdiv(V, BV), triton.cdiv(K, BK), triton.cdiv(n, BC) * H)](
            x, decay.contiguous(), S.contiguous(), n, H=H, K=K, V=V, BK=BK, BV=BV, BC=BC,
            **launch_options("add_decayed_state"))


@triton.jit
def fold_states_kernel(
    states, transitions, out, first, step, n, stride_state, stride_m, stride_m_head, stride_m_row, input_columns,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DIAGONAL: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """out = the fold `S = M_j S + S_j` from S = 0 over j = first, first + step, ... (n terms)
    for one [K, BV] column tile (BK: K padded to a power of two); M_j diagonal `[H, K]` if
    DIAGONAL, else `[H, K, K]` (M_j^T if TRANSPOSE), rows strided. Only the first
    `input_columns` columns of S_j are read after the first term (the others are zero).
    Grid (cdiv(V, BV), H)."""
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    state_offs = (i_h * K + o_k[:, None]) * V + o_v[None, :]
    if TRANSPOSE:
        m_offs = i_h * stride_m_head + o_k[None, :] * stride_m_row + o_k[:, None]
    else:
        m_offs = i_h * stride_m_head + o_k[:, None] * stride_m_row + o_k[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(n):
        j = (first + i * step).to(tl.int64)
        m_x = m_kv & ((o_v < input_columns) | (i == 0))[None, :]
        b_x = tl.load(states + j * stride_state + state_offs, mask=m_x, other=0)
        if DIAGONAL:
            b_m = tl.load(transitions + j * stride_m + i_h * stride_m_head + o_k, mask=m_k, other=0)
            b_s = b_m[:, None] * b_s + b_x
        else:
            b_m = tl.load(transitions + j * stride_m + m_offs, mask=m_k[:, None] & m_k[None, :], other=0)
            # Three tf32 passes: fp32-accurate, as the states exchanged between ranks stay fp32.
            b_s = tl.dot(b_m, b_s, input_precision="tf32x3") + b_x
    tl.store(out + state_offs, b_s, mask=m_kv)


def fold_states(states: torch.Tensor, transitions: torch.Tensor, order: range, transpose: bool = False,
                input_columns: int | None = None) -> torch.Tensor:
    """`S = 0; for j in order: S = M_j S + S_j` in one launch: the merge of the boundary states
    of context-parallel ranks, instead of two launches per rank.

    Args:
        states: fp32 `[D, H, K, V]`, rows may be strided (as the rows of an all-gathered
            table), each row contiguous.
        transitions: fp32 `[D, H, K]` (diagonal, GLA) or `[D, H, K, K]` (KDA; `M_j^T` with
            `transpose`); any strides but a contiguous last dim (a view of the walk's final
            states is read in place).
        order: the rows to fold, in order (a `range`, ascending or descending, within [0, D)).
        input_columns: after the first term, only S_j's first `input_columns` columns are
            inputs, the others read as zero (default: all V). The walk of a fragment's
            segments carries each segment's transition in its last K columns, where it is
            the map of that segment, not an input of the fold.

    Returns: fp32 `[H, K, V]`.
    """
    check_tensor("states", states, ndim=4, dtypes=(torch.float32,))
    D, H, K, V = states.shape
    diagonal = transitions.dim() == 3
    check_tensor("transitions", transitions, shape=(D, H, K) if diagonal else (D, H, K, K), device=states.device,
                 dtypes=(torch.float32,))
    if len(order) and not (0 <= min(order) and max(order) < D):
        raise ValueError(f"order must index the {D} rows of states, got {order}")
    if states.stride()[1:] != (K * V, V, 1):
        states = states.contiguous()
    if input_columns is not None and not 0 <= input_columns <= V:
        raise ValueError(f"input_columns must be in [0, {V}] (the states' columns), got {input_columns}")
    if transitions.stride(-1) != 1:
        transitions = transitions.contiguous()
    out = states.new_empty(H, K, V)
    BV = tile("fold_states", "BV", V)
    fold_states_kernel[(triton.cdiv(V, BV), H)](
        states, transitions, out, order.start, order.step, len(order), states.stride(0), *transitions.stride()[:2],
        transitions.stride(2) if not diagonal else 0, V if input_columns is None else input_columns,
        H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BV=BV, DIAGONAL=diagonal, TRANSPOSE=transpose,
        **launch_options("fold_states"))
    return out
