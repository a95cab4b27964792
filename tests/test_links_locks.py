"""Nothing is deleted through a link (trainer/checkpoint/links.py `swap_folder`), and one run holds a run
folder, or a checkpoint folder, at a time (trainer/checkpoint/run_folder.py), issue 38 findings 3 and 10.

`best` and the publish folder's `.weights` are links that rankmix renames onto a sibling
`<link>.step-N` folder, deleting the folder the link named before: a link of any other shape
(planted, pointing anywhere) is refused in one line, and what it points at survives."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli import rankmix
from test_trust import TRAIN, run  # noqa: F401 (the module's short run, made once per session)
from trainer.checkpoint import run_folder
from trainer.checkpoint.links import check_swap, swap_folder
from trainer.checkpoint.run_folder import LOCK_FILE, STALE_SECONDS, RunLock, RunLocks


def _outside(tmp_path: Path) -> Path:
    """Someone's folder outside the run, with a file in it."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    return folder


def _step(folder: Path, name: str) -> Path:
    """A sibling save `name` with a `.metadata`, as manager.save_weights writes."""
    (folder / name).mkdir(parents=True)
    (folder / name / ".metadata").write_text(name)
    return folder / name


def _refused(link: Path, target: str) -> str:
    return (f"{link} is a link to {target}, not to a folder {link.name}.step-N of rankmix's beside it: "
            f"refused to replace it (nothing was deleted); move it away")


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("name", ["best", ".weights"])
@pytest.mark.parametrize("kind", ["absolute", "relative", "sibling", "link-to-link", "own-name-file"])
def test_a_link_of_another_shape_deletes_nothing(tmp_path, name, kind):
    """`best` (model selection) and `.weights` (publish, through manager.save_weights) point
    at anything but an own sibling folder: refused, naming the link and its target; the link,
    its target and the new save stay as they were."""
    outside, folder = _outside(tmp_path), tmp_path / "run"
    new = _step(folder, f"{name}.step-7")
    sibling = _step(folder, "checkpoints")  # a real folder of the run, not one of the link's
    os.symlink(outside, folder / f"{name}.step-3")
    (folder / f"{name}.step-4").write_text("a file")
    target = {"absolute": str(outside), "relative": "../outside", "sibling": "checkpoints",
              "link-to-link": f"{name}.step-3", "own-name-file": f"{name}.step-4"}[kind]
    link = folder / name
    os.symlink(target, link)
    with pytest.raises(ValueError) as e:
        swap_folder(link, new)
    assert str(e.value) == _refused(link, target)
    assert os.readlink(link) == target
    assert (outside / "precious").read_text() == "keep me" and (sibling / ".metadata").exists()
    assert (new / ".metadata").exists() and (folder / f"{name}.step-4").read_text() == "a file"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".link")) == []


@pytest.mark.parametrize("name", ["best", ".weights"])
def test_the_own_link_moves_and_its_old_folder_goes(tmp_path, name):
    folder = tmp_path / "run"
    for step, tag in ((3, ""), (5, ""), (5, ".calibrated")):
        new = _step(folder, f"{name}.step-{step}{tag}")
        swap_folder(folder / name, new)
        assert os.readlink(folder / name) == new.name and (folder / name / ".metadata").read_text() == new.name
    assert sorted(p.name for p in folder.iterdir()) == sorted([name, f"{name}.step-5.calibrated"])


def test_a_new_save_that_is_a_link_is_neither_written_nor_linked_to(tmp_path):
    """A `best.step-N` planted as a link to elsewhere: manager.save_weights checks before it
    writes (check_swap), and `best` is not pointed at it."""
    outside, folder = _outside(tmp_path), tmp_path / "run"
    old = _step(folder, "best.step-3")
    swap_folder(folder / "best", old)
    os.symlink(outside, folder / "best.step-7")
    refused = (f"{folder / 'best.step-7'} is a link to {outside}, not a folder of rankmix's: refused to write or "
               f"link to it (nothing was deleted); move it away")
    for check in (check_swap, swap_folder):
        with pytest.raises(ValueError) as e:
            check(folder / "best", folder / "best.step-7")
        assert str(e.value) == refused
    assert os.readlink(folder / "best") == "best.step-3" and (old / ".metadata").exists()
    assert sorted(p.name for p in outside.iterdir()) == ["precious"]


