"""Ranks agree on their input (trainer/data/identity.py, Agreement): two real gloo ranks whose
listings of one folder differ, because a file arrived between them, both stop with the same
one-line error naming that file instead of training different step counts; a rank that cannot
list its input stops every rank; ranks that agree read on."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cli import rendezvous_port, spawn
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader

ROWS = 100  # per file, one row group


def write(path: Path, seed: int) -> None:
    """ROWS rows in one row group, written under another name and renamed: whole or absent."""
    ids = np.random.default_rng(seed).integers(0, 50, ROWS)
    pq.write_table(pa.table({"item": ids, "click": ids % 2}), path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


class Announcing(RowEncoder):
    """An encoder that leaves `flag` once it has checked the schema of `last`: its reader has
    then listed the folder and read every footer, so a file written afterwards is one it missed."""

    def __init__(self, flag: Path, last: str):
        features = [FeatureSpec(name="item", kind="id", num_embeddings=50)]
        validate_features(features)
        super().__init__(features, [TaskSpec(name="click", label="click")])
        self.flag, self.last = flag, last

    def check_schema(self, schema, path: str) -> None:
        super().check_schema(schema, path)
        if path == self.last:
            self.flag.touch()


def _worker(rank: int, port: int, folder: str, out: str) -> None:
    import torch.distributed as dist

    # A hang would end in this timeout's error, which the test reports.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    data = Path(folder)
    flag = data.parent / "rank0-listed"

    def build(path: str, last: str = "") -> list:
        try:
            reader = ParquetReader(path, Announcing(flag, last), ReaderOptions(batch_size=10, rank=rank, world_size=2))
            return ["read", reader.steps_in_epoch(0)]
        except Exception as e:
            return [type(e).__name__, str(e)]

    results = {"agree": build(folder)}
    if rank == 1:  # a file arrives after rank 0 listed the folder, before rank 1 does
        while not flag.exists():
            time.sleep(0.01)
        write(data / "part-2.parquet", seed=2)
    results["file added"] = build(folder, str(data / "part-1.parquet") if rank == 0 else "")
    results["unreadable"] = build(folder if rank == 0 else str(data / "missing"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_ranks_that_list_different_files_all_stop_with_one_error(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        write(data / f"part-{i}.parquet", seed=i)
    spawn(_worker, (rendezvous_port(), str(data), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Agreeing ranks: 2 x 100 rows, 100 per rank, 10 batches of 10.
    assert [r["agree"] for r in ranks] == [["read", 10], ["read", 10]]
    size = os.path.getsize(data / "part-2.parquet")
    message = (f"{data}: the ranks see different files, so their steps would not match: {data}/part-2.parquet is "
               f"missing on rank 0 but {size} bytes in 1 row group(s) of {ROWS} rows on rank 1; were files added or "
               "rewritten while the job started? A run's input must not change")
    assert [r["file added"] for r in ranks] == [["ValueError", message]] * 2
    assert ranks[1]["unreadable"] == ["ValueError", f"data path not found: {data}/missing"]
    assert ranks[0]["unreadable"] == ["ValueError", f"{data}: rank 1 cannot read its input: "
                                                    f"data path not found: {data}/missing"]
