"""`embeddings.weight_decay`: an L2 penalty on the embeddings a batch looks up.

The penalty coef/2 * ||e||^2 per looked-up pooled vector, averaged over the batch's rows as the
loss is, reaches the tables through their gradient: the fused optimizer (FBGEMM's Adagrad, which
has no weight decay of its own on the CPU, or none at all in its exact form) steps on it with
the rest of the gradient. Only the rows a batch uses are decayed, as often as they are used: a
frequency-aware L2 (DIN's mini-batch-aware regularisation without its 1/frequency scale), where
a decay of the whole table would shrink every row each step, seen or not.

The loss the run reports stays the task loss: the penalty adds to the gradient alone.
"""

from __future__ import annotations

import torch
from torchrec import KeyedTensor


class _LookupDecay(torch.autograd.Function):
    """Identity forward; backward adds the gradient of coef/2 * sum ||values[b]||^2 / B."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.save_for_backward(values)
        ctx.coef = coef
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        values, = ctx.saved_tensors
        return grad + (ctx.coef / values.shape[0]) * values, None


def decay_lookups(pooled: KeyedTensor, coef: float) -> KeyedTensor:
    """`pooled` ([B, sum of D_f]: a bag collection's output, its key dimension 1, no check here: TorchRec's
    pipeline traces this) with the penalty of `coef` on its rows' gradient; itself for 0."""
    if not coef:
        return pooled
    return KeyedTensor(keys=pooled.keys(), length_per_key=pooled.length_per_key(),
                       values=_LookupDecay.apply(pooled.values(), coef))
