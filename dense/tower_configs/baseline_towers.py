"""The comparison towers as the config sees them: logistic regression, the MLP, DCNv2 and
three RankMixer ablations, with the [model.mlp], [model.dcnv2] and [model.attention] tables
and their builders (the modules: dense/baselines.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from dense.tower_registry import TokenFields, check_ranges, register_tower

if TYPE_CHECKING:
    from torch import nn

    from dense.layout import InputLayout


@dataclass
class MLPConfig:
    """ReLU MLP."""

    key: ClassVar[str] = "mlp"
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    """Hidden widths; the last is the tower's output."""


@dataclass
class DCNv2Config:
    """Cross network."""

    key: ClassVar[str] = "dcnv2"
    cross_layers: int = 3
    """Cross layers x_{l+1} = x_0 * (W x_l + b) + x_l."""
    cross_rank: int = 0
    """Rank r of W = U V^T (0: full E x E matrices)."""

    def validate(self) -> None:
        check_ranges(self, nonnegative=("cross_rank",))


@dataclass
class AttentionConfig:
    """Self-attention token mixing."""

    key: ClassVar[str] = "attention"
    num_heads: int = 0
    """Attention heads H (0: one per token, H = T); D must divide by H."""

    def validate(self) -> None:
        check_ranges(self, nonnegative=("num_heads",))


@register_tower("logreg", tokens=False)
def build_logreg(cfg: TokenFields, layout: InputLayout) -> nn.Module:
    from dense.baselines import Passthrough  # on use: torch (the config loads without it)

    return Passthrough(layout.width)


# Without the dense warm-up: on issue 42's held-out data it cost MLP 0.011 AUC and DCNv2
# 0.0016 (docs/results.md); on the project's logs it was level but for the capacity teacher's MLP.
BASELINE_DEFAULTS = {"optim.dense_warmup_steps": 0}


@register_tower("mlp", tables=(MLPConfig,), tokens=False, defaults=BASELINE_DEFAULTS)
def build_mlp(cfg: TokenFields, layout: InputLayout, mlp: MLPConfig) -> nn.Module:
    from dense.baselines import MLP  # on use: torch (the config loads without it)

    return MLP(layout.width, mlp.hidden)


@register_tower("dcnv2", tables=(MLPConfig, DCNv2Config), tokens=False, defaults=BASELINE_DEFAULTS)
def build_dcnv2(cfg: TokenFields, layout: InputLayout, mlp: MLPConfig, dcn: DCNv2Config) -> nn.Module:
    from dense.baselines import DCNv2  # on use: torch (the config loads without it)

    return DCNv2(layout.width, dcn.cross_layers, dcn.cross_rank, mlp.hidden)


def _ablation(kind: str):
    """The builder of RankMixer with one piece swapped out (dense/baselines.py ABLATIONS)."""
    def build(cfg: TokenFields, layout: InputLayout, attention: AttentionConfig | None = None) -> nn.Module:
        from dense.baselines import ablation_tower  # on use: torch (the config loads without it)

        return ablation_tower(kind, cfg, layout.group_widths, attention.num_heads if attention else 0)
    return build


register_tower("no_token_mixing")(_ablation("no_token_mixing"))
register_tower("shared_ffn")(_ablation("shared_ffn"))
register_tower("self_attention", tables=(AttentionConfig,))(_ablation("self_attention"))
