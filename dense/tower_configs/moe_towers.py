"""The RankMixer tower with per-token Sparse-MoE FFNs as the config sees it: its [model.moe]
table (and RankMixer's block table) and its builder (the modules: dense/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from dense.tower_configs.rankmixer_towers import RankMixerConfig
from dense.tower_registry import TokenFields, check_ranges, register_tower

if TYPE_CHECKING:
    from torch import nn

    from dense.layout import InputLayout

MoEInference = Literal["sparse", "dense"]


@dataclass
class MoEConfig:
    """Sparse mixture of experts."""

    key: ClassVar[str] = "moe"
    num_experts: int = 4
    """E, experts per token."""
    expert_hidden: int = 0
    """Hidden width of each expert (0: k D / E, the dense per-token FFN split over the experts)."""
    budget: float = 0.5
    """Target mean fraction of active experts; the L1 coefficient adapts to track it."""
    l1_init: float = 0.001
    """Initial L1 coefficient lambda on the inference router's gates (also the smallest step scale)."""
    l1_rate: float = 0.1
    """Adaptation speed: lambda += rate * (active - budget) / budget * max(|lambda|, l1_init) per step."""
    consistency: float = 1.0
    """Weight of the loss that teaches the inference router to reproduce the dense training output."""
    inference: MoEInference = "sparse"
    ("""At evaluation and scoring: sparse (inference router, only experts with a non-zero gate) | dense (training """
     """router, every expert).""")

    def validate(self) -> None:
        # l1_init > 0: lambda adapts multiplicatively
        check_ranges(self, positive=("num_experts", "l1_init"), nonnegative=("expert_hidden", "l1_rate", "consistency"))
        if not 0 < self.budget <= 1:
            raise ValueError(f"model.moe.budget={self.budget} must be a fraction of the experts in (0, 1]")


@register_tower("rankmixer_moe", tables=(RankMixerConfig, MoEConfig))
def build_rankmixer_moe(cfg: TokenFields, layout: InputLayout, block: RankMixerConfig, m: MoEConfig) -> nn.Module:
    # on use: torch (the config loads without it)
    from dense.moe import PerTokenMoE, RankMixerMoETower, expert_hidden
    from dense.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg, layout.group_widths)
    t, d = tokenizer.num_tokens, cfg.hidden_dim
    hidden = expert_hidden(d, cfg.ffn_ratio, m.num_experts, m.expert_hidden)

    def moe() -> PerTokenMoE:
        return PerTokenMoE(t, d, m.num_experts, hidden, budget=m.budget, l1_init=m.l1_init, l1_rate=m.l1_rate,
                           consistency=m.consistency, sparse_inference=m.inference == "sparse")
    return RankMixerMoETower(tokenizer, cfg.num_layers, d, cfg.ffn_ratio, moe, norm=block.norm,
                             pooling=block.pooling, dropout=block.dropout, mixing_dropout=block.mixing_dropout)
