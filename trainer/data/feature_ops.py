"""Feature operations, each defined once with its NumPy form (the reader,
trainer/data/encode.py and ids.py) and its torch form (the serving artifact,
trainer/serving/served_model.py) side by side, so the two cannot drift apart. The reader, serving
and the tests enumerate `TRANSFORMS` and `HASHINGS`; their keys are the choices of
`features.*.transform` and `features.*.hashing` (trainer/config.py).

A transform maps values elementwise, [N] -> [N] float64, and may need a domain (`valid`, a
predicate that works on arrays and tensors alike): values outside it are refused by the
caller, which names the file and row (reader) or the feature (serving). A hashing maps
raw ids that the caller has checked (none negative; below num_embeddings for `none`) to
table rows, or for `managed` to the keys that TorchRec's managed-collision map looks up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embeddings.features import MANAGED_ID_RANGE, FeatureSpec, Hashing


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


@dataclass(frozen=True)
class IdHashing:
    """One id hashing mode in both forms."""

    numpy: Callable[[np.ndarray, int], np.ndarray]
    """Raw ids [N] of any integer type (uint64 above 2^63 by value), num_embeddings -> int64 [N], for the reader."""
    torch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Raw ids [N] int64 (uint64 ones by their bit pattern), num_embeddings per id [N] -> int64 [N], for serving."""
    in_range: bool = False
    """The ids must already be rows (below num_embeddings): the caller refuses any other."""
    keeps_rows: bool = True
    """An id already below num_embeddings is its own row, so a batch of such ids needs no hashing."""


def _modulo(values: np.ndarray, num_embeddings: int) -> np.ndarray:
    """In the column's own integer type, so that uint64 ids above 2^63 are reduced, not wrapped.
    Written v - (v // n) * n, which is numpy's `%` (both floor): numpy divides by a scalar with
    libdivide (a multiply and shifts) but takes `%` with the CPU's division, twice the time."""
    n = values.dtype.type(num_embeddings)
    rows = values // n
    rows *= n
    np.subtract(values, rows, out=rows)
    return rows.astype(np.int64, copy=False)


def _modulo_ids(ids: torch.Tensor, num_embeddings: torch.Tensor) -> torch.Tensor:
    """`_modulo` of the unsigned ids whose bit patterns `ids` holds: an id below 0 stands for
    u = id + 2^64, so u % n = (id % n + 2^64 % n) % n, with 2^64 % n = 4 (2^62 % n) % n
    (2^62, unlike 2^63, is an int64 constant that TorchScript can hold; 4n fits for any table)."""
    rows = torch.remainder(ids, num_embeddings)
    wrap = torch.remainder(4 * torch.remainder(torch.full_like(ids, 2 ** 62), num_embeddings), num_embeddings)
    return torch.where(ids < 0, torch.remainder(rows + wrap, num_embeddings), rows)


def spread(values: np.ndarray) -> np.ndarray:
    """Raw ids (any integer type; uint64 ones by their bit pattern) mixed evenly over
    [0, MANAGED_ID_RANGE) by splitmix64's finaliser, a bijection of 64-bit words: ids that
    differ stay different until the final reduction to 62 bits, which gives each value to 4
    words (two ids meet with chance 2^-62), and a log's ids, however clustered, fill every
    rank's part alike."""
    z = values.astype(np.int64, copy=False).view(np.uint64).copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX[0])
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX[1])
    z ^= z >> np.uint64(31)
    z &= np.uint64(MANAGED_ID_RANGE - 1)  # a power of two: its mask, not numpy's `%` (a division per id)
    return z.view(np.int64)


_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's multipliers


def spread_ids(ids: torch.Tensor) -> torch.Tensor:
    """`spread` in tensor ops, which the serving artifact traces: int64 [N] raw ids (bit
    patterns) -> int64 [N] in [0, MANAGED_ID_RANGE). int64 products wrap as unsigned ones do,
    and shifts are made logical by a mask. The reader keeps numpy's: torch's thread pool,
    started from the reader's thread, competed with the training step (0.85x its examples/s)."""
    z = ids ^ _shift_right(ids, 30)
    z = z * (_MIX[0] - 2 ** 64)
    z = z ^ _shift_right(z, 27)
    z = z * (_MIX[1] - 2 ** 64)
    z = z ^ _shift_right(z, 31)
    return z & (MANAGED_ID_RANGE - 1)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned (logical) right shift of int64 words; torch's `>>` keeps the sign."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


_POWERS = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))  # 2^0 .. 2^63


def _log2(values: np.ndarray, num_embeddings: int) -> np.ndarray:
    """Each v >= 0 (uint64 by value) -> min(bit_length(v), num_embeddings - 1): how many powers of
    two are <= v, exact in integers (a float log2 rounds 2^k - 1 up to k past 2^53)."""
    rows = np.searchsorted(_POWERS, values.astype(np.uint64, copy=False), side="right")
    return np.minimum(rows, num_embeddings - 1).astype(np.int64)


def _log2_ids(ids: torch.Tensor, num_embeddings: torch.Tensor) -> torch.Tensor:
    """`_log2` of the unsigned values whose bit patterns `ids` holds: one below 0 is 2^63 or more,
    all 64 powers."""
    powers = torch.tensor([1 << k for k in range(63)], device=ids.device)  # int64's: 2^0 .. 2^62
    rows = torch.where(ids < 0, 64, torch.searchsorted(powers, ids, right=True))
    return torch.minimum(rows, num_embeddings - 1)


HASHINGS: dict[Hashing, IdHashing] = {
    "modulo": IdHashing(_modulo, _modulo_ids),
    "none": IdHashing(lambda v, n: v.astype(np.int64, copy=False), lambda ids, n: ids, in_range=True),
    "managed": IdHashing(lambda v, n: spread(v), lambda ids, n: spread_ids(ids), keeps_rows=False),
    "log2": IdHashing(_log2, _log2_ids, keeps_rows=False),
}


def gap_buckets_numpy(gaps: np.ndarray, buckets: int) -> np.ndarray:
    """Time gaps (seconds, >= 0, int64) -> log-scale buckets (model.sequence.time_buckets):
    1 + floor(log2(gap + 1)), at most buckets - 1; bucket 0 is left for padding. Computed on the
    bit length, exact for every int64 (floating log2 rounds near powers of two)."""
    g = gaps.astype(np.uint64) + np.uint64(1)
    bits = np.zeros(g.shape, np.int64)
    for shift in (32, 16, 8, 4, 2, 1):  # binary search of the highest set bit
        high = g >= (np.uint64(1) << np.uint64(shift))
        g = np.where(high, g >> np.uint64(shift), g)
        bits += high * shift
    return np.minimum(bits + 1, buckets - 1)


def gap_buckets_torch(gaps: torch.Tensor, buckets: int) -> torch.Tensor:
    """`gap_buckets_numpy` for the serving artifact: [N] int64 gaps >= 0 -> [N] int64 buckets."""
    g = gaps + 1
    bits = torch.zeros_like(g)
    for shift in (32, 16, 8, 4, 2, 1):
        high = g >= (1 << shift)
        g = torch.where(high, g >> shift, g)
        bits = bits + high.long() * shift
    return torch.clamp(bits + 1, max=buckets - 1)
