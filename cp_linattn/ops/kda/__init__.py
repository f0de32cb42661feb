"""KDA ops, at the import path of `fla.ops.kda`."""
from cp_linattn.ops.kda.chunk import chunk_kda

__all__ = ["chunk_kda"]
