"""Dense towers chosen by name (`model.tower`): e_input [B, E] -> [B, tower.out_dim]."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dense.layout import InputLayout
from dense.rankmixer import RankMixerTower
from dense.tokenizer import build_tokenizer
from trainer.config import ModelConfig

TowerBuilder = Callable[[ModelConfig, InputLayout], nn.Module]
TOWERS: dict[str, TowerBuilder] = {}


def register_tower(name: str) -> Callable[[TowerBuilder], TowerBuilder]:
    """Make a tower selectable as `model.tower = name`."""
    def wrap(fn: TowerBuilder) -> TowerBuilder:
        TOWERS[name] = fn
        return fn
    return wrap


def build_tower(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    """The tower named by `model.tower`; it exposes `out_dim`."""
    if cfg.tower not in TOWERS:
        raise ValueError(f"model.tower={cfg.tower!r} is not one of {sorted(TOWERS)}")
    return TOWERS[cfg.tower](cfg, layout)


@register_tower("rankmixer")
def rankmixer(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    tokenizer = build_tokenizer(cfg.tokenizer, layout.group_widths, cfg.num_tokens, cfg.token_dim,
                                cfg.hidden_dim)
    return RankMixerTower(tokenizer, cfg.num_layers, cfg.hidden_dim, cfg.ffn_ratio)


class Passthrough(nn.Module):
    """No tower: the heads see e_input itself, so a linear head is logistic regression
    over the embeddings (first-order terms only), the baseline that cannot learn crosses."""

    def __init__(self, width: int):
        super().__init__()
        self.out_dim = width

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return e_input


@register_tower("logreg")
def logreg(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    return Passthrough(layout.width)
