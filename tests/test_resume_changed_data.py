"""Resuming over rewritten training data (trainer/data/identity.py, the sha256 of every byte): a
file replaced by one of the same size, row groups and footer but another `click` column is refused
by name, and so is a 17 MB file with labels flipped deep inside its column chunks and its
modification time set back, or with one byte flipped anywhere; a file rewritten with the same
bytes is not. The digests are computed once per reader, and the ranks share them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import struct
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import trainer.data.identity as identity
from cli import rendezvous_port, run_env, spawn
from test_reader import assert_same, make_encoder, make_table, snap
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader

ROWS = 500
HONOURED = "the saved position cannot be honoured (a run's input must not change; see docs/continuous.md)"


def reader(folder: Path | str, **kw) -> ParquetReader:
    return ParquetReader(str(folder), make_encoder(), ReaderOptions(batch_size=50, shuffle_buffer=120, seed=3, **kw))


def write(path: Path, table: pa.Table, **kw) -> None:
    """`table` as `path`, written beside it and renamed over it: a replaced file, as a job writes one."""
    pq.write_table(table, path.with_suffix(".tmp"), row_group_size=ROWS, **kw)
    os.replace(path.with_suffix(".tmp"), path)


def flipped(table: pa.Table) -> pa.Table:
    """The same rows with every click label inverted."""
    return table.set_column(table.schema.get_field_index("click"), "click",
                            pc.subtract(1, table["click"]))


def footer(path: Path) -> bytes:
    data = path.read_bytes()
    return data[-8 - struct.unpack("<I", data[-8:-4])[0]:]


def keep_mtime(path: Path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


def sha(data: bytes) -> str:
    """The first 16 hex digits of the sha256 of `data`, as messages show a digest."""
    return hashlib.sha256(data).hexdigest()[:16]


def rewritten(path: Path, before: bytes, after: bytes, groups: int, rows: int) -> str:
    return (f"data reader state was saved over other files: {path} was rewritten: still {len(before)} bytes in "
            f"{groups} row group(s) of {rows} rows, but the sha256 of its bytes changed from {sha(before)} to "
            f"{sha(after)}; {HONOURED}")


def data(tmp_path: Path) -> tuple[Path, Path, pa.Table]:
    """Two files of ROWS rows; returns (folder, the second file, its table)."""
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(2):
        write(folder / f"part-{i}.parquet", make_table(i * ROWS, ROWS))
    return folder, folder / "part-1.parquet", make_table(ROWS, ROWS)


def refusal(folder: Path, state: dict) -> str:
    with pytest.raises(ValueError) as error:
        reader(folder).load_state_dict(state)
    return str(error.value)


def test_a_file_replaced_with_the_click_column_flipped_is_refused_by_name(tmp_path):
    folder, part, table = data(tmp_path)
    first = reader(folder)
    list(zip(range(7), first))
    state = json.loads(json.dumps(first.state_dict()))
    before, mtime = part.read_bytes(), part.stat().st_mtime_ns
    write(part, flipped(table))
    after = part.read_bytes()
    # What the old check compared is unchanged, and so is the footer: only the values differ.
    assert len(after) == len(before) and footer(part) == before[-len(footer(part)):] and after != before
    message = rewritten(part, before, after, 1, ROWS)
    assert refusal(folder, state) == message
    keep_mtime(part, mtime)  # the modification time does not matter
    assert refusal(folder, state) == message


def test_a_file_rewritten_with_the_same_bytes_resumes_exactly(tmp_path):
    folder, part, _ = data(tmp_path)
    reference = [snap(b) for b in reader(folder, num_epochs=1)]
    first = reader(folder, num_epochs=1)
    list(zip(range(7), first))
    state = json.loads(json.dumps(first.state_dict()))
    content = part.read_bytes()
    part.unlink()
    part.write_bytes(content)  # a new file and modification time, the same bytes
    fresh = reader(folder, num_epochs=1)
    fresh.load_state_dict(state)
    assert_same([snap(b) for b in fresh], reference[7:])


def test_a_position_saved_without_digests_resumes_with_a_warning_and_keeps_the_old_checks(tmp_path, caplog):
    folder, part, table = data(tmp_path)
    state = json.loads(json.dumps(reader(folder).state_dict()))
    state["files"] = [f[:3] for f in state["files"]]  # as a rankmix before the digest saved it
    with caplog.at_level(logging.WARNING, logger="rankmix.data"):
        reader(folder).load_state_dict(state)
    assert [r.getMessage() for r in caplog.records] == [
        "data reader state records no sha256 of its files' bytes (an older rankmix saved it): only their paths, "
        "bytes and row counts were checked; the next checkpoint records it"]
    write(part, table.slice(0, ROWS - 10))
    assert refusal(folder, state).startswith(f"data reader state was saved over other files: {part} changed from ")


def test_an_older_sampled_digest_is_honoured_as_none_and_a_rewrite_it_hides_resumes(tmp_path, caplog):
    folder, part, table = data(tmp_path)
    state = json.loads(json.dumps(reader(folder).state_dict()))
    state["files"] = [[*f[:3], "ab" * 32] for f in state["files"]]  # an older rankmix's bare hex digest
    write(part, flipped(table))
    with caplog.at_level(logging.WARNING, logger="rankmix.data"):
        reader(folder).load_state_dict(state)  # compared by paths, bytes and rows only, as it was then
    assert [r.getMessage() for r in caplog.records][0].startswith("data reader state records no sha256 of ")


# ----------------------------------------------------------------------------- large files

LARGE_ROWS = 400_000  # about 17 MB uncompressed: far above the 8 MiB the digest once hashed whole


def large_file(folder: Path) -> Path:
    """One file of LARGE_ROWS rows in 2 row groups, plain and uncompressed, as the issue's."""
    folder.mkdir()
    part = folder / "part-0.parquet"
    pq.write_table(make_table(0, LARGE_ROWS), part, row_group_size=LARGE_ROWS // 2, compression="NONE",
                   use_dictionary=False)
    assert part.stat().st_size > 17_000_000
    return part


