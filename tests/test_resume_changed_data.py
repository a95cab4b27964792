"""Resuming over rewritten training data (trainer/data/reader.py, `content_digest`): a file
replaced by one of the same size, row groups and footer but another `click` column is refused
by name; a file rewritten with the same bytes is not. Larger files are sampled: the test lowers
the whole-file threshold to show what the sample reads, catches and (documented) misses."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import trainer.data.reader as reader_module
from cli import rendezvous_port, spawn
from test_reader import assert_same, make_encoder, make_table, snap
from trainer.data.reader import ParquetReader, content_digest

ROWS = 500
HONOURED = "the saved position cannot be honoured (a run's input must not change; see docs/continuous.md)"


def reader(folder: Path, **kw) -> ParquetReader:
    return ParquetReader(str(folder), make_encoder(), batch_size=50, shuffle_buffer=120, seed=3, **kw)


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
    digest = [hashlib.sha256(b"whole:" + data).hexdigest()[:16] for data in (before, after)]
    message = (f"data reader state was saved over other files: {part} was rewritten: still {len(before)} bytes in "
               f"1 row group(s) of {ROWS} rows, but its content digest changed from {digest[0]} to {digest[1]}; "
               f"{HONOURED}")
    assert refusal(folder, state) == message
    keep_mtime(part, mtime)  # a small file is hashed whole: the modification time does not matter
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
        "data reader state records no content digest of its files (an older rankmix saved it): only their paths, "
        "bytes and row counts were checked; the next checkpoint records it"]
    write(part, table.slice(0, ROWS - 10))
    assert refusal(folder, state).startswith(f"data reader state was saved over other files: {part} changed from ")


# ----------------------------------------------------------------------------- sampled (large) files

def deep_file(path: Path) -> int:
    """A file with column chunks far larger than the sample (plain, uncompressed, 4000 rows in
    2 row groups); returns the offset of a `price` value more than 4 KiB from its chunk's ends."""
    pq.write_table(make_table(0, 4000), path, row_group_size=2000, compression="NONE", use_dictionary=False)
    meta = pq.read_metadata(path)
    chunk = meta.row_group(0).column(meta.schema.names.index("price"))
    offset = path.read_bytes().index(struct.pack("<d", 1000.0))
    assert chunk.data_page_offset + 4096 < offset < chunk.data_page_offset + chunk.total_compressed_size - 4096
    return offset


class Counting:
    """A file that counts the reads made of it."""

    def __init__(self, file):
        self.file, self.reads = file, []

    def read_at(self, nbytes: int, offset: int):
        self.reads.append(nbytes)
        return self.file.read_at(nbytes, offset)


def test_a_large_file_costs_a_tail_read_and_one_small_read_per_column_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "FULL_HASH_BYTES", 0)
    path = tmp_path / "big.parquet"
    deep_file(path)
    size = path.stat().st_size
    assert size > 64 << 10
    counting = Counting(pa.OSFile(str(path)))
    content_digest(counting, size, 1)
    chunks = 2 * 5  # row groups x columns, each over 8 KiB: head, then (tail + next head) merged, then tail
    meta = pq.read_metadata(path)
    assert all(meta.row_group(g).column(c).total_compressed_size > 8192 for g in range(2) for c in range(5))
    assert counting.reads == [64 << 10, 4096, *[8192] * (chunks - 1), 4096]


def test_a_large_file_flipped_is_refused_and_a_deep_change_is_seen_by_its_modification_time(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "FULL_HASH_BYTES", 0)
    folder = tmp_path / "data"
    folder.mkdir()
    part = folder / "part-0.parquet"
    offset = deep_file(part)
    state = reader(folder).state_dict()
    mtime = part.stat().st_mtime_ns
    content = part.read_bytes()

    pq.write_table(flipped(make_table(0, 4000)), part, row_group_size=2000, compression="NONE",
                   use_dictionary=False)
    assert part.stat().st_size == len(content)
    keep_mtime(part, mtime)
    assert "content digest changed" in refusal(folder, state)  # the chunks' first 4 KiB hold labels

    # A value 4 KiB inside a chunk, with the footer, size and modification time kept: the
    # documented miss, and the modification time is what catches a plain rewrite of it.
    changed = content[:offset] + struct.pack("<d", 1000.5) + content[offset + 8:]
    part.write_bytes(changed)
    assert "content digest changed" in refusal(folder, state)
    keep_mtime(part, mtime)
    reader(folder).load_state_dict(state)


# ----------------------------------------------------------------------------- ranks share the hashing

def _worker(rank: int, port: int, folder: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    hashed = []
    real = reader_module._file_digest
    reader_module._file_digest = lambda fs, info: hashed.append(info.path) or real(fs, info)
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
    whole = {p.name: hashlib.sha256(b"whole:" + p.read_bytes()).hexdigest() for p in folder.iterdir()}
    spawn(_worker, (rendezvous_port(), str(folder), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    names = [f"part-{i}.parquet" for i in range(3)]
    for r, got in enumerate(ranks):
        assert [f[3] for f in got["files"]] == [whole[n] for n in names]
        assert [Path(p).name for p in got["hashed"]] == [n for i, n in enumerate(names) if i % 2 == r] * 2
        assert got["error"] is not None and got["error"].startswith(
            f"data reader state was saved over other files: {folder}/part-2.parquet was rewritten: ")
    assert ranks[0]["error"] == ranks[1]["error"]
