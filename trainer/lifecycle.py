"""Stopping on request (SIGTERM, what Slurm and Kubernetes send first, and SIGINT), the
flags a training step leaves for the periodic check, and the check itself (`StepChecks`).

A signal only sets a flag; the trainer acts on it at a step boundary, once every rank has
seen it (the flag rides on the periodic check's all-reduce, see `StepFlags` and
`StepChecks.check`), so that the ranks stop after the same step and write one consistent
checkpoint. A second signal gets the default action: a user who presses Ctrl-C twice means it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from trainer.config import CheckpointConfig
from trainer.errors import NonFiniteLossError

SIGNALS = (signal.SIGTERM, signal.SIGINT)
LOSS, GRADIENT = range(2)  # what StepFlags notes
_HORIZON = 2 ** 62  # a step s is noted as _HORIZON - s: larger for earlier steps, and 0 is none


class StopSignal:
    """Context manager that turns SIGTERM/SIGINT into `received` while it is active."""

    def __init__(self) -> None:
        self.received = 0
        """The signal number received (0: none)."""
        self.agreed = False
        """Every rank has received one (set by the trainer)."""
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "no signal"

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))


class StepFlags:
    """What the training steps found since the last `read`, kept on the device so that a
    step reads nothing back: the first step whose loss (LOSS) or dense gradient norm
    (GRADIENT) was not finite. `read` agrees on them over the ranks in one all-reduce that
    also carries this rank's votes for a stop and a timed save."""

    def __init__(self, device: torch.device):
        self.device = device
        self.noted = {LOSS: torch.zeros((), dtype=torch.int64, device=device),
                      GRADIENT: torch.zeros((), dtype=torch.int64, device=device)}

    def note_non_finite(self, slot: int, value: torch.Tensor, step: int) -> None:
        """Note `step` in `slot` if `value` is not finite; an earlier step noted there stays."""
        bad = torch.isfinite(value).logical_not().any()
        # Python scalars go to the kernel as arguments: no host-to-device copy either.
        self.noted[slot] = torch.maximum(self.noted[slot], bad * (_HORIZON - step))

    def read(self, stop: bool, save: bool, world_size: int) -> tuple[int, int, bool, bool]:
        """(first step of a non-finite loss, of a non-finite dense gradient norm (0: none), a
        stop voted, a timed save voted), on any rank, since the last read; then clears them
        (collective: the one read back of the steps in between)."""
        flags = torch.stack([self.noted[LOSS], self.noted[GRADIENT],
                             torch.full((), int(stop), device=self.device),
                             torch.full((), int(save), device=self.device)])
        if world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        loss, gradient, stop_vote, save_vote = flags.tolist()
        for noted in self.noted.values():
            noted.zero_()
        return _HORIZON - loss if loss else 0, _HORIZON - gradient if gradient else 0, bool(stop_vote), bool(save_vote)


class StepChecks:
    """The periodic check of docs/design.md §5.5 and what every rank decides from it: the flags
    of the steps since the last read, this rank's stop vote and rank 0's timed-save vote, in one
    all-reduce (`check`); then a NonFiniteLossError, a stop after an agreed step, or a timed save."""

    def __init__(self, device: torch.device, world_size: int, is_main: bool):
        self.flags = StepFlags(device)
        self.signal = StopSignal()
        self.world_size, self.is_main = world_size, is_main
        self.checked_step = -1
        """The step `check` last read the flags after."""
        self.timed_save_step = -1
        """The step after which every rank agreed a timed save is due."""
        self.stop_at: int | None = None
        """The step to stop after, once every rank saw a signal."""

    def check(self, step: int, save_due: Callable[[], bool]) -> None:
        """Read the flags of the steps up to `step` unless already read after it (collective):
        raise NonFiniteLossError on every rank if a loss or dense gradient norm was not finite,
        and take up a stop signal or a timed save (`save_due()`, asked on rank 0) any rank voted for."""
        if self.checked_step == step:
            return
        self.checked_step = step
        loss, gradient, stop, save = self.flags.read(bool(self.signal.received), self.is_main and save_due(),
                                                     self.world_size)
        found = [(s, what) for s, what in ((loss, "loss"), (gradient, "dense gradient norm")) if s]
        if found:
            first, what = min(found, key=lambda f: f[0])  # a non-finite loss makes its gradients non-finite too
            raise NonFiniteLossError(f"non-finite {what} at step {first} (read after step {step}); training "
                                     f"stopped: no checkpoint holds an update of step {first} or later")
        if stop:
            self.signal.agreed = True
        if save:
            self.timed_save_step = step

    def poll(self, step: int, save_due: Callable[[], bool]) -> bool:
        """Read the flags again now, the stop vote with them (collective); True once every rank
        has seen a stop signal: the run stops after `step`."""
        self.checked_step = -1
        self.check(step, save_due)
        if self.signal.agreed:
            self.stop_at = step
        return self.signal.agreed

    def stop_now(self, step: int, ck: CheckpointConfig, total_steps: int) -> bool:
        """After a signal that every rank has seen: stop after this step, or train on to a
        scheduled save due within checkpoint.signal_grace_steps."""
        if self.stop_at is None:
            if not self.signal.agreed:
                return False
            due = [total_steps] if ck.save_final else []
            if ck.interval:
                due.append(-(-step // ck.interval) * ck.interval)
            within = [s for s in due if step <= s <= step + ck.signal_grace_steps]
            self.stop_at = min(within, default=step) if ck.enabled else step
        return step >= self.stop_at
