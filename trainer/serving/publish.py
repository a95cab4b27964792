"""Publishing while training (`[publish]`): a serving artifact after every N steps or every
data partition, each with a delta against the publish before it; and `rankmix publish
apply`, which builds the next full artifact from a base and a delta.

    <publish.folder>/<name>/    name: step-N, or the partition (date=2026-11-30)
        model.pt2 ...           a `rankmix export` artifact (trainer/serving/export.py)
        tables.pt               every table in fp32 and the managed tables' id maps: the base
                                that `publish apply` patches (quantized rows cannot be patched exactly)
        delta.pt                the table rows changed since the previous publish, every other
                                weight (tokenizer, tower, heads) and the managed tables' id maps whole

The manifest's `publish` entry holds the name, partition, step, the latest logged metrics, the
bytes of the tables and of the model file (full), of delta.pt and their ratio, and the seconds
each stage took.

Which rows changed: for plain tables, TorchRec's ModelDeltaTracker, which records the rows
each lookup reads; the fused sparse optimizer updates no other row. It sees none of the
managed tables' lookups (see `track_lookups`), so their rows are compared bit for bit with the
previous publish's tables.pt. A process's first publish has no delta: the tracker saw none of
the steps before it (after a resume, those since the last publish).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
from torchrec.distributed.model_tracker.types import Trackers
from torchrec.distributed.types import ShardingPlan

from embeddings.managed import served_tables
from trainer.checkpoint import model_tensors, save_weights
from trainer.config import Config
from trainer.config_loader import load_config
from trainer.dist import raise_on_every_rank, side_group
from trainer.safe_load import first_line
from trainer.serving.export import (PUBLISHED, artifact_files, check_widths, out_folder, saved, served_model,
                                    write_artifact)

TABLES_FILE, DELTA_FILE = PUBLISHED
TABLE = "ebc.embedding_bags."  # a served table's weight: TABLE + name + ".weight"
ID_MAP = ("keys", "rows", "miss_rows")  # a managed table's id map (embeddings/managed.py `served_tables`)


class Publisher:
    """Publishes a training run's model as `<folder>/<name>/` (`publish`, collective)."""

    def __init__(self, cfg: Config, model: DistributedModelParallel, run_dir: Path):
        p = cfg.publish
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        self.folder = Path(p.folder) if p.folder else run_dir / "publish"
        self.previous: tuple[str, int] | None = None  # (name, step) of this process's last publish: the delta's base
        if p.every_steps > 0 or p.every_partition:
            check_widths(cfg, p.tables)
            self.tracker = track_lookups(model)

    def due(self, step: int) -> bool:
        """Publish after this step (publish.every_steps)?"""
        every = self.cfg.publish.every_steps
        return every > 0 and step % every == 0

    def publish(self, name: str, step: int, weights: dict, partition: str | None = None) -> Path:
        """Every rank's changed rows to rank 0 and `weights` (checkpoint parts: the model and
        its step) saved, then rank 0 writes the artifact and its delta (collective)."""
        started = time.perf_counter()
        rows = tracked_rows(self.tracker, self.model.plan, dist.get_rank())
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(rows, gathered, dst=0, group=side_group())
        staged = self.folder / ".weights"
        save_weights(staged, weights, step)
        # Every rank reads the whole weights: under a process group, DCP's load is collective.
        tensors = model_tensors(staged)
        error = None
        if dist.get_rank() == 0:
            try:
                self._write(name, step, partition, tensors, gathered, time.perf_counter() - started)
            except ValueError as e:
                error = str(e)
            finally:
                shutil.rmtree(staged.resolve(), ignore_errors=True)  # the artifact holds the weights now
                staged.unlink(missing_ok=True)
        raise_on_every_rank(error)
        self.previous = (name, step)
        return self.folder / name

    def _write(self, name: str, step: int, partition: str | None, tensors: dict[str, torch.Tensor],
               gathered: list[dict], save_seconds: float) -> None:
        """Rank 0: the artifact of the model's whole `tensors`, with tables.pt and delta.pt."""
        tic = time.perf_counter()
        state, id_maps = served_tables(tensors)
        p = self.cfg.publish
        model = served_model(self.cfg, state, id_maps, step, p.tables, f"{self.run_dir} at step {step}")
        files, manifest = artifact_files(self.cfg, model, p.format, p.tables)
        manifest.update(checkpoint=str(self.run_dir), step=step)
        tables, dense = split_tables(state)
        files[TABLES_FILE] = saved(lambda f: torch.save({"tables": tables, "id_maps": _maps(id_maps)}, f))
        artifact_seconds, tic = time.perf_counter() - tic, time.perf_counter()
        delta = None
        if self.previous is not None:
            changed = self._changed_rows(tables, gathered)
            files[DELTA_FILE] = saved(lambda f: torch.save(
                {"base_step": self.previous[1], "manifest": json.dumps(manifest), "dense": dense,
                 "id_maps": _maps(id_maps), "rows": changed, "values": {t: tables[t][r] for t, r in changed.items()}},
                f))
            delta = {"base": self.previous[0], "base_step": self.previous[1], "file": DELTA_FILE,
                     "rows": {t: len(r) for t, r in changed.items()}}
        full = len(files[manifest["file"]])
        manifest["publish"] = {
            "name": name, "partition": partition, "step": step, "metrics": self._latest_metrics(),
            "table_bytes": manifest["table_bytes"], "full_bytes": full,
            "delta_bytes": len(files[DELTA_FILE]) if delta else None,
            "delta_over_full": len(files[DELTA_FILE]) / full if delta else None, "delta": delta,
            "seconds": {"save": save_seconds, "artifact": artifact_seconds, "delta": time.perf_counter() - tic},
            "published_at": time.time()}
        (self.folder / name).parent.mkdir(parents=True, exist_ok=True)  # a partition may be date=.../hour=...
        write_artifact(self.cfg, self.folder / name, files, manifest)

    def _changed_rows(self, tables: dict[str, torch.Tensor], gathered: list[dict]) -> dict[str, torch.Tensor]:
        """Each table's rows changed since the previous publish, ascending: the plain tables'
        rows every rank tracked; the managed tables' rows that differ from the previous tables.pt."""
        pieces: dict[str, list[torch.Tensor]] = {}
        for rows in gathered:
            for table, r in rows.items():
                pieces.setdefault(table, []).append(r)
        changed = {t: torch.unique(torch.cat(rs)) for t, rs in pieces.items()}
        managed = [f.table for f in self.cfg.features if f.hashing == "managed"]
        if managed:
            before = load_tensors(self.folder / self.previous[0] / TABLES_FILE, "the previous publish")["tables"]
            for table in set(managed):
                now, then = tables[table].view(torch.int32), before[table].view(torch.int32)  # bits: -0.0 != 0.0
                changed[table] = (now != then).any(dim=1).nonzero().flatten()
        return {t: changed.get(t, torch.zeros(0, dtype=torch.int64)) for t in sorted(tables)}

    def _latest_metrics(self) -> dict[str, dict]:
        """The last record of each kind (train, eval, valid, ...) in the run's metrics.jsonl."""
        path = self.run_dir / "metrics.jsonl"
        latest = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            latest[record["kind"]] = record
        return latest


