"""What a model asks of the training loop, registered explicitly.

A module with per-step needs (the MoE's auxiliary loss and lambda, UniMixer's
temperature) implements `HookProvider.register_hooks` and appends its callables to the
lists named for when they run. The trainer collects them once from every module of the
model; no method is found by its name, so a renamed attribute cannot turn into a hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class TrainingHooks:
    """Callables the trainer runs, by when they run."""

    extra_losses: list[Callable[[], torch.Tensor]] = field(default_factory=list)
    """After each training forward: scalars added to the task loss."""
    after_optimizer_step: list[Callable[[int], None]] = field(default_factory=list)
    """After each optimizer step, with the number of steps now trained."""
    after_restore: list[Callable[[int], None]] = field(default_factory=list)
    """After the trainer has set up or restored its state, with the step it starts from."""
    metrics: list[Callable[[str], dict[str, float]]] = field(default_factory=list)
    """When training ('train') or evaluation ('eval') metrics are logged: extra values."""

    @classmethod
    def of(cls, model: nn.Module) -> TrainingHooks:
        """The hooks of every `HookProvider` in `model`, in module order."""
        hooks = cls()
        for module in model.modules():
            if isinstance(module, HookProvider):
                module.register_hooks(hooks)
        return hooks


class HookProvider:
    """Mixin for modules that need the training loop's attention."""

    def register_hooks(self, hooks: TrainingHooks) -> None:
        raise NotImplementedError


class ScaledLearningRate:
    """Mixin for modules whose own parameters (not their children's) train at `lr_mult` times
    the dense learning rate: the optimizer puts them in a parameter group of their own."""

    lr_mult: float = 1.0
