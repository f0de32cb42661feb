"""Inter-chunk state recurrence of the gated delta rule (KDA), forward and backward.

Per chunk of BT tokens of one sequence and value head, with gk the chunk-local cumsum of the
log gate, gk_last its value at the chunk's last token, h the fp32 state `[K, V]` entering the
chunk and the WY quantities of the chunk (see `cp_linattn.ops.kda.wy`):

    v_new  = u - w h                                   [BT, V]
    h_next = Diag(exp gk_last) h + kg^T v_new          kg = k * exp(gk_last - gk)

The backward walks the chunks in reverse with dh the gradient of the state leaving a chunk:

    dv2     = dv + kg dh                               (dv: gradient of v_new from the outputs)
    dh_prev = Diag(exp gk_last) dh + scale * qg^T do - w^T dv2

One program owns a `[K, BV]` slice of one (sequence, head) state (the whole key dimension,
because `w h` contracts over it), keeps it in fp32 registers and walks the chunks; the states
leave registers only as the per-chunk snapshots the chunk kernels read. All exponents are
`<= 0` (gk is non-increasing inside a chunk), so no decay strength overflows.

Both functions work on any fragment of a sequence and for any V, including V == K with
u = 0 and an identity initial state, which gives the fragment's K x K transition matrix
(what the context-parallel runtime needs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_linattn.ops.common.index import count_sequences_and_chunks, sequence_bounds, state_tile_offsets
from cp_linattn.ops.common.chunk_h import dot_precision, initial_state_tile
from cp_linattn.ops.launch import launch_kernel, launch_options, tile
from cp_linattn.ops.utils import check_tensor


@triton.jit
def delta_walk_start(init, cu_seqlens, chunk_offsets, T, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                     STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program (V tile, sequence * HV + head) of grid (cdiv(V, BV), N * HV): (i_nh, i_h, bos,
    seq_len, first_chunk, the `state_tile_offsets` of its tile, the fp32 tile it starts from)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos, seq_len, first_chunk = sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    o_k, o_v, m_k, m_v, m_kv, h_offs, state_offs = state_tile_offsets(0, i_v, K, V, BK, BV, STATE_V_FIRST)
    b_h = initial_state_tile(init, i_nh, state_offs, m_kv, K, V, BK, BV, USE_INITIAL_STATE)
    return i_nh, i_h, bos, seq_len, first_chunk, o_k, o_v, m_k, m_v, m_kv, h_offs, state_offs, b_h


@triton.jit
def walk_chunk_rows(i_t, bos, seq_len, i_h, m_k, m_v, HV: tl.constexpr, BT: tl.constexpr):
    """Chunk i_t of a walk: (its rows in `[B, T, HV, *]` tensors, its [BT, BK] and [BT, BV] masks)."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < seq_len
    return (bos + o_t) * HV + i_h, m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]


