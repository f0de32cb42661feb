"""cp_linattn: context-parallel linear attention (GLA, KDA) with chunked Triton kernels."""
from cp_linattn.ops.gla.naive import naive_recurrent_gla
from cp_linattn.ops.kda.naive import kda_gate, kda_lower_bound_gate, naive_recurrent_kda

__version__ = "0.1.0"

__all__ = ["naive_recurrent_gla", "naive_recurrent_kda", "kda_gate", "kda_lower_bound_gate"]
