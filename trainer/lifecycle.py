"""Stopping on request: SIGTERM (what Slurm and Kubernetes send first) and SIGINT.

A signal only sets a flag; the trainer acts on it at a step boundary, once every rank has
seen it (the flag rides on the per-step all-reduce, see
`Trainer._agree_on_finite_and_stop`), so that the ranks stop after the same step and write
one consistent checkpoint. A second signal gets
the default action: a user who presses Ctrl-C twice means it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
