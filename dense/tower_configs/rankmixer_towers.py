"""The RankMixer tower as the config sees it: its [model.rankmixer] table and its builder
(the modules: dense/rankmixer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from dense.tower_registry import TokenFields, register_tower

if TYPE_CHECKING:
    from torch import nn

    from dense.layout import InputLayout

BlockNorm = Literal["post", "pre"]
TowerPooling = Literal["mean", "flatten"]


@dataclass
class RankMixerConfig:
    """RankMixer block."""

    key: ClassVar[str] = "rankmixer"
    norm: BlockNorm = "post"
    """post (the paper's LN(X + F(X))) | pre (X + F(LN(X)), one LN before the pooling)."""
    dropout: float = 0.0
    """Dropout on the per-token FFN's output before its residual add (0: none)."""
    mixing_dropout: float = 0.0
    """Dropout on the token mixing's output before its residual add (0: none)."""
    pooling: TowerPooling = "mean"
    """Tower output: mean (over tokens, the paper's, [B, D]) | flatten (every token into the heads, [B, T*D])."""

    def validate(self) -> None:
        for name in ("dropout", "mixing_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"model.rankmixer.{name}={getattr(self, name)} must be a probability in [0, 1)")


@register_tower("rankmixer", tables=(RankMixerConfig,))
def build_rankmixer(cfg: TokenFields, layout: InputLayout, block: RankMixerConfig) -> nn.Module:
    # on use: torch (the config loads without it)
    from dense.rankmixer import RankMixerTower
    from dense.tokenizer import build_tokenizer

    return RankMixerTower(build_tokenizer(cfg, layout.group_widths), cfg.num_layers, cfg.hidden_dim, cfg.ffn_ratio,
                          norm=block.norm, pooling=block.pooling, dropout=block.dropout,
                          mixing_dropout=block.mixing_dropout)
