"""One run holds a folder, by construction (trainer/checkpoint/run_folder.py), issue 55 finding 5.

Several runs that find one stale lock (and a stale takeover guard beside it) take it over
one at a time under an flock'd guard: exactly one acquires. A run that lost its lock
stops at once with one line, releases nothing of the new holder's and writes nothing more;
and a run's checkpoint folder, the default `<run_dir>/checkpoints` included, is locked."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from cli import REPO, rankmix, read_output, run_env, start_rankmix
from test_trust import TRAIN, copy_run, run  # noqa: F401 (the module's short run, made once per session)
from trainer.checkpoint import run_folder
from trainer.checkpoint.manager import complete_steps
from trainer.checkpoint.run_folder import GUARD_FILE, LOCK_FILE, STALE_SECONDS, RunLock

CLAIMANTS, ROUNDS = 8, 50
RACES = 60


def _stale(folder: Path) -> None:
    """A lock of a run on another host, and a takeover guard, neither touched for an hour."""
    for name in (GUARD_FILE, LOCK_FILE):
        (folder / name).unlink(missing_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
    (folder / GUARD_FILE).write_text("")
    then = time.time() - 3600
    for name in (GUARD_FILE, LOCK_FILE):
        os.utime(folder / name, (then, then))


def _slow_metadata() -> None:
    """This process's file metadata reads take up to 2 ms (a network filesystem, a busy
    disk): the claimants' steps interleave in every order, as they do at random, and rarely,
    on a fast disk."""
    def slowed(real):
        def slow(*args, **kwargs):
            found = real(*args, **kwargs)
            time.sleep(random.uniform(0, 0.002))
            return found
        return slow

    for name in ("stat", "lstat", "fstat"):
        setattr(os, name, slowed(getattr(os, name)))


def _claimant(folder: str, rounds: int, barrier, results) -> None:
    """In a process of its own: each round, try to take the folder, report, then give it up."""
    _slow_metadata()
    for r in range(rounds):
        barrier.wait()  # the stale lock is planted
        lock, took = RunLock(Path(folder)), False
        try:
            lock.acquire()
            took = True
            results.put((r, os.getpid(), lock.holder))
        except ValueError as e:
            results.put((r, os.getpid(), str(e)))
        barrier.wait()  # everyone has answered: the test reads the lock
        barrier.wait()  # read
        if took:
            lock.release()
        barrier.wait()  # released


def test_of_many_processes_finding_a_stale_lock_and_guard_exactly_one_acquires(tmp_path, capfd):
    """The review's attack, with real processes: on every round one claimant holds the folder
    and the lock names it; the others stop naming it as the holder."""
    ctx = multiprocessing.get_context("fork")  # the children only open, link, rename and lock files
    barrier, results = ctx.Barrier(CLAIMANTS + 1), ctx.Queue()
    procs = [ctx.Process(target=_claimant, args=(str(tmp_path), ROUNDS, barrier, results)) for _ in range(CLAIMANTS)]
    for p in procs:
        p.start()
    wrong = []
    try:
        for r in range(ROUNDS):
            _stale(tmp_path)
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
            answers = [results.get(timeout=10) for _ in range(CLAIMANTS)]
            took = [holder for _, _, holder in answers if isinstance(holder, dict)]
            refused = [e for _, _, e in answers if isinstance(e, str)]
            on_disk = json.loads((tmp_path / LOCK_FILE).read_text())
            if len(took) != 1 or on_disk != took[0] or not all(
                    e.startswith(f"{tmp_path} is in use by another run (host {on_disk['host']}, pid {on_disk['pid']}")
                    for e in refused):
                wrong.append(f"round {r}: {len(took)} acquired; {refused[:1]}")
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
    except BaseException:
        barrier.abort()  # the claimants stop waiting
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not wrong, f"{len(wrong)} of {ROUNDS} rounds did not end with one holder: {wrong[:3]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # released; no guard or temporary file left
    err = capfd.readouterr().err.splitlines()
    assert err == [f"rankmix: warning: taking over {tmp_path / LOCK_FILE}: its holder on host elsewhere has not "
                   f"refreshed it for 60 minutes"] * ROUNDS


def _another(lock: RunLock, host: str = "elsewhere", pid: int = 7) -> dict:
    """Put the lock of another run over `lock`'s, whole, as its takeover does; that run's claim."""
    other = {"host": host, "pid": pid, "started": "now"}
    tmp = lock.path.with_name("replacing")
    tmp.write_text(json.dumps(other))
    os.replace(tmp, lock.path)
    return other


def _holder_of(folder: Path) -> dict | None:
    try:
        return json.loads((folder / LOCK_FILE).read_text())
    except FileNotFoundError:
        return None


def test_a_zombie_holder_is_taken_over(tmp_path, capsys):
    """A holder that exited but was not yet reaped by its parent holds nothing."""
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "true did not exit"
            time.sleep(0.01)
        lock = RunLock(tmp_path)
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": lock.holder["host"], "pid": zombie.pid,
                                                      "started": "then"}))  # refreshed just now
        lock.acquire()
        assert _holder_of(tmp_path) == lock.holder
        assert capsys.readouterr().err == (f"rankmix: warning: taking over {tmp_path / LOCK_FILE}: its holder, pid "
                                           f"{zombie.pid} on this host, is gone\n")
        lock.release()
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    finally:
        zombie.wait()


def test_a_holder_whose_lock_was_taken_over_is_told_once_and_releases_nothing(tmp_path, monkeypatch):
    """Its heartbeat finds the lock another's: it tells the run (which stops), refreshes it no
    more, and its release leaves the new holder's lock as it is."""
    monkeypatch.setattr(run_folder, "HEARTBEAT_SECONDS", 0.01)
    told, lost = [], threading.Event()
    lock = RunLock(tmp_path, on_lost=lambda why: (told.append(why), lost.set()))
    lock.acquire()
    assert lock.verify() and not told
    other = _another(lock)
    then = time.time() - 120
    os.utime(lock.path, (then, then))
    assert lost.wait(10), "the heartbeat did not notice"
    time.sleep(0.05)  # five heartbeats more, were it still beating
    why = f"{lock.path} was taken over by host elsewhere, pid 7 (started now); this run stops and writes nothing more"
    assert not lock.verify() and told == [why] and lock.lost == why
    assert os.stat(lock.path).st_mtime == then  # not refreshed for the other run
    lock.release()
    assert _holder_of(tmp_path) == other and sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


