"""Attention layers (linear: GLA, KDA; softmax: SoftmaxAttention); each accepts a `cp_context`."""
from cp_linattn.layers.attention import SoftmaxAttention
from cp_linattn.layers.conv import ShortConvolution
from cp_linattn.layers.gla import GatedLinearAttention
from cp_linattn.layers.kda import KimiDeltaAttention
from cp_linattn.layers.norm import GatedRMSNorm

__all__ = ["GatedLinearAttention", "GatedRMSNorm", "KimiDeltaAttention", "ShortConvolution", "SoftmaxAttention"]
