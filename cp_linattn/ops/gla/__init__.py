"""GLA ops, at the import paths of `fla.ops.gla`."""
from cp_linattn.ops.gla.chunk import chunk_gla
from cp_linattn.ops.gla.fused_chunk import fused_chunk_gla

__all__ = ["chunk_gla", "fused_chunk_gla"]
