"""A small language model of linear-attention blocks (GLA or KDA), or a hybrid of them with
softmax-attention blocks (Kimi Linear's 3:1 pattern), CP aware."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from cp_linattn.layers.attention import SoftmaxAttention
from cp_linattn.layers.gla import GatedLinearAttention
from cp_linattn.layers.common import OPS
from cp_linattn.layers.kda import KimiDeltaAttention

if TYPE_CHECKING:
    from cp_linattn.cp.context import FLACPContext

MODEL_TYPES = ("gla", "kda", "hybrid")
LINEAR_TYPES = ("gla", "kda")


@dataclass
class LMConfig:
    """The model's shape; `build_model` accepts it or a mapping of its fields (model.* in the
    hydra configs). Fields marked "hybrid" are read only by `type: hybrid`."""

    type: str = "kda"  # "gla" | "kda": every block is that linear attention; "hybrid": see `linear`, `attn_every`
    vocab_size: int = 256  # token ids in [0, vocab_size)
    d_model: int = 64  # residual stream width
    n_layers: int = 2  # blocks (mixer + MLP)
    n_heads: int = 2  # heads of every mixer (query heads of the softmax layers)
    head_k_dim: int = 32  # query/key head dim (the softmax layers' head_dim too)
    head_v_dim: int = 32  # value head dim
    mlp_ratio: float = 4.0  # SwiGLU hidden width = 2/3 * mlp_ratio * d_model, rounded to 8
    tie_embeddings: bool = True  # the output head shares the embedding matrix
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of every Linear and Embedding weight
    linear: str = "kda"  # hybrid: the linear-attention layer, "kda" | "gla"
    attn_every: int = 4  # hybrid: block i is softmax attention iff (i + 1) % attn_every == 0 (4: 3 linear, 1 softmax)
    n_kv_heads: int | None = None  # hybrid: key/value heads of the softmax layers (GQA), divides n_heads; None: n_heads
    rope_theta: float | None = 10000.0  # hybrid: RoPE base of the softmax layers, positions per document; None: no RoPE
    ops: str = "ours"  # GLA/KDA layers' op: "ours" | "fla" (FLA 0.6.0's, same arguments, no CP); softmax is ours

    def __post_init__(self) -> None:
        if self.type not in MODEL_TYPES:
            raise ValueError(f"model.type must be one of {list(MODEL_TYPES)}, got {self.type!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_k_dim", "head_v_dim", "attn_every"):
            _check_positive_int(f"model.{name}", getattr(self, name))
        if not self.mlp_ratio > 0:
            raise ValueError(f"model.mlp_ratio must be positive, got {self.mlp_ratio!r}")
        if self.linear not in LINEAR_TYPES:
            raise ValueError(f"model.linear must be one of {list(LINEAR_TYPES)}, got {self.linear!r}")
        if self.ops not in OPS:
            raise ValueError(f"model.ops must be one of {list(OPS)}, got {self.ops!r}")
        if self.n_kv_heads is not None:
            _check_positive_int("model.n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        theta = self.rope_theta
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0):
            raise ValueError(f"model.rope_theta must be a positive number or null (no RoPE), got {self.rope_theta!r}")
        if self.type == "hybrid" and self.attn_every > self.n_layers:
            raise ValueError(f"model.attn_every={self.attn_every} exceeds model.n_layers={self.n_layers}: "
                             "the hybrid model would have no softmax-attention block")

    @property
    def mixers(self) -> list[str]:
        """The mixer of each block: "gla", "kda" or "softmax"."""
        if self.type != "hybrid":
            return [self.type] * self.n_layers
        return ["softmax" if (i + 1) % self.attn_every == 0 else self.linear for i in range(self.n_layers)]


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def make_mixer(cfg: LMConfig, kind: str) -> nn.Module:
    """The token mixer of a block: "gla", "kda" or "softmax" (`LMConfig.mixers`)."""
    if kind == "softmax":
        return SoftmaxAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_k_dim,
                                head_v_dim=cfg.head_v_dim, rope_theta=cfg.rope_theta)
    dims = dict(d_model=cfg.d_model, n_heads=cfg.n_heads, head_k_dim=cfg.head_k_dim,
                head_v_dim=cfg.head_v_dim, norm_eps=cfg.norm_eps, ops=cfg.ops)
    return GatedLinearAttention(**dims) if kind == "gla" else KimiDeltaAttention(**dims)


class Block(nn.Module):
    """Pre-norm residual block: a token mixer (linear or softmax attention), then a SwiGLU MLP."""

    def __init__(self, cfg: LMConfig, mixer: str) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = make_mixer(cfg, mixer)
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
    """Embedding, `n_layers` blocks (mixers by `LMConfig.mixers`), final RMSNorm and a (tied or
    untied) output head. Every block reads the same `cp_context`."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, mixer) for mixer in cfg.mixers)
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