def track_lookups(model: DistributedModelParallel) -> ModelDeltaTrackerTrec:
    """TorchRec's ModelDeltaTracker of the plain tables' lookups, stepped by the model's forward.

    Built here rather than by DistributedModelParallel.init_torchrec_delta_tracker, which reads
    `.module` of the model it wraps: there is none at world size 1, where the dense side is not
    DDP-wrapped (embeddings/torchrec_compat.py `ReplicateAcrossRanks`). The managed tables are
    skipped: their sharded collection runs its tables' compute and output dist as two calls,
    and the tracker records lookups in `compute_and_output_dist` only, so it would see none of
    theirs (and their table names, which their MCH modules share, map to the wrong module)."""
    tracker = ModelDeltaTrackerTrec(model, delete_on_read=True, auto_compact=True, fqns_to_skip=["managed_tables"])
    model.model_trackers[Trackers.DELTA_TRACKER.name] = tracker  # DMP's forward steps it
    return tracker


def tracked_rows(tracker: ModelDeltaTrackerTrec, plan: ShardingPlan, rank: int) -> dict[str, torch.Tensor]:
    """The rows of each plain table this rank looked up since the last call, as rows of the
    whole table: the tracker gives a shard's own rows, and a row-wise shard's count from its first."""
    first = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            starts = {s.shard_offsets[0] for s in sharding.sharding_spec.shards if s.placement.rank() == rank}
            assert len(starts) <= 1, f"table {table} has shards of several row ranges on rank {rank}"
            first[table] = starts.pop() if starts else 0
    table_of = {fqn: table for table, fqn in tracker.table_to_fqn.items()}
    return {table_of[fqn]: ids.long().cpu() + first[table_of[fqn]] for fqn, ids in tracker.get_unique_ids().items()}


