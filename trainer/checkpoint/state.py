"""The training state as named parts that DCP saves and loads (torch.distributed.checkpoint.stateful).

Each stateful component answers for itself, and `CheckpointManager` saves whatever dict of
parts it is given; nothing is assembled by hand or depends on the order of loading:

    model     ModelState: sharded tables, dense weights and buffers (the MoE's lambda)
    optim     OptimizerState: fused sparse Adagrad and dense RMSProp (one CombinedOptimizer)
    trainer   the Trainer: step, world size and epoch position, the same on every rank
    ranks     PerRankState: every rank's data position, RNG and LR schedule, gathered into
              one JSON text, because DCP writes non-tensor values from the coordinator only

A checkpoint loads into another world size: tensors reshard, and per-rank parts rebuild
their state from the saved ranks' (`RankLocal.load_resized`).
"""

from __future__ import annotations

import base64
import json
import logging
import random
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from embeddings.hooks import TrainingHooks
from trainer.config import PIN_FIELDS, table_format
from trainer.data.elastic import resumed_epoch
from trainer.data.partitions import PartitionedReader
from trainer.data.reader import ParquetReader
from trainer.data.table_input import TablePin
from trainer.dist import side_group

log = logging.getLogger("rankmix.data")


def apply_trained_step(model: nn.Module, step: int) -> None:
    """Run `model`'s after_restore hooks (e.g. UniMixer's temperature) at `step`, the step the
    loaded weights were trained to."""
    for hook in TrainingHooks.of(model).after_restore:
        hook(step)


class ModelState:
    """The DMP model's state dict: DCP loads its tensors in place, sharded tables included."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)


class OptimizerState:
    """Both optimizers. RMSProp creates its state at its first step, and DCP loads in place
    into the template this returns, so a fresh optimizer gets its state made first."""

    def __init__(self, optimizer: CombinedOptimizer, lazy: KeyedOptimizer):
        self.optimizer = optimizer
        self.lazy = lazy

    def state_dict(self) -> dict[str, Any]:
        if not self.lazy.state:
            # A zero-gradient step; it moves no weight that the same load does not overwrite.
            self.lazy.init_state()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class RankLocal(Protocol):
    """A part whose state differs between ranks, and that can rebuild it in another world size."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...

    def load_resized(self, saved: list[Any]) -> None:
        """Take up the state saved by `len(saved)` ranks (in rank order) in this world size."""


INPUT_RECORD = ("files", "consumed", "partition", "table")
"""Keys of a reader's state that record the input read so far, the same on every rank."""


class PerRankState:
    """Rank-local parts, gathered from every rank into one JSON text (a collective in
    `state_dict`; see `encode_state`); on load each rank takes its own entry, or, when the
    world size changed, each part rebuilds its state from all the saved ones."""

    def __init__(self, parts: dict[str, RankLocal]):
        self.parts = parts

    def state_dict(self) -> str:
        mine = {name: part.state_dict() for name, part in self.parts.items()}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, mine, group=side_group())
        return encode_state(states)

    def load_state_dict(self, text: str) -> None:
        states = decode_state(text, "the checkpoint's `ranks` part")
        if not isinstance(states, list) or not all(isinstance(s, dict) and s.keys() == self.parts.keys()
                                                   for s in states):
            raise ValueError(f"has a `ranks` part without the parts {sorted(self.parts)} for every rank")
        if len(states) == dist.get_world_size():
            for name, part in self.parts.items():
                part.load_state_dict(states[dist.get_rank()][name])
        else:
            for name, part in self.parts.items():
                part.load_resized([s[name] for s in states])


def encode_state(value: Any) -> str:
    """`value` (dicts with str keys, lists, tuples, numbers, strings, None, NumPy arrays and CPU
    tensors) as JSON text that `decode_state` turns back into equal values, types included:
    a checkpoint holds data, never a pickle (docs/design.md §2.10)."""
    return json.dumps(_tagged(value), allow_nan=True, separators=(",", ":"))


def decode_state(text: str, what: str) -> Any:
    """The value `encode_state` wrote; ValueError naming `what` for anything else."""
    try:
        return _untagged(json.loads(text))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{what} is not rankmix's per-rank state ({type(e).__name__}: {e})") from None


