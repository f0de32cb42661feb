"""Attention layers built on the chunked ops; each accepts a `cp_context`."""
from cp_linattn.layers.conv import ShortConvolution
from cp_linattn.layers.gla import GatedLinearAttention
from cp_linattn.layers.kda import KimiDeltaAttention
from cp_linattn.layers.norm import GatedRMSNorm

__all__ = ["GatedLinearAttention", "GatedRMSNorm", "KimiDeltaAttention", "ShortConvolution"]
