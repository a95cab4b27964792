"""Datasets chosen by name (`data.dataset`): where the Parquet files are and, for the
built-in ones, the feature schema that fits them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, get_args

import torch.distributed as dist

from embeddings.features import FeatureSpec
from embeddings.registry import Registry
from trainer.config import Config, SynthTeacherName
from trainer.data import time_split
from trainer.data.table_input import TablePin, newest_files, pinned_train_files
from trainer.dist import on_rank0, side_group
from trainer.offline import capacity as capacity_data
from trainer.offline import sequence_log
from trainer.offline import synth as synth_data
from trainer.offline.movielens import convert_movielens


@dataclass
class DatasetFiles:
    """Resolved inputs of a run."""

    train_path: str
    eval_path: str
    features: list[FeatureSpec]
    valid_path: str = ""  # data.valid_path, a table's as its files
    pin: TablePin | None = None  # the snapshot of a training table (trainer/data/table_input.py)


DATASETS: Registry[Callable[[Config], DatasetFiles]] = Registry("data.dataset")


def build_dataset(cfg: Config) -> DatasetFiles:
    """Resolve `data.dataset`, then `data.split`; call on every rank (each node's local rank 0
    prepares, the others wait)."""
    files = DATASETS.get(cfg.data.dataset)(cfg)
    return split_in_time(files, cfg) if cfg.data.split == "time" else files


def split_in_time(files: DatasetFiles, cfg: Config) -> DatasetFiles:
    """`files`' training and test rows as one log cut in time (trainer/data/time_split.py): the
    split's folders, written on first use into data.cache_dir."""
    data = cfg.data
    log = ",".join(filter(None, (files.train_path, files.eval_path)))
    # rank 0 reads every byte once for the key (the inputs' digests), not every rank
    key = on_rank0(lambda: time_split.cache_key(time_split.input_digests(log, data), data))
    folder = _prepared(Path(data.cache_dir) / f"time-split-{key}",
                       lambda out: time_split.write_time_split(out, log, data))
    summary = json.loads((folder / "_SUCCESS").read_text())
    rows = summary["rows"]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"data.split=time: cut at {data.time_column}={summary['cut']}: {rows['train']} training, "
              f"{rows['valid']} validation, {rows['test']} test rows ({folder})", flush=True)
    return dataclasses.replace(files, train_path=str(folder / "train"), eval_path=str(folder / "test"),
                               valid_path=str(folder / "valid") if rows["valid"] else "")


@DATASETS.register("parquet")
def parquet(cfg: Config) -> DatasetFiles:
    """User files or tables: data.train_path, data.eval_path and a [[features]] schema. A shuffled
    run reads its training table at one snapshot, pinned (trainer/data/table_input.py); time order
    reads the table's snapshots one by one (trainer/data/partitions.py)."""
    data = cfg.data
    needed = ("train_path", "eval_path") if data.split == "given" else ("train_path",)  # a cut makes the test split
    for key in needed:
        if not getattr(data, key):
            raise ValueError(f"data.{key} is empty: the parquet dataset needs it")
    if not cfg.features:
        raise ValueError("features is empty: the parquet dataset needs a [[features]] schema")
    train, pin = (data.train_path, None) if data.order == "time" else pinned_train_files(data, cfg.train.run_dir)
    return DatasetFiles(train, newest_files(data.eval_path, data.catalog), cfg.features,
                        newest_files(data.valid_path, data.catalog), pin)


def _prepared(folder: Path, make: Callable[[Path], dict]) -> Path:
    """`folder` made by each node's local rank 0, into a temporary folder renamed when
    complete, so `folder` only ever exists whole. data.cache_dir may be node-local (each node
    needs its own copy) or shared (nodes and runs may make it at the same time): the first
    rename wins, and a later one never replaces a folder another process may be reading."""
    failure = None
    if _node_leader() and not (folder / "_SUCCESS").exists():
        tmp = folder.with_name(folder.name + f".tmp-{socket.gethostname()}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            summary = make(tmp)
            (tmp / "_SUCCESS").write_text(json.dumps(summary, indent=1, default=str))
            with contextlib.suppress(OSError):  # ENOTEMPTY: another run's folder took the name first
                os.replace(tmp, folder)
        except ValueError as e:  # raised after the barrier: the node's other ranks must not wait on it
            failure = e
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=side_group())
    if failure is not None:
        raise failure
    if not (folder / "_SUCCESS").exists():
        raise ValueError(f"{folder} was not made: this node's local rank 0 failed to make it (its error is in "
                         "its output)")
    return folder


def _node_leader() -> bool:
    """Local rank 0 of this node (rank 0 where no launcher set LOCAL_RANK), or no job at all."""
    if not dist.is_initialized():
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


# The cache folder names each teacher's version: bump it whenever a writer's rows change,
# or runs would go on reading the rows the old code generated into data.cache_dir.
class SynthTeacher(NamedTuple):
    """One `data.synth_teacher`: how its rows are written, their schema, its cache folder."""

    write: Callable[..., dict]
    """write(out, rows=, files=, seed=) -> summary."""
    features: Callable[[], list[FeatureSpec]]
    cache_prefix: str


