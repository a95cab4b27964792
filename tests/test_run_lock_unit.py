"""trainer/checkpoint/run_folder.py in-process: what a lock holds and how it reads, when it is
stale and why, the takeover guard held by one process at a time, a release that leaves another
run's lock alone, the heartbeat and the several folders of one run. Fast: the mutation target
"run_folder" runs these (test_run_lock.py races real processes and runs `rankmix`)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

import trainer.dist  # noqa: F401 (claim_run_folders imports it on use: here once, not in each forked test)
from trainer.checkpoint import run_folder
from trainer.checkpoint.run_folder import (
    GUARD_FILE,
    LOCK_FILE,
    STALE_SECONDS,
    RunLock,
    RunLocks,
    _alive,
    _same_file,
    claim_run_folders,
    run_folders,
)
from trainer.config import CheckpointConfig

HOST = socket.gethostname()


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def plant(folder: Path, holder: dict | str, age: float = 0.0) -> dict | str:
    """A lock of another run in `folder`, last refreshed `age` seconds ago."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(holder if isinstance(holder, str) else json.dumps(holder))
    then = time.time() - age
    os.utime(folder / LOCK_FILE, (then, then))
    return holder


def holder_of(folder: Path) -> dict | None:
    try:
        return json.loads((folder / LOCK_FILE).read_text())
    except FileNotFoundError:
        return None


def gone_pid() -> int:
    """The pid of a process that ran here and was reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def zombie():
    """The pid of a process that exited and was not reaped yet."""
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "true did not exit"
        time.sleep(0.01)
    yield proc.pid
    proc.wait()


def buffered_stderr(monkeypatch) -> Callable[[], str]:
    """sys.stderr made a block-buffered stream (as a redirected stream may be), in the test's
    call (pytest's capture swaps it between phases); returns what reached its file: a line
    written but not flushed does not count, as os._exit loses it."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8"))
    return lambda: raw.getvalue().decode()


@pytest.fixture(autouse=True)
def no_signal_received():
    """Looking whether a process is alive sends it nothing: this process, looked at by several
    tests, records a SIGHUP (which would end it) and fails the test that sent one."""
    received: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert not received, "a signal was sent to this process"


@pytest.fixture
def fast_heartbeat(monkeypatch):
    monkeypatch.setattr(run_folder, "HEARTBEAT_SECONDS", 0.01)


# ----------------------------------------------------------------------------- holders alive or not


