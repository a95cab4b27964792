"""Cost accounting: dense parameters, forward FLOPs per sample and model FLOPs utilisation.

FLOPs are forward matmul FLOPs per sample, 2 m n k per product as
`torch.utils.flop_counter` counts them. Every tower and the task heads give an analytic
`cost() -> (parameters, FLOPs per sample)`; `measure_cost` checks both numbers against
the modules themselves. A training step costs 3x the forward (the backward computes
gradients for inputs and weights), which is what MFU counts; embedding lookups are not
matmuls and are left out.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class DenseCost:
    """Analytic and counted size of the dense model (tower and heads)."""

    params: int
    """Parameters by the towers' formulas."""
    counted_params: int
    """Parameters of the modules, element by element."""
    flops: int
    """Forward FLOPs per sample by the formulas."""
    counted_flops: int
    """Forward FLOPs per sample by torch's FLOP counter."""

    def describe(self) -> str:
        check = "" if (self.params, self.flops) == (self.counted_params, self.counted_flops) else (
            f" (counted: {self.counted_params:,} parameters, {self.counted_flops:,} FLOPs: the formula is off)")
        return f"dense tower and heads: {self.params:,} parameters, {self.flops:,} forward FLOPs per sample{check}"


def count_flops(module: nn.Module, *inputs: torch.Tensor) -> int:
    """FLOPs of one `module(*inputs)` by torch's counter (no autograd graph is built).

    Attention runs on the math backend here: the fused CPU kernel is not in the
    counter's table and would count as zero.
    """
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module(*inputs)
    return counter.get_total_flops()


def flops_per_sample(module: nn.Module, width: int, device: torch.device) -> int:
    """Counted forward FLOPs per sample of `module` on random inputs [B, width]: the
    difference between batches of 2 and 1, so batch-independent work (UniMixer's
    constrained weights) is not charged to the sample."""
    def at(batch: int) -> int:
        return count_flops(module, torch.randn(batch, width, device=device))
    return at(2) - at(1)


def measure_cost(tower: nn.Module, heads: nn.Module, width: int, device: torch.device) -> DenseCost:
    """Check the analytic cost of tower + heads (both in their current mode) against the modules."""
    (tower_params, tower_flops), (head_params, head_flops) = tower.cost(), heads.cost()
    params, flops = tower_params + head_params, tower_flops + head_flops
    counted_params = sum(p.numel() for m in (tower, heads) for p in m.parameters())
    counted = flops_per_sample(nn.Sequential(tower, heads), width, device)
    return DenseCost(params, counted_params, flops, counted)


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Measured FLOP/s of a plain square matrix multiply on `device` in `dtype`, the best of a
    few after a warm-up: 8192^3 on a GPU; on the CPU the size doubles from 256 until one product
    takes _PROBE_SECONDS (at most 2048): a CPU without bf16 units multiplies bf16 at a few
    GFLOP/s, where a fixed 2048^3 took minutes of every bf16 run's start-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        sync()
        tic = time.perf_counter()
        torch.mm(a, b)
        sync()
        return time.perf_counter() - tic

    # its own generator: the sizes tried depend on the machine's speed, and the run's seeded
    # generator must not draw a number of values that does
    generator = torch.Generator(device=device).manual_seed(0)
    n = 8192 if device.type == "cuda" else 256
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        first = seconds(a, b)  # the warm-up
        if device.type == "cuda" or n >= 2048 or first >= _PROBE_SECONDS:
            break
        n *= 2
    return 2 * n**3 / min(seconds(a, b) for _ in range(3))


_PROBE_SECONDS = 0.05


def activation_bytes(model: nn.Module, width: int, batch: int, training: bool,
                     autocast: torch.dtype | None = None) -> int:
    """Peak bytes that `model` ([B, width] -> [B, K]) holds besides its parameters and their
    gradients at `batch` rows: training, the tensors saved for backward and the backward's
    temporaries; evaluation (no_grad), the forward's live intermediates. Measured on the CPU by
    torch's MemTracker on fake tensors (the sizes without the arithmetic) at the batch itself,
    under `autocast` (the step's mixed precision) when given: where the peak falls moves with the
    batch (late in the backward, among the gradients, at tens of rows; at its start at
    thousands), so small batches extrapolated under-count (RankMixer T16 D256 at 2,048 rows:
    0.55 GB extrapolated from 32 and 64 rows, 0.91 GB at the batch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()  # the gradients are told apart without track_external(model)
    grad_mode = contextlib.nullcontext() if training else torch.no_grad()
    precision = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    # fake tensors: the parameters stay real, every tensor made from them is a size without data
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, grad_mode, precision:
        out = model(torch.randn(batch, width))
        if training:
            out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    at_peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return at_peak[_MemRefType.ACT] + at_peak[_MemRefType.TEMP]


def mfu(examples_per_sec: float, flops: int, peak: float) -> float:
    """Model FLOPs utilisation of training: forward + backward = 3x forward FLOPs."""
    return 3 * flops * examples_per_sec / peak
