"""Comparison towers (docs/design.md §3.7): logistic regression over the embeddings, a
DLRM-style MLP, DCNv2, and three RankMixer ablations, each e_input [B, E] -> [B, out_dim],
with analytic (parameters, FLOPs) costs.

FLOPs are forward matmul FLOPs per sample, 2 m n k per product as `torch.utils.flop_counter`
counts them; element-wise work (activations, norms, the cross product's Hadamard) is left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dense.rankmixer import PerTokenFFN, check_mixing_width, mix_heads
from dense.tokenizer import build_tokenizer

if TYPE_CHECKING:
    from dense.tower_registry import TokenFields


def linear_cost(fan_in: int, fan_out: int, bias: bool = True) -> tuple[int, int]:
    """(parameters, FLOPs per row) of one nn.Linear."""
    return fan_in * fan_out + (fan_out if bias else 0), 2 * fan_in * fan_out


def _add(*costs: tuple[int, int]) -> tuple[int, int]:
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


# ---------------------------------------------------------------- logistic regression, DLRM MLP and DCNv2


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


class MLP(nn.Module):
    """Linear + ReLU per hidden width: [B, E] -> [B, hidden[-1]]."""

    def __init__(self, input_dim: int, hidden: list[int]):
        super().__init__()
        if not hidden:
            raise ValueError("model.mlp.hidden needs at least one width")
        widths = [input_dim, *hidden]
        layers = []
        for fan_in, fan_out in zip(widths, widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        self.net = nn.Sequential(*layers)
        self.widths, self.out_dim = widths, hidden[-1]

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return self.net(e_input)

    def cost(self) -> tuple[int, int]:
        return _add(*(linear_cost(i, o) for i, o in zip(self.widths, self.widths[1:])))


class CrossLayer(nn.Module):
    """x_{l+1} = x_0 * (W x_l + b) + x_l, with W full [E, E] or W = U V^T, U, V [E, r]."""

    def __init__(self, dim: int, rank: int = 0):
        super().__init__()
        self.dim, self.rank = dim, rank
        # Low rank applies V^T then U: 4 E r FLOPs instead of 2 E^2; b sits on the second map.
        self.down = nn.Linear(dim, rank, bias=False) if rank else nn.Identity()
        self.up = nn.Linear(rank or dim, dim)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """([B, E], [B, E]) -> [B, E]."""
        return x0 * self.up(self.down(x)) + x

    def weight(self) -> torch.Tensor:
        """W [E, E] as one matrix (for checks; the forward never builds it when r > 0)."""
        return self.up.weight @ self.down.weight if self.rank else self.up.weight

    def cost(self) -> tuple[int, int]:
        if not self.rank:
            return linear_cost(self.dim, self.dim)
        return _add(linear_cost(self.dim, self.rank, bias=False), linear_cost(self.rank, self.dim))


class DCNv2(nn.Module):
    """Cross network (`layers` CrossLayers) stacked under the MLP: [B, E] -> [B, hidden[-1]]."""

    def __init__(self, input_dim: int, layers: int, rank: int, hidden: list[int]):
        super().__init__()
        self.cross = nn.ModuleList(CrossLayer(input_dim, rank) for _ in range(layers))
        self.mlp = MLP(input_dim, hidden)
        self.out_dim = self.mlp.out_dim

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        x = e_input
        for layer in self.cross:
            x = layer(e_input, x)
        return self.mlp(x)

    def cost(self) -> tuple[int, int]:
        return _add(*(c.cost() for c in self.cross), self.mlp.cost())


# ---------------------------------------------------------------- RankMixer ablations


class TokenMixing(nn.Module):
    """RankMixer's parameter-free mixing with H = T heads: [B, T, D] -> [B, T, D]."""

    def __init__(self, num_tokens: int, dim: int):
        super().__init__()
        check_mixing_width(dim, num_tokens)
        self.num_tokens = num_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mix_heads(x, self.num_tokens)  # its width was checked in __init__

    def cost(self, num_tokens: int) -> tuple[int, int]:
        return 0, 0  # a permutation of values: no weights, no matmuls


