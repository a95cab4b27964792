"""Ranking metrics in memory that does not grow with the split (docs/training.md, "Lifetime and
windowed metrics").

AUC comes from per-label histograms of the logit over a fixed grid, logloss, NE and
calibration from exact float64 running sums, UAUC from (user, score, label) rows spilled to
disk in hash buckets of users and read back one bucket at a time. `trainer/metrics/ranking.py`'s
`task_metrics` stays the exact reference these are tested against.

AUC error bound: the histogram counts a positive-negative pair whose logits share a bin as
half a win, the exact AUC counts it 0, 1/2 or 1, so |AUC_hist - AUC| <= sum_i pos_i neg_i /
(2 P N) (bin i's positives and negatives, P and N in all), reported as `<task>/auc_bound`.
Logits outside +-LOGIT_RANGE share the end bins, within the same bound.

TorchRec's RecMetric AUC keeps every prediction of its window (no whole-split AUC), and its
`compute` fails on this stack: torchmetrics 1.9 hands its frozen MetricComputationReport to
lightning-utilities 0.15's `apply_to_collection`, which refuses frozen dataclasses.
"""

from __future__ import annotations

import math
import resource
import shutil
import tempfile
from collections import deque
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainer.metrics.ranking import base_rate_entropy, uauc_sums

LOGIT_RANGE = 16.0
"""The histograms' grid covers logits in [-LOGIT_RANGE, LOGIT_RANGE]."""
LIFETIME_BINS = 1 << 20
"""Bins of a whole split's histogram: 3e-5 of a logit each, 16 MB of float64 per task."""
WINDOW_BINS = 1 << 12
"""Bins of the training window's histogram, built from the window's rows at each log step."""
BUCKET_ROWS = 1 << 17
"""UAUC reads back this many spilled rows per bucket on average (all ranks together)."""
_SUMS = 4  # rows, positives, sum of probabilities, sum of log losses


def _codes(logits: torch.Tensor, labels: torch.Tensor, bins: int) -> torch.Tensor:
    """[B, K] -> histogram index of each (task, label, logit bin), as int64 [B, K]."""
    width = 2 * LOGIT_RANGE / bins
    cell = ((logits.double() + LOGIT_RANGE) / width).floor().clamp(0, bins - 1).long()
    task = torch.arange(logits.shape[1], device=logits.device)
    return (task * 2 + labels.long()) * bins + cell


def _sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, K] -> [K, 4] float64: rows, positives, sum of probabilities, sum of log losses
    (the same float64 log loss as `trainer.metrics.ranking.logloss`)."""
    # A non-finite logit is the step checks' to report (trainer/lifecycle.py StepFlags); BCE
    # would refuse it here, on CUDA by a device-side assert, before they could.
    probs, y = torch.sigmoid(logits.double()).nan_to_num(0.5), labels.double()
    losses = nn.functional.binary_cross_entropy(probs, y, reduction="none")
    return torch.stack([torch.full_like(y[0], len(y)), y.sum(0), probs.sum(0), losses.sum(0)], dim=1)


def histogram_auc(neg: np.ndarray, pos: np.ndarray) -> tuple[float, float]:
    """(AUC, its error bound) from negatives and positives per bin, bins in score order;
    NaN when a class is absent."""
    n, p = neg.sum(), pos.sum()
    if n == 0 or p == 0:
        return float("nan"), float("nan")
    below = np.cumsum(neg) - neg
    wins = float((pos * (below + neg / 2)).sum())
    return wins / (p * n), float((pos * neg).sum()) / (2 * p * n)


def _task_figures(hist: np.ndarray, sums: np.ndarray, task_names: list[str]) -> dict[str, float]:
    """'<task>/auc', '/auc_bound', '/logloss', '/ne', '/calibration' from a [K, 2, bins]
    histogram and [K, 4] sums."""
    out: dict[str, float] = {}
    for k, name in enumerate(task_names):
        rows, positives, prob_sum, loss_sum = sums[k]
        out[f"{name}/auc"], out[f"{name}/auc_bound"] = histogram_auc(hist[k, 0], hist[k, 1])
        out[f"{name}/logloss"] = loss_sum / rows if rows else float("nan")
        rate = positives / rows if rows else 0.0
        out[f"{name}/ne"] = out[f"{name}/logloss"] / base_rate_entropy(rate) if 0 < rate < 1 else float("nan")
        out[f"{name}/calibration"] = prob_sum / positives if positives else float("nan")
    return out


def _first_task(out: dict[str, float], task_names: list[str], metrics: tuple[str, ...]) -> dict[str, float]:
    """`out` plus the first task's `metrics` without the task prefix."""
    return {**out, **{m: out[f"{task_names[0]}/{m}"] for m in metrics if f"{task_names[0]}/{m}" in out}}


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks (in place) when there are several."""
    if _world() > 1:
        dist.all_reduce(t)
    return t


class SplitMetrics:
    """AUC, UAUC, logloss, NE and calibration over a whole split, fed batch by batch on every
    rank: a [K, 2, LIFETIME_BINS] histogram and [K, 4] sums on the device (all-reduced once,
    in `compute`), and with `spill_dir` a `UserBuckets` for UAUC. Fixed memory; a context
    manager that removes the spilled rows."""

    def __init__(self, task_names: list[str], device: torch.device, spill_dir: Path | None = None,
                 rows: int = 0):
        self.task_names = task_names
        k = len(task_names)
        self.state = torch.zeros(k * 2 * LIFETIME_BINS + k * _SUMS, dtype=torch.float64, device=device)
        self.users = UserBuckets(spill_dir, k, rows) if spill_dir is not None else None

    def __enter__(self) -> SplitMetrics:
        return self

    def __exit__(self, *exc) -> None:
        if self.users is not None:
            self.users.close()

    def add(self, logits: torch.Tensor, labels: torch.Tensor, users: torch.Tensor) -> None:
        """One batch's rows that count (padding already dropped): logits, labels [B, K], users [B]."""
        if not len(logits):
            return
        hist_size = len(self.task_names) * 2 * LIFETIME_BINS
        self.state[:hist_size].index_add_(0, _codes(logits, labels, LIFETIME_BINS).flatten(),
                                          torch.ones(logits.numel(), dtype=torch.float64, device=logits.device))
        self.state[hist_size:] += _sums(logits, labels).flatten()
        if self.users is not None:
            self.users.add(logits.float().cpu().numpy(), labels.float().cpu().numpy(), users.cpu().numpy())

    def compute(self) -> dict[str, float]:
        """The split's metrics over every rank (collective), as `task_metrics` names them,
        plus 'examples' and '<task>/auc_bound'."""
        k = len(self.task_names)
        state = _all_reduce(self.state).cpu().numpy()
        hist, sums = state[:k * 2 * LIFETIME_BINS].reshape(k, 2, LIFETIME_BINS), state[k * 2 * LIFETIME_BINS:]
        # [K, 2, bins]: negatives and positives per logit bin, for trainer/components/calibration.py
        self.histogram = hist
        out = _task_figures(hist, sums.reshape(k, _SUMS), self.task_names)
        if self.users is not None:
            for name, value in zip(self.task_names, self.users.uauc(self.state.device)):
                out[f"{name}/uauc"] = value
        out = _first_task(out, self.task_names, ("auc", "uauc", "logloss", "ne", "calibration"))
        out["examples"] = int(sums[0])
        return out


