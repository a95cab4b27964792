"""Continuous training (data.order = "time", docs/continuous.md) as a component of the loop:
the partitions trained in time order, their progressive metrics, an evaluation of each partition
before its first step (metrics.eval_next_partition), and following train_path for new ones
(data.follow). Its config: [data]'s order, success_marker, follow and poll_seconds, and
metrics.eval_next_partition.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer.components.base import Loop, LoopComponent
from trainer.config import Config
from trainer.credentials import redact_uri
from trainer.data.partitions import PartitionedReader
from trainer.data.reader import ParquetReader
from trainer.metrics.progressive import ProgressiveMetrics

if TYPE_CHECKING:
    from torch import nn


def partitioned_reader(cfg: Config, path: str, retries: dict,
                       open_reader: Callable[[str, int, int], ParquetReader]) -> PartitionedReader:
    """The training reader of time order: the complete partitions under `path`, each read once
    by `open_reader(uri, seed, epochs)`, shuffled with a seed of its own name, so that it gives
    the same rows wherever it falls in a run."""
    seed = cfg.train.seed
    return PartitionedReader(path, lambda uri, name: open_reader(uri, (seed << 32) + zlib.crc32(name.encode()), 1),
                             marker=cfg.data.success_marker, catalog=cfg.data.catalog, **retries)


class ContinuousTraining(LoopComponent):
    """Time order's part of the loop. `progressive` scores each training row before its update
    (a forward hook on `model`); `next_evaluated` is the last partition (epoch) evaluated ahead.
    It trains no further once another component asked the loop to stop (early stopping)."""

    def __init__(self, cfg: Config, path: str, reader: PartitionedReader, model: nn.Module, task_names: list[str],
                 device, batch_size: int):
        self.data, self.steps, self.evaluate_ahead = cfg.data, cfg.train.steps, cfg.metrics.eval_next_partition
        self.path, self.reader, self.batch_size = path, reader, batch_size
        self.progressive = ProgressiveMetrics(model, task_names, device)
        self.next_evaluated = -1

    def after_restore(self, loop: Loop) -> None:
        """train.steps, else the steps of the complete partitions after the restored position (none
        is an error for a run that has trained nothing, unless it follows)."""
        loop.total_steps = self.steps or loop.step + self.reader.steps_left()
        if loop.total_steps == 0 and not self.data.follow:
            raise ValueError(f"{redact_uri(self.path)}: no complete partition with a batch of {self.batch_size} "
                             f"rows per rank (data.order=time, data.success_marker={self.data.success_marker!r})")
        if loop.logger.bar is not None:
            loop.logger.bar.total = loop.total_steps
        if loop.step == loop.total_steps and loop.step:
            loop.logger.write(f"no new complete partition after {self.reader.sequence[-1].name}")

    def before_step(self, loop: Loop) -> None:
        """Before the first step of a partition that follows trained steps: the model's metrics over
        its files, logged as `next_partition` (collective)."""
        if not self.evaluate_ahead:
            return
        epoch = self._partition_ahead(loop)
        if epoch in (-1, self.next_evaluated):
            return
        self.next_evaluated = epoch
        loop.check()
        metrics = loop.metrics_on(self.reader.uri(epoch))
        loop.logger.log(loop.step, "next_partition", {"partition": self.reader.sequence[epoch].name,
                                                      "epoch": epoch, **metrics})

    def _partition_ahead(self, loop: Loop) -> int:
        """The partition (epoch) whose first step is next, -1 inside a partition or before any step."""
        epoch, step = loop.position.epoch, loop.position.step
        if not loop.step or 0 < step < self.reader.steps_in_epoch(epoch):
            return -1
        epoch += step > 0
        while self.reader.steps_in_epoch(epoch) == 0:  # skipped: fewer rows than a batch per rank
            epoch += 1
        return epoch

    def partition_end(self, loop: Loop, partition: str) -> None:
        """The partition's progressive metrics (collective), before the components after this one act on it."""
        loop.logger.log(loop.step, "progressive", {"partition": partition, "epoch": loop.position.epoch,
                                                   **self.progressive.compute()})

    def train_on(self, loop: Loop) -> bool:
        """data.follow, once the known partitions are trained: poll data.train_path every
        data.poll_seconds until new complete partitions land (True: train them) or a stop signal
        reaches every rank (False, after a checkpoint of this step). Collective: the ranks agree
        on the stop in the flags' all-reduce and on the partitions through rank 0's listing."""
        if not self.data.follow or loop.stopping or loop.step < loop.total_steps or self.steps \
                or loop.stop_requested:
            return False
        while True:
            if loop.poll_stop():
                return False
            if self.reader.refresh():
                loop.total_steps = loop.step + self.reader.steps_left()
                if loop.total_steps > loop.step:
                    return True
            time.sleep(self.data.poll_seconds)

    def state_dict(self) -> dict:
        return {"next_evaluated": self.next_evaluated}

    def load_state_dict(self, state: dict) -> None:
        self.next_evaluated = state["next_evaluated"]