@triton.jit
def chunk_delta_rule_fwd_kernel_h(
    kg, w, u, gk, h, v_new, h0, ht,
    cu_seqlens, chunk_offsets,
    T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_CHUNKS: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, U_COLS: tl.constexpr, IDENTITY_TAIL: tl.constexpr,
):
    """Writes h (state entering each chunk) and v_new; grid (cdiv(V, BV), N * HV). The state
    has V columns, u the first U_COLS of them (the others take zero input); with
    IDENTITY_TAIL the state starts from `[0, I]` (the K columns from U_COLS on, the identity)."""
    i_nh, i_h, bos, seq_len, first_chunk, o_k, o_v, m_k, m_v, m_kv, h_offs, state_offs, b_h = delta_walk_start(
        h0, cu_seqlens, chunk_offsets, T, HV, K, V, BT, BK, BV, USE_INITIAL_STATE, STATE_V_FIRST, IS_VARLEN)
    if IDENTITY_TAIL:
        b_h = tl.where(o_k[:, None] == o_v[None, :] - U_COLS, 1.0, b_h)

    for i_t in range(0, tl.cdiv(seq_len, BT)):
        if STORE_CHUNKS:
            tl.store(h + ((first_chunk + i_t) * HV + i_h) * K * V + h_offs, b_h, mask=m_kv)
        rows, m_tk, m_tv = walk_chunk_rows(i_t, bos, seq_len, i_h, m_k, m_v, HV, BT)
        b_w = tl.load(w + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0)
        b_u = tl.load(u + rows[:, None] * U_COLS + o_v[None, :], mask=m_tv & (o_v < U_COLS)[None, :],
                      other=0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PRECISION)
        if STORE_CHUNKS:
            tl.store(v_new + rows[:, None] * V + o_v[None, :], b_vn.to(v_new.dtype.element_ty), mask=m_tv)
        b_kg = tl.load(kg + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0)
        last = bos + tl.minimum(i_t * BT + BT, seq_len) - 1
        b_g_last = tl.load(gk + (last * HV + i_h) * K + o_k, mask=m_k, other=0)
        b_h = b_h * tl.exp(b_g_last)[:, None] + tl.dot(
            tl.trans(b_kg), b_vn.to(b_kg.dtype), input_precision=DOT_PRECISION)

    if STORE_FINAL_STATE:
        tl.store(ht + i_nh.to(tl.int64) * K * V + state_offs, b_h, mask=m_kv)