SYNTH_TEACHERS: dict[str, SynthTeacher] = {
    "default": SynthTeacher(synth_data.write_synthetic, lambda: synth_features(), "synth-v2"),  # defined below
    "capacity": SynthTeacher(capacity_data.write_capacity, lambda: capacity_features(), "synth-capacity-v3"),
    "sequence": SynthTeacher(sequence_log.write_sequence_log, sequence_log.sequence_features, "synth-sequence-v2"),
    "recency": SynthTeacher(functools.partial(sequence_log.write_sequence_log, recency=True),
                            sequence_log.sequence_features, "synth-recency-v2"),
}
assert SYNTH_TEACHERS.keys() == set(get_args(SynthTeacherName)), "one teacher per data.synth_teacher choice"


@DATASETS.register("synth")
def synth(cfg: Config) -> DatasetFiles:
    """Synthetic logs with a hidden teacher (data.synth_teacher: trainer/offline/synth.py or
    trainer/offline/capacity.py), generated on first use."""
    teacher = SYNTH_TEACHERS[cfg.data.synth_teacher]
    rows, seed = cfg.data.synth_rows, cfg.train.seed
    folder = _prepared(Path(cfg.data.cache_dir) / f"{teacher.cache_prefix}-{rows}-seed{seed}",
                       lambda out: teacher.write(out, rows=rows, seed=seed))
    return DatasetFiles(str(folder / "train"), str(folder / "valid"), cfg.features or teacher.features(),
                        cfg.data.valid_path)


@DATASETS.register("movielens")
def movielens(cfg: Config) -> DatasetFiles:
    """MovieLens-100K converted from data.source_dir on first use (trainer/offline/movielens.py)."""
    if not cfg.data.source_dir:
        raise ValueError("data.source_dir is empty: the movielens dataset needs the ml-100k folder")
    if not cfg.features:
        raise ValueError("features is empty: the movielens dataset needs a [[features]] schema "
                         "(see configs/movielens.toml)")
    # v3: with item_genre and the history's side fields hist_ratings and hist_genres
    folder = _prepared(Path(cfg.data.cache_dir) / "movielens-100k-v3",
                       lambda out: convert_movielens(cfg.data.source_dir, out))
    return DatasetFiles(str(folder / "train"), str(folder / "valid"), cfg.features, cfg.data.valid_path)


def declared_features(cfg: Config) -> list[FeatureSpec]:
    """The features a run of `cfg` reads, without preparing its data (what `rankmix plan`
    sizes): the config's schema, or where it gives none, its synthetic teacher's."""
    if cfg.features or cfg.data.dataset != "synth":
        return cfg.features
    return SYNTH_TEACHERS[cfg.data.synth_teacher].features()


def synth_features() -> list[FeatureSpec]:
    """The schema of `write_synthetic`'s columns (default sizes), in semantic groups. Table
    sizes come from synth.py's constants (ids are 1-based, 0 is padding; hour and weekday
    start at 0), so the two cannot drift apart into silent modulo folding."""
    s, f = synth_data, FeatureSpec
    features = [
        f(name="user_id", num_embeddings=s.NUM_USERS + 1, embedding_dim=16, hashing="none", group="user"),
        f(name="user_age", num_embeddings=s.NUM_AGES + 1, embedding_dim=8, group="user"),
        f(name="user_gender", num_embeddings=s.NUM_GENDERS + 1, embedding_dim=4, group="user"),
        f(name="user_activity", kind="numeric", transform=["log1p"], group="user"),
        f(name="item_id", table="item", num_embeddings=s.NUM_ITEMS + 1, embedding_dim=16, hashing="none",
          group="item"),
        f(name="item_category", num_embeddings=s.NUM_CATEGORIES + 1, embedding_dim=8, group="item"),
        f(name="item_tags", kind="id_list", num_embeddings=s.NUM_TAGS + 1, embedding_dim=8, group="item"),
        f(name="item_price", kind="numeric", transform=["log1p"], group="item"),
        f(name="hour", num_embeddings=s.NUM_HOURS, embedding_dim=4, group="context"),
        f(name="weekday", num_embeddings=s.NUM_WEEKDAYS, embedding_dim=4, group="context"),
        f(name="device", num_embeddings=s.NUM_DEVICES + 1, embedding_dim=4, group="context"),
        f(name="hist_items", kind="sequence", table="item", num_embeddings=s.NUM_ITEMS + 1, embedding_dim=16,
          hashing="none", pooling="mean", max_len=s.MAX_HIST, group="behaviour"),
    ]
    return features


def capacity_features() -> list[FeatureSpec]:
    """The schema of `write_capacity`'s columns: its 16 fields in four groups of four, the
    target item, and the behaviour sequence sharing the item's table."""
    c = capacity_data
    features = [FeatureSpec(name=name, num_embeddings=vocab + 1, embedding_dim=16, hashing="none",
                            group=f"fields{i // 4}")
                for i, (name, vocab) in enumerate(zip(c.field_names(), c.FIELD_VOCAB))]
    features += [
        FeatureSpec(name="item", num_embeddings=c.NUM_ITEMS + 1, embedding_dim=16, hashing="none", group="item"),
        FeatureSpec(name="hist", kind="sequence", table="item", num_embeddings=c.NUM_ITEMS + 1, embedding_dim=16,
                    hashing="none", pooling="mean", max_len=c.MAX_HIST, group="behaviour"),
    ]
    return features
