"""A run folder has one run at a time (docs/design.md §2.10).

`<run_dir>/.lock` names the run that holds the folder (host, pid, start time), and so does
`<folder>/.lock` of its checkpoint folder, wherever that points (`RunLocks`). A second run
stops with one line naming that holder. The holder refreshes its lock (every
`HEARTBEAT_SECONDS`); a lock is taken over, with a warning, once its holder is dead on this
host or it has not been refreshed for `STALE_SECONDS` (a holder on another host, a reused pid,
a hung run).

A lock appears whole (a hard link to a written sibling). Taking a lock over and releasing one
happen under `.lock.takeover`, a guard held with `fcntl.flock`: the kernel gives it to one
process at a time and takes it back from a process that dies, so a guard file left behind
means nothing, and no process ever deletes a guard another holds. Under it the claimant
judges the lock again, replaces it, and reads it back: of several runs that find the same
stale lock, exactly one takes it over, and a release never deletes the lock of the run that
took it over. A holder that finds its lock no longer its own (`RunLock.verify`, at every
heartbeat and at every check of the training loop) is told once (`on_lost`); a run stops at
once (`stop_run`), writing nothing more.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import BAD_INPUT
from trainer.run_layout import RunFolder

if TYPE_CHECKING:
    from trainer.config import CheckpointConfig

LOCK_FILE = ".lock"
GUARD_FILE = ".lock.takeover"
HEARTBEAT_SECONDS = 60.0
STALE_SECONDS = 600.0
GUARD_SECONDS = 30.0  # how long a run waits for another's takeover or release, microseconds of work, to end


class RunLock:
    """The exclusive claim of one run on its run folder (rank 0 holds it); `option` is the
    setting that chose the folder, for the error; `on_lost(why)` is called once if the lock
    turns out no longer this run's."""

    def __init__(self, folder: Path, option: str = "--train.run_dir", on_lost: Callable[[str], None] | None = None):
        self.path = Path(folder) / LOCK_FILE
        self.option = option
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": datetime.now(UTC).isoformat(timespec="seconds"),
                       "token": secrets.token_hex(8)}  # tells two claims of one process apart
        self.lost: str | None = None
        """Why this run no longer holds the folder (None: it does, as far as it has looked)."""
        self._on_lost = on_lost
        self._losing = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the folder, or raise ValueError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._create():
            text, held, mtime = self._read()
            if text is None:
                continue  # released meanwhile
            why = self._stale(held, mtime)
            if why is None:
                raise ValueError(self._in_use(held))
            if self._take_over(text):
                break
        self._heartbeat = threading.Thread(target=self._refresh, name="rankmix-run-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Give the folder up (only if this run still holds it)."""
        self._stop.set()
        if self._heartbeat is None:
            return
        self._heartbeat.join()
        self._heartbeat = None
        try:
            with self._guard():  # no takeover between the look and the unlink
                if self._read()[1] == self.holder:
                    self.path.unlink()
        except FileNotFoundError:  # the folder went away
            pass
        except ValueError as e:  # it goes stale in STALE_SECONDS
            print(f"rankmix: warning: {self.path} left in place: {e}", file=sys.stderr, flush=True)

    def verify(self) -> bool:
        """Whether this run still holds the folder; if not, `on_lost` is told why (once)."""
        why = self._lost()
        if why is None:
            return True
        with self._losing:
            if self.lost is None:
                self.lost = why
                self._stop.set()  # never keep alive a lock that another run took over
                if self._on_lost is not None:
                    self._on_lost(why)
        return False

    def _in_use(self, held: dict | None) -> str:
        if held is None:
            return f"{self.path}: unreadable lock file: delete it if no run holds {self.path.parent}"
        return (f"{self.path.parent} is in use by another run (host {held['host']}, pid {held['pid']}, "
                f"started {held.get('started')}): give this run a folder of its own ({self.option}). A lock is "
                f"taken over once it has not been refreshed for {STALE_SECONDS / 60:g} minutes")

    def _lost(self) -> str | None:
        """Why the lock is no longer this run's (None: it is, or it could not be read just now)."""
        text, held, _ = self._read()
        if held == self.holder:
            return None
        if text is None:
            what = "was removed"
        elif held is not None:
            what = f"was taken over by host {held['host']}, pid {held['pid']} (started {held.get('started')})"
        elif text == "":
            return None  # unreadable for a moment (a network filesystem): the next look decides
        else:
            what = "was overwritten by something that is not a rankmix lock"
        return f"{self.path} {what}; this run stops and writes nothing more"

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

    def _take_over(self, stale: str) -> bool:
        """Replace the lock that read `stale` by this run's, under the guard; whether this run
        holds the folder now (False: it changed meanwhile, and the caller judges it again)."""
        with self._guard():
            text, held, mtime = self._read()
            why = self._stale(held, mtime) if text == stale else None
            if why is None:  # taken, released or refreshed before this run got the guard
                return False
            print(f"rankmix: warning: taking over {self.path}: {why}", file=sys.stderr, flush=True)
            tmp = self._written()
            try:
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            return self._read()[1] == self.holder

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Hold `.lock.takeover` (flock), waiting up to GUARD_SECONDS for another holder.

        The guard file goes when its holder is done, unlinked while still held: a process that
        locked the unlinked file finds that the path names another file, or none, and tries again."""
        guard = self.path.with_name(GUARD_FILE)
        deadline = time.monotonic() + GUARD_SECONDS
        while True:
            try:
                fd = os.open(guard, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
            except FileNotFoundError:  # the folder went away: the caller's to say
                raise
            except OSError as e:  # a link or a folder planted there
                raise ValueError(f"{guard}: not a lock guard ({e.strerror}): move it away") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(fd, guard):
                    break
            except BlockingIOError:
                pass  # another process's takeover or release, microseconds long
            except OSError as e:
                os.close(fd)
                raise ValueError(f"{guard}: cannot lock it ({e.strerror}): the run folder's filesystem must "
                                 "support flock") from None
            os.close(fd)
            if time.monotonic() > deadline:
                raise ValueError(f"{guard} has been held by another process for {GUARD_SECONDS:g} s")
            time.sleep(0.002)
        try:
            yield
        finally:
            try:
                guard.unlink()
            finally:
                os.close(fd)

    def _read(self) -> tuple[str | None, dict | None, float]:
        """The lock's text (None: there is none), its holder (None: not a lock of rankmix's) and
        its refresh time, of one and the same file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None, None, 0.0
        except OSError:  # a link planted there, or a filesystem's error: unreadable, aged by its own time
            try:
                return "", None, self.path.lstat().st_mtime
            except OSError:
                return "", None, time.time()
        try:
            with os.fdopen(fd, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime
                text = f.read().decode()
        except (OSError, UnicodeDecodeError):
            return "", None, time.time()
        try:
            held = json.loads(text)
        except ValueError:
            return text, None, mtime
        ok = isinstance(held, dict) and isinstance(held.get("host"), str) and type(held.get("pid")) is int \
            and 0 < held["pid"] < 2 ** 31
        return text, held if ok else None, mtime

    def _stale(self, held: dict | None, mtime: float) -> str | None:
        """Why the lock `held`, last refreshed at `mtime`, is stale, or None while its holder may be alive."""
        if held is not None and held["host"] == self.holder["host"] and not _alive(held["pid"]):
            return f"its holder, pid {held['pid']} on this host, is gone"
        idle = time.time() - mtime
        if idle <= STALE_SECONDS:
            return None
        if held is None:
            return f"it is unreadable and has not been refreshed for {idle / 60:.0f} minutes"
        who = (f"pid {held['pid']} on this host" if held["host"] == self.holder["host"] else
               f"on host {held['host']}")
        return f"its holder {who} has not refreshed it for {idle / 60:.0f} minutes"

    def _refresh(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if not self.verify():
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # the folder went away: the next look finds the lock removed


class RunLocks:
    """RunLocks on several folders (each with the option that chose it), taken in order and
    given up together; a folder named twice is locked once."""

    def __init__(self, folders: dict[Path, str], on_lost: Callable[[str], None] | None = None):
        self.locks: list[RunLock] = []
        for folder, option in folders.items():
            if all(os.path.realpath(folder) != os.path.realpath(lock.path.parent) for lock in self.locks):
                self.locks.append(RunLock(folder, option, on_lost))

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

    def verify(self) -> bool:
        """Whether this run still holds every folder (`RunLock.verify`)."""
        return all([lock.verify() for lock in self.locks])  # each looks: each lost lock is told


def run_folders(run_dir: Path, checkpoint: CheckpointConfig) -> dict[Path, str]:
    """The folders a run writes, each with the option that chose it: the run folder, and the
    checkpoint folder wherever it points. The default `<run_dir>/checkpoints` is locked too: a
    run whose checkpoint.folder names it then collides with this run, not only with its run folder."""
    run = RunFolder(Path(run_dir), checkpoint_folder=checkpoint.folder)
    folders = {run.root: "--train.run_dir"}
    if not run.default_checkpoints:
        folders[run.checkpoints] = "--checkpoint.folder"
    elif checkpoint.enabled:  # else nothing is written or read there, and the folder is not made
        folders[run.checkpoints] = "--train.run_dir"
    return folders


_stopping = threading.Lock()


def stop_run(why: str) -> None:
    """End this process now, whatever its threads are doing, with `why` as its one line (exit
    code 2): a run that lost its folder to another must not write one more byte there (a
    checkpoint, a summary, a config), and a raised error would unwind through code that writes."""
    _stopping.acquire()  # a second caller (another lock, the loop's check) waits here for the end
    print(f"rankmix: error: {why}", file=sys.stderr, flush=True)
    os._exit(BAD_INPUT)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the one `path` names now."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


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
    folder); every rank stops when it cannot (collective). Rank 0's locks, None elsewhere; a
    lock found lost later stops the run at once (`stop_run`), and the other ranks with it (torchrun
    ends a job whose rank failed)."""
    from trainer.dist import raise_on_every_rank  # on use: torch (the folder tests run without a process group)

    lock, error = (RunLocks(folders, on_lost=stop_run), None) if is_main else (None, None)
    if lock is not None:
        try:
            lock.acquire()
        except ValueError as e:
            error = str(e)
    raise_on_every_rank(error)
    return lock
