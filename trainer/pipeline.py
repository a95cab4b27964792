"""TorchRec's TrainPipelineSparseDist with this trainer's stages plugged in.

The pipeline runs batch i+1's input distribution (the sparse all-to-all) while batch i
computes. It calls `loss_fn(batch) -> (loss, aux)` instead of the model, and runs
`check(loss)` before each backward: the trainer notes there, on the device, whether the
loss is finite (read every train.check_every steps, never mid-step; docs/training.md,
"Checks and precision").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embeddings.torchrec_compat import SparseDistPipelineWithBackwardHooks


class CheckedSparseDistPipeline(SparseDistPipelineWithBackwardHooks):
    """TrainPipelineSparseDist whose backward first runs `check(loss)` then `after_backward()`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 loss_fn: Callable, check: Callable[[torch.Tensor], None], after_backward: Callable[[], None],
                 execute_all_batches: bool = False):
        super().__init__(model, optimizer, device, execute_all_batches=execute_all_batches, custom_model_fwd=loss_fn)
        self._check = check
        self._after_backward = after_backward

    def before_backward(self, losses: torch.Tensor) -> None:
        self._check(losses)

    def after_backward(self) -> None:
        self._after_backward()


def build_pipeline(choice: str, world_size: int, device: torch.device, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer, loss_fn: Callable, check: Callable[[torch.Tensor], None],
                   after_backward: Callable[[], None], execute_all_batches: bool) -> CheckedSparseDistPipeline | None:
    """train.pipeline; auto pipelines where there is communication to hide. `execute_all_batches`:
    the batches end (time order's end with the known partitions), and the pipeline must still
    train the two it read ahead (the loop never steps past them)."""
    if choice == "auto":
        choice = "sparse_dist" if world_size > 1 or device.type == "cuda" else "none"
    if choice == "none":
        return None
    return CheckedSparseDistPipeline(model, optimizer, device, loss_fn=loss_fn, check=check,
                                     after_backward=after_backward, execute_all_batches=execute_all_batches)
