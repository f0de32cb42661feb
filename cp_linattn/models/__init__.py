"""Language models made of the CP-aware attention layers."""
from cp_linattn.models.lm import LinearAttentionLM, LMConfig, build_model

__all__ = ["LMConfig", "LinearAttentionLM", "build_model"]
