"""RankMixer (arXiv 2507.15551): parameter-free token mixing and per-token FFNs.

Internally every block runs token-major, on activations laid out [T, B, D]: the per-token
FFN is then one batched matrix product over T with no transposes, and only the token
mixing permutes data (fused with its residual add into one elementwise kernel). The
public [B, T, D] interfaces transpose at the edges; the tower stays token-major from the
tokenizer to the mean over tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def token_mixing(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Multi-head token mixing (eq. 3-4): [B, T, D] -> [B, H, T*D/H].

    Each token is split into H heads of q = D/H; output row h concatenates head h of
    every token: out[h, t*q + r] = x[t, h*q + r] (0-based). With H = T the shape is kept.
    """
    if x.shape[-1] % num_heads:
        raise ValueError(f"token mixing needs model.hidden_dim={x.shape[-1]} divisible by the {num_heads} heads")
    return mix_heads(x, num_heads)


def mix_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`token_mixing` of a width already checked, which a traced forward cannot check."""
    b, t, d = x.shape
    return x.view(b, t, num_heads, d // num_heads).transpose(1, 2).reshape(b, num_heads, t * d // num_heads)


def token_mixing_residual_tm(x: torch.Tensor, y: torch.Tensor | None = None,
                             dropout: nn.Module | None = None) -> torch.Tensor:
    """TokenMixing(Y) + X with H = T heads, token-major: [T, B, D] -> [T, B, D] (Y = X
    unless given: the pre-norm block mixes LN(X)); `dropout` drops the mixed values first.

    out[h, b, t*q + r] = y[t, b, h*q + r] + x[h, b, t*q + r]; the permuted view and the
    residual are summed by a single elementwise kernel, no intermediate copy; the result
    has x's layout (contiguous when x is).
    """
    t, b, d = x.shape
    x4 = x.reshape(t, b, t, d // t)
    y4 = x4 if y is None else y.reshape(t, b, t, d // t)
    mixed = y4.permute(2, 1, 0, 3)
    if dropout is not None:
        mixed = dropout(mixed)
    return torch.add(x4, mixed).reshape(t, b, d)  # x4 first: output takes its layout


class PerTokenFFN(nn.Module):
    """Token t has its own two-layer GELU MLP D -> kD -> D (eq. 6-7); all T run as
    batched matrix products over weights stored [T, D, kD] and [T, kD, D]."""

    def __init__(self, num_tokens: int, dim: int, ffn_ratio: int):
        super().__init__()
        hidden = ffn_ratio * dim
        self.w1 = nn.Parameter(uniform_init((num_tokens, dim, hidden), dim))
        self.b1 = nn.Parameter(uniform_init((num_tokens, 1, hidden), dim))
        self.w2 = nn.Parameter(uniform_init((num_tokens, hidden, dim), hidden))
        self.b2 = nn.Parameter(uniform_init((num_tokens, 1, dim), hidden))

    def forward_tm(self, x: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] -> [T, B, D]."""
        return torch.baddbmm(self.b2, F.gelu(torch.baddbmm(self.b1, x, self.w1)), self.w2)

    def residual_tm(self, x: torch.Tensor) -> torch.Tensor:
        """Token-major x + PFFN(x), [T, B, D] -> [T, B, D], with a hand-written backward
        (fewer temporaries and elementwise passes than autograd's graph of the same ops)."""
        return _FFNResidual.apply(x, self.w1, self.b1, self.w2, self.b2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]."""
        return self.forward_tm(x.transpose(0, 1)).transpose(0, 1)

    def cost(self, num_tokens: int | None = None) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample), eq. 12: T (2 k D^2 + kD + D), 4 T k D^2.
        `num_tokens` is unused: the token count is in the weights' shape."""
        t, d, hidden = self.w1.shape
        return t * (2 * d * hidden + hidden + d), 4 * t * d * hidden


class _FFNResidual(torch.autograd.Function):
    """x + GELU(x W1 + b1) W2 + b2 per token, token-major x [T, B, D].

    Forward: the residual and b2 seed the second product's accumulator.
    Backward: GELU's gradient is written over the hidden gradient in place, and the
    residual's gradient seeds the accumulator of the input-gradient product.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        pre = torch.baddbmm(b1, x, w1)
        h = F.gelu(pre)
        out = torch.baddbmm(torch.add(x, b2), h, w2)  # out of place: FlopCounterMode counts it
        ctx.save_for_backward(x, w1, w2, pre, h)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w1, w2, pre, h = ctx.saved_tensors
        x, w1, w2 = in_dtype(grad.dtype, x, w1, w2)
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        grad = grad.contiguous()
        gw2 = torch.bmm(h.transpose(1, 2), grad) if need_w2 else None
        gb2 = grad.sum(1, keepdim=True) if need_b2 else None
        gpre = torch.bmm(grad, w2.transpose(1, 2))
        torch.ops.aten.gelu_backward.grad_input(gpre, pre, grad_input=gpre)
        gw1 = torch.bmm(x.transpose(1, 2), gpre) if need_w1 else None
        gb1 = gpre.sum(1, keepdim=True) if need_b1 else None
        gx = torch.baddbmm(grad, gpre, w1.transpose(1, 2)) if need_x else None
        return gx, gw1, gb1, gw2, gb2


def in_dtype(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` in `dtype`. A hand-written backward gets its gradient in the dtype the
    forward's products had (bf16 under autocast) while weights and inputs were saved in
    float32; the products of the backward run in the forward's dtype, as autograd's would."""
    return [t.to(dtype) for t in tensors]


