"""train.mixed_precision's settings: the tower's autocast dtype and the float32 matmul precision
(read alone by `rankmix plan`, which needs the dtype and not the loop)."""

from __future__ import annotations

import torch


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """train.mixed_precision -> the tower's autocast dtype (weights stay fp32). auto is bf16
    on CUDA only: most CPUs have no bf16 matrix units, and the CPU tests' exact comparisons are fp32."""
    if mixed_precision == "none" or (mixed_precision == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def set_matmul_precision(mixed_precision: str, device: torch.device) -> None:
    """On CUDA, float32 matmuls outside autocast in TF32, unless train.mixed_precision=none
    asks for float32 throughout. The CPU's are left alone (exact tests)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest" if mixed_precision == "none" else "high")