def test_a_release_racing_a_takeover_never_deletes_the_new_holders_lock(tmp_path, monkeypatch):
    """A run that stopped refreshing gives its folder up at any moment of another's takeover
    (reading the lock takes up to 2 ms): the lock that stays is the new holder's, every time. Unguarded,
    the release read its own lock, the takeover replaced it, and the release deleted the new one."""
    def slow_loads(text: str):
        time.sleep(random.uniform(0, 0.002))
        return json.loads(text)
    monkeypatch.setattr(run_folder, "json", SimpleNamespace(loads=slow_loads, dumps=json.dumps, dump=json.dump))
    wrong = []
    for i in range(RACES):
        old, new = RunLock(tmp_path), RunLock(tmp_path)
        old.acquire()
        then = time.time() - STALE_SECONDS - 60
        os.utime(old.path, (then, then))  # paused for 11 minutes
        start = threading.Barrier(2)
        threads = [threading.Thread(target=lambda start=start, old=old: (
                       start.wait(), time.sleep(random.uniform(0, 0.004)), old.release())),
                   threading.Thread(target=lambda start=start, new=new: (start.wait(), new.acquire()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if _holder_of(tmp_path) != new.holder:
            wrong.append(f"race {i}: the lock names {_holder_of(tmp_path)}")
        new.release()
    assert not wrong, f"{len(wrong)} of {RACES} races lost the new holder's lock: {wrong[:2]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _wait_for(what: str, found, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not found():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.01)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _steps_logged(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line).get("step", 0) for line in lines if line.endswith("}")), default=0)


def test_a_run_whose_lock_is_taken_over_mid_run_stops_and_writes_nothing_more(run, tmp_path):  # noqa: F811
    """Resumed at step 4, it trains; its run folder's lock is taken over (as after a pause of
    10 minutes): at its next check it stops with one line, exit 2, and saves no checkpoint,
    summary or lock of its own again."""
    copied = copy_run(run, tmp_path)
    summary = (copied / "summary.json").read_bytes()
    out, err = tmp_path / "out", tmp_path / "err"
    child = start_rankmix(["train", *TRAIN, f"--train.run_dir={copied}", f"--data.cache_dir={run.parent / 'data'}",
                           "--train.steps=3000", "--checkpoint.interval=0", "--train.check_every=1",
                           "--metrics.log_every=1"], REPO, run_env(), out, err)
    try:
        _wait_for("training after the resume", lambda: _steps_logged(copied) >= 6 or not child.is_alive())
        other = _another(RunLock(copied))
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    stderr = read_output(err)
    assert child.exitcode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"rankmix: error: {copied / LOCK_FILE} was taken over by host "
                                               f"elsewhere, pid 7 (started now); this run stops and writes nothing "
                                               f"more")
    assert complete_steps(copied / "checkpoints") == [2, 4] and sorted(
        p.name for p in (copied / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
    assert (copied / "summary.json").read_bytes() == summary and _holder_of(copied) == other


def test_a_checkpoint_folder_set_to_another_runs_default_one_is_refused_while_it_runs(run, tmp_path):  # noqa: F811
    """Run A uses its default `checkpoints/`; run B, pointed at it by checkpoint.folder,
    stops naming A and writes nothing there."""
    a, b = tmp_path / "a", tmp_path / "b"
    out, err = tmp_path / "out", tmp_path / "err"
    first = start_rankmix(["train", *TRAIN, f"--train.run_dir={a}", f"--data.cache_dir={run.parent / 'data'}",
                           "--train.steps=3000", "--checkpoint.interval=0"], REPO, run_env(), out, err)
    try:
        _wait_for("training in run A", lambda: (a / "metrics.jsonl").exists() or not first.is_alive())
        assert first.is_alive(), read_output(err)[-3000:]
        os.kill(first.pid, signal.SIGSTOP)  # holds its folders, costs nothing meanwhile
        before = _names(a / "checkpoints")
        proc = rankmix("train", *TRAIN, f"--train.run_dir={b}", f"--checkpoint.folder={a / 'checkpoints'}",
                       f"--data.cache_dir={run.parent / 'data'}")
        held = _holder_of(a)
    finally:
        first.kill()
        first.join()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"rankmix: error: {a / 'checkpoints'} is in use by another run (host {held['host']}, pid {first.pid}, "
        f"started {held['started']}): give this run a folder of its own (--checkpoint.folder).")
    assert _names(a / "checkpoints") == before == [LOCK_FILE]
    assert not (b / LOCK_FILE).exists()