def uniform_init(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    bound = 1 / math.sqrt(fan_in)  # nn.Linear's default range
    return torch.empty(shape).uniform_(-bound, bound)


def check_mixing_width(dim: int, num_tokens: int) -> None:
    """Token mixing with H = T heads splits each token into T equal heads."""
    if dim % num_tokens:
        raise ValueError(f"RankMixer needs model.hidden_dim={dim} divisible by the number of "
                         f"tokens {num_tokens} (token mixing uses H = T heads)")


# The values of model.rankmixer.norm and .pooling (dense/tower_configs/rankmixer_towers.py's
# BlockNorm and TowerPooling, which tests/test_config_choices.py holds equal to these): spelt
# out here, because the declaration builds from this module and so sits above it.
NORMS = ("post", "pre")
POOLINGS = ("mean", "flatten")


class RankMixerBlock(nn.Module):
    """Post-norm block (eq. 1, the default): S = LN(TokenMixing(X) + X); X' = LN(FFN(S) + S).
    Pre-norm (`norm="pre"`): S = X + TokenMixing(LN(X)); X' = S + FFN(LN(S)), the residual
    stream left unnormalised (the tower normalises once before pooling).

    The per-token FFN is pluggable: any module with `forward_tm(s)` and `residual_tm(s)`
    (token-major FFN(s) and s + FFN(s), [T, B, D] -> [T, B, D]) and `cost()` (parameters,
    FLOPs per sample). The default is the dense `PerTokenFFN` of `ffn_ratio`; the Sparse-MoE
    (dense/moe.py) is another. `dropout` drops FFN outputs before the residual add,
    `mixing_dropout` the token mixing's.
    """

    def __init__(self, num_tokens: int, dim: int, ffn_ratio: int, ffn: nn.Module | None = None,
                 norm: str = "post", dropout: float = 0.0, mixing_dropout: float = 0.0):
        super().__init__()
        check_mixing_width(dim, num_tokens)
        if norm not in NORMS:
            raise ValueError(f"model.rankmixer.norm must be one of {NORMS}, got {norm!r}")
        self.num_tokens, self.pre_norm = num_tokens, norm == "pre"
        self.norm1 = nn.LayerNorm(dim)
        self.ffn = ffn if ffn is not None else PerTokenFFN(num_tokens, dim, ffn_ratio)
        self.norm2 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout) if dropout else None
        self.mixing_dropout = nn.Dropout(mixing_dropout) if mixing_dropout else None

    def forward_tm(self, x: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] -> [T, B, D]."""
        if self.pre_norm:
            s = token_mixing_residual_tm(x, self.norm1(x), dropout=self.mixing_dropout)
            return s + self._dropped(self.ffn.forward_tm(self.norm2(s)))
        s = self.norm1(token_mixing_residual_tm(x, dropout=self.mixing_dropout))
        if self.dropout is None:  # the fused residual
            return self.norm2(self.ffn.residual_tm(s))
        return self.norm2(s + self.dropout(self.ffn.forward_tm(s)))

    def _dropped(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.dropout is None else self.dropout(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]."""
        return self.forward_tm(x.transpose(0, 1)).transpose(0, 1)


class RankMixerTower(nn.Module):
    """Tokenizer -> L RankMixer blocks -> pooling: e_input [B, E] -> [B, D] (mean over
    tokens, the paper's) or [B, T*D] (`pooling="flatten"`: every token into the heads).

    `ffn` makes each block's per-token FFN (default: `PerTokenFFN(T, D, ffn_ratio)`); `norm`
    places the blocks' LayerNorms (`RankMixerBlock`)."""

    def __init__(self, tokenizer: nn.Module, num_layers: int, dim: int, ffn_ratio: int,
                 ffn: Callable[[], nn.Module] | None = None, norm: str = "post", pooling: str = "mean",
                 dropout: float = 0.0, mixing_dropout: float = 0.0):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"model.rankmixer.pooling must be one of {POOLINGS}, got {pooling!r}")
        self.tokenizer = tokenizer
        t = tokenizer.num_tokens
        # Without `ffn` each block makes its dense PerTokenFFN (its LayerNorms draw nothing from the RNG).
        self.blocks = nn.Sequential(*(RankMixerBlock(t, dim, ffn_ratio, ffn() if ffn else None, norm=norm,
                                                     dropout=dropout, mixing_dropout=mixing_dropout)
                                      for _ in range(num_layers)))
        # Pre-norm leaves the residual stream unnormalised: one LayerNorm before the pooling.
        self.final_norm = nn.LayerNorm(dim) if norm == "pre" else nn.Identity()
        self.flatten = pooling == "flatten"
        self.out_dim = dim * t if self.flatten else dim

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        x = self.tokenizer.forward_tm(e_input)  # [T, B, D] from here to the pooling
        for block in self.blocks:
            x = block.forward_tm(x)
        x = self.final_norm(x)
        if self.flatten:
            return x.transpose(0, 1).reshape(x.shape[1], -1)
        return x.mean(dim=0)

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample): the tokenizer, then per block its
        FFN (eq. 12 for the dense one: 2 k T D^2 weights and 4 k T D^2 FLOPs) and norms."""
        params, flops = self.tokenizer.cost()
        for block in self.blocks:
            ffn_params, ffn_flops = block.ffn.cost()
            params += ffn_params + sum(p.numel() for n in (block.norm1, block.norm2) for p in n.parameters())
            flops += ffn_flops
        return params + sum(p.numel() for p in self.final_norm.parameters()), flops
