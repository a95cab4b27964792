"""A run folder has one run at a time, and its files are whole whenever anyone reads them.

- `RunLock`: `<run_dir>/.lock` names the run that holds the folder (host, pid, start time).
  A second run stops with one line naming that holder. A lock whose holder is dead on this
  host is taken over with a warning; one held from another host counts as live while its
  holder refreshes it (every `HEARTBEAT_SECONDS`), and is taken over, with a warning, once
  it has not been refreshed for `STALE_SECONDS`.
- `write_atomic`: a file written next to its destination and renamed over it, so a reader
  (or a run killed mid-write) never sees half of it.
- `swap_folder`: `best/` and the like are a symbolic link renamed onto a complete folder:
  the old folder stays whole until the link points at the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

LOCK_FILE = ".lock"
HEARTBEAT_SECONDS = 60.0
STALE_SECONDS = 600.0


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def swap_folder(link: Path, new: Path) -> None:
    """Make `link` (a symbolic link beside `new`) point at folder `new` with one rename, then
    delete the folder it pointed at before. A real folder at `link` (not a link) is replaced."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(new.name, tmp)
    old = link.parent / os.readlink(link) if link.is_symlink() else None
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)  # a folder written before `best` became a link
    os.replace(tmp, link)
    if old is not None and old.resolve() != new.resolve():
        shutil.rmtree(old, ignore_errors=True)


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


def claim(folder: Path, is_main: bool) -> RunLock | None:
    """Rank 0 takes `folder`'s lock; every rank raises the same ValueError when it cannot
    (collective: no rank waits on one that gave up)."""
    lock, error = (RunLock(folder), None) if is_main else (None, None)
    if lock is not None:
        try:
            lock.acquire()
        except (ValueError, OSError) as e:
            error = f"{e}" if isinstance(e, ValueError) else f"{folder}: cannot take the run folder ({e})"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ValueError(error)
    return lock


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
