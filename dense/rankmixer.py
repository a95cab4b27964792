"""RankMixer (arXiv 2507.15551): parameter-free token mixing and per-token FFNs."""

from __future__ import annotations

import math

import torch
from torch import nn


def token_mixing(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Multi-head token mixing (eq. 3-4): [B, T, D] -> [B, H, T*D/H].

    Each token is split into H heads of q = D/H; output row h concatenates head h of
    every token: out[h, t*q + r] = x[t, h*q + r] (0-based). With H = T the shape is kept.
    """
    b, t, d = x.shape
    if d % num_heads:
        raise ValueError(f"token mixing needs model.hidden_dim={d} divisible by the {num_heads} heads")
    return x.view(b, t, num_heads, d // num_heads).transpose(1, 2).reshape(b, num_heads, t * d // num_heads)


class PerTokenFFN(nn.Module):
    """Token t has its own two-layer GELU MLP D -> kD -> D (eq. 6-7); all T run as
    batched matrix products over weights stored [T, D, kD] and [T, kD, D]."""

    def __init__(self, num_tokens: int, dim: int, ratio: int):
        super().__init__()
        hidden = ratio * dim
        self.w1 = nn.Parameter(_uniform((num_tokens, dim, hidden), dim))
        self.b1 = nn.Parameter(_uniform((num_tokens, 1, hidden), dim))
        self.w2 = nn.Parameter(_uniform((num_tokens, hidden, dim), hidden))
        self.b2 = nn.Parameter(_uniform((num_tokens, 1, dim), hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]."""
        xt = x.transpose(0, 1)  # [T, B, D]: one matmul per token, batched over T
        h = nn.functional.gelu(torch.baddbmm(self.b1, xt, self.w1))
        return torch.baddbmm(self.b2, h, self.w2).transpose(0, 1)


def _uniform(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    bound = 1 / math.sqrt(fan_in)  # nn.Linear's default range
    return torch.empty(shape).uniform_(-bound, bound)


class RankMixerBlock(nn.Module):
    """Post-norm block (eq. 1): S = LN(TokenMixing(X) + X); X' = LN(PFFN(S) + S)."""

    def __init__(self, num_tokens: int, dim: int, ratio: int):
        super().__init__()
        if dim % num_tokens:
            raise ValueError(f"RankMixer needs model.hidden_dim={dim} divisible by the number of "
                             f"tokens {num_tokens} (token mixing uses H = T heads)")
        self.num_tokens = num_tokens
        self.norm1 = nn.LayerNorm(dim)
        self.ffn = PerTokenFFN(num_tokens, dim, ratio)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]."""
        s = self.norm1(token_mixing(x, self.num_tokens) + x)
        return self.norm2(self.ffn(s) + s)


class RankMixerTower(nn.Module):
    """Tokenizer -> L RankMixer blocks -> mean over tokens: e_input [B, E] -> [B, D]."""

    def __init__(self, tokenizer: nn.Module, num_layers: int, dim: int, ratio: int):
        super().__init__()
        self.tokenizer = tokenizer
        self.blocks = nn.Sequential(*(RankMixerBlock(tokenizer.num_tokens, dim, ratio)
                                      for _ in range(num_layers)))
        self.out_dim = dim

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.tokenizer(e_input)).mean(dim=1)
