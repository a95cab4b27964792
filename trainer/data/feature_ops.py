"""Numeric feature transforms, each defined once with its NumPy form (the reader,
trainer/data/encode.py) and its torch form (the serving artifact, trainer/serving/model.py)
side by side, so the two cannot drift apart. The reader, serving and the tests enumerate
`TRANSFORMS`; its keys are `features.*.transform`'s choices (trainer/config.py).

A transform maps values elementwise, [N] -> [N] float64, and may need a domain (`valid`, a
predicate that works on arrays and tensors alike): values outside it are refused by the
caller, which names the file and row (reader) or the feature (serving).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.config import FeatureSpec


@dataclass(frozen=True)
class Transform:
    """One numeric transform in both forms."""

    numpy: Callable[[np.ndarray, FeatureSpec], np.ndarray]
    """[N] float64 -> [N] float64, for the reader."""
    torch: Callable[[torch.Tensor, FeatureSpec], torch.Tensor]
    """[B] float64 -> [B] float64, for the serving artifact (traced: tensor ops only)."""
    valid: Callable[[Any], Any] | None = None
    """Which values the transform accepts (elementwise, on arrays and tensors), or None: all."""
    needs: str = ""
    """The domain in words, for the error message."""


TRANSFORMS: dict[str, Transform] = {
    "log1p": Transform(lambda x, f: np.log1p(x), lambda x, f: torch.log1p(x),
                       valid=lambda x: x > -1, needs="values > -1"),
    "clip": Transform(lambda x, f: np.clip(x, f.clip_min, f.clip_max),
                      lambda x, f: torch.clamp(x, f.clip_min, f.clip_max)),
    "standardize": Transform(lambda x, f: (x - f.mean) / f.std, lambda x, f: (x - f.mean) / f.std),
}