class SelfAttention(nn.Module):
    """Multi-head self-attention over the T tokens (QKV projection, SDPA, output projection):
    [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"self_attention needs model.hidden_dim={dim} divisible by {num_heads} heads "
                             "(model.attention.num_heads)")
        self.dim, self.num_heads = dim, num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # [B, T, 3D] -> 3 x [B, H, T, D/H]
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, t, d))

    def cost(self, num_tokens: int) -> tuple[int, int]:
        qkv, out = linear_cost(self.dim, 3 * self.dim), linear_cost(self.dim, self.dim)
        # QK^T and AV: 2 T T D each, summed over heads.
        return qkv[0] + out[0], num_tokens * (qkv[1] + out[1]) + 4 * num_tokens ** 2 * self.dim


class SharedFFN(nn.Module):
    """One GELU MLP D -> kD -> D applied to every token: [B, T, D] -> [B, T, D]."""

    def __init__(self, dim: int, ffn_ratio: int):
        super().__init__()
        self.dim, self.hidden = dim, ffn_ratio * dim
        self.net = nn.Sequential(nn.Linear(dim, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def cost(self, num_tokens: int) -> tuple[int, int]:
        params, flops = _add(linear_cost(self.dim, self.hidden), linear_cost(self.hidden, self.dim))
        return params, num_tokens * flops


class AblationBlock(nn.Module):
    """Post-norm block: S = LN(Mix(X) + X); X' = LN(FFN(S) + S), or X' = LN(FFN(X) + X) when
    `mixing` is None. [B, T, D] -> [B, T, D]."""

    def __init__(self, mixing: nn.Module | None, ffn: nn.Module, dim: int):
        super().__init__()
        self.mixing, self.ffn = mixing, ffn
        self.norm1 = nn.LayerNorm(dim) if mixing is not None else None
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x if self.mixing is None else self.norm1(self.mixing(x) + x)
        return self.norm2(self.ffn(s) + s)

    def cost(self, num_tokens: int) -> tuple[int, int]:
        ffn = self.ffn.cost(num_tokens)
        mix = self.mixing.cost(num_tokens) if self.mixing is not None else (0, 0)
        norms = sum(p.numel() for n in (self.norm1, self.norm2) if n is not None for p in n.parameters())
        return _add(ffn, mix, (norms, 0))


class AblationTower(nn.Module):
    """Tokenizer -> blocks -> mean over tokens: e_input [B, E] -> [B, D]."""

    def __init__(self, tokenizer: nn.Module, blocks: list[AblationBlock], dim: int):
        super().__init__()
        self.tokenizer = tokenizer
        self.blocks = nn.Sequential(*blocks)
        self.out_dim = dim

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.tokenizer(e_input)).mean(dim=1)

    def cost(self) -> tuple[int, int]:
        t = self.tokenizer.num_tokens
        return _add(self.tokenizer.cost(), *(b.cost(t) for b in self.blocks))


ABLATIONS = ("no_token_mixing", "shared_ffn", "self_attention")


def ablation_block(kind: str, num_tokens: int, dim: int, ffn_ratio: int, num_heads: int) -> AblationBlock:
    """One block of the ablation `kind` (one of ABLATIONS)."""
    if kind == "no_token_mixing":
        return AblationBlock(None, PerTokenFFN(num_tokens, dim, ffn_ratio), dim)
    if kind == "shared_ffn":
        return AblationBlock(TokenMixing(num_tokens, dim), SharedFFN(dim, ffn_ratio), dim)
    if kind == "self_attention":
        return AblationBlock(SelfAttention(dim, num_heads or num_tokens), PerTokenFFN(num_tokens, dim, ffn_ratio), dim)
    raise ValueError(f"unknown RankMixer ablation {kind!r}; expected one of {ABLATIONS}")


def ablation_tower(kind: str, cfg: TokenFields, group_widths: list[int], num_heads: int = 0) -> AblationTower:
    """The ablation `kind` built from the token fields `cfg`, with RankMixer's tokenizer
    (`num_heads`: self_attention's, model.attention.num_heads)."""
    tokenizer = build_tokenizer(cfg, group_widths)
    blocks = [ablation_block(kind, tokenizer.num_tokens, cfg.hidden_dim, cfg.ffn_ratio, num_heads)
              for _ in range(cfg.num_layers)]
    return AblationTower(tokenizer, blocks, cfg.hidden_dim)
