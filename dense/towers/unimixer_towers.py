"""The UniMixer towers as the config sees them: their [model.unimixer] table and builders
(the modules: dense/unimixer.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dense.tower_registry import check_ranges, register_tower

if TYPE_CHECKING:
    from torch import nn

    from dense.layout import InputLayout
    from dense.model_config import ModelConfig


@dataclass
class UniMixerConfig:
    """UniMixer mixing."""

    key: ClassVar[str] = "unimixer"
    block_size: int = 0
    """Block size over the flattened T x D tokens (0: D, one block per token)."""
    tau_start: float = 1.0
    """Temperature at step 0 (eq. 21)."""
    tau_end: float = 0.05
    """Temperature after tau_anneal_steps (eq. 21)."""
    tau_anneal_steps: int = 0
    """J, steps of the linear temperature anneal (0: hold tau_start for the whole run)."""
    sinkhorn_iters: int = 50
    """Most Sinkhorn-Knopp iterations (row and column normalisation each) for the mixing weights."""
    sinkhorn_tol: float = 1e-5
    """Sinkhorn stops early once every row's log-sum is within this of 0 (0: always sinkhorn_iters)."""
    num_basis: int = 4
    """unimixer_lite: b, shared basis matrices of the local weights."""
    global_rank: int = 8
    """unimixer_lite: r, rank of the global weight A_G B_G."""

    def validate(self) -> None:
        check_ranges(self, positive=("tau_start", "tau_end", "sinkhorn_iters", "num_basis", "global_rank"),
                     nonnegative=("block_size", "tau_anneal_steps", "sinkhorn_tol"))
        if self.tau_anneal_steps and self.tau_end > self.tau_start:
            raise ValueError(f"model.unimixer.tau_end={self.tau_end} exceeds model.unimixer.tau_start="
                             f"{self.tau_start}: eq. 21 anneals the temperature downwards")


@register_tower("unimixer", tables=(UniMixerConfig,), skip=("num_basis", "global_rank"))
def build_unimixer(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    from dense.unimixer import UniMixing  # on use: torch (the config loads without it)

    return _unimixer_tower(cfg, layout, lambda length, block: UniMixing(length, block, cfg.hidden_dim))


@register_tower("unimixer_lite", tables=(UniMixerConfig,))
def build_unimixer_lite(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    from dense.unimixer import UniMixingLite  # on use: torch (the config loads without it)

    return _unimixer_tower(cfg, layout, lambda length, block: UniMixingLite(
        length, block, cfg.hidden_dim, cfg.unimixer.num_basis, cfg.unimixer.global_rank))


def _unimixer_tower(cfg: ModelConfig, layout: InputLayout, mixing: Callable) -> nn.Module:
    """Tokenizer and M Siamese UniMixer layers; `mixing(L, blk)` builds each layer's mixing."""
    # on use: torch (the config loads without it)
    from dense.tokenizer import build_tokenizer
    from dense.unimixer import UniMixerBlock, UniMixerTower

    tokenizer, u = build_tokenizer(cfg, layout.group_widths), cfg.unimixer
    length, block = tokenizer.num_tokens * cfg.hidden_dim, u.block_size or cfg.hidden_dim
    blocks = [UniMixerBlock(mixing(length, block), cfg.ffn_ratio) for _ in range(cfg.num_layers)]
    return UniMixerTower(tokenizer, blocks, cfg.hidden_dim, u.tau_start, u.tau_end, u.tau_anneal_steps,
                         u.sinkhorn_iters, u.sinkhorn_tol)
