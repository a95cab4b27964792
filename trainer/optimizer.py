"""One optimizer for both sides of the model, and the learning-rate schedule of both.

The sparse tables are updated inside the backward pass by FBGEMM's fused Adagrad
(embeddings/tables.py); the dense parameters by RMSProp, as in the RankMixer paper. One
`CombinedOptimizer` steps, zeroes, schedules and saves both (docs/design.md §5.3).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embeddings.hooks import ScaledLearningRate
from trainer.config import OptimConfig


def build_optimizer(model: nn.Module, o: OptimConfig) -> tuple[CombinedOptimizer, KeyedOptimizerWrapper,
                                                               list[nn.Parameter]]:
    """(the combined optimizer, the dense one, the dense parameters) of a sharded model."""
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    decay = {id(p): d for name, p in dense.items() if (d := weight_decay_of(name, o)) != o.weight_decay}
    # the sequence modules' parameters: a group of their own only where their schedule is
    own_schedule = o.sequence_lr_mult != 1 or o.sequence_warmup_steps >= 0
    sequence = {id(p) for name, p in dense.items() if DECAY_PARTS["sequence"].search(name)} if own_schedule else set()
    # foreach on every device (torch picks it only on CUDA): one kernel per stage for all
    # tensors instead of a Python loop over them, a tenth of a small model's CPU step.
    dense_optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.RMSprop(
        param_groups(model, params, o.lr, decay, sequence, o.sequence_lr_mult), lr=o.lr, alpha=o.alpha, eps=o.eps,
        momentum=o.momentum, weight_decay=o.weight_decay, foreach=True))
    # One optimizer for both sides, so that LR schedules reach the fused sparse kernel too.
    combined = CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense_optimizer)])
    return combined, dense_optimizer, list(dense.values())


# The dense parameters that optim.<part>_weight_decay sets apart, by their names in the model
# (dense/tokenizer.py under a token tower; RankingModel.sequences), whatever wraps the model.
DECAY_PARTS = {"tokenizer": re.compile(r"(^|\.)tower\.tokenizer\."), "sequence": re.compile(r"(^|\.)sequences\.")}


def weight_decay_of(name: str, o: OptimConfig) -> float:
    """The weight decay of the dense parameter `name`: its part's where set (>= 0), else optim.weight_decay."""
    for part, pattern in DECAY_PARTS.items():
        own = getattr(o, f"{part}_weight_decay")
        if own >= 0 and pattern.search(name):
            return own
    return o.weight_decay


def param_groups(model: nn.Module, params: list[torch.Tensor], lr: float, decay: dict[int, float] | None = None,
                 sequence: set[int] | frozenset[int] = frozenset(), sequence_mult: float = 1.0) -> list[dict]:
    """`params` as RMSProp's parameter groups: one at `lr`, then one per learning-rate multiple
    that a `ScaledLearningRate` module of `model` asks for its own parameters, per weight decay
    of `decay` (id -> decay, for the parameters whose decay is not the optimizer's) and for the
    parameters `sequence` (ids: the sequence modules' with their own schedule, at `sequence_mult`
    x lr, marked "part": "sequence" for `warmups`); none when no module asks and nothing differs:
    the groups, and so checkpoints, of other models and configs stay as they were."""
    mult = {id(p): m.lr_mult for m in model.modules() if isinstance(m, ScaledLearningRate)
            for p in m.parameters(recurse=False)}
    decay = decay or {}
    groups: dict[tuple[float, float | None, bool], list[torch.Tensor]] = {(1.0, None, False): []}
    for p in params:
        own = id(p) in sequence
        groups.setdefault((mult.get(id(p), 1.0) * (sequence_mult if own else 1.0), decay.get(id(p)), own),
                          []).append(p)
    return [{"params": group, "lr": lr * m, **({} if d is None else {"weight_decay": d}),
             **({"part": "sequence"} if own else {})}
            for (m, d, own), group in groups.items() if group or (m, d, own) == (1.0, None, False)]


def warmups(optimizer: CombinedOptimizer, sparse_groups: int, o: OptimConfig) -> list[Callable[[int], float]]:
    """The LR factor of every parameter group after `step` steps (the `sparse_groups` first):
    optim.warmup_steps ramps both learning rates, optim.dense_warmup_steps the dense one, and
    optim.sequence_warmup_steps the sequence modules' where they have a group of their own."""
    def ramp(steps: int):
        return lambda step: min(1.0, (step + 1) / max(steps, 1))
    both, dense = ramp(o.warmup_steps), ramp(o.dense_warmup_steps)
    sequence = ramp(o.dense_warmup_steps if o.sequence_warmup_steps < 0 else o.sequence_warmup_steps)

    def of(group: dict) -> Callable[[int], float]:
        own = sequence if group.get("part") == "sequence" else dense
        return lambda step: both(step) * own(step)
    return [both if i < sparse_groups else of(group) for i, group in enumerate(optimizer.param_groups)]
