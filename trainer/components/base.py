"""What the training loop calls besides its own steps, and the narrow door through which those
calls see the loop.

A component is a part of a run, built from its own config section (trainer/assembly.py builds
them), owning its state, and called by the loop at fixed points through the methods of
`LoopComponent` (each a no-op unless the component overrides it):

    after_restore(loop)            the run's state is set up or restored from a checkpoint
    before_step(loop)              before each training step
    partition_end(loop, name)      data.order=time: a partition's last step is trained, before
                                   any checkpoint of that step
    after_step(loop)               after each step's training log, before its evaluation and checkpoint
    after_checkpoint(loop)         after each step's checkpoint (if one was due)
    train_on(loop) -> bool         the planned steps are trained: are there more to train?
    after_training(loop) -> dict   on the final weights, before the test metrics: extra metrics
    summary() -> dict              what it adds to the run's summary.json

A component sees the loop as a `Loop` only (the Trainer is one), never the Trainer itself, and
reaches no other component through it: what one needs of another is given to it when it is
built (calibration gets model selection), and a component that wants the training to end asks
for it by setting `Loop.stop_requested` (model selection's early stopping), which every component
can read.

Its `state_dict` is what it holds between those calls; a component whose state must outlive the
process names its `checkpoint_part`, and the Trainer saves and loads it as that checkpoint part
(model selection's "best"; a publish's lookup tracker, for one, cannot be saved, so the
publisher's state is not).

The components, in the order the loop calls them: model selection (selection.py), continuous
training (continuous.py), publishing (publisher.py) and calibration (calibration.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trainer.checkpoint.state import TrainedPosition
    from trainer.metrics.logger import MetricLogger


class Loop(Protocol):
    """What a component sees of the training loop."""

    step: int
    """Steps trained so far."""
    total_steps: int
    """The step the loop trains to (continuous training sets it as partitions land)."""
    position: TrainedPosition
    """The data position: `epoch`, and `step` within it."""
    logger: MetricLogger
    """The run's metric log (`log`, `write`) and progress bar (`bar`)."""
    stop_requested: bool
    """A stop request: a component sets it to end the training after this step, which the loop
    then saves as its last (model selection's early stopping); every component can read it."""

    @property
    def stopping(self) -> bool:
        """Every rank has seen a stop signal, and the step to stop after is set."""

    def check(self) -> None:
        """Read the steps' flags (collective); before anything that reads or saves the weights."""

    def poll_stop(self) -> bool:
        """Read the flags now, the stop vote with them (collective): True when the run stops."""

    def due(self, every: int) -> bool:
        """This step is one of every `every` (0: none)."""

    def epoch_ended(self) -> bool:
        """The step just trained was its epoch's last."""

    def steps_in_epoch(self) -> int:
        """Steps of the epoch being trained (in time order: of the partition)."""

    def epochs_trained(self) -> float:
        """Passes over the training split so far."""

    def metrics_on(self, path: str, **split) -> dict[str, float]:
        """The model's metrics over the files at `path` (collective)."""

    def weights(self, step: int | None = None) -> dict:
        """The checkpoint parts of the model's weights, trained to `step` (default: this one)."""

    def wait_for_save(self) -> None:
        """Wait for the checkpoint save in flight (one save at a time)."""

    def after_restore(self, step: int) -> None:
        """The model's after-restore hooks, for weights trained to `step`."""


class LoopComponent:
    """A part of a run that the training loop calls through the hooks above."""

    checkpoint_part: str | None = None
    """The checkpoint part that holds `state_dict` (None: nothing of it is saved)."""

    def after_restore(self, loop: Loop) -> None:
        pass

    def before_step(self, loop: Loop) -> None:
        pass

    def partition_end(self, loop: Loop, partition: str) -> None:
        pass

    def after_step(self, loop: Loop) -> None:
        pass

    def after_checkpoint(self, loop: Loop) -> None:
        pass

    def train_on(self, loop: Loop) -> bool:
        return False

    def after_training(self, loop: Loop) -> dict[str, float]:
        return {}

    def summary(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