def test_a_real_folder_in_the_links_place_is_replaced_only_when_it_is_a_save(tmp_path):
    """A `best` folder holding a DCP save is rankmix's own layout from before `best` became a
    link: replaced. Any other folder, or a file, is someone's: refused, and it survives."""
    folder = tmp_path / "run"
    _step(folder, "best")
    swap_folder(folder / "best", _step(folder, "best.step-2"))
    assert os.readlink(folder / "best") == "best.step-2"

    (folder / "publish").mkdir()
    (folder / "publish" / ".weights").mkdir()
    (folder / "publish" / ".weights" / "notes").write_text("mine")
    with pytest.raises(ValueError, match=rf"^{folder / 'publish' / '.weights'} is a folder that holds no checkpoint "
                                         r"\(\.metadata\), not rankmix's: refused to replace it \(nothing was "
                                         r"deleted\); move it away$"):
        swap_folder(folder / "publish" / ".weights", _step(folder / "publish", ".weights.step-4"))
    assert (folder / "publish" / ".weights" / "notes").read_text() == "mine"

    (folder / "best.step-2").rename(folder / "kept")
    (folder / "best").unlink()
    (folder / "best").write_text("a file")
    with pytest.raises(ValueError, match=rf"^{folder / 'best'} is a file, not rankmix's link: refused to replace it"):
        swap_folder(folder / "best", _step(folder, "best.step-6"))
    assert (folder / "best").read_text() == "a file"


@pytest.mark.parametrize("planted", ["best", "best.step-2"])
def test_a_training_with_a_planted_best_link_stops_and_touches_nothing(run, tmp_path, planted):  # noqa: F811
    """The attack of issue 38: `ln -s /some/dir RUN/best`, then a training with validation
    (its one validation, after step 2, saves `best.step-2`). Refused before the save: the
    folder is neither deleted nor written into."""
    outside, folder = _outside(tmp_path), tmp_path / "run"
    folder.mkdir()
    os.symlink(outside, folder / planted)
    proc = rankmix("train", *TRAIN, "--train.steps=2", "--data.valid_fraction=0.1", f"--train.run_dir={folder}",
                   f"--data.cache_dir={run.parent / 'data'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    refused = _refused(folder / "best", str(outside)) if planted == "best" else (
        f"{folder / planted} is a link to {outside}, not a folder of rankmix's: refused to write or link to it "
        f"(nothing was deleted); move it away")
    assert proc.stderr.strip().splitlines()[-1] == f"rankmix: error: {refused}"
    assert sorted(p.name for p in outside.iterdir()) == ["precious"] and (outside / "precious").read_text() == "keep me"
    assert os.readlink(folder / planted) == str(outside) and not (folder / LOCK_FILE).exists()


# ----------------------------------------------------------------------------- locks


def _plant(folder: Path, lock: RunLock, pid: int, age: float = 0.0) -> None:
    """A lock of `pid` on this host, last refreshed `age` seconds ago."""
    folder.mkdir(exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"host": lock.holder["host"], "pid": pid, "started": "then"}))
    then = time.time() - age
    os.utime(folder / LOCK_FILE, (then, then))


def _holds(lock: RunLock) -> bool:
    try:
        return json.loads(lock.path.read_text()) == lock.holder
    except ValueError:  # the old code's lock, caught while it was being written
        return False


def _takeover_race(folder: Path, pid: int) -> tuple[list[RunLock], list[str]]:
    """Two runs that find the lock of dead `pid` in `folder` at once: those whose acquire
    returned, and the errors of the others."""
    locks = [RunLock(folder), RunLock(folder)]
    _plant(folder, locks[0], pid)
    start, took, refused = threading.Barrier(2), [], []

    def take(lock: RunLock) -> None:
        start.wait()
        try:
            lock.acquire()
            took.append(lock)
        except ValueError as e:
            refused.append(str(e))
    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took, refused


def test_two_simultaneous_takeovers_of_a_dead_holders_lock_leave_one_holder(tmp_path, monkeypatch):
    """Reading the lock takes up to 2 ms (a network filesystem, a busy disk): the two runs'
    steps interleave in every order, as they do at random, and rarely, on a fast disk."""
    def slow_loads(text: str):
        time.sleep(random.uniform(0, 0.002))
        return json.loads(text)
    monkeypatch.setattr(run_folder, "json", SimpleNamespace(loads=slow_loads, dumps=json.dumps, dump=json.dump))
    dead = subprocess.Popen(["true"])
    dead.wait()
    host, wrong = RunLock(tmp_path).holder["host"], []
    in_use = f"{tmp_path} is in use by another run (host {host}, pid {os.getpid()}"
    for _ in range(200):
        took, refused = _takeover_race(tmp_path, dead.pid)
        if len(took) != 1 or not _holds(took[0]) or not all(e.startswith(in_use) for e in refused):
            wrong.append(f"{len(took)} held it{''.join(f'; {e}' for e in refused)}")
        for lock in took:
            lock.release()
        (tmp_path / LOCK_FILE).unlink(missing_ok=True)
    assert not wrong, f"{len(wrong)} of 200 races did not end with one holder: {wrong[:2]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no guard or temporary file left


