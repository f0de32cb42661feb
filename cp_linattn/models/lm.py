"""A small language model of linear-attention blocks (GLA or KDA), CP aware."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_linattn.layers.gla import GatedLinearAttention
from cp_linattn.layers.kda import KimiDeltaAttention

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext

MODEL_TYPES = ("gla", "kda")


@dataclass
class LMConfig:
    type: str = "kda"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    head_k_dim: int = 32
    head_v_dim: int = 32
    mlp_ratio: float = 4.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.type not in MODEL_TYPES:
            raise ValueError(f"model.type must be one of {list(MODEL_TYPES)}, got {self.type!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_k_dim", "head_v_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"model.mlp_ratio must be positive, got {self.mlp_ratio!r}")


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: linear attention, then a SwiGLU MLP."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        dims = dict(d_model=cfg.d_model, n_heads=cfg.n_heads, head_k_dim=cfg.head_k_dim,
                    head_v_dim=cfg.head_v_dim, norm_eps=cfg.norm_eps)
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GatedLinearAttention(**dims) if cfg.type == "gla" else KimiDeltaAttention(**dims)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        # 2/3 of mlp_ratio * d_model keeps the parameter count of a plain MLP, rounded to 8
        hidden = 8 * max(1, round(cfg.mlp_ratio * cfg.d_model * 2 / 3 / 8))
        self.mlp = SwiGLU(cfg.d_model, hidden)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.LongTensor | None, cp_context: FLACPContext | None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cu_seqlens, cp_context)
        return x + self.mlp(self.mlp_norm(x))


class LinearAttentionLM(nn.Module):
    """Embedding, `n_layers` blocks, final RMSNorm and a (tied or untied) output head."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=cfg.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(
        self,
        input_ids: torch.LongTensor,
        cu_seqlens: torch.LongTensor | None = None,
        cp_context: FLACPContext | None = None,
    ) -> torch.Tensor:
        """input_ids: `[1, T]` packed tokens with `cu_seqlens` `[N + 1]`; under CP this rank's
        shard `[1, T_local]` (cu_seqlens None or the global offsets).
        Returns logits `[1, T, vocab_size]` (`[1, T_local, vocab_size]` under CP)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [1, T], got shape {list(input_ids.shape)}")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, cp_context)
        return self.head(self.norm(x))


def build_model(cfg: LMConfig | dict) -> LinearAttentionLM:
    """The model of a config (an `LMConfig` or a mapping of its fields)."""
    if not isinstance(cfg, LMConfig):
        unknown = set(cfg) - set(LMConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; known: {sorted(LMConfig.__dataclass_fields__)}")
        cfg = LMConfig(**cfg)
    return LinearAttentionLM(cfg)
