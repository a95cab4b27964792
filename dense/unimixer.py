"""UniMixer (docs/design.md §3.6): learnable block mixing (UniMixing, UniMixing-Lite), per-token
SwiGLU and SiameseNorm, with the linear temperature schedule of eq. 21.

Tokens [B, T, D] are flattened to L = T*D and cut into n = L/blk blocks of blk values
(`model.unimixer.block_size`, default D/T: RankMixer's head, so that its token mixing is one
of the mixings UniMixing can learn). The mixing of eq. 11 is the generalised Kronecker product
W_G (x) {W_B^i}, an L x L matrix that is never built: eq. 14 applies the n per-block
blk x blk matrices, then the n x n global matrix. The SwiGLU after it (eq. 19) is per token,
its width independent of the block size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dense.rankmixer import in_dtype, uniform_init
from dense.tower_registry import ServingForm
from embeddings.hooks import HookProvider, ScaledLearningRate, TrainingHooks


def sinkhorn(logits: torch.Tensor, tau: torch.Tensor | float, stages: int, steps: int) -> torch.Tensor:
    """The doubly stochastic scaling of exp(logits / tau) for symmetric logits:
    [..., n, n] -> [..., n, n] float32, exp(logits / tau + f_i + f_j) with potentials f
    that make every row (and, by symmetry, column) sum to 1.

    Sinkhorn-Knopp's alternating normalisation converges slowly at low temperature (at
    tau = 0.05, 200 iterations leave rows 1% off 1): a near-permutation is close to a
    decomposable matrix. Here the scaling is found by Newton's method on the symmetric
    potentials, whose system (diag(r) + M) df = -r log r (M the current matrix, r its row
    sums) is diagonally dominant and solved in one batched product; Newton converges fast
    only near the solution, so the temperature is lowered from 1 to tau in `stages` steps
    (epsilon scaling: geometric, each stage warm-started from the last one's potentials;
    `scaling_stages` gives how many a temperature needs)
    with `steps` Newton steps each, then one more that carries the gradient. A fixed number
    of steps: nothing is read back.

    In log space and float32 even under autocast: at tau = 0.05 the logits are 20x the
    weights, and exp of that overflows bf16.
    """
    with torch.autocast(logits.device.type, enabled=False):
        w = logits.float()
        tau = torch.as_tensor(tau, dtype=torch.float32, device=w.device)
        with torch.no_grad():
            f = prev = None
            for k in range(stages):
                temp = tau ** ((k + 1) / stages)
                f = -0.5 * (w / temp).logsumexp(-1, keepdim=True) if f is None else f * (prev / temp)
                prev = temp
                for _ in range(steps):
                    f = _newton_step(w / temp, f)
        # One more step with autograd: at the solution Newton's step does not depend on where
        # it starts to first order, so its gradient is the implicit function's, -J^-1 dF/dw,
        # at one step's cost instead of differentiating through all of them.
        f = _newton_step(w / tau, f)
        return (w / tau + f + f.mT).exp()


def _newton_step(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """One Newton step towards rows of exp(x_ij + f_i + f_j) summing to 1: [..., n, n] logits,
    [..., n, 1] potentials -> the potentials after it."""
    log_m = x + f + f.mT
    log_r = log_m.logsumexp(-1, keepdim=True)
    r = log_r.exp()
    # M's eigenvalue -1 (two blocks swapping) makes the system singular: a little damping
    damping = 1e-6 * torch.eye(x.shape[-1], device=x.device)
    system = torch.diag_embed(r.squeeze(-1)) + log_m.exp() + damping
    # solve_ex: no check of the result on the host (solve's would wait for the device)
    step = torch.linalg.solve_ex(system, -r * log_r, check_errors=False)[0]
    return f + step.clamp(-1.0, 1.0)  # far from the solution a full step overshoots


def scaling_stages(tau: float, per_halving: int) -> int:
    """Temperature stages of `sinkhorn` at `tau`: `per_halving` for each halving of the
    temperature below 1 (one at tau >= 1), so that each stage starts near its solution."""
    return max(1, math.ceil(per_halving * math.log2(1 / tau))) if tau < 1 else 1


def constrain_all(weights: list[torch.Tensor], tau: torch.Tensor | float, stages: int,
                  steps: int) -> list[torch.Tensor]:
    """Eq. 15 for many matrices at once: symmetrise, divide by tau, scale to doubly stochastic.
    weights: [..., n, n] each, any n -> the constrained float32 matrices in order.

    Matrices of one size (every layer's local blocks, every layer's global matrix) run as
    one batched scaling: a tower's whole constraint is then one or two sequences of
    kernels instead of one per matrix, which at small sizes is what the step costs.
    The result is averaged with its transpose once more: float rounding leaves
    exp(x_ij + f_i + f_j) and exp(x_ji + f_j + f_i) a rounding apart, and the mean of a
    doubly stochastic matrix and its transpose is still doubly stochastic (the paper's text
    also puts the symmetrisation last).
    """
    by_size: dict[int, list[int]] = {}
    for i, w in enumerate(weights):
        by_size.setdefault(w.shape[-1], []).append(i)
    out: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
    with torch.autocast(weights[0].device.type, enabled=False):
        for n, members in by_size.items():
            w = torch.cat([weights[i].float().reshape(-1, n, n) for i in members])
            p = sinkhorn((w + w.mT) / 2, tau, stages, steps)
            p = (p + p.mT) / 2
            counts = [weights[i].numel() // (n * n) for i in members]
            for i, part in zip(members, p.split(counts)):
                out[i] = part.view(weights[i].shape)
    return out


def temperature(step: int, tau_start: float, tau_end: float, anneal_steps: int) -> float:
    """Eq. 21: tau_j = max(tau_start - (tau_start - tau_end) j / J, tau_end); J = 0 holds tau_start."""
    if anneal_steps <= 0:
        return tau_start
    return max(tau_start - (tau_start - tau_end) * step / anneal_steps, tau_end)


def rankmixer_permutation(num_tokens: int, dim: int, block: int) -> torch.Tensor:
    """RankMixer's token mixing (H = T heads of D/T) as W_G [n, n] over blocks of `block`
    values, which must divide D/T: input token t's head h is output token h's head t, each
    head's sub-blocks moving together. The permutation is its own inverse, so symmetric."""
    head = dim // num_tokens
    n = num_tokens * dim // block
    g = torch.zeros(n, n)
    for i in range(n):
        t, offset = divmod(i * block, dim)
        h, within = divmod(offset, head)
        g[(h * dim + t * head + within) // block, i] = 1
    return g


class BlockMixing(nn.Module, ScaledLearningRate):
    """Eq. 14 with constrained weights from `logits()`, which the two variants define;
    residual + RMSNorm (eq. 16). The tower constrains every layer's logits in one batch
    (`constrain_all`) and passes each layer its pair.

    `init = "permutation"` starts at RankMixer's token mixing: fixed logit offsets (the
    `prior_*` buffers) of ln(n - 1) on its permutation (W_G) and on the identity (each W_B),
    half of each row's mass at tau = 1 and all of it as tau falls, the learned logits starting
    small around them; "random" has no offset and unit-variance learned logits. The mixing's
    parameters train at `lr_mult` times the dense learning rate (RMSProp moves each by about
    the rate per step, too little for logits of order 1 to change what they select)."""

    def __init__(self, length: int, block: int, dim: int, init: str = "random", lr_mult: float = 1.0):
        super().__init__()
        if length % block:
            raise ValueError(f"model.unimixer.block_size={block} must divide the flattened token length "
                             f"T*D = {length}")
        self.block, self.num_blocks = block, length // block
        self.dim, self.num_tokens = dim, length // dim  # Python ints: a traced forward's shapes are symbolic
        self.norm = nn.RMSNorm(dim)
        self.lr_mult = lr_mult
        n = self.num_blocks
        prior_global, prior_local = torch.zeros(n, n), torch.zeros(block, block)
        if init == "permutation":
            head = dim // self.num_tokens
            if dim % self.num_tokens or head % block:
                raise ValueError(f"model.unimixer.init='permutation' needs model.unimixer.block_size={block} to "
                                 f"divide RankMixer's head width D/T = {dim}/{self.num_tokens}")
            prior_global = math.log(max(n - 1, 1)) * rankmixer_permutation(self.num_tokens, dim, block)
            prior_local = math.log(max(block - 1, 1)) * torch.eye(block)
        self.learned_std = 0.1 if init == "permutation" else 1.0
        self.register_buffer("prior_global", prior_global)
        self.register_buffer("prior_local", prior_local)

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_G [n, n], W_B [n, blk, blk]) before the constraint of eq. 15."""
        raise NotImplementedError

    def weights(self, tau: torch.Tensor | float, stages: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_G [n, n], W_B [n, blk, blk]), constrained (float32)."""
        w_global, w_local = constrain_all(list(self.logits()), tau, stages, steps)
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

    def __init__(self, length: int, block: int, dim: int, init: str = "random", lr_mult: float = 1.0):
        super().__init__(length, block, dim, init, lr_mult)
        std = self.learned_std
        self.w_global = nn.Parameter(torch.randn(self.num_blocks, self.num_blocks) * std)
        self.w_local = nn.Parameter(torch.randn(self.num_blocks, block, block) * std)

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w_global + self.prior_global, self.w_local + self.prior_local


