"""UniMixer (docs/design.md §3.6): learnable block mixing (UniMixing, UniMixing-Lite), per-block SwiGLU
and SiameseNorm, with the linear temperature schedule of eq. 21.

Tokens [B, T, D] are flattened to L = T*D and cut into n = L/blk blocks of blk values
(`model.unimixer.block_size`). The mixing of eq. 11 is the generalised Kronecker product
W_G (x) {W_B^i}, an L x L matrix that is never built: eq. 14 applies the n per-block
blk x blk matrices, then the n x n global matrix.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dense.rankmixer import in_dtype, uniform_init
from dense.tower_registry import ServingForm
from embeddings.hooks import HookProvider, TrainingHooks


def sinkhorn(logits: torch.Tensor, iters: int, tol: float = 0.0,
             on_device: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """exp, then alternate row and column normalisation: [..., n, n] -> (doubly stochastic
    [..., n, n], iterations run [] on the logits' device).

    With `tol` > 0 it stops once every row's log-sum is within `tol` of 0 (each
    iteration ends on the columns, which are then exact): at tau = 1 that takes about
    10 iterations instead of the configured maximum; on the CPU backward unrolls only those,
    elsewhere every iteration runs and `torch.where` keeps the first within `tol`.
    Where that test runs depends on the device (`on_device`, default: everywhere but the
    CPU); both give the same result, bit for bit:

    - on the CPU it reads the row sums back after each iteration, which waits for nothing;
    - on a GPU such a read would wait for the whole queue, so every iteration runs and the
      first within `tol` is kept, decided on the device (`_sinkhorn_on_device`).

    In log space and float32 even under autocast: at tau = 0.05 the logits are 20x the
    weights, and exp of that overflows bf16 while bf16 row sums drift by ~1e-2.
    """
    with torch.autocast(logits.device.type, enabled=False):
        log_p = logits.float()
        if tol and (log_p.device.type != "cpu" if on_device is None else on_device):
            return _sinkhorn_on_device(log_p, iters, tol)
        for i in range(iters):
            rows = log_p.logsumexp(dim=-1, keepdim=True)
            if tol and i and float(rows.detach().abs().amax()) <= tol:
                return log_p.exp(), torch.tensor(i)
            log_p = log_p - rows
            log_p = log_p - log_p.logsumexp(dim=-2, keepdim=True)
        return log_p.exp(), torch.tensor(iters)


def _sinkhorn_on_device(log_p: torch.Tensor, iters: int, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`sinkhorn` with its tolerance test decided on the device, nothing read back: all
    `iters` iterations run, and the log-probabilities of the first within `tol` are kept
    (by `torch.where`, which passes their gradient on unchanged and the later iterations'
    as zeros, so backward computes the early stop's gradient too)."""
    kept, used = log_p, torch.full((), iters, device=log_p.device)  # used < iters: stopped
    for i in range(iters):
        rows = log_p.logsumexp(dim=-1, keepdim=True)
        if i:
            now = (rows.detach().abs().amax() <= tol) & (used == iters)
            kept, used = torch.where(now, log_p, kept), used.masked_fill(now, i)
        log_p = log_p - rows
        log_p = log_p - log_p.logsumexp(dim=-2, keepdim=True)
    return torch.where(used < iters, kept, log_p).exp(), used


