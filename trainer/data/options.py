"""What a `ParquetReader` is asked to do (trainer/data/reader.py): its batches, order, share and
retries, in one value; `ReaderOptions.from_config` is the one place the config's [data] becomes one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import DataConfig


@dataclass(frozen=True)
class ReaderOptions:
    """A reader's batches, order, share of the ranks, retries and split.

    Training (`drop_last=True`) runs `num_epochs` epochs (0: without end), each of the same number
    of steps on every rank. Evaluation (`drop_last=False`) reads one epoch: every row of the rank
    once, the batches padded with weight-0 rows. `retry_seconds` and `retry_attempts`: how long a
    failing object store is retried (trainer/data/store.py); 0 seconds gives up at once.
    `holdout_fraction` > 0 splits every row group: `holdout=True` reads only the last share of its
    rows (a validation split carved from training files), `holdout=False` only the rest.
    `pin_memory` assembles and pins batches ahead in a prefetch thread, so that copies to a CUDA
    device with non_blocking=True overlap compute (it needs CUDA).
    """

    batch_size: int
    shuffle_buffer: int = 0
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    rank: int = 0
    world_size: int = 1
    num_epochs: int = 0
    retry_seconds: float = 300.0
    retry_attempts: int = 3
    holdout_fraction: float = 0.0
    holdout: bool = False
    pin_memory: bool = False

    @classmethod
    def from_config(cls, data: DataConfig, *, training: bool, batch_size: int, rank: int = 0, world_size: int = 1,
                    seed: int = 0, num_epochs: int = 0, pin_memory: bool = False, holdout_fraction: float = 0.0,
                    holdout: bool = False) -> ReaderOptions:
        """The options of a reader of `data`'s files. Training shuffles as `data` says and leaves out
        every row group's share of the validation split (data.row_group_holdout); `seed`, `num_epochs` and
        `pin_memory` are its own. Evaluation reads every row of its split once, in file order
        (`holdout_fraction`, `holdout`: the split's, as ModelSelection.split gives them)."""
        common = {"batch_size": batch_size, "rank": rank, "world_size": world_size,
                  "retry_seconds": data.retry_seconds, "retry_attempts": data.retry_attempts}
        if training:
            return cls(**common, shuffle=data.shuffle, shuffle_buffer=data.shuffle_buffer, seed=seed,
                       num_epochs=num_epochs, holdout_fraction=data.row_group_holdout, pin_memory=pin_memory)
        return cls(**common, shuffle=False, drop_last=False, holdout_fraction=holdout_fraction, holdout=holdout)
