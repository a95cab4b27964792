"""RankMixer with a per-token Sparse-MoE in place of each per-token FFN (RankMixer eq. 10-11).

Token t has E experts e_tj (D -> h -> D, GELU) and two ReLU routers (DTSI):

- h_train combines the experts in training, where every expert is computed (dense
  training): v_t = sum_j ReLU(h_train(s_t))_j e_tj(s_t). The task trains it and the experts.
- h_infer is the only router at inference, where an expert whose gate is zero is not
  computed at all. It carries the L1 term lambda * sum_tj G_tj, and it learns from the
  task through a consistency loss: its combination of the (detached) expert outputs must
  reproduce the (detached) training output. With the L1 gradient alone h_infer decays to
  zero and inference dies, the bug of public implementations.

lambda adapts after every optimizer step as the multiplier of the constraint
active = budget: lambda += rate (active - budget) / budget * max(|lambda|, l1_init), where
`active` is the fraction of non-zero inference gates in the step's batch averaged over
ranks (every rank keeps the same lambda, which is a checkpointed buffer). It turns
negative when the routers are sparser than the budget by themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn import functional as F

from dense.rankmixer import RankMixerTower, in_dtype, uniform_init
from dense.tower_registry import ServingForm
from embeddings.hooks import HookProvider, TrainingHooks

TRAIN, EVAL = 0, 1  # rows of the statistics buffers


class PerTokenMoE(nn.Module):
    """T x E experts and two routers per token: token-major s [T, B, D] -> v [T, B, D]."""

    def __init__(self, num_tokens: int, dim: int, num_experts: int, hidden: int, *, budget: float,
                 l1_init: float, l1_rate: float, consistency: float, sparse_inference: bool = True):
        super().__init__()
        t, e = num_tokens, num_experts
        self.num_tokens, self.num_experts, self.hidden = t, e, hidden
        self.budget, self.l1_rate, self.l1_init, self.consistency = budget, l1_rate, l1_init, consistency
        self.sparse_inference = sparse_inference
        # Token t's experts side by side: w1[t] is [D, E h] (expert j's columns j h .. (j+1) h),
        # w2[t] is [E h, D] (its rows), so that every expert of every token runs in the
        # dense FFN's two batched products (`expert` gives one expert's weights).
        # Drawn expert by expert ([T, E, ...]) and then laid side by side: the same values
        # for the same seed as experts stored one by one.
        side_by_side = (0, 2, 1, 3)  # [T, E, rows, h] -> [T, rows, E, h]
        self.w1 = nn.Parameter(uniform_init((t, e, dim, hidden), dim).permute(side_by_side).reshape(t, dim, e * hidden))
        self.b1 = nn.Parameter(uniform_init((t, e, 1, hidden), dim).permute(side_by_side).reshape(t, 1, e * hidden))
        self.w2 = nn.Parameter(uniform_init((t, e, hidden, dim), hidden).reshape(t, e * hidden, dim))
        self.b2 = nn.Parameter(uniform_init((t, e, 1, dim), hidden).reshape(t, e, dim))
        self.router_train = nn.Parameter(uniform_init((t, dim, e), dim))
        self.router_train_bias = nn.Parameter(uniform_init((t, 1, e), dim))
        self.router_infer = nn.Parameter(uniform_init((t, dim, e), dim))
        self.router_infer_bias = nn.Parameter(uniform_init((t, 1, e), dim))
        self.register_buffer("l1_coef", torch.tensor(float(l1_init)))
        # Statistics, not state: gate activity per (token, expert) since the last log, of
        # the inference router in training steps and in evaluation.
        self.register_buffer("active_sum", torch.zeros(2, t, e), persistent=False)
        self.register_buffer("stat_batches", torch.zeros(2, 1, 1), persistent=False)
        self.pending_loss: torch.Tensor | None = None  # L1 + consistency of the last training forward
        self._pending: torch.Tensor | None = None  # its active fraction [T, E], until take_pending
        self.keeps_statistics = True  # off in a serving artifact, which has no one to report them to

    # ---------------------------------------------------------------- routing and experts

    def gates(self, s: torch.Tensor, router: str) -> torch.Tensor:
        """ReLU routing (eq. 10): [T, B, D] -> G [T, B, E] of router `train` or `infer`."""
        w, b = (self.router_train, self.router_train_bias) if router == "train" else (
            self.router_infer, self.router_infer_bias)
        return F.relu(torch.baddbmm(b, s, w))

    def expert(self, token: int, j: int) -> tuple[torch.Tensor, ...]:
        """Expert j of `token`: (W1 [D, h], b1 [h], W2 [h, D], b2 [D]), views of the weights."""
        cols = slice(j * self.hidden, (j + 1) * self.hidden)
        return self.w1[token, :, cols], self.b1[token, 0, cols], self.w2[token, cols], self.b2[token, j]

    def experts(self, s: torch.Tensor) -> torch.Tensor:
        """Every expert on every row: [T, B, D] -> e [T, E, B, D]."""
        return _expert_outputs(s, self.w1, self.b1, self.w2, self.b2)[0]

    def combine(self, gates: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """v_t = sum_j G_tj e_tj (eq. 11): ([T, B, E], [T, E, B, D]) -> [T, B, D], one
        multiply-add per expert into one output (an einsum would copy e into a bmm
        layout, a product then a sum would write and read a [T, E, B, D] temporary)."""
        g = gates.transpose(1, 2).contiguous().unsqueeze(-1)  # [T, E, B, 1]
        out = outputs[:, 0] * g[:, 0]
        for j in range(1, self.num_experts):  # not outputs.shape: a traced forward's shapes are symbolic
            out = out.addcmul(outputs[:, j], g[:, j])
        return out

    # ---------------------------------------------------------------- forward

    def forward_tm(self, s: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] -> [T, B, D]: dense training, or inference by one router."""
        if not self.training:
            if self.sparse_inference:
                out, gates = self.sparse_forward(s)
                if self.keeps_statistics:
                    self._record(EVAL, (gates > 0).float().mean(dim=1))
                return out
            return self.combine(self.gates(s, "train"), self.experts(s))
        outputs = self.experts(s)
        v = self.combine(self.gates(s, "train"), outputs)
        self._train_inference_router(s, outputs, v)
        return v

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """`forward_tm`: an FFN slot with no residual of its own (UniMixer's block)."""
        return self.forward_tm(s)

    def residual_tm(self, s: torch.Tensor) -> torch.Tensor:
        """s + MoE(s), token-major [T, B, D] -> [T, B, D]: the FFN slot of a RankMixerBlock.
        A training step runs whole in `_MoETrainingStep` (the same function as forward_tm
        and its pending loss, with a hand-written backward)."""
        if not (self.training and torch.is_grad_enabled()):
            return s + self.forward_tm(s)
        return self._training_step(s)

    # Hand-fused already; its out= writes into chosen layouts, which torch.compile's
    # functionalisation does not keep, so a compiled tower runs this step eagerly.
    @torch.compiler.disable
    def _training_step(self, s: torch.Tensor) -> torch.Tensor:
        out, self.pending_loss, self._pending = _MoETrainingStep.apply(
            s, self.w1, self.b1, self.w2, self.b2, self.router_train, self.router_train_bias,
            self.router_infer, self.router_infer_bias, self.l1_coef, self.consistency)
        return out

    def _train_inference_router(self, s: torch.Tensor, outputs: torch.Tensor, v: torch.Tensor) -> None:
        """The inference router's L1 and consistency terms (`pending_loss`) for a training
        forward of input s [T, B, D], expert outputs [T, E, B, D] and output v [T, B, D].
        They train that router alone: through s they would also push the layers below to
        shrink their activations for the L1's sake."""
        g_infer = self.gates(s.detach(), "infer")
        v_infer = self.combine(g_infer, outputs.detach())
        if torch.is_grad_enabled():  # a real training step, not a FLOP count or a probe
            l1 = g_infer.sum(dim=(0, 2)).mean()
            self.pending_loss = self.l1_coef * l1 + self.consistency * (v_infer - v.detach()).pow(2).mean()
            self._pending = (g_infer.detach() > 0).float().mean(dim=1)

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample) of training: every expert and both
        routers (the gated sums are elementwise)."""
        t, d, eh = self.w1.shape
        e = self.num_experts
        return t * (2 * d * eh + eh) + t * e * d + 2 * t * (d * e + e), 4 * t * d * eh + 2 * (2 * t * d * e)

    def inference_flops(self, active: float) -> float:
        """Expected FLOPs per sample of sparse inference when a fraction `active` of the gates
        is non-zero: the inference router, and the active experts only."""
        t, d, eh = self.w1.shape
        return 2 * t * d * self.num_experts + active * 4 * t * eh * d

    def sparse_forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference by h_infer alone, computing expert (t, j) only on the rows whose gate
        G_tj is non-zero: [T, B, D] -> ([T, B, D], the gates [T, B, E]). FLOPs fall with the
        active fraction. On a GPU, run eagerly, the rows of every expert are found at once
        (two reads back to the host per layer); otherwise expert by expert, in a form that
        reads nothing back to Python, so that it traces (torch.export, torch.fx) into the
        serving artifact as it runs here."""
        gates = self.gates(s, "infer")
        if not is_fx_symbolic_tracing() and s.is_cuda and not torch.compiler.is_compiling():
            return self._dispatch_sorted(s, gates), gates
        return self._dispatch_per_expert(s, gates), gates

    def _dispatch_per_expert(self, s: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """sum_j G_tj e_tj(s_t) over the non-zero gates, one nonzero per expert (each a host
        sync on a GPU, free on a CPU): ([T, B, D], [T, B, E]) -> [T, B, D]."""
        out = torch.zeros_like(s)
        for token in range(self.num_tokens):
            for j in range(self.num_experts):
                gate = gates[token, :, j]
                rows = gate.nonzero().squeeze(1)
                w1, b1, w2, b2 = self.expert(token, j)
                y = torch.addmm(b2, F.gelu(torch.addmm(b1, s[token].index_select(0, rows), w1)), w2)
                out[token].index_add_(0, rows, (y * gate.index_select(0, rows).unsqueeze(1)).to(out.dtype))
        return out

    def _dispatch_sorted(self, s: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The same sum with every active (token, row, expert) found at once and sorted by
        expert: two host reads per layer instead of one per expert."""
        t, b, d = s.shape
        token, row, expert = gates.nonzero(as_tuple=True)
        flat_expert = token * self.num_experts + expert
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=t * self.num_experts).tolist()
        source = (token * b + row)[order]  # row of s.view(T B, D) each active pair reads
        outputs = []
        for k, x in enumerate(s.reshape(t * b, d)[source].split(counts)):  # expert (t, j) at t E + j
            if counts[k]:
                w1, b1, w2, b2 = self.expert(*divmod(k, self.num_experts))
                outputs.append(torch.addmm(b2, F.gelu(torch.addmm(b1, x, w1)), w2))
        out = s.new_zeros(t * b, d)
        if outputs:
            weighted = torch.cat(outputs) * gates[token, row, expert][order].unsqueeze(1)
            out.index_add_(0, source, weighted.to(out.dtype))
        return out.view(t, b, d)

    # ---------------------------------------------------------------- the adaptive L1

    def take_pending(self) -> torch.Tensor | None:
        """The active fraction [T, E] of the training forward since the last call, or None."""
        active, self._pending = self._pending, None
        return active

    def adapt(self, active: torch.Tensor) -> None:
        """After an optimizer step: move lambda towards the budget with that step's activity
        [T, E] (already averaged over ranks)."""
        self._record(TRAIN, active)
        # A Lagrange multiplier of "active = budget", so it may turn negative: when the
        # routers are naturally sparser than the budget, a negative coefficient rewards
        # gate mass and the router biases open more rows. Steps are relative to |lambda|
        # (floored at l1_init, so it can cross zero), and to the budget, so a budget of
        # 1/8 is tracked as quickly as one of 1/2.
        error = (active.mean() - self.budget) / self.budget
        self.l1_coef.add_(self.l1_rate * error * self.l1_coef.abs().clamp(min=self.l1_init))

    def _record(self, kind: int, active: torch.Tensor) -> None:
        self.active_sum[kind] += active
        self.stat_batches[kind] += 1

    def take_stats(self, kind: int) -> torch.Tensor:
        """Mean active fraction [T, E] of TRAIN steps or EVAL batches since the last call
        (NaN before any); resets."""
        stats = self.active_sum[kind] / self.stat_batches[kind]
        self.active_sum[kind].zero_()
        self.stat_batches[kind].zero_()
        return stats


def _expert_outputs(s: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                    b2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every expert of every token in two batched products: s [T, B, D] ->
    (e [T, E, B, D], pre-activations [T, B, E h], hidden units expert-major [T E, B, h]).
    The first product covers a token's experts side by side ([D, E h]); the second runs
    over (token, expert) pairs, on the hidden units copied expert-major."""
    t, b, d = s.shape
    e = b2.shape[1]
    pre = torch.baddbmm(b1, s, w1)
    hidden = _per_expert(F.gelu(pre), pre.shape[-1], e).reshape(t * e, b, -1)
    outputs = torch.baddbmm(b2.view(t * e, 1, d), hidden, w2.view(t * e, -1, d))
    return outputs.view(t, e, b, d), pre, hidden


class _MoETrainingStep(torch.autograd.Function):
    """One training forward of a PerTokenMoE in its block's FFN slot, whole: s [T, B, D] ->
    (s + sum_j G_tj e_tj(s) [T, B, D], the inference router's pending loss [], its
    active fraction [T, E] (not differentiable)).

    The same function as `PerTokenMoE.forward_tm` plus `_train_inference_router` (equal
    to float rounding; under autocast the output keeps the products' dtype, as
    `_FFNResidual`'s does, where the reference's sum would promote it), in fewer passes:
    the experts' first layer and both routers are one product ([D, E h + 2 E]
    per token), GELU writes the hidden units straight into the expert-major layout of
    the second product, both gated sums share one pass over the expert outputs; the
    hand-written backward mirrors it (one product for all three weight gradients, GELU's
    gradient written straight back into token-major layout). The pending loss reaches
    only the inference router, as in the reference (its input and the expert outputs
    are detached there)."""

    @staticmethod
    def forward(ctx, s, w1, b1, w2, b2, w_train, b_train, w_infer, b_infer, l1_coef, consistency):
        t, b, d = s.shape
        e, eh = b2.shape[1], w1.shape[-1]
        w_all, b_all = torch.cat([w1, w_train, w_infer], dim=-1), torch.cat([b1, b_train, b_infer], dim=-1)
        pre_all = torch.baddbmm(b_all, s, w_all)  # [T, B, E h + 2 E]
        gates = F.relu(pre_all[..., eh:eh + e]).transpose(1, 2).contiguous()  # [T, E, B]
        g_infer = F.relu(pre_all[..., eh + e:]).transpose(1, 2).contiguous()
        hidden = pre_all.new_empty(t, e, b, eh // e)  # expert-major
        torch.ops.aten.gelu.out(_per_expert(pre_all, eh, e), out=hidden)
        outputs = torch.baddbmm(b2.view(t * e, 1, d), hidden.view(t * e, b, -1), w2.view(t * e, -1, d))
        outputs = outputs.view(t, e, b, d)
        v, v_infer = outputs[:, 0] * gates[:, 0, :, None], outputs[:, 0] * g_infer[:, 0, :, None]
        for j in range(1, e):
            v.addcmul_(outputs[:, j], gates[:, j, :, None])
            v_infer.addcmul_(outputs[:, j], g_infer[:, j, :, None])
        residual = v_infer.sub_(v)
        pending = l1_coef * g_infer.sum() / b + consistency * residual.pow(2).mean()
        ctx.save_for_backward(s, w_all, w2, pre_all, hidden, outputs, gates, g_infer, residual, l1_coef)
        ctx.consistency = consistency
        active = (g_infer > 0).float().mean(dim=2)
        ctx.mark_non_differentiable(active)
        return v.add_(s), pending, active

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_pending, _grad_active):
        s, w_all, w2, pre_all, hidden, outputs, gates, g_infer, residual, l1_coef = ctx.saved_tensors
        s, w_all, w2 = in_dtype(grad.dtype, s, w_all, w2)
        t, b, d = s.shape
        e, eh = gates.shape[1], hidden.shape[1] * hidden.shape[3]
        grad = grad.contiguous()
        g_all = grad.new_empty(pre_all.shape)  # the gradient of the one first product's output
        # gate gradients [T, E, B], through the ReLUs: the task's into the training router,
        # the L1's and the consistency's into the inference router
        g_train = torch.linalg.vecdot(outputs, grad.unsqueeze(1)).mul_(gates > 0)
        g_infer_logits = torch.linalg.vecdot(outputs, residual.unsqueeze(1))
        g_infer_logits.mul_(2 * ctx.consistency / residual.numel()).add_(l1_coef / b)
        g_infer_logits.mul_(grad_pending).mul_(g_infer > 0)
        g_all[..., eh:eh + e] = g_train.transpose(1, 2)
        g_all[..., eh + e:] = g_infer_logits.transpose(1, 2)
        # the experts
        g_outputs = (grad.unsqueeze(1) * gates.unsqueeze(-1)).view(t * e, b, d)
        gw2 = torch.bmm(hidden.view(t * e, b, -1).transpose(1, 2), g_outputs).view_as(w2)
        gb2 = torch.bmm(gates, grad)  # the row sums of g_outputs, without reading it
        g_hidden = torch.bmm(g_outputs, w2.view(t * e, -1, d).transpose(1, 2)).view_as(hidden)
        torch.ops.aten.gelu_backward.grad_input(g_hidden, _per_expert(pre_all, eh, e),
                                                grad_input=_per_expert(g_all, eh, e))
        g_weights = torch.bmm(s.transpose(1, 2), g_all)  # [T, D, E h + 2 E]: experts and both routers
        g_biases = g_all.sum(1, keepdim=True)
        # the input: residual, experts and the training router (the inference router's input is detached)
        gs = torch.baddbmm(grad, g_all[..., :eh + e], w_all[..., :eh + e].transpose(1, 2))
        gw1, gw_train, gw_infer = g_weights.split([eh, e, e], dim=-1)
        gb1, gb_train, gb_infer = g_biases.split([eh, e, e], dim=-1)
        return gs, gw1, gb1, gw2, gb2, gw_train, gb_train, gw_infer, gb_infer, None, None


def _per_expert(x: torch.Tensor, eh: int, e: int) -> torch.Tensor:
    """The expert columns of a token-major [T, B, E h + ...] tensor as an expert-major
    view [T, E, B, h] (no copy)."""
    t, b, _ = x.shape
    return x[..., :eh].view(t, b, e, eh // e).transpose(1, 2)


class MoEHooks(HookProvider, ServingForm):
    """What a tower of `PerTokenMoE` FFNs asks of the training loop and of serving, for any
    tower that lists them (`moes`) and gives the FLOPs per sample of everything else
    (`dense_flops`).

    Training hooks (embeddings/hooks.py): `aux_loss()` joins the task loss, `adapt_moes` moves
    every layer's lambda after each optimizer step, `log_moes()` gives the routing statistics
    for TensorBoard.
    """

    @property
    def moes(self) -> list[PerTokenMoE]:
        raise NotImplementedError

    def dense_flops(self) -> float:
        """Forward FLOPs per sample of the tower but its MoEs."""
        raise NotImplementedError

    def register_hooks(self, hooks: TrainingHooks) -> None:
        hooks.extra_losses.append(self.aux_loss)
        hooks.after_optimizer_step.append(self.adapt_moes)
        hooks.metrics.append(self.log_moes)

    def adapt_moes(self, step: int) -> None:
        """After an optimizer step: every layer's activity, averaged over ranks in one
        collective, moves its lambda. Nothing happens without a training forward since."""
        pending = [m.take_pending() for m in self.moes]
        if any(p is None for p in pending):
            return
        active = torch.stack(pending)  # [L, T, E]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(active)
            active /= dist.get_world_size()
        for moe, layer_active in zip(self.moes, active):
            moe.adapt(layer_active)

    def serving_form(self) -> nn.Module:
        """This tower itself, its routing statistics (kept in evaluation for the logs) turned off."""
        for moe in self.moes:
            moe.keeps_statistics = False
        return self

    def aux_loss(self) -> torch.Tensor:
        """Sum of the blocks' L1 and consistency terms of the last training forward (a scalar)."""
        losses = [m.pending_loss for m in self.moes if m.pending_loss is not None]
        for m in self.moes:
            m.pending_loss = None  # each forward's terms join exactly one loss
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def log_moes(self, kind: str) -> dict[str, float]:
        """Routing of the inference router since the last call, in `train` steps or `eval`
        batches: active fraction overall, per layer and token, per layer and expert index
        (mean over tokens), dead experts (never active), lambda (mean and per layer), and (eval) the FLOPs per
        sample sparse inference spent."""
        row = TRAIN if kind == "train" else EVAL
        if not all(m.stat_batches[row] for m in self.moes):  # e.g. dense inference: no routing
            return {}
        stats = [m.take_stats(row) for m in self.moes]  # [T, E] each
        active = float(torch.stack(stats).mean())
        values = {"moe/active_ratio": active, "moe/dead_experts": int(sum((s == 0).sum() for s in stats)),
                  "moe/l1_coef": float(torch.stack([m.l1_coef for m in self.moes]).mean())}
        if kind == "eval":
            values["moe/inference_flops_per_sample"] = self.inference_flops(active)
        for layer, (m, s) in enumerate(zip(self.moes, stats)):
            values[f"moe/layer{layer}/l1_coef"] = float(m.l1_coef)
            values[f"moe/layer{layer}/active_ratio"] = float(s.mean())
            values.update({f"moe/layer{layer}/token{t}": float(v) for t, v in enumerate(s.mean(dim=1))})
            values.update({f"moe/layer{layer}/expert{j}": float(v) for j, v in enumerate(s.mean(dim=0))})
        return values

    def inference_flops(self, active: float) -> float:
        """Expected FLOPs per sample of sparse inference when a fraction `active` of the
        gates is non-zero: the rest of the tower, each layer's inference router, and the
        active experts only."""
        return self.dense_flops() + sum(moe.inference_flops(active) for moe in self.moes)


class RankMixerMoETower(RankMixerTower, MoEHooks):
    """RankMixer whose blocks carry a `PerTokenMoE` as their per-token FFN:
    e_input [B, E_in] -> [B, D]; its hooks and serving form are `MoEHooks`'."""

    def __init__(self, tokenizer: nn.Module, num_layers: int, dim: int, ffn_ratio: int, moe: Callable[[], PerTokenMoE],
                 norm: str = "post", pooling: str = "mean", dropout: float = 0.0, mixing_dropout: float = 0.0):
        super().__init__(tokenizer, num_layers, dim, ffn_ratio, ffn=moe, norm=norm, pooling=pooling, dropout=dropout,
                         mixing_dropout=mixing_dropout)

    @property
    def moes(self) -> list[PerTokenMoE]:
        return [block.ffn for block in self.blocks]

    def dense_flops(self) -> float:
        return self.tokenizer.cost()[1]  # token mixing is a permutation: no FLOPs

    def set_step(self, step: int) -> None:
        """`adapt_moes` (the name the tests and benches call)."""
        self.adapt_moes(step)

    def log_values(self, kind: str) -> dict[str, float]:
        """`log_moes` (the name the tests and benches call)."""
        return self.log_moes(kind)


def expert_hidden(dim: int, ffn_ratio: int, num_experts: int, configured: int) -> int:
    """model.moe.expert_hidden, or k D / E: the dense FFN's hidden units split over the experts."""
    if configured:
        return configured
    if ffn_ratio * dim % num_experts:
        raise ValueError(f"model.ffn_ratio x model.hidden_dim = {ffn_ratio * dim} does not split over "
                         f"model.moe.num_experts={num_experts}; set model.moe.expert_hidden")
    return ffn_ratio * dim // num_experts