def _tagged(v: Any) -> Any:
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError(f"per-rank state keys must be strings, got {list(v)}")
        return {"dict": {k: _tagged(x) for k, x in v.items()}}
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [_tagged(x) for x in v]}
    if isinstance(v, (np.ndarray, torch.Tensor)):
        array = v.numpy() if isinstance(v, torch.Tensor) else v
        return {"torch" if isinstance(v, torch.Tensor) else "numpy": {
            "dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"per-rank state holds a {type(v).__name__}, which a checkpoint does not store")


def _untagged(v: Any) -> Any:
    if not isinstance(v, dict):
        if isinstance(v, list):
            raise ValueError("an untagged list")
        return v
    (kind, x), = v.items()
    if kind == "dict":
        return {k: _untagged(y) for k, y in x.items()}
    if kind in ("list", "tuple"):
        items = [_untagged(y) for y in x]
        return items if kind == "list" else tuple(items)
    if kind in ("numpy", "torch"):
        dtype = np.dtype(x["dtype"])
        if dtype.kind not in "biuf":
            raise ValueError(f"an array of dtype {dtype}")
        array = np.frombuffer(base64.b64decode(x["data"], validate=True), dtype=dtype)
        array = array.reshape(x["shape"]).copy()
        return torch.from_numpy(array) if kind == "torch" else array
    raise ValueError(f"unknown tag {kind!r}")


class RNGState:
    """Python's, NumPy's, torch's and this rank's CUDA generators. A run in another world
    size keeps its own seeding: no saved rank's stream is this rank's."""

    def state_dict(self) -> dict:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    def load_resized(self, saved: list[dict]) -> None:
        pass


class LRScheduleState:
    """The LR schedule, and the learning rates it set: optimizer state dicts hold none. Its
    state differs per rank because each rank's sparse optimizer has its own param groups."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer):
        self.scheduler = scheduler
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self._apply()

    def load_resized(self, saved: list[dict]) -> None:
        # The schedule is a function of the step alone: replay it to the saved step.
        self.scheduler.last_epoch = saved[0]["last_epoch"] - 1
        self.scheduler.step()
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr


class TrainedPosition:
    """The reader's position after the last *trained* batch. The pipeline reads ahead of
    the step being trained, so the position is recorded as each batch leaves the reader
    (`track`) and taken up when its step is done (`advance`). A saved position also records
    what its epoch has left on this rank, for a resume at another world size, and the rows
    that such resumes read twice (`rows_reread`, the run's total; trainer/data/elastic.py), and
    the snapshot of a training table (`pin`), which a resume must read again."""

    def __init__(self, reader: ParquetReader | PartitionedReader, data_position: str, pin: TablePin | None = None):
        self.reader = reader
        self.data_position = data_position  # checkpoint.data_position, for another world size
        self.pin = pin
        self.current = reader.state_dict()
        self.rows_reread = 0
        self._ahead: deque[dict] = deque()

    @property
    def epoch(self) -> int:
        return self.current["epoch"]

    @property
    def step(self) -> int:
        """Batches of the current epoch trained on."""
        return self.current["step"]

    def track(self, batches: Iterator) -> Iterator:
        for batch in batches:
            self._ahead.append(self.reader.state_dict())
            yield batch

    def advance(self) -> None:
        """The oldest batch handed out has been trained on."""
        self.current = self._ahead.popleft()

    def state_dict(self) -> dict:
        table = {"table": self.pin.state_dict()} if self.pin else {}
        return {**self.reader.with_units_left(self.current), "rows_reread": self.rows_reread, **table}

    def load_state_dict(self, state: dict) -> None:
        self._check_table(state.get("table"))
        self.reader.load_state_dict(state)
        self.current = state
        self.rows_reread = int(state.get("rows_reread", 0))
        self._ahead.clear()

    def _check_table(self, saved: dict | None) -> None:
        """Refuse a position saved over another table, or another snapshot of this one."""
        mine = self.pin.state_dict() if self.pin else None
        if saved == mine:
            return
        if saved is None or mine is None or saved["path"] != mine["path"]:
            what = lambda t: f"table {t['path']}" if t else "files, not a table"  # noqa: E731
            raise ValueError(f"data reader state was saved reading {what(saved)}, but this run reads {what(mine)}")
        option = f"data.{PIN_FIELDS[table_format(mine['path'])]}"
        raise ValueError(f"data reader state was saved reading {option.split('.')[1]} {saved['snapshot']} of "
                         f"{saved['path']}, but this run reads {mine['snapshot']} ({option}): a resume reads the "
                         f"snapshot it started on; set {option}={saved['snapshot']}, or leave it unset in the run "
                         "folder that pinned it")

    def load_resized(self, saved: list[dict]) -> None:
        """An epoch boundary means the same thing in any world size. Inside an epoch (a partition
        in time order), the units the saved ranks had left become the rest of it, split over this
        world size (trainer/data/elastic.py), unless checkpoint.data_position = next_epoch."""
        first = saved[0]
        epoch, step = first["epoch"], first["step"]
        partitioned = isinstance(self.reader, PartitionedReader)
        readers = [s.get("reader") or {} for s in saved] if partitioned else saved
        # a partition's last step is its epoch's end; a resumed epoch is inside before its first step
        inside = (step or "resumed" in readers[0]) and not first.get("done")
        # This rank's fresh position, with what the saved one records of the input read so far
        # (files; partitions consumed), so that its checks run and no partition is trained again.
        position = self.reader.state_dict()
        position.update({key: first[key] for key in INPUT_RECORD if key in first})
        position["rows_reread"] = int(first.get("rows_reread", 0))
        if inside and self.data_position != "next_epoch":
            taken = resumed_epoch(readers)
            if taken is None:
                raise ValueError(
                    f"was saved at world size {len(saved)} in the middle of epoch {epoch} (batch {step}) by an older "
                    f"rankmix, without the rows each rank had left; at world size {dist.get_world_size()} that "
                    "position would replay or skip rows. Resume at the saved world size, or set "
                    f"checkpoint.data_position=next_epoch to continue from the start of epoch {epoch + 1}")
            resumed, half_read = taken
            position.update(epoch=epoch, step=0, resumed=resumed, rows_reread=position["rows_reread"] + half_read)
            self.load_state_dict(position)
            self.current = self.reader.state_dict()  # the reader's own form of the resumed position
            steps = self.reader.steps_in_epoch(epoch)
            if resumed["rows"]:
                log.warning("data: epoch %d resumed at world size %d from %d: its %d rows left in %d steps per rank; "
                            "%d rows of half-read shuffle windows are read again", epoch, dist.get_world_size(),
                            len(saved), resumed["rows"], steps, half_read)
            if steps or partitioned:  # a partition without a step is skipped, and consumed, as any
                return
            # fewer rows left than one batch per rank: drop_last's share, and nothing is read again
            position.update(epoch=epoch + 1, rows_reread=position["rows_reread"] - half_read)
        else:
            position.update(epoch=epoch + 1 if step or inside else epoch)
        position.update(step=0)
        position.pop("resumed", None)
        self.load_state_dict(position)