def _bucket_of(users: np.ndarray, buckets: int) -> np.ndarray:
    """A user's bucket: splitmix64's finaliser of the id, so that consecutive ids spread."""
    z = users.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) % np.uint64(buckets)).astype(np.int64)


class UserBuckets:
    """UAUC in bounded memory: every rank appends its (user, logits, labels) rows to
    `buckets` files by a hash of the user, then each bucket in turn is gathered from all
    ranks onto one rank (bucket b % world), which sums its users' AUCs (`uauc_sums`).

    `rows` (the split's rows, all ranks) sets the buckets to about BUCKET_ROWS rows each, so
    a rank holds one bucket at a time: about BUCKET_ROWS x (8 + 8K) bytes of rows and the sort's
    few arrays of that length, plus one user's rows where a single user has more. Rows wait
    in memory up to BUCKET_ROWS before they go to disk. Each bucket's file is opened once per
    split, for its writes and its read: opening it per write cost (rows / BUCKET_ROWS)^2 opens,
    2M over 180M rows. That holds a file open per bucket (1,400 at 180M rows), so the soft limit
    of open files is raised where it is lower, up to the hard limit; where even that is too
    low, each write opens its file again. The folder is removed by `close`."""

    def __init__(self, folder: Path, num_tasks: int, rows: int):
        self.num_tasks = num_tasks
        self.buckets = max(_world(), math.ceil(rows / BUCKET_ROWS))
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=".uauc-", dir=folder))
        self.dtype = np.dtype([("user", "<i8"), ("logits", "<f4", (num_tasks,)), ("labels", "<f4", (num_tasks,))])
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.files: dict[int, BinaryIO] = {}  # bucket -> its file, open until it is read
        self.keep_open = _allow_open_files(self.buckets)

    def add(self, logits: np.ndarray, labels: np.ndarray, users: np.ndarray) -> None:
        rows = np.empty(len(users), self.dtype)
        rows["user"], rows["logits"], rows["labels"] = users, logits, labels
        self.pending.append(rows)
        self.pending_rows += len(rows)
        if self.pending_rows >= BUCKET_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Append the rows waiting in memory to their buckets' files."""
        if not self.pending:
            return
        rows = np.concatenate(self.pending)
        self.pending, self.pending_rows = [], 0
        bucket = _bucket_of(rows["user"], self.buckets)
        order = np.argsort(bucket, kind="stable")
        rows, counts = rows[order], np.bincount(bucket, minlength=self.buckets)
        for b, (start, n) in enumerate(zip(np.cumsum(counts) - counts, counts)):
            if not n:
                continue
            if not self.keep_open:
                with open(self.folder / f"{b}.bin", "ab") as f:
                    f.write(rows[start:start + n].tobytes())
                continue
            if b not in self.files:
                self.files[b] = open(self.folder / f"{b}.bin", "a+b")  # appends wherever it was read
            self.files[b].write(rows[start:start + n].tobytes())

    def _read(self, b: int) -> np.ndarray:
        """Bucket `b`'s rows on this rank, in the order added."""
        f = self.files.get(b)
        if f is not None:
            rows = np.empty(f.seek(0, 2) // self.dtype.itemsize, self.dtype)
            f.seek(0)
            f.readinto(memoryview(rows).cast("B"))
            return rows
        path = self.folder / f"{b}.bin"
        return np.fromfile(path, self.dtype) if path.exists() else np.empty(0, self.dtype)

    def uauc(self, device: torch.device) -> list[float]:
        """Every task's UAUC over the rows of all ranks (collective)."""
        self._flush()
        totals = np.zeros((self.num_tasks, 2))
        for b in range(self.buckets):
            rows = _gather_rows(self._read(b), b % _world(), device, self.num_tasks)
            if b in self.files:  # read once: its descriptor is not needed any more
                self.files.pop(b).close()
            if rows is not None and len(rows):
                for k in range(self.num_tasks):
                    totals[k] += uauc_sums(rows["logits"][:, k].astype(np.float64), rows["labels"][:, k],
                                           rows["user"])
        totals = _all_reduce(torch.tensor(totals, device=device)).cpu().numpy()
        return [total / weight if weight else float("nan") for total, weight in totals]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


OPEN_FILES_MARGIN = 256
"""Descriptors left for everything else (data files, sockets, checkpoints) when UAUC's buckets
hold their files open."""


def _allow_open_files(files: int) -> bool:
    """Whether this process may hold `files` more files open, raising the soft limit up to the
    hard one where that makes room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = files + OPEN_FILES_MARGIN
    if soft == resource.RLIM_INFINITY or need <= soft:
        return True
    if hard != resource.RLIM_INFINITY and need > hard:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (ValueError, OSError):
        return False
    return True


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather_rows(rows: np.ndarray, owner: int, device: torch.device, num_tasks: int) -> np.ndarray | None:
    """Every rank's `rows` on rank `owner` (None elsewhere), through tensors on `device`
    (gather needs equal sizes: each rank pads to the largest)."""
    if _world() == 1:
        return rows
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(_world())]
    dist.all_gather(sizes, torch.tensor([len(rows)], device=device))
    sizes = [int(s) for s in sizes]
    users = torch.zeros(max(sizes), dtype=torch.int64, device=device)
    values = torch.zeros(max(sizes), 2 * num_tasks, dtype=torch.float32, device=device)
    users[:len(rows)] = torch.from_numpy(rows["user"].copy())
    values[:len(rows)] = torch.from_numpy(np.concatenate([rows["logits"], rows["labels"]], axis=1))
    mine = dist.get_rank() == owner
    gathered = {name: [torch.empty_like(t) for _ in sizes] if mine else None
                for name, t in (("users", users), ("values", values))}
    dist.gather(users, gathered["users"], dst=owner)
    dist.gather(values, gathered["values"], dst=owner)
    if not mine:
        return None
    out = np.empty(sum(sizes), rows.dtype)
    out["user"] = torch.cat([u[:n] for u, n in zip(gathered["users"], sizes)]).cpu().numpy()
    both = torch.cat([v[:n] for v, n in zip(gathered["values"], sizes)]).cpu().numpy()
    out["logits"], out["labels"] = both[:, :num_tasks], both[:, num_tasks:]
    return out


class TrainingWindow:
    """AUC, NE and calibration over the last `batches` training batches of every rank, from
    the training forward's logits (a forward hook on `model`, training mode only). Holds the
    window's logits and labels ([B, K] per batch, detached: the step does no more); at
    `compute` they become a [K, 2, WINDOW_BINS] histogram and [K, 4] sums, all-reduced in one
    collective.
    The window starts empty after a resume."""

    def __init__(self, model: nn.Module, task_names: list[str], batches: int):
        self.task_names = task_names
        self.batches: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=batches)
        if batches:
            model.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> None:
        if module.training:
            self.batches.append((logits.detach(), args[0].labels))

    def compute(self) -> dict[str, float]:
        """'window/<task>/auc', '/ne', '/calibration' (and 'window/auc'... for the first task);
        {} when off (collective when on)."""
        if not self.batches:
            return {}
        k = len(self.task_names)
        logits, labels = (torch.cat(t) for t in zip(*self.batches))
        hist = torch.bincount(_codes(logits, labels, WINDOW_BINS).flatten(), minlength=k * 2 * WINDOW_BINS)
        state = _all_reduce(torch.cat([hist.double(), _sums(logits, labels).flatten()]))
        state = state.cpu().numpy()
        figures = _task_figures(state[:k * 2 * WINDOW_BINS].reshape(k, 2, WINDOW_BINS),
                                state[k * 2 * WINDOW_BINS:].reshape(k, _SUMS), self.task_names)
        out = {key: v for key, v in figures.items() if key.split("/")[1] in ("auc", "ne", "calibration")}
        out = _first_task(out, self.task_names, ("auc", "ne", "calibration"))
        return {f"window/{key}": v for key, v in out.items()}