def click_labels_inside_chunks(path: Path) -> list[int]:
    """Offsets of the low byte of the `click` labels in the middle 8 KiB of each row group's
    `click` column chunk: more than 4 KiB from either end (the ends the old digest sampled)."""
    data, meta = path.read_bytes(), pq.read_metadata(path)

    def label(i: int) -> bool:  # click = id % 2, plain int64: 0 and 1 alternate, 7 zero bytes after each
        return all(data[i + k] == (data[i] if k % 16 == 0 else 1 - data[i] if k % 8 == 0 else 0) and data[i] < 2
                   for k in range(-8, 16))
    offsets = []
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(meta.schema.names.index("click"))
        start, stop = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size
        middle = (start + stop) // 2
        assert start + 4096 < middle - 4096 and middle + 4096 < stop - 4096
        offsets += [i for i in range(middle - 4096, middle + 4096) if label(i)]
    return offsets


def test_a_17_mb_file_with_labels_flipped_inside_its_chunks_and_its_mtime_set_back_is_named(tmp_path):
    part = large_file(tmp_path / "data")
    state = json.loads(json.dumps(reader(part.parent).state_dict()))
    before, mtime = part.read_bytes(), part.stat().st_mtime_ns
    changed, offsets = bytearray(before), click_labels_inside_chunks(part)
    for offset in offsets:
        changed[offset] ^= 1  # 0 <-> 1
    part.write_bytes(changed)
    keep_mtime(part, mtime)  # as cp -p, rsync -a and tar leave it
    stat = part.stat()
    assert (stat.st_size, stat.st_mtime_ns) == (len(before), mtime)
    original = tmp_path / "original.parquet"
    original.write_bytes(before)
    labels = [pq.read_table(p, columns=["click"])["click"].to_numpy() for p in (original, part)]
    assert (labels[0] != labels[1]).sum() == len(offsets) > 2000  # what a resume trains on
    assert refusal(part.parent, state) == rewritten(part, before, bytes(changed), 2, LARGE_ROWS)


def test_a_byte_flipped_anywhere_in_a_large_file_is_named(tmp_path):
    part = large_file(tmp_path / "data")
    state = json.loads(json.dumps(reader(part.parent).state_dict()))
    before, mtime = part.read_bytes(), part.stat().st_mtime_ns
    rng = random.Random(55)
    # random positions over the whole file, the first and last bytes (magic, footer) among them
    for offset in [0, len(before) - 1, *(rng.randrange(len(before)) for _ in range(8))]:
        changed = bytearray(before)
        changed[offset] ^= 0xFF
        part.write_bytes(changed)
        keep_mtime(part, mtime)
        with pytest.raises(ValueError) as error:
            reader(part.parent).load_state_dict(state)
        assert str(part) in str(error.value), offset
        if 4 <= offset < len(before) - 8 - struct.unpack("<I", before[-8:-4])[0]:  # in the row groups' bytes
            assert str(error.value) == rewritten(part, before, bytes(changed), 2, LARGE_ROWS), offset
    part.write_bytes(before)
    reader(part.parent).load_state_dict(state)


