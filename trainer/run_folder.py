"""A run folder has one run at a time (docs/design.md §2.10).

`<run_dir>/.lock` names the run that holds the folder (host, pid, start time). A second run
stops with one line naming that holder. A lock whose holder is dead on this host is taken
over with a warning; one held from another host counts as live while its holder refreshes
it (every `HEARTBEAT_SECONDS`), and is taken over, with a warning, once it has not been
refreshed for `STALE_SECONDS`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = ".lock"
HEARTBEAT_SECONDS = 60.0
STALE_SECONDS = 600.0


class RunLock:
    """The exclusive claim of one run on its run folder (rank 0 holds it)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_FILE
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the folder, or raise ValueError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            held = self._read()
            why = self._stale(held)
            if why is None:
                raise ValueError(
                    f"{self.path.parent} is in use by another run (host {held.get('host')}, pid {held.get('pid')}, "
                    f"started {held.get('started')}): give this run a folder of its own (--train.run_dir). A lock "
                    f"held from another host is taken over once it has not been refreshed for "
                    f"{STALE_SECONDS / 60:g} minutes")
            print(f"rankmix: warning: taking over {self.path}: {why}", file=sys.stderr, flush=True)
            if self._read() == held:  # unless it changed hands meanwhile
                self.path.unlink(missing_ok=True)
        self._heartbeat = threading.Thread(target=self._refresh, name="rankmix-run-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Give the folder up (only if this run still holds it)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
            if self._read() == self.holder:
                self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.holder, f)
        return True

    def _read(self) -> dict:
        try:
            held = json.loads(self.path.read_text())
            return held if isinstance(held, dict) else {}
        except (OSError, ValueError):  # vanished, or being written: not ours, and not known stale
            return {}

    def _stale(self, held: dict) -> str | None:
        """Why the lock `held` is stale, or None while its holder may be alive."""
        if held.get("host") == self.holder["host"] and isinstance(held.get("pid"), int):
            return None if _alive(held["pid"]) else f"its holder, pid {held['pid']} on this host, is gone"
        try:
            idle = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it was released"
        if idle > STALE_SECONDS:
            return f"its holder on host {held.get('host')} has not refreshed it for {idle / 60:.0f} minutes"
        return None

    def _refresh(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the folder went away: the run notices at its next write


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): kill's answer stands
        return True