def split_tables(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Served weights (`served_tables`) -> (tables by name, every other weight by its name)."""
    tables = {k[len(TABLE):-len(".weight")]: v for k, v in state.items() if k.startswith(TABLE)}
    return tables, {k: v for k, v in state.items() if not k.startswith(TABLE)}


def _maps(id_maps: dict[str, tuple]) -> dict[str, dict[str, torch.Tensor]]:
    return {t: dict(zip(ID_MAP, m)) for t, m in id_maps.items()}


def load_tensors(path: Path, what: str) -> dict:
    """A file of tensors in plain containers, read as data (weights_only: nothing in it runs)."""
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{what}: no {path.name} at {path.parent}") from None
    except Exception as e:  # a damaged or foreign file
        raise ValueError(f"{what}: cannot read {path} ({type(e).__name__}: {first_line(e)})") from None


def _published_step(folder: Path, what: str) -> int:
    """The step of the published artifact in `folder`."""
    try:
        return int(json.loads((folder / "manifest.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{what}: no readable manifest.json there (not a published artifact)") from None


def apply(base: str, delta: str, out: str) -> dict:
    """The artifact of `delta` (a published folder, or its delta.pt) applied to `base` (the
    published folder of the delta's base step), written to folder `out`: the next full artifact,
    with its own tables.pt. Returns its manifest."""
    folder = out_folder(out)
    base_path, delta_path = Path(base), Path(delta)
    tables = load_tensors(base_path / TABLES_FILE, f"--base {base}")
    change = load_tensors(delta_path / DELTA_FILE if delta_path.is_dir() else delta_path, f"--delta {delta}")
    base_step = _published_step(base_path, f"--base {base}")
    if change["base_step"] != base_step:
        raise ValueError(f"--delta {delta} applies to the publish of step {change['base_step']}, "
                         f"but --base {base} is of step {base_step}")
    weights = tables["tables"]
    for table, rows in change["rows"].items():
        weights[table][rows] = change["values"][table]
    id_maps = {t: tuple(m[k] for k in ID_MAP) for t, m in change["id_maps"].items()}
    manifest = json.loads(change["manifest"])
    cfg = load_config(str(base_path / "config.toml"), [], allow_redacted=True)
    state = {**{f"{TABLE}{t}.weight": w for t, w in weights.items()}, **change["dense"]}
    model = served_model(cfg, state, id_maps, manifest["step"], manifest["tables"], delta)
    files, _ = artifact_files(cfg, model, manifest["format"], manifest["tables"])
    files[TABLES_FILE] = saved(lambda f: torch.save({"tables": weights, "id_maps": change["id_maps"]}, f))
    write_artifact(cfg, folder, files, manifest)
    return manifest
