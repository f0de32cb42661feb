"""cp_linattn: context-parallel linear attention (GLA, KDA) with chunked Triton kernels."""
from cp_linattn.cp import FLACPContext, build_cp_context, shard, unshard
from cp_linattn.ops.gla.chunk import chunk_gla
from cp_linattn.ops.gla.fused_chunk import fused_chunk_gla
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.kda.chunk import chunk_kda
from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate, naive_recurrent_kda

__version__ = "0.1.0"

__all__ = [
    "chunk_gla",
    "fused_chunk_gla",
    "chunk_kda",
    "build_cp_context",
    "FLACPContext",
    "shard",
    "unshard",
    "naive_recurrent_gla",
    "naive_recurrent_kda",
    "kda_gate",
    "kda_lower_bound_gate",
]
