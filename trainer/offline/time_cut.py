"""Where a log is cut in time: the converters' validation cut (trainer/offline/movielens.py) and
data.split=time's (trainer/data/time_split.py) are the same rule."""

from __future__ import annotations

import numpy as np


def time_cut(times: np.ndarray, share: float, option: str) -> int:
    """The first time at or above the `share` quantile of `times` [N]: rows before it are the
    earlier part. Rounding up to a time in the log keeps rows of one time together, on the
    later side. A cut that leaves either side empty is a ValueError naming `option` ("key=value")."""
    ordered = np.sort(times)
    k = int(np.searchsorted(ordered, np.quantile(ordered, share), side="left")) if ordered.size else 0
    if k == 0 or k == ordered.size:
        raise ValueError(f"{option} leaves a split empty: {ordered.size} rows, "
                         f"{np.unique(ordered).size} distinct times")
    return int(ordered[k])
