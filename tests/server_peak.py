"""Imported by the suite's preloaded server (tests/cli.py) alone, never by a test: its children's
runs take the CPU's matrix-multiply peak for MFU (`dense.cost.peak_flops`, timed at every run's
start where metrics.peak_tflops is 0) as the pytest worker timed it once, in
$RANKMIX_TESTS_CPU_PEAK, instead of timing it again in each rank: about 0.75 s of a core each,
220 times in `make test` (165 s of its 1,100 s of CPU). Only the figure's source differs (MFU's
denominator, which no test compares between runs); a run given metrics.peak_tflops, any other
device or dtype, and every process not forked from the server (torchrun's ranks, fresh
interpreters) time their own."""

from __future__ import annotations

import os

import torch

import trainer.assembly
from dense.cost import peak_flops

_CPU_FP32 = float(os.environ.get("RANKMIX_TESTS_CPU_PEAK", "0"))


def timed_once(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    if device.type == "cpu" and dtype == torch.float32:
        return _CPU_FP32
    return peak_flops(device, dtype)


if _CPU_FP32 > 0:
    trainer.assembly.peak_flops = timed_once
