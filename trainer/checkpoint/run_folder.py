"""A run folder has one run at a time (docs/design.md §2.10).

`<run_dir>/.lock` names the run that holds the folder (host, pid, start time), and so does
`<folder>/.lock` of a checkpoint folder configured apart from it (`RunLocks`). A second run
stops with one line naming that holder. The holder refreshes its lock (every
`HEARTBEAT_SECONDS`); a lock is taken over, with a warning, once its holder is dead on this
host or it has not been refreshed for `STALE_SECONDS` (a holder on another host, a reused pid,
a hung run).

A lock appears whole (a hard link to a written sibling), and a takeover replaces the stale lock
by a rename under `.lock.takeover`, a guard that one process holds at a time: of several runs
that find the same stale lock, exactly one takes it over.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

LOCK_FILE = ".lock"
HEARTBEAT_SECONDS = 60.0
STALE_SECONDS = 600.0
GUARD_SECONDS = 30.0  # a takeover guard this old was left by a process killed inside its takeover


class RunLock:
    """The exclusive claim of one run on its run folder (rank 0 holds it); `option` is the
    setting that chose the folder, for the error."""

    def __init__(self, folder: Path, option: str = "--train.run_dir"):
        self.path = Path(folder) / LOCK_FILE
        self.option = option
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "token": secrets.token_hex(8)}  # tells two claims of one process apart
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the folder, or raise ValueError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            text, held = self._read()
            if text is None:
                continue  # released meanwhile
            why = self._stale(held)
            if why is None:
                raise ValueError(self._in_use(held))
            if self._take_over(text, why):
                break
        self._heartbeat = threading.Thread(target=self._refresh, name="rankmix-run-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Give the folder up (only if this run still holds it)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
            if self._ours():
                self.path.unlink(missing_ok=True)

    def _in_use(self, held: dict | None) -> str:
        if held is None:
            return f"{self.path}: unreadable lock file: delete it if no run holds {self.path.parent}"
        return (f"{self.path.parent} is in use by another run (host {held['host']}, pid {held['pid']}, "
                f"started {held.get('started')}): give this run a folder of its own ({self.option}). A lock is "
                f"taken over once it has not been refreshed for {STALE_SECONDS / 60:g} minutes")

    def _written(self) -> Path:
        """A new sibling file holding this run's claim, whole."""
        tmp = self.path.with_name(f"{LOCK_FILE}.{self.holder['token']}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(self.holder))
        return tmp

    def _create(self) -> bool:
        """Claim the free folder: the lock appears with its content (link fails if one exists)."""
        tmp = self._written()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: created in place, empty for a moment
            return self._create_in_place()
        finally:
            tmp.unlink(missing_ok=True)

    def _create_in_place(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.holder, f)
        return True

    def _take_over(self, stale: str, why: str) -> bool:
        """Replace the lock that read `stale` by this run's, under the guard; whether this run
        holds the folder now (False: another took it first, or holds the guard)."""
        guard = self.path.with_name(f"{LOCK_FILE}.takeover")
        try:
            os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            _remove_if_older(guard, GUARD_SECONDS)
            time.sleep(0.01)
            return False
        try:
            if self._read()[0] != stale:  # it changed hands meanwhile: judge the new holder
                return False
            print(f"rankmix: warning: taking over {self.path}: {why}", file=sys.stderr, flush=True)
            os.replace(self._written(), self.path)
            return self._ours()
        finally:
            guard.unlink(missing_ok=True)

    def _read(self) -> tuple[str | None, dict | None]:
        """The lock's text (None: there is none) and its holder (None: not a lock of rankmix's)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return (None, None) if not self.path.is_symlink() else ("", None)
        except (OSError, UnicodeDecodeError):
            return "", None
        try:
            held = json.loads(text)
        except ValueError:
            return text, None
        ok = isinstance(held, dict) and isinstance(held.get("host"), str) and type(held.get("pid")) is int \
            and 0 < held["pid"] < 2 ** 31
        return text, held if ok else None

    def _ours(self) -> bool:
        return self._read()[1] == self.holder

    def _stale(self, held: dict | None) -> str | None:
        """Why the lock `held` is stale, or None while its holder may be alive."""
        if held is not None and held["host"] == self.holder["host"] and not _alive(held["pid"]):
            return f"its holder, pid {held['pid']} on this host, is gone"
        try:
            idle = time.time() - self.path.lstat().st_mtime
        except FileNotFoundError:
            return "it was released"
        if idle <= STALE_SECONDS:
            return None
        if held is None:
            return f"it is unreadable and has not been refreshed for {idle / 60:.0f} minutes"
        who = (f"pid {held['pid']} on this host" if held["host"] == self.holder["host"] else
               f"on host {held['host']}")
        return f"its holder {who} has not refreshed it for {idle / 60:.0f} minutes"

    def _refresh(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if self._ours():  # never keep alive a lock that another run took over
                try:
                    os.utime(self.path)
                except OSError:
                    pass  # the folder went away: the run notices at its next write


class RunLocks:
    """RunLocks on several folders (each with the option that chose it), taken in order and
    given up together; a folder named twice is locked once."""

    def __init__(self, folders: dict[Path, str]):
        self.locks: list[RunLock] = []
        for folder, option in folders.items():
            if all(os.path.realpath(folder) != os.path.realpath(lock.path.parent) for lock in self.locks):
                self.locks.append(RunLock(folder, option))

    def acquire(self) -> None:
        for i, lock in enumerate(self.locks):
            try:
                lock.acquire()
            except BaseException:
                for taken in reversed(self.locks[:i]):
                    taken.release()
                raise

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def _remove_if_older(path: Path, seconds: float) -> None:
    try:
        if time.time() - path.lstat().st_mtime > seconds:
            path.unlink(missing_ok=True)
    except OSError:  # gone meanwhile; or not a file, which the next takeover reports again
        pass


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


def claim_run_folders(folders: dict[Path, str], is_main: bool) -> RunLocks | None:
    """Rank 0 takes the locks of `folders` (each with the option that chose it: one run per
    folder); every rank stops when it cannot (collective). Rank 0's locks, None elsewhere."""
    from trainer.dist import raise_on_every_rank  # on use: torch (the folder tests run without a process group)

    lock, error = (RunLocks(folders), None) if is_main else (None, None)
    if lock is not None:
        try:
            lock.acquire()
        except ValueError as e:
            error = str(e)
    raise_on_every_rank(error)
    return lock
