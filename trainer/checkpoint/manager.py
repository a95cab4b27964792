"""Sharded checkpoints with torch.distributed.checkpoint (DCP), exact resume, retention.

A checkpoint is `<dir>/step-N/`, written by DCP from a dict of named parts, each a
Stateful component (the parts of a training run are listed in trainer/checkpoint/state.py).

DCP writes `.metadata` last, after every rank's data: a folder without it is incomplete
(killed mid-save) and is never loaded. DCP reshards on load, so a checkpoint loads into
another world size or sharding plan.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, Metadata, TensorStorageMetadata

from embeddings.features import FeatureSpec, managed_tables
from trainer.checkpoint.links import check_swap, swap_folder
from trainer.checkpoint.safe_load import LoadPlanner, SafeReader, UnsafeFileError, first_line, read_metadata
from trainer.checkpoint.views import ViewSavePlanner
from trainer.config import CheckpointConfig
from trainer.dist import gloo_group, raise_on_every_rank, side_group
from trainer.run_layout import STEP_PREFIX, RunFolder, complete_steps, resolve_checkpoint


class CheckpointManager:
    """When to save, where, and which checkpoints to keep."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, rank: int):
        self.cfg = cfg
        self.folder = RunFolder(run_dir, checkpoint_folder=cfg.folder).checkpoints
        self.rank = rank
        self._last_save_time = time.monotonic()
        self._pending: tuple[Path, Future, Callable[[str], None]] | None = None
        # async_save on the default group hung (docs/design.md §4.8): it gets a gloo group of its own.
        self._group = gloo_group() if cfg.async_save else None

    def latest(self) -> Path | None:
        """This run's newest complete checkpoint, if any."""
        steps = complete_steps(self.folder)
        return self.folder / f"{STEP_PREFIX}{steps[-1]}" if steps else None

    def restore(self, parts: dict[str, Any], features: list[FeatureSpec], world_size: int) -> tuple[Path, bool] | None:
        """Load this run's newest complete checkpoint into `parts`, else checkpoint.load_path's
        (all of it, or its weights: load_mode) (collective). (what was loaded, all of it), or None."""
        latest = [self.latest() if self.cfg.enabled and self.cfg.resume else None]
        dist.broadcast_object_list(latest, src=0, group=side_group())  # every rank resumes from the same one
        if latest[0] is not None:
            path, full = latest[0], True
        elif self.cfg.load_path:
            path, full = resolve_checkpoint(self.cfg.load_path), self.cfg.load_mode == "full"
        else:
            return None
        require_saved_world_size(features, path, world_size)
        load(path, parts if full else {"model": parts["model"]})
        return path, full

    def due(self, step: int, last: bool, timed: bool = False) -> bool:
        """Save after this step? Every `interval` steps, at the end, and when `timed`: rank 0's
        `time_due`, which every rank has agreed on."""
        if not self.cfg.enabled:
            return False
        if last and self.cfg.save_final:
            return True
        return (self.cfg.interval > 0 and step % self.cfg.interval == 0) or timed

    def time_due(self) -> bool:
        """`interval_minutes` have passed since the last save, by this rank's clock. Ranks'
        clocks differ and a save is collective, so the trainer takes rank 0's verdict to every
        rank on the all-reduce of its periodic check (`Trainer.check`), not a collective per step."""
        minutes = self.cfg.interval_minutes
        return minutes > 0 and time.monotonic() - self._last_save_time >= 60 * minutes

    def save(self, step: int, parts: dict[str, Any], on_done: Callable[[str], None] = print) -> None:
        """Write `parts` as step-`step` (collective), then apply retention. With async_save
        the writing goes on in the background; the previous save is finished first."""
        self.wait()
        path = self.folder / f"{STEP_PREFIX}{step}"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if path.exists():  # a save of this step was interrupted, or is being redone
                shutil.rmtree(path)
        dist.barrier(group=side_group())
        self._last_save_time = time.monotonic()
        if self.cfg.async_save:  # stages a CPU copy now, writes it while training goes on
            future = dcp.async_save(parts, checkpoint_id=str(path), process_group=self._group,
                                    planner=ViewSavePlanner())
            self._pending = (path, future, on_done)
        else:
            dcp.save(parts, checkpoint_id=str(path), process_group=side_group(), planner=ViewSavePlanner())
            self._finish(path, on_done)

    def wait(self) -> None:
        """Finish the save in flight, if any (collective)."""
        if self._pending is not None:
            path, future, on_done = self._pending
            self._pending = None
            future.result()
            self._finish(path, on_done)

    def close(self, wait: bool = True, timeout: float = 60.0) -> None:
        """Finish the save in flight before the process group goes. After a failure the
        other ranks may be gone and the save's collectives would never complete: then wait
        at most `timeout` seconds for its writes and leave it incomplete (no `.metadata`,
        so it is never loaded)."""
        if wait:
            self.wait()
        elif self._pending is not None:
            _, future, _ = self._pending
            self._pending = None
            try:
                future.result(timeout=timeout)
            except Exception:  # the run is failing already: report that failure, not this one
                pass

    def _finish(self, path: Path, on_done: Callable[[str], None]) -> None:
        if self.rank == 0:
            self._retain()
            on_done(f"saved {path}")
        dist.barrier(group=side_group())

    def _retain(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop incomplete ones older than them."""
        steps = complete_steps(self.folder)
        if self.cfg.keep <= 0 or not steps:
            return
        kept = set(steps[-self.cfg.keep:])
        for p in self.folder.iterdir():
            step = p.name[len(STEP_PREFIX):]
            if p.name.startswith(STEP_PREFIX) and step.isdigit() and int(step) not in kept \
                    and int(step) < steps[-1]:
                shutil.rmtree(p, ignore_errors=True)


def save_weights(path: Path, parts: dict[str, Any], step: int, tag: str = "") -> None:
    """Write `parts` as the weights at `path`, synchronously (collective): into the sibling
    folder `<path>.step-<step><tag>`, then `path`, a symbolic link, is renamed onto it
    (`run_folder.swap_folder`), so `path` always holds a whole save. A `tag` tells a second
    save of one step from the first, which `path` still points at while it is written."""
    new = path.with_name(f"{path.name}.step-{step}{tag}")
    error = None
    if dist.get_rank() == 0:
        try:
            check_swap(path, new)  # before anything is written: nothing goes through a planted link
            shutil.rmtree(new, ignore_errors=True)  # an interrupted save of this step
        except ValueError as e:
            error = str(e)
    raise_on_every_rank(error)  # the barrier too: rank 0 cleared `new`
    dcp.save(parts, checkpoint_id=str(new), process_group=side_group(), planner=ViewSavePlanner())
    dist.barrier(group=side_group())
    if dist.get_rank() == 0:
        swap_folder(path, new)
    dist.barrier(group=side_group())


def model_tensors(path: Path) -> dict[str, Any]:
    """The `model` part of checkpoint `path` as whole tensors by name, whatever the plan and
    world size that saved it, read by this process alone (no collective, even under a process
    group) and without the optimizer's state."""
    metadata = read_metadata(path)  # checked: sizes, dtypes, and chunks that tile each tensor
    prefix = "model."
    wanted = {key[len(prefix):]: meta for key, meta in metadata.state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    _fits_in_memory(path, wanted.values())
    # zeros, not empty: even if a read were missed, no memory of this process could leave in an export
    model = {name: torch.zeros(meta.size, dtype=meta.properties.dtype) for name, meta in wanted.items()}
    _read({"model": model}, path, metadata, no_dist=True)
    return model


def _fits_in_memory(path: Path, tensors: Iterable[TensorStorageMetadata]) -> None:
    """Refuse before allocating whole tensors that this host's memory could not hold."""
    need = sum(math.prod(meta.size) * meta.properties.dtype.itemsize for meta in tensors)
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise ValueError(f"{path}: its model takes {need / 2**30:.1f} GiB whole, more than this host's "
                         f"{have / 2**30:.1f} GiB of memory")


def export_weights(path: str, out: str) -> int:
    """The model weights of checkpoint `path` as one torch.save file of whole tensors
    (no process group needed); returns the number of tensors."""
    model = model_tensors(resolve_checkpoint(path, "--checkpoint"))
    tmp = Path(out).with_name(f".{Path(out).name}.tmp")
    torch.save(model, tmp)
    os.replace(tmp, out)  # a reader never sees half a file
    return len(model)


def trained_step(path: Path) -> int:
    """How many optimizer steps trained the weights of checkpoint `path` (its `trainer` part's
    step; best-weights folders carry one too)."""
    return _trainer_value(path, "step")


def require_saved_world_size(features: list[FeatureSpec], path: Path, world_size: int, advice: str = "") -> None:
    """Refuse checkpoint `path` at `world_size` when it holds managed tables saved at another:
    each rank's MCH map holds the ids of its own range, with its own miss row, and TorchRec's
    resharding moves neither."""
    managed = managed_tables(features)
    saved = _trainer_value(path, "world_size") if managed else world_size
    if saved != world_size:
        raise ValueError(f"{path} was saved at world size {saved}: managed tables {managed} load only at the "
                         f"world size that trained them (each rank's id map holds the ids of its own range), "
                         f"not at {world_size}{advice}")


def _trainer_value(path: Path, key: str) -> int:
    metadata = read_metadata(path)
    if f"trainer.{key}" not in metadata.state_dict_metadata:
        raise ValueError(f"{path}: not a rankmix checkpoint (it has no trainer.{key})")
    progress = {key: 0}
    _read({"trainer": progress}, path, metadata)
    return progress[key]


def _read(parts: dict[str, Any], path: Path, metadata: Metadata, no_dist: bool = False) -> None:
    """`_dcp_load` for reads of a checkpoint as a file (no model to fit): a storage file DCP
    cannot read is one line naming `path`."""
    try:
        _dcp_load(parts, path, metadata, no_dist)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0]
        raise ValueError(f"{path}: not a readable checkpoint ({type(first).__name__}: {first_line(first)[:200]})") \
            from None


def _dcp_load(parts: dict[str, Any], path: Path, metadata: Metadata, no_dist: bool = False) -> None:
    """dcp.load through rankmix's safe reader and planner (trainer/checkpoint/safe_load.py): nothing
    in `path` is unpickled unchecked. A refused file is reported as itself. `no_dist`: this
    process reads alone, whatever process group is up."""
    try:
        dcp.load(parts, storage_reader=SafeReader(str(path), metadata), planner=LoadPlanner(),
                 process_group=side_group(), no_dist=no_dist)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeFileError)]
        if refused:
            raise UnsafeFileError(f"{path}: {refused[0]}") from None
        raise


def load(path: Path, parts: dict[str, Any]) -> None:
    """Load `parts` (state dicts, or Stateful components, see trainer/checkpoint/state.py) in place from
    the DCP checkpoint at `path` (collective). A part that cannot take up its saved state
    raises ValueError, reported here with the checkpoint's path."""
    metadata = read_metadata(path)  # a refused or unreadable file is one line on every rank, before any collective
    try:
        _dcp_load(parts, path, metadata)
    except UnsafeFileError:
        raise
    except ValueError as e:
        raise ValueError(f"{path} {e}") from None
    except CheckpointException as e:  # a rank's plan failed: the checkpoint is of another model
        first = next(iter(e.failures.values()))[0]
        raise ValueError(f"{path} does not fit this run ({str(first).strip()}): it was saved by another model or "
                         "configuration. Give this run a folder of its own (--train.run_dir), or "
                         "set checkpoint.resume=false to start afresh in this one") from None
