"""The CSV converter killed at any step of its work on the output folder, then run again with
any options: every row is there exactly once (issue 38, finding 9). A kill is simulated
deterministically: every file the converter renames or removes is one step, and from step k
on every such call raises, as if the process had died just before it (nothing after it
reaches the disk, the cleanup of `finally` blocks included)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from trainer.offline.csvlog import convert_csv

ROWS = 7
LAYOUT = dict(label="click", numeric=["id"])
# (earlier options, later options): fewer and larger parts, more and smaller, another layout
CHANGES = [
    (dict(rows_per_file=2, row_group_size=2), dict(rows_per_file=3, row_group_size=3)),
    (dict(rows_per_file=3, row_group_size=1), dict(rows_per_file=1, row_group_size=1)),
    (dict(rows_per_file=2, row_group_size=2), dict(rows_per_file=2, row_group_size=2, drop=["tag"])),
]


class Killed(BaseException):
    """The simulated kill (no `except Exception` of the converter may take it)."""


@contextlib.contextmanager
def killed_at(step: int):
    """Renames and removals of files count as steps from 0; step `step` and every later one
    raise `Killed`. Yields the list of steps taken."""
    taken: list[str] = []
    real = {name: getattr(os, name) for name in ("replace", "rename", "unlink", "remove", "rmdir")}

    def counted(name):
        def call(*args, **kwargs):
            if len(taken) >= step:
                raise Killed(f"killed before {name}{args}")
            taken.append(f"{name} {Path(args[0]).name}")
            return real[name](*args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as patch:
        for name in real:
            patch.setattr(os, name, counted(name))
        yield taken


def write_log(path: Path, ids: range) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("id,click,tag\n" + "".join(f"{i},{i % 2},t{i}\n" for i in ids))
    return path


def ids_on_disk(out: Path) -> Counter:
    """Each row id in every Parquet file below `out`: what a training over `out` reads."""
    return Counter(i for p in out.rglob("*.parquet") for i in pq.read_table(p, columns=["id"])["id"].to_pylist())


def convert(srcs: list[Path], out: Path, options: dict) -> dict:
    options = dict(options)
    return convert_csv([str(s) for s in srcs], str(out), **LAYOUT, drop=options.pop("drop", []), **options)


def every_kill(kill, check) -> int:
    """For step 0, 1, ...: `kill(step)` killed at that step, then `check(step)`, until `kill`
    completes; returns the number of steps of the complete run."""
    for step in range(100):
        with killed_at(step) as taken:
            try:
                kill(step)
            except Killed:
                taken = None
        check(step)
        if taken is not None:
            return len(taken)
    raise AssertionError("the run never completed")


@pytest.mark.parametrize("rerun", ["earlier", "later"])
@pytest.mark.parametrize("earlier,later", CHANGES)
def test_a_reconversion_killed_at_any_step_then_rerun_keeps_every_row_once(tmp_path, earlier, later, rerun):
    """A kill between the part renames of a reconversion (changed options), then a rerun with the
    earlier options: the old marker survived, the rerun said "skipped", rows were lost or twice."""
    src = write_log(tmp_path / "in" / "log.csv", range(ROWS))
    first = tmp_path / "first"
    assert convert([src], first, earlier)["rows"] == ROWS

    def kill(step):
        shutil.copytree(first, tmp_path / f"out{step}")  # renames and removes nothing
        convert([src], tmp_path / f"out{step}", later)

    def check(step):
        out, options = tmp_path / f"out{step}", earlier if rerun == "earlier" else later
        again = convert([src], out, options)
        assert again["rows"] == ROWS and again["files"][0]["rows"] == ROWS, step
        assert ids_on_disk(out) == Counter(range(ROWS)), f"killed at step {step}"
        columns = {"click", "id", "tag"} - set(options.get("drop", []))  # no part of the other options
        assert {frozenset(pq.read_schema(p).names) for p in out.rglob("*.parquet")} == {frozenset(columns)}, step
        assert convert([src], out, options)["skipped_files"] == 1

    steps = every_kill(kill, check)
    assert steps >= 5  # the marker twice, the part renames, the removal of a stale part


def test_a_first_conversion_killed_at_any_step_keeps_its_name(tmp_path):
    """x/a.csv and y/a.csv get hashed names; killed before its marker was written, y/a.csv
    converted alone was named `a`, and the parts left under its hashed name were read too."""
    x = write_log(tmp_path / "x" / "a.csv", range(0, 3))
    y = write_log(tmp_path / "y" / "a.csv", range(100, 104))

    def kill(step):
        convert([x, y], tmp_path / f"out{step}", dict(rows_per_file=1))

    def check(step):
        out = tmp_path / f"out{step}"
        convert([y], out, dict(rows_per_file=2))  # y alone, other options
        on_disk = ids_on_disk(out)
        assert {i: n for i, n in on_disk.items() if i >= 100} == Counter(range(100, 104)), step
        convert([x, y], out, dict(rows_per_file=1))
        assert ids_on_disk(out) == Counter([*range(0, 3), *range(100, 104)]), step

    assert every_kill(kill, check) >= 10


def test_an_input_named_like_a_marker_is_data(tmp_path):
    """An input `_DONE_q.csv` has parts `_DONE_q-NNNNN.parquet`, which were read as a done-marker:
    every later run exited with "unreadable done-marker; delete it"."""
    src = write_log(tmp_path / "_DONE_q.csv", range(5))
    other = write_log(tmp_path / "q.csv", range(10, 12))
    out = tmp_path / "out"
    assert convert([src], out, {})["files"][0]["parts"] == ["_DONE_q-00000.parquet"]
    again = convert([src, other], out, {})
    assert [f["skipped"] for f in again["files"]] == [True, False]
    assert ids_on_disk(out) == Counter([*range(5), 10, 11])


def test_markers_of_the_earlier_converter_are_adopted(tmp_path):
    """An output folder of the converter before markers moved (`<out>/_DONE_<name>`): its
    inputs stay done under the names they had."""
    x = write_log(tmp_path / "x" / "a.csv", range(0, 3))
    y = write_log(tmp_path / "y" / "a.csv", range(100, 104))
    out = tmp_path / "out"
    names = [f["parts"][0] for f in convert([x, y], out, {})["files"]]
    for marker in (out / ".rankmix-done").iterdir():
        marker.rename(out / f"_DONE_{marker.stem}")
    again = convert([y], out, {})
    assert again["skipped_files"] == 1 and again["files"][0]["parts"] == [names[1]]
    assert not list(out.glob("_DONE_*")) and len(list((out / ".rankmix-done").iterdir())) == 2
    assert ids_on_disk(out) == Counter([*range(0, 3), *range(100, 104)])


def test_a_planted_marker_folder_is_refused(tmp_path):
    src = write_log(tmp_path / "log.csv", range(2))
    out = tmp_path / "out"
    out.mkdir()
    (out / ".rankmix-done").symlink_to(tmp_path)
    with pytest.raises(ValueError) as e:
        convert([src], out, {})
    assert str(e.value) == (f"{out / '.rankmix-done'}: a link or a file, not a folder; the converter keeps its "
                            "done-markers there")