def test_the_digests_are_computed_once_per_reader_not_per_epoch(tmp_path, monkeypatch):
    folder, _, _ = data(tmp_path)
    hashed = []
    real = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda fs, info: hashed.append(info.path) or real(fs, info))
    first = reader(folder, num_epochs=3)
    batches = sum(1 for _ in first)
    state = json.loads(json.dumps(first.state_dict()))
    assert batches == 3 * 2 * ROWS // 50 and state["epoch"] == 3
    assert sorted(hashed) == [str(folder / f"part-{i}.parquet") for i in range(2)]
    resumed = reader(folder, num_epochs=3)  # a resume is a new run: it hashes the bytes again
    resumed.load_state_dict(state)
    assert sorted(hashed) == sorted([str(folder / f"part-{i}.parquet") for i in range(2)] * 2)
    assert [f[3] for f in state["files"]] == [
        "sha256:" + hashlib.sha256((folder / f"part-{i}.parquet").read_bytes()).hexdigest() for i in range(2)]


def test_a_file_on_an_object_store_is_hashed_through_its_filesystem_in_blocks(tmp_path, monkeypatch):
    pytest.importorskip("moto.server", reason="moto[server] not installed")
    from object_store import Server, filesystem, query, upload

    monkeypatch.setattr(identity, "DIGEST_BLOCK", 4096)  # many reads of each file, not one
    folder, _, _ = data(tmp_path)
    server = Server()
    try:
        upload(filesystem(server.port), "rankmix-test", {folder: "logs/digest"})
        remote = reader(f"s3://x:x@rankmix-test/logs/digest{query(server.port)}")
        assert [f[3] for f in remote.state_dict()["files"]] == [
            "sha256:" + hashlib.sha256((folder / f"part-{i}.parquet").read_bytes()).hexdigest() for i in range(2)]
    finally:
        server.stop()


def test_a_file_that_grows_while_it_is_hashed_is_refused(tmp_path):
    _, part, _ = data(tmp_path)
    listed = pafs.FileInfo(str(part), type=pafs.FileType.File, size=part.stat().st_size - 1)
    with pytest.raises(ValueError) as error:
        identity.file_digest(pafs.LocalFileSystem(), listed)
    assert str(error.value) == f"it changed while it was read: listed with {listed.size} bytes, read {listed.size + 1}"


# ----------------------------------------------------------------------------- ranks share the hashing

def _worker(rank: int, port: int, folder: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    hashed = []
    real = identity.file_digest
    identity.file_digest = lambda fs, info: hashed.append(info.path) or real(fs, info)
    kw = dict(rank=rank, world_size=2)
    state = reader(Path(folder), **kw).state_dict()
    flip = Path(folder, "part-2.parquet")
    if rank == 0:
        write(flip, flipped(make_table(2 * ROWS, ROWS)))
    dist.barrier()
    try:
        reader(Path(folder), **kw).load_state_dict(state)
        error = None
    except ValueError as e:
        error = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"files": state["files"], "hashed": hashed, "error": error}))
    dist.destroy_process_group()


def test_ranks_share_the_hashing_and_all_refuse_a_rewritten_file(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):
        write(folder / f"part-{i}.parquet", make_table(i * ROWS, ROWS))
    whole = {p.name: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    spawn(_worker, (rendezvous_port(), str(folder), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    names = [f"part-{i}.parquet" for i in range(3)]
    for r, got in enumerate(ranks):
        assert [f[3] for f in got["files"]] == [whole[n] for n in names]
        assert [Path(p).name for p in got["hashed"]] == [n for i, n in enumerate(names) if i % 2 == r] * 2
        assert got["error"] is not None and got["error"].startswith(
            f"data reader state was saved over other files: {folder}/part-2.parquet was rewritten: ")
    assert ranks[0]["error"] == ranks[1]["error"]


# ----------------------------------------------------------------------------- the bench

@pytest.mark.bench
def test_digest_bench_prints_a_row_a_round_and_the_median_ratio(tmp_path):
    """bench/digest.py on a small log of the rehearsal's schema: a row per round, then the median."""
    proc = subprocess.run([sys.executable, "bench/digest.py", "--rows", "40000", "--files", "4", "--rounds", "2",
                           "--tmp", str(tmp_path)], cwd=Path(__file__).resolve().parents[1], env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = re.findall(r"^\| (\d) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| (\d+\.\d{3}) \|$", proc.stdout, re.M)
    assert [r for r, _ in rounds] == ["0", "1"]
    median = re.search(r"^median ratio \(digest / one epoch's raw read\): (\d+\.\d{3}) ", proc.stdout, re.M)
    assert median and float(median.group(1)) == pytest.approx(sum(float(x) for _, x in rounds) / 2, abs=2e-3)
    assert not list(tmp_path.iterdir())  # the log is deleted without --keep