def test_alive_is_a_running_process_of_this_host_and_asks_it_nothing(tmp_path, zombie, monkeypatch):
    """A look that sent a signal would end the process it looks at."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert _alive(sleeper.pid)
        time.sleep(0.05)
        assert sleeper.poll() is None, "the look ended it"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _alive(os.getpid()) and _alive(1)
    assert not _alive(gone_pid()) and not _alive(zombie)
    named = tmp_path / "a) R"  # its /proc stat reads "pid (a) R) Z ...": the state follows the last ')'
    named.symlink_to("/bin/true")
    proc = subprocess.Popen([str(named)])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "it did not exit"
            time.sleep(0.01)
        assert "(a) R)" in Path(f"/proc/{proc.pid}/stat").read_text() and not _alive(proc.pid)
    finally:
        proc.wait()

    def not_ours(pid, signal):  # tests run as root here: every process is ours to signal
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "kill", not_ours)
    assert _alive(gone_pid())


# ----------------------------------------------------------------------------- taking and giving up


def test_a_lock_names_this_run_and_goes_with_its_release(tmp_path):
    folder = tmp_path / "a" / "run"
    lock = RunLock(folder)
    before = datetime.now(UTC).replace(microsecond=0)
    lock.acquire()
    held = holder_of(folder)
    assert held == lock.holder and held["host"] == HOST and held["pid"] == os.getpid()
    assert before <= datetime.fromisoformat(held["started"]) <= datetime.now(UTC)
    assert re.fullmatch(r"[0-9a-f]{16}", held["token"]) and held["token"] != RunLock(folder).holder["token"]
    assert names(folder) == [LOCK_FILE] and lock.lost is None and lock.verify()
    lock.release()
    assert names(folder) == []
    lock.release()  # twice: nothing more
    assert names(folder) == []


def test_a_held_folder_is_refused_naming_its_holder_and_the_option(tmp_path):
    other = plant(tmp_path, {"host": "elsewhere", "pid": 7, "started": "then"}, age=STALE_SECONDS - 30)
    with pytest.raises(ValueError) as e:
        RunLock(tmp_path, "--checkpoint.folder").acquire()
    assert str(e.value) == (f"{tmp_path} is in use by another run (host elsewhere, pid 7, started then): give this "
                            "run a folder of its own (--checkpoint.folder). A lock is taken over once it has not "
                            "been refreshed for 10 minutes")
    assert holder_of(tmp_path) == other and names(tmp_path) == [LOCK_FILE]
    with pytest.raises(ValueError, match=r"\(--train\.run_dir\)"):
        RunLock(tmp_path).acquire()


def test_a_fresh_unreadable_lock_is_refused(tmp_path):
    plant(tmp_path, "not a lock")
    with pytest.raises(ValueError) as e:
        RunLock(tmp_path).acquire()
    assert str(e.value) == f"{tmp_path / LOCK_FILE}: unreadable lock file: delete it if no run holds {tmp_path}"


@pytest.mark.parametrize("held, age, why", [
    ({"host": "elsewhere", "pid": 7, "started": "then"}, 3600, "its holder on host elsewhere has not refreshed it for "
                                                               "60 minutes"),
    ({"host": HOST, "pid": os.getpid()}, 3600, f"its holder pid {os.getpid()} on this host has not refreshed it "
                                               "for 60 minutes"),
    ("not a lock", 3600, "it is unreadable and has not been refreshed for 60 minutes"),
    ({"host": HOST, "pid": None}, 0, "its holder, pid {pid} on this host, is gone"),
], ids=["other-host", "hung", "unreadable", "dead"])
def test_a_stale_lock_is_taken_over_saying_why(tmp_path, monkeypatch, held, age, why):
    stderr = buffered_stderr(monkeypatch)
    pid = gone_pid()
    if isinstance(held, dict) and held["pid"] is None:
        held = {**held, "pid": pid}
    plant(tmp_path, held, age)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert holder_of(tmp_path) == lock.holder and names(tmp_path) == [LOCK_FILE]
        assert stderr() == f"rankmix: warning: taking over {tmp_path / LOCK_FILE}: " \
                                          f"{why.format(pid=pid)}\n"
    finally:
        lock.release()
    assert names(tmp_path) == []


def test_a_zombie_holder_on_this_host_is_gone(tmp_path, capsys, zombie):
    """Exited, not yet reaped by its parent: it holds nothing, though `kill(pid, 0)` still finds it."""
    assert not _alive(zombie)
    plant(tmp_path, {"host": HOST, "pid": zombie, "started": "then"})
    lock = RunLock(tmp_path)
    lock.acquire()
    assert holder_of(tmp_path) == lock.holder
    assert capsys.readouterr().err == (f"rankmix: warning: taking over {tmp_path / LOCK_FILE}: its holder, pid "
                                       f"{zombie} on this host, is gone\n")
    lock.release()


def test_a_live_holder_on_this_host_or_a_dead_one_elsewhere_holds_until_stale(tmp_path):
    for held in ({"host": HOST, "pid": os.getpid()}, {"host": "elsewhere", "pid": gone_pid()}):
        plant(tmp_path, held, age=STALE_SECONDS - 30)
        with pytest.raises(ValueError, match="is in use by another run"):
            RunLock(tmp_path).acquire()


def test_a_lock_released_between_the_claim_and_the_look_is_claimed_again(tmp_path, monkeypatch):
    """The holder releases just after this run's claim failed: the next claim takes the free folder."""
    lock, create = RunLock(tmp_path), RunLock._create
    calls = []

    def create_once_held(self):
        calls.append(1)
        if len(calls) > 1:
            return create(self)
        plant(tmp_path, {"host": "elsewhere", "pid": 7})
        claimed = create(self)
        (tmp_path / LOCK_FILE).unlink()  # released
        return claimed
    monkeypatch.setattr(RunLock, "_create", create_once_held)
    lock.acquire()
    assert len(calls) == 2 and holder_of(tmp_path) == lock.holder
    lock.release()


