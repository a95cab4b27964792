"""Dense towers chosen by name (`model.tower`): e_input [B, E] -> [B, tower.out_dim]."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dense.towers.baselines import ABLATIONS, MLP, DCNv2, ablation_tower
from dense.layout import InputLayout
from dense.towers.moe import PerTokenMoE, RankMixerMoETower, expert_hidden
from dense.towers.rankmixer import RankMixerTower
from dense.tokenizer import build_tokenizer
from dense.towers.unimixer import UniMixerBlock, UniMixerTower, UniMixing, UniMixingLite
from trainer.config import ModelConfig
from embeddings.registry import Registry

TOWERS: Registry[Callable[[ModelConfig, InputLayout], nn.Module]] = Registry("model.tower")


def build_tower(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    """The tower named by `model.tower`; it exposes `out_dim`."""
    return TOWERS.get(cfg.tower)(cfg, layout)


@TOWERS.register("rankmixer")
def rankmixer(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    tokenizer = build_tokenizer(cfg, layout.group_widths)
    block = cfg.rankmixer
    return RankMixerTower(tokenizer, cfg.num_layers, cfg.hidden_dim, cfg.ffn_ratio, norm=block.norm,
                          pooling=block.pooling, dropout=block.dropout)


@TOWERS.register("rankmixer_moe")
def rankmixer_moe(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    tokenizer = build_tokenizer(cfg, layout.group_widths)
    t, d, m, block = tokenizer.num_tokens, cfg.hidden_dim, cfg.moe, cfg.rankmixer
    hidden = expert_hidden(d, cfg.ffn_ratio, m.num_experts, m.expert_hidden)

    def moe() -> PerTokenMoE:
        return PerTokenMoE(t, d, m.num_experts, hidden, budget=m.budget, l1_init=m.l1_init, l1_rate=m.l1_rate,
                           consistency=m.consistency, sparse_inference=m.inference == "sparse")
    return RankMixerMoETower(tokenizer, cfg.num_layers, d, moe, norm=block.norm, pooling=block.pooling,
                             dropout=block.dropout)


class Passthrough(nn.Module):
    """No tower: the heads see e_input itself, so a linear head is logistic regression
    over the embeddings (first-order terms only), the baseline that cannot learn crosses."""

    def __init__(self, width: int):
        super().__init__()
        self.out_dim = width

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return e_input

    def cost(self) -> tuple[int, int]:
        return 0, 0


@TOWERS.register("unimixer")
def unimixer(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    return _unimixer_tower(cfg, layout, lambda length, block: UniMixing(length, block, cfg.hidden_dim))


@TOWERS.register("unimixer_lite")
def unimixer_lite(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    return _unimixer_tower(cfg, layout, lambda length, block: UniMixingLite(
        length, block, cfg.hidden_dim, cfg.unimixer.num_basis, cfg.unimixer.global_rank))


def _unimixer_tower(cfg: ModelConfig, layout: InputLayout, mixing: Callable) -> nn.Module:
    """Tokenizer and M Siamese UniMixer layers; `mixing(L, blk)` builds each layer's mixing."""
    tokenizer, u = build_tokenizer(cfg, layout.group_widths), cfg.unimixer
    length, block = tokenizer.num_tokens * cfg.hidden_dim, u.block_size or cfg.hidden_dim
    blocks = [UniMixerBlock(mixing(length, block), cfg.ffn_ratio) for _ in range(cfg.num_layers)]
    return UniMixerTower(tokenizer, blocks, cfg.hidden_dim, u.tau_start, u.tau_end, u.tau_anneal_steps,
                         u.sinkhorn_iters, u.sinkhorn_tol)


@TOWERS.register("logreg")
def logreg(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    return Passthrough(layout.width)


@TOWERS.register("mlp")
def mlp(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    return MLP(layout.width, cfg.mlp.hidden)


@TOWERS.register("dcnv2")
def dcnv2(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    return DCNv2(layout.width, cfg.dcnv2.cross_layers, cfg.dcnv2.cross_rank, cfg.mlp.hidden)


def _register_ablation(kind: str) -> None:
    """RankMixer with one piece swapped out (dense/towers/baselines.py), under the name `kind`."""

    @TOWERS.register(kind)
    def build(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
        return ablation_tower(kind, cfg, layout.group_widths)


for _kind in ABLATIONS:
    _register_ablation(_kind)