class UniMixingLite(BlockMixing):
    """Eq. 18: W_B^i from b shared bases, W_B^i = Sinkhorn(sum_l omega^i_l Z_l); W_G = Sinkhorn(A_G B_G)
    of rank r. The same symmetrise-and-temperature constraint as UniMixing (the paper's
    figure 5 anneals Lite too)."""

    def __init__(self, length: int, block: int, dim: int, num_basis: int, rank: int, init: str = "random",
                 lr_mult: float = 1.0):
        super().__init__(length, block, dim, init, lr_mult)
        n, std = self.num_blocks, self.learned_std
        self.basis = nn.Parameter(torch.randn(num_basis, block, block) * std)
        self.omega = nn.Parameter(torch.randn(n, num_basis) / math.sqrt(num_basis))  # unit-variance mix
        scale = std ** 0.5 * rank ** -0.25  # entries of A_G B_G then have variance std^2
        self.a_global = nn.Parameter(torch.randn(n, rank) * scale)
        self.b_global = nn.Parameter(torch.randn(rank, n) * scale)

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.a_global @ self.b_global + self.prior_global,
                torch.einsum("nl,ljk->njk", self.omega, self.basis) + self.prior_local)


class PerTokenSwiGLU(nn.Module):
    """Eq. 19 per token: token t has its own W_up, W_gate [D, h], W_down [h, D]; all tokens in
    batched products. Up and gate share one [T, D, 2 h] weight: one bmm, not two."""

    def __init__(self, num_tokens: int, dim: int, hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(uniform_init((num_tokens, dim, 2 * hidden), dim))
        self.b_in = nn.Parameter(uniform_init((num_tokens, 1, 2 * hidden), dim))
        self.w_down = nn.Parameter(uniform_init((num_tokens, hidden, dim), hidden))
        self.b_down = nn.Parameter(uniform_init((num_tokens, 1, dim), hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] -> [T, B, D]; training through `_SwiGLU`'s backward."""
        if torch.is_grad_enabled() and (x.requires_grad or self.w_in.requires_grad):
            return _SwiGLU.apply(x, self.w_in, self.b_in, self.w_down, self.b_down)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same as forward by autograd's ops (inference, and the tests' reference)."""
        up, gate = torch.baddbmm(self.b_in, x, self.w_in).chunk(2, dim=-1)
        return torch.baddbmm(self.b_down, up * nn.functional.silu(gate), self.w_down)


class _SwiGLU(torch.autograd.Function):
    """(x W_in + b_in) split into up and gate; (up * SiLU(gate)) W_down + b_down, for
    token-major x [T, B, D] -> [T, B, D], with a hand-written backward: the up and
    gate gradients written into one buffer (no split and concatenation), SiLU's gradient
    by its own kernel, no autograd graph over the [T, B, 2 h] intermediates."""

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
    """O = pSwiGLU(RMSNorm(Z + UniMixing(Z))), token-major [T, B, D] -> [T, B, D], the
    SwiGLU per token (eq. 19) of width `hidden`, whatever the mixing's block size; or
    another per-token FFN `ffn` ([T, B, D] -> [T, B, D], the sparse MoE of figure 2)."""

    def __init__(self, mixing: BlockMixing, hidden: int, ffn: nn.Module | None = None):
        super().__init__()
        self.mixing = mixing
        self.ffn = ffn if ffn is not None else PerTokenSwiGLU(mixing.num_tokens, mixing.dim, hidden)

    def forward(self, z: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Token-major [T, B, D] and the layer's constrained (W_G, W_B) -> [T, B, D]."""
        return self.ffn(self.mixing(z, *weights))


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
    (`constrain_all`). The temperature is a non-persistent buffer set by `set_step`: a pure
    function of the optimizer step, so checkpoints need no extra state, and a buffer (not a
    float) so that traced forwards read the current value.
    """

    def __init__(self, tokenizer: nn.Module, blocks: list[UniMixerBlock], dim: int,
                 tau_start: float, tau_end: float, anneal_steps: int, sinkhorn_stages: int, sinkhorn_steps: int):
        super().__init__()
        self.tokenizer = tokenizer
        self.layers = nn.ModuleList(SiameseLayer(b, dim) for b in blocks)
        self.norm_out = nn.RMSNorm(dim)
        self.out_dim = dim
        self.schedule = (tau_start, tau_end, anneal_steps)
        self.per_halving, self.newton_steps = sinkhorn_stages, sinkhorn_steps
        self.register_buffer("tau", torch.tensor(tau_start), persistent=False)
        self.stages = scaling_stages(tau_start, sinkhorn_stages)  # of the temperature now, known on the host

    def register_hooks(self, hooks: TrainingHooks) -> None:
        hooks.after_optimizer_step.append(self.set_step)
        hooks.after_restore.append(self.set_step)
        hooks.metrics.append(self.log_values)

    def set_step(self, step: int) -> None:
        """The temperature of `step` (after every optimizer step and after a restore)."""
        tau = temperature(step, *self.schedule)
        self.tau.fill_(tau)
        self.stages = scaling_stages(tau, self.per_halving)

    def mixing_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's constrained (W_G [n, n], W_B [n, blk, blk]), in one batched constraint."""
        logits = [w for layer in self.layers for w in layer.block.mixing.logits()]
        weights = constrain_all(logits, self.tau, self.stages, self.newton_steps)
        return list(zip(weights[0::2], weights[1::2]))

    def log_values(self, kind: str) -> dict[str, float]:
        """At training logs: the temperature and each layer's `mixing_health` (read back:
        log steps only)."""
        if kind != "train":
            return {}
        values = {"unimixer/tau": float(self.tau)}
        with torch.no_grad():
            for i, (w_global, w_local) in enumerate(self.mixing_weights()):
                values.update({f"unimixer/layer{i}/{k}": v for k, v in mixing_health(w_global, w_local).items()})
        return values

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
        lite = (mixing.basis.shape[0], mixing.a_global.shape[1]) if isinstance(mixing, UniMixingLite) else None
        params, flops = unimixer_cost(self.tokenizer.num_tokens, self.out_dim, mixing.block, first.ffn.w_down.shape[1],
                                      len(self.layers), lite)
        tok_params, tok_flops = self.tokenizer.cost()
        return tok_params + params, tok_flops + flops


class FrozenMixing(nn.Module):
    """A UniMixer tower for inference, its mixing weights constrained once, at the
    temperature it holds now: they depend on nothing else, and need not be traced.
    e_input [B, E] -> [B, D].

    The tower is taken over: its unconstrained mixing parameters and logit offsets, which
    only `logits()` reads, are removed, so that an exported artifact does not carry them too."""

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
            for name in [*dict(mixing.named_parameters(recurse=False)), "prior_global", "prior_local"]:
                delattr(mixing, name)

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        weights = [(getattr(self, f"global_{i}"), getattr(self, f"local_{i}")) for i in range(len(self.tower.layers))]
        return self.tower.mix(e_input, weights)


# ---------------------------------------------------------------- health and analytic costs


def full_mixing(w_global: torch.Tensor, w_local: torch.Tensor) -> torch.Tensor:
    """The L x L matrix of eq. 11 (block (i, j) is W_G[i, j] W_B^j): ([n, n], [n, blk, blk]) -> [L, L]."""
    n, blk = w_local.shape[0], w_local.shape[-1]
    return (w_global[:, :, None, None] * w_local[None]).permute(0, 2, 1, 3).reshape(n * blk, n * blk)


def mixing_health(w_global: torch.Tensor, w_local: torch.Tensor, full_limit: int = 2048) -> dict[str, float]:
    """How much a layer's constrained mixing mixes: ([n, n], [n, blk, blk]) -> values.

    - `global_row_max`, `local_row_max`: mean largest entry of a row (1: a permutation, 1/n: uniform);
    - `global_entropy`, `local_entropy`: mean row entropy over ln(n) (0: a permutation, 1: uniform);
    - `global_sv2`, `global_sv3`: W_G's second and third singular values (the first of a
      doubly stochastic matrix is 1): near 0, W_G is a rank-1 average of the blocks;
    - `sv_median`, `sv_above_half`: the median singular value of the full L x L mixing and the
      fraction above 0.5 (1 and 1 for a permutation, near 0 for an average; only for L <= `full_limit`).
    """
    values = {}
    for name, w in (("global", w_global.float()), ("local", w_local.float())):
        n = w.shape[-1]
        entropy = -(w * w.clamp_min(1e-30).log()).sum(-1).mean() / math.log(n) if n > 1 else w.new_zeros(())
        values |= {f"{name}_row_max": float(w.amax(-1).mean()), f"{name}_entropy": float(entropy)}
    sv = torch.linalg.svdvals(w_global.float())
    values |= {"global_sv2": float(sv[1]) if len(sv) > 1 else 0.0, "global_sv3": float(sv[2]) if len(sv) > 2 else 0.0}
    if w_global.shape[0] * w_local.shape[-1] <= full_limit:
        full = torch.linalg.svdvals(full_mixing(w_global.float(), w_local.float()))
        values |= {"sv_median": float(full.median()), "sv_above_half": float((full > 0.5).float().mean())}
    return values


def matched_ffn_hidden(num_tokens: int, dim: int, block: int, ffn_ratio: int) -> int:
    """The per-token SwiGLU width h at which a UniMixer layer's forward FLOPs per sample
    match (from below, within one unit's 6 T D) a RankMixer layer's with FFN ratio k:
    6 T D h + 2 L (blk + n) <= 4 k T D^2, L = T D, n = L / blk."""
    n = num_tokens * dim // block
    hidden = (2 * ffn_ratio * dim - block - n) // 3
    if hidden < 1:
        raise ValueError(f"model.unimixer.ffn_hidden=0 matches RankMixer's FLOPs at model.ffn_ratio={ffn_ratio}, "
                         f"but the mixing alone costs more ({n} blocks of {block}); set model.unimixer.ffn_hidden")
    return hidden


def unimixer_cost(num_tokens: int, dim: int, block: int, hidden: int, layers: int,
                  lite: tuple[int, int] | None = None) -> tuple[int, int]:
    """(parameters, forward matmul FLOPs per sample) of the M layers and the output norm,
    without the tokenizer. `lite` = (num_basis, rank) for UniMixing-Lite; `hidden` = 0
    leaves the SwiGLU out.

    Per sample, a layer costs 2 L blk (local) + 2 L n (global) + 6 T D h (SwiGLU);
    building the constrained matrices does not depend on the batch and is left out.
    """
    length = num_tokens * dim
    n = length // block
    if lite is None:
        mixing = n * n + n * block * block
    else:
        basis, rank = lite
        mixing = basis * block * block + n * basis + 2 * n * rank
    swiglu = num_tokens * (3 * dim * hidden + 2 * hidden + dim) if hidden else 0  # 0: another FFN, counted apart
    params = layers * (mixing + swiglu + 3 * dim) + dim
    flops = layers * (2 * length * block + 2 * length * n + 6 * num_tokens * dim * hidden)
    return params, flops