def test_a_takeover_of_a_lock_changed_meanwhile_takes_nothing(tmp_path, capsys):
    old = json.dumps({"host": "elsewhere", "pid": 7})
    lock = RunLock(tmp_path)
    plant(tmp_path, {"host": "elsewhere", "pid": 8}, age=3600)  # another stale lock now
    assert not lock._take_over(old) and holder_of(tmp_path) == {"host": "elsewhere", "pid": 8}
    plant(tmp_path, old)  # the same, refreshed
    assert not lock._take_over(old) and holder_of(tmp_path) == json.loads(old)
    plant(tmp_path, old, age=3600)
    assert lock._take_over(old) and holder_of(tmp_path) == lock.holder
    assert names(tmp_path) == [LOCK_FILE] and capsys.readouterr().err.count("taking over") == 1


def test_a_claim_on_a_filesystem_without_hard_links_is_made_in_place(tmp_path, monkeypatch):
    """Hard links fail with EPERM there (this filesystem has them: os.link is made to fail)."""
    def no_link(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_link)
    lock = RunLock(tmp_path)
    assert lock._create() and holder_of(tmp_path) == lock.holder and names(tmp_path) == [LOCK_FILE]
    assert not RunLock(tmp_path)._create() and holder_of(tmp_path) == lock.holder
    assert names(tmp_path) == [LOCK_FILE]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / LOCK_FILE).st_mode & 0o777 == 0o644 & ~umask


# ----------------------------------------------------------------------------- release and loss