@triton.jit
def chunk_delta_rule_bwd_kernel_dhu(
    qg, kg, w, gk, do, dv, dh, dv2, dht, dh0,
    cu_seqlens, chunk_offsets,
    scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr, STORE_CHUNKS: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Writes dh (gradient of the state leaving each chunk) and dv2; grid like the forward."""
    i_nh, i_h, bos, seq_len, first_chunk, o_k, o_v, m_k, m_v, m_kv, h_offs, state_offs, b_dh = delta_walk_start(
        dht, cu_seqlens, chunk_offsets, T, HV, K, V, BT, BK, BV, USE_FINAL_STATE_GRADIENT, STATE_V_FIRST, IS_VARLEN)

    # A unit-step loop walked backwards: negative-step loops are not trusted to the GPU pipeliner.
    n_steps = tl.cdiv(seq_len, BT)
    for i_rev in range(0, n_steps):
        i_t = n_steps - 1 - i_rev
        if STORE_CHUNKS:
            tl.store(dh + ((first_chunk + i_t) * HV + i_h) * K * V + h_offs, b_dh, mask=m_kv)
        rows, m_tk, m_tv = walk_chunk_rows(i_t, bos, seq_len, i_h, m_k, m_v, HV, BT)
        b_kg = tl.load(kg + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0)
        b_dv = tl.load(dv + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0).to(tl.float32)
        b_dv2 = b_dv + tl.dot(b_kg, b_dh.to(b_kg.dtype), input_precision=DOT_PRECISION)
        if STORE_CHUNKS:
            tl.store(dv2 + rows[:, None] * V + o_v[None, :], b_dv2.to(dv2.dtype.element_ty), mask=m_tv)
        b_qg = tl.load(qg + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0)
        b_w = tl.load(w + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0)
        b_do = tl.load(do + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0).to(b_qg.dtype)
        last = bos + tl.minimum(i_t * BT + BT, seq_len) - 1
        b_g_last = tl.load(gk + (last * HV + i_h) * K + o_k, mask=m_k, other=0)
        b_dh = b_dh * tl.exp(b_g_last)[:, None]
        b_dh += scale * tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PRECISION)
        b_dh -= tl.dot(tl.trans(b_w), b_dv2.to(b_w.dtype), input_precision=DOT_PRECISION)

    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + state_offs, b_dh, mask=m_kv)


def delta_state_block_sizes(kernel: str, K: int, V: int) -> tuple[int, int]:
    """The whole (power-of-two padded) key dim per program, since `w @ h` contracts over it;
    the value dim is split so the fp32 state slice takes at most 64 registers per thread
    (8192 elements at 4 warps, 16384 at 8) and stays below the kernel's cap."""
    BK = max(16, triton.next_power_of_2(K))
    state_elements = 64 * 32 * launch_options(kernel)["num_warps"]
    return BK, min(tile(kernel, "BV", V), max(16, state_elements // BK))


def chunk_delta_rule_fwd_h(
    kg: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gk: torch.Tensor, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None, chunk_size: int = 64,
    state_v_first: bool = False, store_chunk_states: bool = True, state_columns: int | None = None,
    identity_tail: bool = False, launch: str = "chunk_delta_rule_fwd_h",
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """States entering every chunk of the gated delta rule, the new values, the final states.

    Args:
        kg: `[B, T, HV, K]`, `k * exp(gk_last - gk)` per chunk; w: `[B, T, HV, K]` (one dtype).
        u: `[B, T, HV, V]` (any float dtype; V may equal K for the transition matrix).
        gk: `[B, T, HV, K]` fp32 chunk-local cumsum of the log gate (chunks of `chunk_size`).
        initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), read as fp32.
        cu_seqlens: int64 `[N + 1]` offsets of a packed batch (B == 1); else N = B.
        chunk_indices, chunk_offsets: optional `prepare_chunk_indices` / `prepare_chunk_offsets`
            of cu_seqlens, to skip host work.
        store_chunk_states: False when only the final states are wanted (the CP pre-process):
            h and v_new are then neither allocated nor written, and None is returned for them.
        state_columns: the state's columns V (default: u's); u then feeds the first u's-width
            of them and the others take zero input: the CP pre-process walks `[u, 0]` from
            `[0, I]`, a fragment's state and its transition at once, without building `[u, 0]`.
        identity_tail: start every sequence from `[0, I]` (needs `state_columns` = u's width
            + K and no initial_state): the final state's last K columns are then the
            sequence's K x K transition, with no `[0, I]` built in memory.
        launch: the `cp_linattn.ops.launch.LAUNCH` entry of the launch settings.

    Returns (V: `state_columns`):
        h: fp32 `[B, NT, HV, K, V]` (always K-first), h[:, c] the state entering chunk c (NT:
            chunks per row, or all chunks of the packed batch), or None;
        v_new: `[B, T, HV, V]` in u's dtype, `[u, 0] - w h`, or None;
        final_state: fp32 `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`) or None.
    """
    B, T, HV, K = kg.shape
    U = u.shape[-1]
    V = U if state_columns is None else state_columns
    if V < U:
        raise ValueError(f"state_columns must be at least u's last dimension {U}, got {state_columns}")
    check_tensor("w", w, shape=(B, T, HV, K), device=kg.device)
    check_tensor("u", u, shape=(B, T, HV, None), device=kg.device)
    check_tensor("gk", gk, shape=(B, T, HV, K), device=kg.device, dtypes=(torch.float32,))
    if identity_tail and (V - U != K or initial_state is not None):
        raise ValueError(f"identity_tail needs state_columns = u's width + K = {U + K} (got {V}) and no "
                         f"initial_state (got {'one' if initial_state is not None else 'none'})")
    N, NT, chunk_offsets = count_sequences_and_chunks(kg, cu_seqlens, chunk_indices, chunk_offsets, chunk_size,
                                                 store_chunk_states)
    if initial_state is not None:
        check_tensor("initial_state", initial_state,
                     shape=(N, HV, V, K) if state_v_first else (N, HV, K, V), device=kg.device)
        initial_state = initial_state.contiguous()
    kg, w, u, gk = kg.contiguous(), w.to(kg.dtype).contiguous(), u.contiguous(), gk.contiguous()
    h = kg.new_empty(B, NT, HV, K, V, dtype=torch.float32) if store_chunk_states else None
    v_new = u.new_empty(B, T, HV, V) if store_chunk_states else None
    final_state = None
    if output_final_state:
        final_state = kg.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    BK, BV = delta_state_block_sizes(launch, K, V)
    if N * HV > 0:
        launch_kernel(chunk_delta_rule_fwd_kernel_h, (triton.cdiv(V, BV), N * HV), launch,
            kg, w, u, gk, h, v_new, initial_state, final_state, cu_seqlens, chunk_offsets, T,
            HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
            USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
            STORE_CHUNKS=store_chunk_states,
            STATE_V_FIRST=state_v_first,
            IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(kg.dtype), U_COLS=U,
            IDENTITY_TAIL=identity_tail,
        )
    return h, v_new, final_state


def chunk_delta_rule_bwd_dhu(
    qg: torch.Tensor, kg: torch.Tensor, w: torch.Tensor, gk: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
    scale: float, dht: torch.Tensor | None = None, need_dh0: bool = False, cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.Tensor | None = None, chunk_offsets: torch.Tensor | None = None, chunk_size: int = 64,
    state_v_first: bool = False, store_chunk_grads: bool = True, launch: str = "chunk_delta_rule_bwd_dhu",
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Reverse recurrence of the gated delta rule, for outputs `o = scale * qg h + (intra)`.

    Args:
        qg: `[B, T, HV, K]` `q * exp(gk)` (without scale); kg, w, gk as in `chunk_delta_rule_fwd_h`.
        do: `[B, T, HV, V]` output gradient; dv: `[B, T, HV, V]` gradient of v_new from the
            intra-chunk outputs (`Aqk^T do`).
        dht: optional gradient of the final states (layout as the states), read as fp32.
        launch: the `cp_linattn.ops.launch.LAUNCH` entry of the launch settings.

    Returns:
        dh: fp32 `[B, NT, HV, K, V]`, dh[:, c] the gradient w.r.t. the state LEAVING chunk c
            (from all later outputs and dht), K-first;
        dh0: fp32 gradient of the initial states (layout as the states) or None;
        dv2: `[B, T, HV, V]` in qg's dtype, the total gradient of v_new (`dv + kg dh`),
            summed in fp32 and rounded once on store: its consumer (KDA's
            `chunk_kda_bwd_kernel_wy_dqkg`) rounds it to that dtype for every dot anyway, and a bf16
            dv2 halves its traffic (fp32 inputs keep it fp32).
        With `store_chunk_grads=False` (only dh0 wanted: the CP pre-process) dh and dv2 are
        neither allocated nor written, and None is returned for them.
    """
    B, T, HV, K = qg.shape
    V = do.shape[-1]
    for name, x in (("kg", kg), ("w", w), ("gk", gk)):
        check_tensor(name, x, shape=(B, T, HV, K), device=qg.device)
    check_tensor("do", do, shape=(B, T, HV, None), device=qg.device)
    check_tensor("dv", dv, shape=(B, T, HV, V), device=qg.device)
    N, NT, chunk_offsets = count_sequences_and_chunks(qg, cu_seqlens, chunk_indices, chunk_offsets, chunk_size,
                                                 store_chunk_grads)
    if dht is not None:
        check_tensor("dht", dht, shape=(N, HV, V, K) if state_v_first else (N, HV, K, V), device=qg.device)
        dht = dht.contiguous()
    qg, kg, w = qg.contiguous(), kg.to(qg.dtype).contiguous(), w.to(qg.dtype).contiguous()
    gk, do, dv = gk.float().contiguous(), do.contiguous(), dv.contiguous()
    dh = qg.new_empty(B, NT, HV, K, V, dtype=torch.float32) if store_chunk_grads else None
    dv2 = torch.empty_like(dv, dtype=qg.dtype) if store_chunk_grads else None
    dh0 = None
    if need_dh0:
        dh0 = qg.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    BK, BV = delta_state_block_sizes(launch, K, V)
    if N * HV > 0:
        launch_kernel(chunk_delta_rule_bwd_kernel_dhu, (triton.cdiv(V, BV), N * HV), launch,
            qg, kg, w, gk, do, dv, dh, dv2, dht, dh0, cu_seqlens, chunk_offsets, float(scale), T,
            HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
            USE_FINAL_STATE_GRADIENT=dht is not None, STORE_INITIAL_STATE_GRADIENT=need_dh0,
            STORE_CHUNKS=store_chunk_grads,
            STATE_V_FIRST=state_v_first,
            IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(qg.dtype),
        )
    return dh, dh0, dv2

