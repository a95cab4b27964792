"""The UniMixer towers as the config sees them: their [model.unimixer] table and builders
(the modules: dense/unimixer.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from dense.tower_configs.moe_towers import MoEConfig
from dense.tower_registry import TokenFields, check_ranges, register_tower

if TYPE_CHECKING:
    from torch import nn

    from dense.layout import InputLayout

MixingInit = Literal["permutation", "random"]
Schedule = Literal["anneal", "two_stage"]


@dataclass
class UniMixerConfig:
    """UniMixer mixing."""

    key: ClassVar[str] = "unimixer"
    block_size: int = 0
    ("""Block size over the flattened T x D tokens (0: D/T, RankMixer's head, whose token mixing UniMixing can """
     """then learn).""")
    ffn_hidden: int = 0
    ("""Hidden width of the per-token SwiGLU (0: the widest at which a layer's FLOPs stay within RankMixer's at """
     """model.ffn_ratio).""")
    init: MixingInit = "permutation"
    ("""permutation: start at RankMixer's token mixing (fixed logit offsets, half of each row at tau 1) | random: """
     """unit-variance logits.""")
    mixing_lr_mult: float = 10.0
    ("""Learning rate of the mixing parameters as a multiple of optim.lr (RMSProp moves each by about the rate """
     """per step).""")
    tau_start: float = 1.0
    """Temperature at step 0 (eq. 21)."""
    tau_end: float = 0.05
    """Temperature after tau_anneal_steps (eq. 21)."""
    tau_anneal_steps: int = 500
    """J, steps of the linear temperature anneal (0: hold tau_start for the whole run)."""
    schedule: Schedule = "anneal"
    ("""anneal: eq. 21 | two_stage: train at tau_start (run_dir/hot), then again at tau_end from those weights """
     """(§4.5; trainer/stages.py).""")
    sinkhorn_stages: int = 3
    ("""Temperatures per halving of tau below 1 at which the doubly stochastic scaling is solved in turn (epsilon """
     """scaling).""")
    sinkhorn_steps: int = 3
    """Newton steps of the scaling at each of those temperatures."""
    num_basis: int = 4
    """unimixer_lite: b, shared basis matrices of the local weights."""
    global_rank: int = 8
    """unimixer_lite: r, rank of the global weight A_G B_G."""

    def validate(self) -> None:
        check_ranges(self, positive=("tau_start", "tau_end", "mixing_lr_mult", "sinkhorn_stages", "sinkhorn_steps",
                                     "num_basis", "global_rank"),
                     nonnegative=("block_size", "ffn_hidden", "tau_anneal_steps"))
        if self.tau_anneal_steps and self.tau_end > self.tau_start:
            raise ValueError(f"model.unimixer.tau_end={self.tau_end} exceeds model.unimixer.tau_start="
                             f"{self.tau_start}: eq. 21 anneals the temperature downwards")


@register_tower("unimixer", tables=(UniMixerConfig,), skip=("num_basis", "global_rank"))
def build_unimixer(cfg: TokenFields, layout: InputLayout, u: UniMixerConfig) -> nn.Module:
    from dense.unimixer import UniMixing  # on use: torch (the config loads without it)

    return _unimixer_tower(cfg, u, layout, lambda length, block: UniMixing(length, block, cfg.hidden_dim, u.init,
                                                                        u.mixing_lr_mult))


@register_tower("unimixer_lite", tables=(UniMixerConfig,))
def build_unimixer_lite(cfg: TokenFields, layout: InputLayout, u: UniMixerConfig) -> nn.Module:
    from dense.unimixer import UniMixingLite  # on use: torch (the config loads without it)

    return _unimixer_tower(cfg, u, layout, lambda length, block: UniMixingLite(
        length, block, cfg.hidden_dim, u.num_basis, u.global_rank, u.init, u.mixing_lr_mult))


@register_tower("unimixer_moe", tables=(UniMixerConfig, MoEConfig), skip=("num_basis", "global_rank", "ffn_hidden"))
def build_unimixer_moe(cfg: TokenFields, layout: InputLayout, u: UniMixerConfig, m: MoEConfig) -> nn.Module:
    """UniMixing and a sparse per-token MoE per block (figure 2), the MoE's experts as
    RankMixer's MoE sizes them (model.moe)."""
    # on use: torch (the config loads without it)
    from dense.moe import PerTokenMoE, expert_hidden
    from dense.tokenizer import build_tokenizer
    from dense.unimixer import UniMixerBlock, UniMixing
    from dense.unimixer_moe import UniMixerMoETower

    tokenizer = build_tokenizer(cfg, layout.group_widths)
    t, d = tokenizer.num_tokens, cfg.hidden_dim
    length, block, _ = mixing_shape(cfg, u, t, ffn=False)
    hidden = expert_hidden(d, cfg.ffn_ratio, m.num_experts, m.expert_hidden)
    blocks = [UniMixerBlock(UniMixing(length, block, d, u.init, u.mixing_lr_mult), 0, PerTokenMoE(
        t, d, m.num_experts, hidden, budget=m.budget, l1_init=m.l1_init, l1_rate=m.l1_rate, consistency=m.consistency,
        sparse_inference=m.inference == "sparse")) for _ in range(cfg.num_layers)]
    return UniMixerMoETower(tokenizer, blocks, d, u.tau_start, u.tau_end, u.tau_anneal_steps,
                            u.sinkhorn_stages, u.sinkhorn_steps)


def mixing_shape(cfg: TokenFields, u: UniMixerConfig, num_tokens: int, ffn: bool = True) -> tuple[int, int, int]:
    """(L, blk, SwiGLU width) of a UniMixer over `num_tokens` tokens: the defaults of
    model.unimixer.block_size (D/T) and ffn_hidden (RankMixer's FLOPs) resolved (0 without `ffn`)."""
    from dense.unimixer import matched_ffn_hidden  # on use: torch (the config loads without it)

    d = cfg.hidden_dim
    if not u.block_size and d % num_tokens:
        raise ValueError(f"model.unimixer.block_size=0 takes D/T, but model.hidden_dim={d} is not divisible by "
                         f"the number of tokens {num_tokens}; set model.unimixer.block_size")
    block = u.block_size or d // num_tokens
    if (num_tokens * d) % block:
        raise ValueError(f"model.unimixer.block_size={block} must divide the flattened token length "
                         f"T*D = {num_tokens * d}")
    if not ffn:
        return num_tokens * d, block, 0
    return num_tokens * d, block, u.ffn_hidden or matched_ffn_hidden(num_tokens, d, block, cfg.ffn_ratio)


def _unimixer_tower(cfg: TokenFields, u: UniMixerConfig, layout: InputLayout, mixing: Callable) -> nn.Module:
    """Tokenizer and M Siamese UniMixer layers; `mixing(L, blk)` builds each layer's mixing."""
    # on use: torch (the config loads without it)
    from dense.tokenizer import build_tokenizer
    from dense.unimixer import UniMixerBlock, UniMixerTower

    tokenizer = build_tokenizer(cfg, layout.group_widths)
    length, block, hidden = mixing_shape(cfg, u, tokenizer.num_tokens)
    blocks = [UniMixerBlock(mixing(length, block), hidden) for _ in range(cfg.num_layers)]
    return UniMixerTower(tokenizer, blocks, cfg.hidden_dim, u.tau_start, u.tau_end, u.tau_anneal_steps,
                         u.sinkhorn_stages, u.sinkhorn_steps)