def constrain_all(weights: list[torch.Tensor], tau: torch.Tensor | float, iters: int,
                  tol: float = 0.0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Eq. 15 for many matrices at once: symmetrise, divide by tau, Sinkhorn-Knopp.
    weights: [..., n, n] each, any n -> (the constrained float32 matrices in order, the
    most iterations a batch ran, [] on their device).

    Matrices of one size (every layer's local blocks, every layer's global matrix) run as
    one batched Sinkhorn: a tower's whole constraint is then one or two sequences of
    kernels instead of one per matrix, which at small sizes is what the step costs.
    The result is averaged with its transpose once more: a finite number of iterations
    leaves it symmetric only to the iteration's tolerance, and the mean of a doubly
    stochastic matrix and its transpose is still doubly stochastic (the paper's text also
    puts the symmetrisation last).
    """
    by_size: dict[int, list[int]] = {}
    for i, w in enumerate(weights):
        by_size.setdefault(w.shape[-1], []).append(i)
    out: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
    used = []
    with torch.autocast(weights[0].device.type, enabled=False):
        for n, members in by_size.items():
            w = torch.cat([weights[i].float().reshape(-1, n, n) for i in members])
            p, group_used = sinkhorn((w + w.mT) / (2 * tau), iters, tol)
            p = (p + p.mT) / 2
            counts = [weights[i].numel() // (n * n) for i in members]
            for i, part in zip(members, p.split(counts)):
                out[i] = part.view(weights[i].shape)
            used.append(group_used)
    return out, torch.stack(used).amax()


def temperature(step: int, tau_start: float, tau_end: float, anneal_steps: int) -> float:
    """Eq. 21: tau_j = max(tau_start - (tau_start - tau_end) j / J, tau_end); J = 0 holds tau_start."""
    if anneal_steps <= 0:
        return tau_start
    return max(tau_start - (tau_start - tau_end) * step / anneal_steps, tau_end)


class BlockMixing(nn.Module):
    """Eq. 14 with constrained weights from `logits()`, which the two variants define;
    residual + RMSNorm (eq. 16). The tower constrains every layer's logits in one batch
    (`constrain_all`) and passes each layer its pair."""

    def __init__(self, length: int, block: int, dim: int):
        super().__init__()
        if length % block:
            raise ValueError(f"model.unimixer.block_size={block} must divide the flattened token length "
                             f"T*D = {length}")
        self.block, self.num_blocks = block, length // block
        self.dim, self.num_tokens = dim, length // dim  # Python ints: a traced forward's shapes are symbolic
        self.norm = nn.RMSNorm(dim)

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_G [n, n], W_B [n, blk, blk]) before the constraint of eq. 15."""
        raise NotImplementedError

    def weights(self, tau: torch.Tensor | float, iters: int, tol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_G [n, n], W_B [n, blk, blk]), constrained (float32)."""
        w_global, w_local = constrain_all(list(self.logits()), tau, iters, tol)[0]
        return w_global, w_local

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] -> block-major [n, B, blk] (block i holds values i blk ..
        (i+1) blk - 1 of each row's flattened tokens): the same tensor when blk = D."""
        if self.block == self.dim:
            return x
        return x.transpose(0, 1).reshape(x.shape[1], self.num_blocks, self.block).transpose(0, 1).contiguous()

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block-major [n, B, blk] -> token-major [T, B, D], the inverse of `to_blocks`."""
        if self.block == self.dim:
            return blocks
        return blocks.transpose(0, 1).reshape(blocks.shape[1], self.num_tokens, self.dim).transpose(0, 1).contiguous()

    def mix(self, x: torch.Tensor, w_global: torch.Tensor, w_local: torch.Tensor) -> torch.Tensor:
        """Eq. 14 with the matrices given (no constraint), token-major [T, B, D] -> [T, B, D]:
        one batched product over the blocks, then one product with W_G over all rows.

        W_B^i x_i is eq. 26's Kronecker block (the product of eq. 11); eq. 13 writes
        x_i W_B^i, the same thing for the symmetric matrices of eq. 15.
        """
        blocks = self.to_blocks(x)
        h = torch.bmm(blocks, w_local.to(x.dtype).transpose(1, 2))  # [n, B, blk]
        mixed = torch.mm(w_global.to(x.dtype), h.view(self.num_blocks, -1)).view_as(h)
        return self.from_blocks(mixed)

    def forward(self, x: torch.Tensor, w_global: torch.Tensor, w_local: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] and the constrained weights -> RMSNorm(X + UniMixing(X))."""
        return self.norm(x + self.mix(x, w_global, w_local))


class UniMixing(BlockMixing):
    """Free W_G [n, n] and one W_B^i [blk, blk] per block (eq. 11-16)."""

    def __init__(self, length: int, block: int, dim: int):
        super().__init__(length, block, dim)
        # Unit-variance logits: clearly non-uniform at tau = 1, near-permutations at tau = 0.05.
        self.w_global = nn.Parameter(torch.randn(self.num_blocks, self.num_blocks))
        self.w_local = nn.Parameter(torch.randn(self.num_blocks, block, block))

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w_global, self.w_local


class UniMixingLite(BlockMixing):
    """Eq. 18: W_B^i from b shared bases, W_B^i = Sinkhorn(sum_l omega^i_l Z_l); W_G = Sinkhorn(A_G B_G)
    of rank r. The same symmetrise-and-temperature constraint as UniMixing (the paper's
    figure 5 anneals Lite too)."""

    def __init__(self, length: int, block: int, dim: int, num_basis: int, rank: int):
        super().__init__(length, block, dim)
        n = self.num_blocks
        self.basis = nn.Parameter(torch.randn(num_basis, block, block))
        self.omega = nn.Parameter(torch.randn(n, num_basis) / math.sqrt(num_basis))  # unit-variance mix
        scale = rank ** -0.25  # entries of A_G B_G then have unit variance
        self.a_global = nn.Parameter(torch.randn(n, rank) * scale)
        self.b_global = nn.Parameter(torch.randn(rank, n) * scale)

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a_global @ self.b_global, torch.einsum("nl,ljk->njk", self.omega, self.basis)


class PerTokenSwiGLU(nn.Module):
    """Eq. 19: token i has its own W_up, W_gate [blk, n blk], W_down [n blk, blk]; all tokens
    in batched products. Up and gate share one [T, blk, 2 n blk] weight: one bmm, not two."""

    def __init__(self, num_tokens: int, dim: int, ffn_ratio: int):
        super().__init__()
        hidden = ffn_ratio * dim
        self.w_in = nn.Parameter(uniform_init((num_tokens, dim, 2 * hidden), dim))
        self.b_in = nn.Parameter(uniform_init((num_tokens, 1, 2 * hidden), dim))
        self.w_down = nn.Parameter(uniform_init((num_tokens, hidden, dim), hidden))
        self.b_down = nn.Parameter(uniform_init((num_tokens, 1, dim), hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Block-major [n, B, blk] -> [n, B, blk]; training through `_SwiGLU`'s backward."""
        if torch.is_grad_enabled() and (x.requires_grad or self.w_in.requires_grad):
            return _SwiGLU.apply(x, self.w_in, self.b_in, self.w_down, self.b_down)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same as forward by autograd's ops (inference, and the tests' reference)."""
        up, gate = torch.baddbmm(self.b_in, x, self.w_in).chunk(2, dim=-1)
        return torch.baddbmm(self.b_down, up * nn.functional.silu(gate), self.w_down)


class _SwiGLU(torch.autograd.Function):
    """(x W_in + b_in) split into up and gate; (up * SiLU(gate)) W_down + b_down, for
    token-major x [T, B, blk] -> [T, B, blk], with a hand-written backward: the up and
    gate gradients written into one buffer (no split and concatenation), SiLU's gradient
    by its own kernel, no autograd graph over the [T, B, 2 k blk] intermediates."""

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_down, b_down):
        pre = torch.baddbmm(b_in, x, w_in)
        up, gate = pre.chunk(2, dim=-1)
        act = nn.functional.silu(gate)
        h = up * act
        ctx.save_for_backward(x, w_in, w_down, pre, act, h)
        return torch.baddbmm(b_down, h, w_down)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w_in, w_down, pre, act, h = ctx.saved_tensors
        x, w_in, w_down = in_dtype(grad.dtype, x, w_in, w_down)
        up, gate = pre.chunk(2, dim=-1)
        gw_down = torch.bmm(h.transpose(1, 2), grad)
        gb_down = grad.sum(1, keepdim=True)
        g_h = torch.bmm(grad, w_down.transpose(1, 2))
        g_pre = torch.empty_like(pre)
        g_up, g_gate = g_pre.chunk(2, dim=-1)
        torch.mul(g_h, act, out=g_up)
        torch.ops.aten.silu_backward.grad_input(g_h.mul_(up), gate, grad_input=g_gate)
        gx = torch.bmm(g_pre, w_in.transpose(1, 2))
        gw_in = torch.bmm(x.transpose(1, 2), g_pre)
        return gx, gw_in, g_pre.sum(1, keepdim=True), gw_down, gb_down


class UniMixerBlock(nn.Module):
    """O = pSwiGLU(RMSNorm(Z + UniMixing(Z))), token-major [T, B, D] -> [T, B, D]. The
    SwiGLU's tokens are the mixing blocks (eq. 19's weights are blk x n blk); blk = D makes
    them the tokens (and the block-major layout the token-major one, with no copy)."""

    def __init__(self, mixing: BlockMixing, ffn_ratio: int):
        super().__init__()
        self.mixing = mixing
        self.ffn = PerTokenSwiGLU(mixing.num_blocks, mixing.block, ffn_ratio)

    def forward(self, z: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Token-major [T, B, D] and the layer's constrained (W_G, W_B) -> [T, B, D]."""
        s = self.mixing(z, *weights)
        return self.mixing.from_blocks(self.ffn(self.mixing.to_blocks(s)))


class SiameseLayer(nn.Module):
    """Section 4.4: O = Block(X + RMSNorm(Y)); X <- RMSNorm(X + O); Y <- Y + O."""

    def __init__(self, block: UniMixerBlock, dim: int):
        super().__init__()
        self.block = block
        self.norm_y = nn.RMSNorm(dim)
        self.norm_x = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor,
                weights: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major ([T, B, D], [T, B, D]) and the layer's constrained (W_G, W_B) -> the
        same two, updated."""
        o = self.block(x + self.norm_y(y), weights)
        return self.norm_x(x + o), y + o


class UniMixerTower(nn.Module, HookProvider, ServingForm):
    """Tokenizer -> M Siamese UniMixer layers -> X_M + RMSNorm(Y_M) (eq. 20) -> mean over
    tokens: e_input [B, E] -> [B, D].

    Every layer's mixing weights are constrained together at the start of the forward
    (`constrain_all`, at most `sinkhorn_iters` iterations, fewer once within `sinkhorn_tol`).
    The temperature is a non-persistent buffer set by `set_step`: a pure function of the
    optimizer step, so checkpoints need no extra state, and a buffer (not a float) so that
    traced forwards read the current value.
    """

    def __init__(self, tokenizer: nn.Module, blocks: list[UniMixerBlock], dim: int,
                 tau_start: float, tau_end: float, anneal_steps: int, sinkhorn_iters: int, sinkhorn_tol: float):
        super().__init__()
        self.tokenizer = tokenizer
        self.layers = nn.ModuleList(SiameseLayer(b, dim) for b in blocks)
        self.norm_out = nn.RMSNorm(dim)
        self.out_dim = dim
        self.schedule = (tau_start, tau_end, anneal_steps)
        self.sinkhorn = (sinkhorn_iters, sinkhorn_tol)
        self.register_buffer("tau", torch.tensor(tau_start), persistent=False)
        self._iters = [0, 0]  # Sinkhorn iterations run, training forwards: since the last log

    def register_hooks(self, hooks: TrainingHooks) -> None:
        hooks.after_optimizer_step.append(self.set_step)
        hooks.after_restore.append(self.set_step)
        hooks.metrics.append(self.log_values)

    def set_step(self, step: int) -> None:
        """The temperature of `step` (after every optimizer step and after a restore)."""
        self.tau.fill_(temperature(step, *self.schedule))

    def mixing_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's constrained (W_G [n, n], W_B [n, blk, blk]), in one batched constraint."""
        logits = [w for layer in self.layers for w in layer.block.mixing.logits()]
        weights, used = constrain_all(logits, self.tau, *self.sinkhorn)
        if self.training and torch.is_grad_enabled():  # training steps, not FLOP counts or probes
            self._iters[0] += used
            self._iters[1] += 1
        return list(zip(weights[0::2], weights[1::2]))

    def log_values(self, kind: str) -> dict[str, float]:
        """Mean Sinkhorn iterations per training forward since the last training log."""
        if kind != "train" or not self._iters[1]:
            return {}
        iters, self._iters = float(self._iters[0]) / self._iters[1], [0, 0]  # summed on the device until now
        return {"unimixer/sinkhorn_iters": iters}

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return self.mix(e_input, self.mixing_weights())

    def mix(self, e_input: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """e_input [B, E] -> [B, D] with every layer's constrained (W_G, W_B) given."""
        x = self.tokenizer.forward_tm(e_input)  # [T, B, D] from here to the mean over tokens
        y = x
        for layer, layer_weights in zip(self.layers, weights):
            x, y = layer(x, y, layer_weights)
        return (x + self.norm_out(y)).mean(dim=0)

    def serving_form(self) -> nn.Module:
        """This tower with its mixing weights constrained once (`FrozenMixing`)."""
        return FrozenMixing(self)

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample): tokenizer plus `unimixer_cost`."""
        first = self.layers[0].block
        mixing = first.mixing
        ffn_ratio = first.ffn.w_down.shape[1] // mixing.block
        lite = (mixing.basis.shape[0], mixing.a_global.shape[1]) if isinstance(mixing, UniMixingLite) else None
        params, flops = unimixer_cost(self.tokenizer.num_tokens, self.out_dim, mixing.block, ffn_ratio,
                                      len(self.layers), lite)
        tok_params, tok_flops = self.tokenizer.cost()
        return tok_params + params, tok_flops + flops


# ---------------------------------------------------------------- analytic costs


class FrozenMixing(nn.Module):
    """A UniMixer tower for inference, its mixing weights constrained once, at the
    temperature it holds now: they depend on nothing else, and the Sinkhorn loop's
    data-dependent stop would not trace. e_input [B, E] -> [B, D].

    The tower is taken over: its unconstrained mixing parameters, which only `logits()`
    reads, are removed, so that an exported artifact does not carry them too."""

    def __init__(self, tower: UniMixerTower):
        super().__init__()
        self.tower = tower
        with torch.no_grad():
            weights = tower.mixing_weights()
        for i, (w_global, w_local) in enumerate(weights):
            self.register_buffer(f"global_{i}", w_global)
            self.register_buffer(f"local_{i}", w_local)
        for layer in tower.layers:
            mixing = layer.block.mixing
            for name, _ in list(mixing.named_parameters(recurse=False)):
                delattr(mixing, name)

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        weights = [(getattr(self, f"global_{i}"), getattr(self, f"local_{i}")) for i in range(len(self.tower.layers))]
        return self.tower.mix(e_input, weights)


def unimixer_cost(num_tokens: int, dim: int, block: int, ffn_ratio: int, layers: int,
                  lite: tuple[int, int] | None = None) -> tuple[int, int]:
    """(parameters, forward matmul FLOPs per sample) of the M layers and the output norm,
    without the tokenizer. `lite` = (num_basis, rank) for UniMixing-Lite.

    Per sample, a layer costs 2 L blk (local) + 2 L n (global) + 6 k L blk (SwiGLU);
    building the constrained matrices does not depend on the batch and is left out.
    """
    length = num_tokens * dim
    n = length // block
    if lite is None:
        mixing = n * n + n * block * block
    else:
        basis, rank = lite
        mixing = basis * block * block + n * basis + 2 * n * rank
    swiglu = n * (3 * ffn_ratio * block * block + 2 * ffn_ratio * block + block)
    params = layers * (mixing + swiglu + 3 * dim) + dim
    flops = layers * (2 * length * block + 2 * length * n + 6 * ffn_ratio * length * block)
    return params, flops