def test_a_release_leaves_the_lock_of_the_run_that_took_it_over(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    other = plant(tmp_path, {"host": "elsewhere", "pid": 7, "started": "now"})
    lock.release()
    assert holder_of(tmp_path) == other and names(tmp_path) == [LOCK_FILE]


def test_a_release_of_a_lock_never_taken_removes_nothing(tmp_path):
    other = plant(tmp_path, {"host": HOST, "pid": os.getpid()})
    RunLock(tmp_path).release()
    assert holder_of(tmp_path) == other


def test_a_release_after_the_folder_went_away_is_quiet(tmp_path, capsys):
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    (tmp_path / "run" / LOCK_FILE).unlink()
    (tmp_path / "run").rmdir()
    lock.release()
    assert capsys.readouterr().err == "" and not (tmp_path / "run").exists()


def test_a_release_that_cannot_take_the_guard_leaves_the_lock_saying_so(tmp_path, monkeypatch):
    stderr = buffered_stderr(monkeypatch)
    lock = RunLock(tmp_path)
    lock.acquire()
    (tmp_path / GUARD_FILE).mkdir()
    lock.release()
    assert holder_of(tmp_path) == lock.holder
    assert stderr() == (f"rankmix: warning: {tmp_path / LOCK_FILE} left in place: "
                                       f"{tmp_path / GUARD_FILE}: not a lock guard (Is a directory): move it away\n")


@pytest.mark.parametrize("change, what", [
    (lambda path: path.unlink(), "was removed"),
    (lambda path: path.write_text(json.dumps({"host": "h", "pid": 9, "started": "s"})),
     "was taken over by host h, pid 9 (started s)"),
    (lambda path: path.write_text(json.dumps({"host": "h", "pid": 9})),
     "was taken over by host h, pid 9 (started None)"),
    (lambda path: path.write_text("[]"), "was overwritten by something that is not a rankmix lock"),
], ids=["removed", "taken", "taken-no-start", "overwritten"])
def test_a_lost_lock_is_told_once_and_stops_the_heartbeat(tmp_path, change, what):
    told = []
    lock = RunLock(tmp_path, on_lost=told.append)
    lock.acquire()
    change(tmp_path / LOCK_FILE)
    why = f"{tmp_path / LOCK_FILE} {what}; this run stops and writes nothing more"
    assert not lock.verify() and not lock.verify()
    assert told == [why] and lock.lost == why and lock._stop.is_set()
    lock.release()
    assert not RunLock(tmp_path).verify()  # without on_lost: just the answer


def test_a_lock_unreadable_for_a_moment_is_not_lost(tmp_path):
    lock = RunLock(tmp_path, on_lost=lambda why: pytest.fail(why))
    lock.acquire()
    (tmp_path / LOCK_FILE).write_bytes(b"\xff\xfe")
    assert lock.verify() and lock.lost is None
    (tmp_path / LOCK_FILE).write_text(json.dumps(lock.holder))
    lock.release()
    assert names(tmp_path) == []


def test_the_heartbeat_refreshes_the_lock(tmp_path, fast_heartbeat):
    lock = RunLock(tmp_path)
    lock.acquire()
    then = time.time() - 3600
    os.utime(tmp_path / LOCK_FILE, (then, then))
    deadline = time.monotonic() + 10
    while os.stat(tmp_path / LOCK_FILE).st_mtime == then:
        assert time.monotonic() < deadline, "not refreshed"
        time.sleep(0.01)
    assert lock._heartbeat.name == "rankmix-run-lock" and lock._heartbeat.daemon
    lock.release()
    assert names(tmp_path) == [] and lock._heartbeat is None


def test_the_heartbeat_of_a_lost_lock_tells_the_run_and_refreshes_it_no_more(tmp_path, fast_heartbeat):
    told = threading.Event()
    lock = RunLock(tmp_path, on_lost=lambda why: told.set())
    lock.acquire()
    other = plant(tmp_path, {"host": "elsewhere", "pid": 7}, age=120)
    assert told.wait(10)
    mtime = os.stat(tmp_path / LOCK_FILE).st_mtime
    time.sleep(0.05)
    assert os.stat(tmp_path / LOCK_FILE).st_mtime == mtime and not lock._heartbeat.is_alive()
    lock.release()
    assert holder_of(tmp_path) == other


# ----------------------------------------------------------------------------- reading a lock


@pytest.mark.parametrize("text, valid", [
    ({"host": "h", "pid": 1}, True), ({"host": "h", "pid": 2 ** 31 - 1, "started": "s"}, True),
    ({"host": "h", "pid": 0}, False), ({"host": "h", "pid": 2 ** 31}, False), ({"host": "h", "pid": -1}, False),
    ({"host": "h", "pid": True}, False), ({"host": "h", "pid": 1.0}, False), ({"host": "h", "pid": "1"}, False),
    ({"host": 1, "pid": 1}, False), ({"pid": 1}, False), ({"host": "h"}, False), ([], False), ("not json", False),
], ids=["pid-1", "pid-max", "pid-0", "pid-2^31", "pid-negative", "pid-bool", "pid-float", "pid-str", "host-int",
        "no-host", "no-pid", "list", "not-json"])
def test_a_lock_is_rankmixs_only_with_a_host_and_a_pid(tmp_path, text, valid):
    text = text if isinstance(text, str) else json.dumps(text)
    plant(tmp_path, text, age=60)
    mtime = os.stat(tmp_path / LOCK_FILE).st_mtime
    assert RunLock(tmp_path)._read() == (text, json.loads(text) if valid else None, mtime)


def test_a_missing_link_or_undecodable_lock_reads_as_such(tmp_path):
    lock = RunLock(tmp_path)
    assert lock._read() == (None, None, 0.0)
    (tmp_path / "target").write_text(json.dumps({"host": "h", "pid": 1}))
    (tmp_path / LOCK_FILE).symlink_to("target")
    os.utime(tmp_path / LOCK_FILE, (1000, 1000), follow_symlinks=False)
    assert lock._read() == ("", None, 1000)  # a link planted there is not followed, and ages by its own time
    (tmp_path / LOCK_FILE).unlink()
    plant(tmp_path, "x", age=3600)
    (tmp_path / LOCK_FILE).write_bytes(b"\xff")
    text, held, mtime = lock._read()
    assert (text, held) == ("", None) and abs(mtime - time.time()) < 5  # unreadable just now: as if fresh
    text, held, mtime = RunLock(tmp_path / ("x" * 300))._read()  # a name too long: neither opened nor found
    assert (text, held) == ("", None) and abs(mtime - time.time()) < 5


# ----------------------------------------------------------------------------- the guard


def test_while_held_the_guard_is_the_file_its_path_names_and_goes_after(tmp_path):
    """Another process opening the guard's path finds it locked: not a file unlinked meanwhile."""
    lock = RunLock(tmp_path)
    with lock._guard():
        fd = os.open(tmp_path / GUARD_FILE, os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert names(tmp_path) == []
    with lock._guard():  # taken again
        pass
    assert names(tmp_path) == []


def test_a_guard_unlinked_by_its_last_holder_before_this_lock_on_it_is_made_again(tmp_path, monkeypatch):
    """The last holder unlinks the guard between this run's open and its flock: this run holds
    an unlinked file, which guards nothing, and must open the path again."""
    flock, calls = fcntl.flock, []

    def flock_after_unlink(fd, op):
        calls.append(op)
        if len(calls) == 1:
            (tmp_path / GUARD_FILE).unlink()
        return flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock_after_unlink)
    with RunLock(tmp_path)._guard():
        monkeypatch.setattr(fcntl, "flock", flock)
        assert len(calls) == 2 and (tmp_path / GUARD_FILE).exists()
        fd = os.open(tmp_path / GUARD_FILE, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert names(tmp_path) == []


def test_a_guard_held_by_another_process_is_waited_for_then_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "GUARD_SECONDS", 0.05)
    fd = os.open(tmp_path / GUARD_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError) as e, RunLock(tmp_path)._guard():
            pass
        assert str(e.value) == f"{tmp_path / GUARD_FILE} has been held by another process for 0.05 s"
        assert time.monotonic() - start >= 0.05
    finally:
        os.close(fd)
    assert names(tmp_path) == [GUARD_FILE]  # another's: left alone


def test_a_guard_released_while_waited_for_is_taken(tmp_path):
    fd = os.open(tmp_path / GUARD_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    timer = threading.Timer(0.05, lambda: ((tmp_path / GUARD_FILE).unlink(), os.close(fd)))
    timer.start()
    with RunLock(tmp_path)._guard():
        assert (tmp_path / GUARD_FILE).exists()
    timer.join()
    assert names(tmp_path) == []


def test_a_planted_guard_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / GUARD_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError) as e, RunLock(tmp_path)._guard():
        pass
    assert str(e.value) == (f"{tmp_path / GUARD_FILE}: not a lock guard (Too many levels of symbolic links): move "
                            "it away")
    with pytest.raises(FileNotFoundError), RunLock(tmp_path / "gone")._guard():
        pass


def test_same_file_is_the_file_a_path_names_now(tmp_path):
    path = tmp_path / "f"
    path.write_text("")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _same_file(fd, path)
        (tmp_path / "g").write_text("")
        os.replace(tmp_path / "g", path)
        assert not _same_file(fd, path)
        path.unlink()
        assert not _same_file(fd, path)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- a run's folders


def test_a_run_locks_its_folder_and_its_checkpoint_folder_wherever_it_points(tmp_path):
    run = tmp_path / "run"
    assert run_folders(run, CheckpointConfig()) == {run: "--train.run_dir", run / "checkpoints": "--train.run_dir"}
    assert run_folders(run, CheckpointConfig(folder=str(tmp_path / "ck"))) == {
        run: "--train.run_dir", tmp_path / "ck": "--checkpoint.folder"}
    assert run_folders(run, CheckpointConfig(enabled=False)) == {run: "--train.run_dir"}
    assert run_folders(run, CheckpointConfig(enabled=False, folder=str(tmp_path / "ck"))) == {
        run: "--train.run_dir", tmp_path / "ck": "--checkpoint.folder"}


def test_several_folders_are_locked_once_each_and_released_together(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to("a")
    locks = RunLocks({tmp_path / "a": "--x", tmp_path / "link": "--y", tmp_path / "b": "--z"})
    assert [(lock.path.parent, lock.option) for lock in locks.locks] == [(tmp_path / "a", "--x"),
                                                                        (tmp_path / "b", "--z")]
    locks.acquire()
    assert holder_of(tmp_path / "a") == locks.locks[0].holder and holder_of(tmp_path / "b") == locks.locks[1].holder
    assert locks.verify()
    locks.release()
    assert names(tmp_path / "a") == [] and names(tmp_path / "b") == []


def test_a_folder_held_by_another_releases_those_taken_before_it(tmp_path):
    other = plant(tmp_path / "b", {"host": "elsewhere", "pid": 7, "started": "then"})
    locks = RunLocks({tmp_path / "a": "--x", tmp_path / "b": "--z", tmp_path / "c": "--w"})
    with pytest.raises(ValueError, match=r"^\S+/b is in use by another run .* \(--z\)"):
        locks.acquire()
    assert names(tmp_path / "a") == [] and holder_of(tmp_path / "b") == other and not (tmp_path / "c").exists()


def test_every_lost_folder_of_a_run_is_told(tmp_path):
    told = []
    locks = RunLocks({tmp_path / "a": "--x", tmp_path / "b": "--z"}, on_lost=told.append)
    locks.acquire()
    for name in ("a", "b"):
        (tmp_path / name / LOCK_FILE).unlink()
    assert not locks.verify()
    assert told == [f"{tmp_path / n / LOCK_FILE} was removed; this run stops and writes nothing more" for n in "ab"]
    locks.release()


def test_claiming_takes_the_folders_on_rank_0_only(tmp_path):
    locks = claim_run_folders({tmp_path / "a": "--x"}, is_main=True)
    assert holder_of(tmp_path / "a") == locks.locks[0].holder and locks.locks[0]._on_lost is run_folder.stop_run
    assert claim_run_folders({tmp_path / "a": "--x"}, is_main=False) is None
    with pytest.raises(ValueError) as e:
        claim_run_folders({tmp_path / "a": "--y"}, is_main=True)
    assert str(e.value).startswith(f"{tmp_path / 'a'} is in use by another run (host {HOST}, pid {os.getpid()}")
    locks.release()


class Exited(BaseException):
    pass


def test_a_run_that_lost_its_folder_says_why_in_one_line_and_exits_2(monkeypatch):
    """In this process, os._exit made to raise (it cannot end the test run); the next test ends a real process."""
    def exit_(code):
        raise Exited(code)
    monkeypatch.setattr(os, "_exit", exit_)
    stderr = buffered_stderr(monkeypatch)
    try:
        with pytest.raises(Exited) as e:
            run_folder.stop_run("it went")
    finally:
        run_folder._stopping.release()
    assert e.value.args == (2,) and stderr() == "rankmix: error: it went\n"  # flushed: os._exit flushes nothing


def test_a_run_that_lost_its_folder_ends_at_once_with_one_line(tmp_path):
    """In a forked child: stop_run ends the process (exit 2) whatever its threads do."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        sys.stderr = open(write, "w")
        try:
            run_folder.stop_run("it went")
        finally:
            os._exit(99)
    os.close(write)
    with os.fdopen(read) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2 and err == "rankmix: error: it went\n"
