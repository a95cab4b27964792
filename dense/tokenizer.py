"""Tokenizers: e_input [B, E] -> tokens [B, T, D] (RankMixer eq. 2, UniMixer eq. 9)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dense.tower_registry import TokenFields


class SliceTokenizer(nn.Module):
    """Cut e_input into T slices of d and project each with its own Proj_i: R^d -> R^D.

    x_i = e_input[d(i-1) : d i] W_i + b_i. When T*d exceeds E the tail of e_input is
    padded with zeros (the last token sees fewer real inputs); T*d < E is an error,
    since features would be dropped.
    """

    def __init__(self, input_dim: int, num_tokens: int, token_dim: int, hidden_dim: int, bias_init: str):
        super().__init__()
        self.input_dim, self.num_tokens = input_dim, num_tokens
        self.token_dim = token_dim or math.ceil(input_dim / num_tokens)
        if self.token_dim * num_tokens < input_dim:
            raise ValueError(f"model.token_dim={token_dim} x model.num_tokens={num_tokens} is smaller "
                             f"than e_input's width {input_dim}: features would be dropped")
        bound = 1 / math.sqrt(self.token_dim)
        self.weight = nn.Parameter(torch.empty(num_tokens, self.token_dim, hidden_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(num_tokens, hidden_dim).uniform_(-bound, bound))
        if bias_init == "zero":  # drawn all the same, so that the weights' draws do not move
            nn.init.zeros_(self.bias)

    def forward_tm(self, e_input: torch.Tensor) -> torch.Tensor:
        """[B, E] -> token-major [T, B, D]: one batched product, bias included."""
        pad = self.num_tokens * self.token_dim - self.input_dim
        slices = nn.functional.pad(e_input, (0, pad)) if pad else e_input
        slices = slices.view(-1, self.num_tokens, self.token_dim).transpose(0, 1)
        return torch.baddbmm(self.bias.unsqueeze(1), slices, self.weight)

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        """[B, E] -> [B, T, D]."""
        return self.forward_tm(e_input).transpose(0, 1)

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample): T (d D + D), 2 T d D."""
        t, d, dim = self.weight.shape
        return t * (d * dim + dim), 2 * t * d * dim


class GroupTokenizer(nn.Module):
    """One token per semantic group, each projected by its own Linear(E_g, D)."""

    def __init__(self, group_widths: list[int], hidden_dim: int, bias_init: str):
        super().__init__()
        self.group_widths = list(group_widths)
        self.proj = nn.ModuleList(nn.Linear(w, hidden_dim) for w in group_widths)
        if bias_init == "zero":
            for p in self.proj:
                nn.init.zeros_(p.bias)

    @property
    def num_tokens(self) -> int:
        return len(self.group_widths)

    def forward_tm(self, e_input: torch.Tensor) -> torch.Tensor:
        """[B, E] -> token-major [T = number of groups, B, D]."""
        groups = torch.split(e_input, self.group_widths, dim=1)  # indexed, not iterated: torch.fx traces it
        return torch.stack([p(groups[i]) for i, p in enumerate(self.proj)], dim=0)

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        """[B, E] -> [B, T = number of groups, D]."""
        return self.forward_tm(e_input).transpose(0, 1)

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample): sum over groups of E_g D + D, 2 E_g D."""
        dim = self.proj[0].out_features
        width = sum(self.group_widths)
        return width * dim + len(self.group_widths) * dim, 2 * width * dim


def build_tokenizer(cfg: TokenFields, group_widths: list[int]) -> nn.Module:
    """`model.tokenizer` over e_input's semantic groups: slice (eq. 2: model.num_tokens
    slices of model.token_dim) or group (one token per group), each projected to model.hidden_dim."""
    if cfg.tokenizer == "slice":
        return SliceTokenizer(sum(group_widths), cfg.num_tokens, cfg.token_dim, cfg.hidden_dim, cfg.tokenizer_bias)
    if cfg.tokenizer == "group":
        return GroupTokenizer(group_widths, cfg.hidden_dim, cfg.tokenizer_bias)
    raise ValueError(f"model.tokenizer must be slice or group, got {cfg.tokenizer!r}")
