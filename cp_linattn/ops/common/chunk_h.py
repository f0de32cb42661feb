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

from cp_linattn.ops.common.index import count_sequences_and_chunks, sequence_bounds, state_tile_offsets
from cp_linattn.ops.launch import jit_traced_as, launch_kernel, tiles
from cp_linattn.ops.utils import check_option, check_tensor


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get true fp32 products (tf32 would cost ~1e-3 relative error); fp16/bf16
    operands are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fp32_dot_precision(dtype: torch.dtype) -> str:
    """For dots whose operands are kept in fp32 because rounding them to the input dtype costs
    too much (terms that later cancel): fp32-accurate in every mode (tf32x3 = three tf32 passes)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


@triton.jit
def initial_state_tile(init, i_nh, state_offs, m_kv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr):
    """The fp32 [BK, BV] tile a walk starts from: sequence-head i_nh's tile of `init` `[N * H,
    K, V]` (any float dtype), or zeros."""
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_s += tl.load(init + i_nh.to(tl.int64) * K * V + state_offs, mask=m_kv, other=0).to(tl.float32)
    return b_s


@jit_traced_as("REVERSE", "chunk_bwd_kernel_dh")
def chunk_fwd_kernel_h(
    kq, vdo, gk, states, init, final, decay, decay_total,
    cu_seqlens, chunk_offsets,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    REVERSE: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_CHUNKS: tl.constexpr,
    STORE_DECAY: tl.constexpr, STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """GLA's diagonal-decay recurrence over one [BK, BV] state tile, chunk by chunk; grid
    (cdiv(V, BV), cdiv(K, BK), N * H). b is the chunk-local gate cumsum, b_last its last row.

    Forward (kq = k, vdo = v), from the sequence start: `S <- Diag(exp b_last) S + (k exp(b_last
    - b))^T v`; states[c] is the state entering chunk c (in states' dtype), final the last.
    REVERSE (kq = q, vdo = do), from the sequence end: `dS <- Diag(exp b_last) dS + (scale q
    exp(b))^T do`; states[c] is the gradient of the state leaving chunk c, final dh0.
    init: the state (gradient) the walk starts from; init and final are stored `[V, K]` per
    head with STATE_V_FIRST (states stays K-first). With STORE_DECAY, the first V tile
    writes the log decay from the walk's start to each stored state (decay) and, forward,
    over the whole sequence (decay_total)."""
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len, first_chunk = sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)

    o_k, o_v, m_k, m_v, m_kv, chunk_offs, state_offs = state_tile_offsets(i_k, i_v, K, V, BK, BV, STATE_V_FIRST)

    b_s = initial_state_tile(init, i_nh, state_offs, m_kv, K, V, BK, BV, USE_INITIAL_STATE)
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
            tl.store(states + ((first_chunk + i_t) * H + i_h) * K * V + chunk_offs,
                     b_s.to(states.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < seq_len
        rows = (bos + o_t) * H + i_h
        b_kq = tl.load(kq + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        b_g = tl.load(gk + rows[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
        b_vdo = tl.load(vdo + rows[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0)
        last = bos + tl.minimum(i_t * BT + BT, seq_len) - 1
        b_g_last = tl.load(gk + (last * H + i_h) * K + o_k, mask=m_k, other=0)
        # Padded rows would see exp(b_last - 0) > 1 forward; zero them instead of trusting k == 0.
        if REVERSE:
            b_kq_scaled = tl.where(m_t[:, None], b_kq * tl.exp(b_g) * scale, 0)
        else:
            b_kq_scaled = tl.where(m_t[:, None], b_kq * tl.exp(b_g_last[None, :] - b_g), 0)
        b_s = b_s * tl.exp(b_g_last)[:, None] + tl.dot(
            tl.trans(b_kq_scaled.to(b_vdo.dtype)), b_vdo, input_precision=DOT_PRECISION)
        if STORE_DECAY:
            tl.store(decay + ((first_chunk + i_t) * H + i_h) * K + o_k, b_decay, mask=m_decay)
            b_decay += b_g_last

    if STORE_FINAL_STATE:
        tl.store(final + i_nh.to(tl.int64) * K * V + state_offs, b_s, mask=m_kv)
    if STORE_DECAY and not REVERSE:
        tl.store(decay_total + i_nh.to(tl.int64) * K + o_k, b_decay, mask=m_decay)


def chunk_fwd_h(
    k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, h0: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None, chunk_size: int = 64,
    store_chunk_states: bool = True, states_dtype: torch.dtype = torch.float32, output_decays: bool = False,
    state_v_first: bool = False,
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
        state_v_first: h0 and ht are `[N, H, V, K]` (h stays K-first).

    Returns:
        h: `[B, NT, H, K, V]` in `states_dtype`, h[:, c] the state before chunk c (NT = chunks
            per row, or the total number of chunks of the packed batch with `cu_seqlens`), or None;
        ht: fp32 `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`) state after each
            sequence's last token, or None.
        decays: with `output_decays`, (fp32 `[B, NT, H, K]` log decay from the sequence's
            start to the start of each chunk, fp32 `[N, H, K]` over each whole sequence);
            else None. A state S entering sequence n adds `Diag(exp decay[c]) S` to h[c] and
            `Diag(exp total[n]) S` to ht[n].
    """
    check_option("states_dtype", states_dtype, (torch.float32, torch.float16, torch.bfloat16))
    return _walk("chunk_fwd_h", k, ("v", v), gk, ("h0", h0), scale=1.0, store_final=output_final_state,
                 store_chunks=store_chunk_states, states_dtype=states_dtype, output_decays=output_decays,
                 varlen=(cu_seqlens, chunk_indices, chunk_offsets), chunk_size=chunk_size, state_v_first=state_v_first)


def chunk_bwd_dh(
    q: torch.Tensor, gk: torch.Tensor, do: torch.Tensor, scale: float, dht: torch.Tensor | None = None,
    need_dh0: bool = False, cu_seqlens: torch.LongTensor | None = None, chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None, chunk_size: int = 64, store_chunk_grads: bool = True,
    output_decays: bool = False, state_v_first: bool = False,
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
        state_v_first: dht and dh0 are `[N, H, V, K]` (dh stays K-first).

    Returns:
        dh: fp32 `[B, NT, H, K, V]`; dh[:, c] is the gradient w.r.t. the state at the END of
            chunk c (= h[:, c + 1], or the final state for a sequence's last chunk) from the
            outputs of all later chunks of the sequence plus `dht`. It excludes chunk c's own
            outputs, which is what the gradients of chunk c's k and v need.
        dh0: fp32 `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`), the gradient w.r.t.
            each sequence's initial state (from all its outputs and `dht`), or None unless `need_dh0`.
        decay: with `output_decays`, fp32 `[B, NT, H, K]`, the log decay from the end of each
            chunk to its sequence's end (a gradient dS arriving at the end of a sequence adds
            `Diag(exp decay[c]) dS` to dh[c]); else None.
    """
    dh, dh0, decays = _walk("chunk_bwd_dh", q, ("do", do), gk, ("dht", dht), scale=float(scale), store_final=need_dh0,
                            store_chunks=store_chunk_grads, states_dtype=torch.float32, output_decays=output_decays,
                            varlen=(cu_seqlens, chunk_indices, chunk_offsets), chunk_size=chunk_size,
                            state_v_first=state_v_first)
    return dh, dh0, decays[0] if output_decays else None


def _walk(launcher: str, kq: torch.Tensor, named_vdo: tuple[str, torch.Tensor], gk: torch.Tensor,
          named_init: tuple[str, torch.Tensor | None], scale: float, store_final: bool, store_chunks: bool,
          states_dtype: torch.dtype, output_decays: bool, varlen: tuple, chunk_size: int, state_v_first: bool):
    """Checks, allocations and launch of `chunk_fwd_kernel_h` for `launcher`, `chunk_fwd_h` (kq = k,
    vdo = v) or `chunk_bwd_dh` (kq = q, vdo = do, walked in REVERSE); vdo and init come with the names
    their errors give. varlen: (cu_seqlens, chunk_indices, chunk_offsets). init and the final
    states are `[N, H, V, K]` with state_v_first. Returns (per-chunk states or None, final
    states or None, (decay, decay over each whole sequence) or None)."""
    (vdo_name, vdo), (init_name, init) = named_vdo, named_init
    cu_seqlens, chunk_indices, chunk_offsets = varlen
    B, T, H, K = kq.shape
    V = vdo.shape[-1]
    check_tensor(vdo_name, vdo, shape=(B, T, H, None), device=kq.device)
    check_tensor("gk", gk, shape=(B, T, H, K), device=kq.device, dtypes=(torch.float32,))
    N, NT, chunk_offsets = count_sequences_and_chunks(kq, cu_seqlens, chunk_indices, chunk_offsets, chunk_size,
                                                      store_chunks or output_decays)
    state_shape = (N, H, V, K) if state_v_first else (N, H, K, V)
    if init is not None:
        check_tensor(init_name, init, shape=state_shape, device=kq.device)
        init = init.contiguous()
    kq, vdo, gk = kq.contiguous(), vdo.to(kq.dtype).contiguous(), gk.contiguous()
    states = kq.new_empty(B, NT, H, K, V, dtype=states_dtype) if store_chunks else None
    final = kq.new_empty(state_shape, dtype=torch.float32) if store_final else None
    reverse = launcher == "chunk_bwd_dh"
    # the reverse walk has no whole-sequence decay to give
    decays = (kq.new_empty(B, NT, H, K, dtype=torch.float32),
              None if reverse else kq.new_empty(N, H, K, dtype=torch.float32)) if output_decays else None
    BK, BV = tiles(launcher, K, V)
    if N * H > 0:
        launch_kernel(chunk_fwd_kernel_h, (triton.cdiv(V, BV), triton.cdiv(K, BK), N * H), launcher,
            kq, vdo, gk, states, init, final, *(decays or (None, None)), cu_seqlens, chunk_offsets, scale, T,
            H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, REVERSE=reverse,
            USE_INITIAL_STATE=init is not None, STORE_FINAL_STATE=store_final, STORE_CHUNKS=store_chunks,
            STORE_DECAY=output_decays, STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None,
            DOT_PRECISION=dot_precision(kq.dtype),
        )
    return states, final, decays


