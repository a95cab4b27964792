"""What the training loop calls besides its own steps: components of a run, each built from its
own config section, owning its state, and called by `Trainer.fit` at fixed points through the
methods below (each a no-op unless the component overrides it).

    after_restore(trainer)            the run's state is set up or restored from a checkpoint
    before_step(trainer)              before each training step
    partition_end(trainer, name)      data.order=time: a partition's last step is trained, before
                                      any checkpoint of that step
    after_step(trainer)               after each step's training log, before its evaluation and checkpoint
    after_checkpoint(trainer)         after each step's checkpoint (if one was due)
    train_on(trainer) -> bool         the planned steps are trained: are there more to train?
    after_training(trainer) -> dict   on the final weights, before the test metrics: extra metrics

A component reaches the run through the Trainer's public methods and attributes only. Its
`state_dict` is what it holds between those calls; a component whose state must outlive the
process names its `checkpoint_part`, is built before the restore, and the Trainer saves and
loads it as that checkpoint part (model selection's "best"; a publish's lookup tracker, for
one, cannot be saved, so the publisher's state is not).

The components, in the order the loop calls them: model selection
(trainer/checkpoint/selection.py), continuous training (trainer/continuous.py), publishing
(trainer/serving/publish.py) and calibration (trainer/calibration.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.train import Trainer


class LoopComponent:
    """A part of a run that the training loop calls through the hooks above."""

    checkpoint_part: str | None = None
    """The checkpoint part that holds `state_dict` (None: nothing of it is saved)."""

    def after_restore(self, trainer: Trainer) -> None:
        pass

    def before_step(self, trainer: Trainer) -> None:
        pass

    def partition_end(self, trainer: Trainer, partition: str) -> None:
        pass

    def after_step(self, trainer: Trainer) -> None:
        pass

    def after_checkpoint(self, trainer: Trainer) -> None:
        pass

    def train_on(self, trainer: Trainer) -> bool:
        return False

    def after_training(self, trainer: Trainer) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
