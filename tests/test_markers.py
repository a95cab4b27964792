"""The converter's done-markers and input names (trainer/offline/csvlog.py): which files of
`.rankmix-done` are markers, what a marker must hold to count, an old converter's markers
adopted without overwriting a newer one, and each input's name. In-process and fast: the
mutation target "csvlog_markers" runs these."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from trainer.offline.csvlog import (
    CsvLayout,
    _adopt_legacy_markers,
    _digest,
    _marker,
    _markers,
    _name_hash,
    _names,
    _part_of,
    _read_marker,
    convert_csv,
)

LAYOUT = dict(label="click", numeric=["id"])


def write_log(path: Path, rows: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("id,click\n" + "".join(f"{i},{i % 2}\n" for i in range(rows)))
    return path


def done(path: str, **more) -> str:
    return json.dumps({"path": path, "digest": "d", "report": {"rows": 1}, **more})


# ----------------------------------------------------------------------------- which files are markers


def test_a_marker_is_a_json_file_of_the_marker_folder_named_for_its_input(tmp_path):
    assert _marker(tmp_path, "day_0") == tmp_path / ".rankmix-done" / "day_0.json"
    assert list(_markers(tmp_path)) == []  # no marker folder yet
    folder = tmp_path / ".rankmix-done"
    folder.mkdir()
    for name in ("b.json", "a.json", ".b.json.123.tmp", "notes.txt", "json", "c.json.bak"):
        (folder / name).write_text("not json")
    assert list(_markers(tmp_path)) == [("a", folder / "a.json"), ("b", folder / "b.json")]


def test_a_stray_file_in_the_marker_folder_is_ignored_by_a_conversion(tmp_path):
    """An editor's backup or a temporary file left by a kill is no marker: before the filter,
    every later run stopped with "unreadable done-marker"."""
    src = write_log(tmp_path / "log.csv")
    out = tmp_path / "out"
    convert_csv([str(src)], str(out), **LAYOUT)
    for name in ("log.json~", ".log.json.4242.tmp", "README"):
        (out / ".rankmix-done" / name).write_text("{half")
    again = convert_csv([str(src)], str(out), **LAYOUT)
    assert again["skipped_files"] == 1 and again["files"][0]["parts"] == ["log-00000.parquet"]


def test_a_marker_counts_only_with_its_inputs_path(tmp_path):
    marker = tmp_path / "m.json"
    for text, expected in ((done("/in/a.csv"), json.loads(done("/in/a.csv"))), ('{"path": "/a"}', {"path": "/a"}),
                           ('{"path": 3}', None), ('{"digest": "d"}', None), ('["/a"]', None), ('"/a"', None)):
        marker.write_text(text)
        assert _read_marker(marker) == expected, text


def test_an_unreadable_marker_is_named_with_what_to_do(tmp_path):
    marker = tmp_path / "m.json"
    marker.write_text("{half")
    with pytest.raises(ValueError) as e:
        _read_marker(marker)
    assert str(e.value) == (f"{marker}: unreadable done-marker (Expecting property name enclosed in double quotes: "
                            "line 1 column 2 (char 1)); delete it to convert its input again")
    marker.unlink()
    marker.mkdir()
    with pytest.raises(ValueError) as e:
        _read_marker(marker)
    assert str(e.value) == (f"{marker}: unreadable done-marker ([Errno 21] Is a directory: '{marker}'); delete it "
                            "to convert its input again")


# ----------------------------------------------------------------------------- an old converter's markers


def legacy(out: Path, name: str, text: str | bytes) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / ".rankmix-done").mkdir(exist_ok=True)
    old = out / f"_DONE_{name}"
    old.write_bytes(text if isinstance(text, bytes) else text.encode())
    return old


def test_an_old_converters_marker_is_moved_into_the_marker_folder(tmp_path):
    old = legacy(tmp_path, "a", done("/in/a.csv"))
    _adopt_legacy_markers(tmp_path)
    assert not old.exists() and _read_marker(_marker(tmp_path, "a")) == json.loads(done("/in/a.csv"))


def test_an_old_marker_never_overwrites_a_newer_one(tmp_path):
    """A later run of this converter marked `a` done with other options: the old marker goes, the new one stays."""
    old = legacy(tmp_path, "a", done("/in/a.csv", digest="old"))
    _marker(tmp_path, "a").write_text(done("/in/a.csv", digest="new"))
    _adopt_legacy_markers(tmp_path)
    assert not old.exists() and json.loads(_marker(tmp_path, "a").read_text())["digest"] == "new"


@pytest.mark.parametrize("text", [
    "{half", b"\xff\xfe", '["/in/a.csv"]', '{"path": 1, "digest": "d", "report": {}}', '{"digest": "d", "report": {}}',
    '{"path": "/in/a.csv", "report": {}}', '{"path": "/in/a.csv", "digest": "d"}',
], ids=["not-json", "not-utf8", "list", "path-int", "no-path", "no-digest", "no-report"])
def test_a_file_named_like_an_old_marker_that_is_not_one_is_data(tmp_path, text):
    old = legacy(tmp_path, "a", text)
    _adopt_legacy_markers(tmp_path)
    assert old.read_bytes() == (text if isinstance(text, bytes) else text.encode())
    assert list((tmp_path / ".rankmix-done").iterdir()) == []


def test_an_old_marker_of_1_mib_is_adopted_and_one_byte_more_is_data(tmp_path):
    text = done("/in/a.csv")
    legacy(tmp_path, "a", text.ljust(1 << 20))
    big = legacy(tmp_path, "b", text.ljust((1 << 20) + 1))
    _adopt_legacy_markers(tmp_path)
    assert [p.name for p in (tmp_path / ".rankmix-done").iterdir()] == ["a.json"] and big.exists()


def test_every_old_marker_is_adopted_whatever_files_are_listed_before_it(tmp_path):
    """Files that are not markers, in the listing among markers: each is passed over, not the end."""
    (tmp_path / "elsewhere").write_text(done("/in/x.csv"))
    for i in range(3):
        (tmp_path / f"_DONE_link{i}").symlink_to(tmp_path / "elsewhere")
        (tmp_path / f"_DONE_folder{i}").mkdir()
        (tmp_path / f"_DONE_half{i}").write_text("{half")
    for i in range(10):
        legacy(tmp_path, f"m{i}", done(f"/in/m{i}.csv"))
    _adopt_legacy_markers(tmp_path)
    assert sorted(p.name for p in (tmp_path / ".rankmix-done").iterdir()) == sorted(f"m{i}.json" for i in range(10))
    assert len(list(tmp_path.glob("_DONE_*"))) == 9


def test_a_link_or_folder_named_like_an_old_marker_is_left_alone(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text(done("/in/a.csv"))
    out = tmp_path / "out"
    legacy(out, "x", "").unlink()
    (out / "_DONE_a").symlink_to(target)
    (out / "_DONE_b").mkdir()
    _adopt_legacy_markers(out)
    assert (out / "_DONE_a").is_symlink() and target.read_text() == done("/in/a.csv") and (out / "_DONE_b").is_dir()
    assert list((out / ".rankmix-done").iterdir()) == []


# ----------------------------------------------------------------------------- what a marker's digest covers


def test_the_digest_follows_the_layout_the_part_options_and_the_inputs_size_and_time(tmp_path):
    src = write_log(tmp_path / "a.csv")
    os.utime(src, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    layout = CsvLayout(**LAYOUT)
    # the digest of this converter's markers, as it is documented: a later converter must keep finding them done
    key = {"layout": "CsvLayout", **vars(layout), "rows_per_file": 0, "row_group_size": 1024,
           "size": src.stat().st_size, "mtime_ns": 1_700_000_000_000_000_000}
    assert _digest(str(src), layout, 0, 1024) == hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    digests = {_digest(str(src), layout, 0, 1024), _digest(str(src), layout, 1, 1024),
               _digest(str(src), layout, 0, 1023), _digest(str(src), CsvLayout("click", numeric=["id"], drop=["x"]),
                                                           0, 1024)}
    os.utime(src, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_001))
    digests.add(_digest(str(src), layout, 0, 1024))
    src.write_text(src.read_text() + "9,1\n")
    os.utime(src, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    digests.add(_digest(str(src), layout, 0, 1024))
    assert len(digests) == 6
    copy = tmp_path / "b" / "a.csv"  # the same bytes and time elsewhere: the path is the marker's to compare
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    os.utime(copy, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert _digest(str(copy), layout, 0, 1024) == _digest(str(src), layout, 0, 1024)


# ----------------------------------------------------------------------------- names


def hashed(name: str, path: Path) -> str:
    return f"{name}-h{hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()}"


def test_a_part_name_reads_as_its_inputs():
    assert [_part_of(n) for n in ("a-1", "a-00012", "a-1-2", "a", "a-", "a-b", "-1", "a-1x")] == \
        ["a", "a", "a-1", None, None, None, "", None]


def test_the_name_hash_is_8_hex_digits_of_the_full_path():
    assert _name_hash("/x/a.csv") == hashlib.blake2b(b"/x/a.csv", digest_size=4).hexdigest()
    assert len(_name_hash("/x/a.csv")) == 8 and _name_hash("/x/a.csv") != _name_hash("/y/a.csv")


def test_each_input_is_named_by_its_stem_unless_another_claims_it(tmp_path):
    out = tmp_path / "out"
    x, y, z = tmp_path / "x" / "a.csv.gz", tmp_path / "y" / "a.tsv", tmp_path / "z" / "b.csv"
    assert _names([str(z)], out) == ["b"]
    assert _names([str(x), str(y), str(z)], out) == [hashed("a", x), hashed("a", y), "b"]


def test_a_name_that_reads_as_anothers_part_is_hashed_with_it(tmp_path):
    a, a1, b2 = tmp_path / "a.csv", tmp_path / "a-1.csv", tmp_path / "b-2.csv"
    assert _names([str(a), str(a1), str(b2)], tmp_path / "out") == [hashed("a", a), hashed("a-1", a1), "b-2"]


def test_an_input_keeps_the_name_an_earlier_run_gave_it_and_others_avoid_it(tmp_path):
    out = tmp_path / "out"
    (out / ".rankmix-done").mkdir(parents=True)
    x, y, z = tmp_path / "x" / "a.csv", tmp_path / "y" / "a.csv", tmp_path / "z" / "c.csv"
    _marker(out, "a").write_text(json.dumps({"path": str(x)}))  # claimed while being replaced, as done
    _marker(out, "c").write_text(json.dumps({"digest": "d"}))  # an old converter's, without a path: no claim
    assert _names([str(y)], out) == [hashed("a", y)]
    assert _names([str(y), str(x), str(z)], out) == [hashed("a", y), "a", "c"]
    _marker(out, "a-1").write_text(json.dumps({"path": str(tmp_path / "w" / "a-1.csv")}))
    assert _names([str(x)], out) == ["a"]  # its own name stays, whatever claims it as a part
    b = tmp_path / "z" / "b.csv"
    _marker(out, hashed("b", b)).write_text(json.dumps({"path": str(b)}))
    assert _names([str(b)], out) == [hashed("b", b)]  # hashed once (a clash then), hashed for good


def test_an_input_given_twice_is_refused(tmp_path):
    src = tmp_path / "a.csv"
    with pytest.raises(ValueError) as e:
        _names([str(src), "b.csv", str(tmp_path / "." / "a.csv")], tmp_path / "out")
    assert str(e.value) == f"--src gives one file more than once: {[str(src), str(tmp_path / '.' / 'a.csv')]}"