def test_a_live_pid_that_stopped_refreshing_is_taken_over_and_a_fresh_one_holds(tmp_path, capsys):
    """A reused pid (here a `sleep`) does not hold a folder for ever: a refresh older than the
    stale time releases it; a fresh one holds."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lock = RunLock(tmp_path)
        _plant(tmp_path, lock, sleeper.pid, age=60)
        with pytest.raises(ValueError, match=rf"^{tmp_path} is in use by another run \(host {lock.holder['host']}, "
                                             rf"pid {sleeper.pid}, started then\): give this run a folder of its "
                                             r"own \(--train.run_dir\)\. A lock is taken over once it has not been "
                                             r"refreshed for 10 minutes$"):
            lock.acquire()
        _plant(tmp_path, lock, sleeper.pid, age=STALE_SECONDS + 120)
        lock.acquire()
        assert _holds(lock)
        assert capsys.readouterr().err == (f"rankmix: warning: taking over {tmp_path / LOCK_FILE}: its holder pid "
                                           f"{sleeper.pid} on this host has not refreshed it for 12 minutes\n")
        lock.release()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_unreadable_lock_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_text("garbage{")
    lock = RunLock(tmp_path)
    with pytest.raises(ValueError) as e:
        lock.acquire()
    assert str(e.value) == f"{tmp_path / LOCK_FILE}: unreadable lock file: delete it if no run holds {tmp_path}"
    assert (tmp_path / LOCK_FILE).read_text() == "garbage{"
    then = time.time() - STALE_SECONDS - 60
    os.utime(tmp_path / LOCK_FILE, (then, then))  # nothing refreshes it: no run holds it
    lock.acquire()
    assert _holds(lock) and capsys.readouterr().err == (
        f"rankmix: warning: taking over {tmp_path / LOCK_FILE}: it is unreadable and has not been refreshed "
        f"for 11 minutes\n")
    lock.release()


def test_a_shared_checkpoint_folder_is_held_by_one_run(tmp_path):
    """Run folders A and B, one checkpoint folder: B stops naming A's claim, and gives up its
    own run folder again."""
    shared = tmp_path / "checkpoints"
    first = RunLocks({tmp_path / "a": "--train.run_dir", shared: "--checkpoint.folder"})
    first.acquire()
    try:
        second = RunLocks({tmp_path / "b": "--train.run_dir", shared: "--checkpoint.folder"})
        holder = first.locks[1].holder
        with pytest.raises(ValueError) as e:
            second.acquire()
        assert str(e.value).startswith(f"{shared} is in use by another run (host {holder['host']}, pid {os.getpid()}, "
                                       f"started {holder['started']}): give this run a folder of its own "
                                       f"(--checkpoint.folder).")
        assert not (tmp_path / "b" / LOCK_FILE).exists()
    finally:
        first.release()
    assert not (tmp_path / "a" / LOCK_FILE).exists() and not (shared / LOCK_FILE).exists()
    same = RunLocks({tmp_path / "c": "--train.run_dir", tmp_path / "c" / ".": "--checkpoint.folder"})
    assert len(same.locks) == 1  # a checkpoint folder that is the run folder is locked once


def test_a_training_on_a_held_checkpoint_folder_stops_naming_the_holder(run, tmp_path):  # noqa: F811
    shared = tmp_path / "checkpoints"
    holder = RunLock(shared)  # what run A, whose checkpoint.folder it is, holds
    holder.acquire()
    try:
        proc = rankmix("train", *TRAIN, f"--train.run_dir={tmp_path / 'b'}", f"--checkpoint.folder={shared}",
                       f"--data.cache_dir={run.parent / 'data'}")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"rankmix: error: {shared} is in use by another run (host {holder.holder['host']}, pid {os.getpid()}, "
            f"started {holder.holder['started']}): give this run a folder of its own (--checkpoint.folder).")
        assert not (tmp_path / "b" / LOCK_FILE).exists() and not any(shared.glob("step-*"))
    finally:
        holder.release()
