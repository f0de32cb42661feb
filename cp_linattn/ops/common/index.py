"""Where a program's tokens are: sequence and chunk bounds of a dense or packed batch.

Kernel-side (`@triton.jit`) helpers map a program id to its sequence's or chunk's tokens and a
state tile to its offsets; host-side `prepare_*` helpers build the per-chunk index tensors
those kernels read (as FLA's `fla/ops/utils/index.py`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from cp_linattn.ops.utils import Dims


@triton.jit
def chunk_bounds(cu_seqlens, chunk_indices, i_t, i_b, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """For program chunk i_t of batch row i_b: (first token of its sequence, the sequence's
    length, first token of the chunk within the sequence, index of the chunk in h tensors)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        state_index = i_t.to(tl.int64)
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b.to(tl.int64) * T
        seq_len = T
        state_index = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    return bos, seq_len, (i_c * BT).to(tl.int32), state_index


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
def state_tile_offsets(i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
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
def block_offsets(i_d, BD: tl.constexpr, D: tl.constexpr, m_rows):
    """Block i_d of a head dim of D: (its offsets, their mask, that mask crossed with the
    rows' mask `m_rows` into a [rows, BD] tile mask)."""
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    return o_d, m_d, m_rows[:, None] & m_d[None, :]


def count_sequences_and_chunks(x, cu_seqlens, chunk_indices, chunk_offsets, chunk_size, count_chunks: bool):
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
        # int() of device offsets is a host sync: the ops pass chunk_indices (built on the host)
        n_chunks = chunk_indices.shape[0] if chunk_indices is not None else int(chunk_offsets[-1])
    return cu_seqlens.numel() - 1, n_chunks, chunk_offsets


def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence lengths `[N]` from offsets `[N + 1]`."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Offsets `[N + 1]` of each sequence's first chunk in the list of all chunks."""
    n_chunks = (prepare_lens(cu_seqlens) + chunk_size - 1) // chunk_size
    return torch.cat([cu_seqlens.new_zeros(1), n_chunks.cumsum(0)])


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`[NT, 2]` int32 table: for every chunk of the packed batch, (sequence id, chunk id in it).

    Chunks never cross a sequence boundary; empty sequences own no chunk. Reads the offsets on
    the host: a host sync for device offsets (the ops pass their CPU copy, `prepare_varlen_chunks`).
    """
    n_chunks = ((prepare_lens(cu_seqlens) + chunk_size - 1) // chunk_size).tolist()
    seq = torch.repeat_interleave(torch.arange(len(n_chunks)), torch.tensor(n_chunks, dtype=torch.long))
    first = torch.cumsum(torch.tensor([0] + n_chunks[:-1], dtype=torch.long), 0)
    local = torch.arange(seq.numel()) - first[seq]
    return torch.stack([seq, local], 1).to(device=cu_seqlens.device, dtype=torch.int32)


def whole_chunk_segments(n_chunks: int, count: int) -> tuple[int, int]:
    """(segments, chunks per segment) of a walk of n_chunks cut into at most `count` segments
    of whole chunks: none empty, the last one possibly shorter, at least one."""
    per_segment = max(1, -(-n_chunks // max(1, min(count, n_chunks))))
    return max(1, -(-n_chunks // per_segment)), per_segment


def host_sequence_bounds(dims: Dims) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence, in the order of the state tensor's N axis."""
    if dims.cu_seqlens_cpu is None:
        return [(b, 0, dims.T) for b in range(dims.B)]
    cu = dims.cu_seqlens_cpu.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(dims.N)]


def join_sequence_outputs(per_sequence: list[torch.Tensor], dims: Dims) -> torch.Tensor:
    """Inverse of `host_sequence_bounds`: `[L_n, ...]` pieces back to `[B, T, ...]`."""
    if dims.cu_seqlens_cpu is None:
        return torch.stack(per_sequence)
    return torch.cat(per_sequence, 0)[None]
