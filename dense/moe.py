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
from torch.nn import functional as F

from dense.hooks import HookProvider, TrainingHooks
from dense.rankmixer import RankMixerTower, uniform_init


TRAIN, EVAL = 0, 1  # rows of the statistics buffers


class PerTokenMoE(nn.Module):
    """T x E experts and two routers per token: token-major s [T, B, D] -> v [T, B, D]."""

    def __init__(self, num_tokens: int, dim: int, num_experts: int, hidden: int, *, budget: float,
                 l1_init: float, l1_rate: float, consistency: float, sparse_inference: bool = True):
        super().__init__()
        t, e = num_tokens, num_experts
        self.num_experts, self.hidden = e, hidden
        self.budget, self.l1_rate, self.l1_init, self.consistency = budget, l1_rate, l1_init, consistency
        self.sparse_inference = sparse_inference
        self.w1 = nn.Parameter(uniform_init((t, e, dim, hidden), dim))
        self.b1 = nn.Parameter(uniform_init((t, e, 1, hidden), dim))
        self.w2 = nn.Parameter(uniform_init((t, e, hidden, dim), hidden))
        self.b2 = nn.Parameter(uniform_init((t, e, 1, dim), hidden))
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

    # ---------------------------------------------------------------- routing and experts

    def gates(self, s: torch.Tensor, router: str) -> torch.Tensor:
        """ReLU routing (eq. 10): [T, B, D] -> G [T, B, E] of router `train` or `infer`."""
        w, b = (self.router_train, self.router_train_bias) if router == "train" else (
            self.router_infer, self.router_infer_bias)
        return F.relu(torch.baddbmm(b, s, w))

    def experts(self, s: torch.Tensor) -> torch.Tensor:
        """Every expert on every row: [T, B, D] -> [T, E, B, D]."""
        hidden = F.gelu(torch.matmul(s.unsqueeze(1), self.w1) + self.b1)  # [T, E, B, h]
        return torch.matmul(hidden, self.w2) + self.b2

    @staticmethod
    def combine(gates: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        """v_t = sum_j G_tj e_tj (eq. 11): ([T, B, E], [T, E, B, D]) -> [T, B, D]."""
        return torch.einsum("tbe,tebd->tbd", gates, outputs)

    # ---------------------------------------------------------------- forward

    def forward_tm(self, s: torch.Tensor) -> torch.Tensor:
        """Token-major [T, B, D] -> [T, B, D]: dense training, or inference by one router."""
        if not self.training:
            if self.sparse_inference:
                return self.sparse_forward(s)
            return self.combine(self.gates(s, "train"), self.experts(s))
        outputs = self.experts(s)
        v = self.combine(self.gates(s, "train"), outputs)
        # The inference router's terms train it alone: through s they would also push
        # the layers below to shrink their activations for the L1's sake.
        g_infer = self.gates(s.detach(), "infer")
        v_infer = self.combine(g_infer, outputs.detach())
        if torch.is_grad_enabled():  # a real training step, not a FLOP count or a probe
            l1 = g_infer.sum(dim=(0, 2)).mean()
            self.pending_loss = self.l1_coef * l1 + self.consistency * (v_infer - v.detach()).pow(2).mean()
            self._pending = (g_infer.detach() > 0).float().mean(dim=1)
        return v

    def residual_tm(self, s: torch.Tensor) -> torch.Tensor:
        """s + MoE(s), token-major [T, B, D] -> [T, B, D]: the FFN slot of a RankMixerBlock."""
        return s + self.forward_tm(s)

    def cost(self) -> tuple[int, int]:
        """(parameters, FLOPs per sample) of the training forward: every expert, both
        routers and both combinations."""
        t, e, d, h = self.w1.shape
        return (t * e * (2 * d * h + h + d) + 2 * t * (d * e + e),
                4 * t * e * d * h + 2 * (2 * t * d * e) + 2 * (2 * t * e * d))

    def sparse_forward(self, s: torch.Tensor) -> torch.Tensor:
        """Inference by h_infer alone, computing expert (t, j) only on the rows whose gate
        G_tj is non-zero: [T, B, D] -> [T, B, D]. FLOPs fall with the active fraction."""
        t, b, d = s.shape
        gates = self.gates(s, "infer")
        token, row, expert = gates.nonzero(as_tuple=True)
        flat_expert = token * self.num_experts + expert
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=t * self.num_experts).tolist()
        source = (token * b + row)[order]  # row of s.view(T B, D) each active pair reads
        w1, b1 = self.w1.flatten(0, 1), self.b1.flatten(0, 1)  # expert (t, j) at t E + j
        w2, b2 = self.w2.flatten(0, 1), self.b2.flatten(0, 1)
        outputs = []
        for k, x in enumerate(s.reshape(t * b, d)[source].split(counts)):
            if counts[k]:
                outputs.append(torch.addmm(b2[k], F.gelu(torch.addmm(b1[k], x, w1[k])), w2[k]))
        out = s.new_zeros(t * b, d)
        if outputs:
            weighted = torch.cat(outputs) * gates[token, row, expert][order].unsqueeze(1)
            out.index_add_(0, source, weighted.to(out.dtype))
        self._record(EVAL, (gates > 0).float().mean(dim=1))
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


class RankMixerMoETower(RankMixerTower, HookProvider):
    """RankMixer whose blocks carry a `PerTokenMoE` as their per-token FFN:
    e_input [B, E_in] -> [B, D].

    Training hooks (dense/hooks.py): `aux_loss()` joins the task loss, `set_step` adapts
    every layer's lambda after each optimizer step, `log_values()` gives the routing
    statistics for TensorBoard.
    """

    def register_hooks(self, hooks: TrainingHooks) -> None:
        hooks.extra_losses.append(self.aux_loss)
        hooks.after_optimizer_step.append(self.set_step)
        hooks.metrics.append(self.log_values)

    def __init__(self, tokenizer: nn.Module, num_layers: int, dim: int, moe: Callable[[], PerTokenMoE],
                 norm: str = "post", pooling: str = "mean", dropout: float = 0.0):
        super().__init__(tokenizer, num_layers, dim, ffn=moe, norm=norm, pooling=pooling, dropout=dropout)

    @property
    def moes(self) -> list[PerTokenMoE]:
        return [block.ffn for block in self.blocks]

    def set_step(self, step: int) -> None:
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

    def aux_loss(self) -> torch.Tensor:
        """Sum of the blocks' L1 and consistency terms of the last training forward (a scalar)."""
        losses = [m.pending_loss for m in self.moes if m.pending_loss is not None]
        for m in self.moes:
            m.pending_loss = None  # each forward's terms join exactly one loss
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def log_values(self, kind: str) -> dict[str, float]:
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
        gates is non-zero: the inference router, and the active experts only."""
        flops = self.tokenizer.cost()[1]
        for block in self.blocks:
            t, e, d, h = block.ffn.w1.shape
            flops += 2 * t * d * e + active * 4 * t * e * d * h
        return flops


def expert_hidden(dim: int, ratio: int, num_experts: int, configured: int) -> int:
    """model.expert_hidden, or k D / E: the dense FFN's hidden units split over the experts."""
    if configured:
        return configured
    if ratio * dim % num_experts:
        raise ValueError(f"model.ffn_ratio x model.hidden_dim = {ratio * dim} does not split over "
                         f"model.num_experts={num_experts}; set model.expert_hidden")
    return ratio * dim // num_experts
