"""Publishing while training (`[publish]`): a serving artifact after every N steps or every
data partition, each with a delta against the publish before it; and `rankmix publish
apply`, which builds the next full artifact from a base and a delta.

    <publish.folder>/<name>/    name: step-N, or the partition (date=2026-11-30)
        model.pt2 ...           a `rankmix export` artifact (trainer/serving/export.py)
        tables.pt               every table in fp32 and the managed tables' id maps: the base
                                that `publish apply` patches (quantized rows cannot be patched exactly)
        delta.pt                the table rows changed since the previous publish, every other
                                weight (tokenizer, tower, heads) and the managed tables' id maps whole,
                                and the digest of its base's tables.pt content (`tables_digest`)

The manifest's `publish` entry holds the name, partition, step, the latest logged metrics, the
bytes of the tables and of the model file (full), of delta.pt and their ratio, and the seconds
each stage took.

Which rows changed: for plain tables, TorchRec's ModelDeltaTracker, which records the rows
each lookup reads; the fused sparse optimizer updates no other row. It sees none of the
managed tables' lookups (see `track_lookups`), so their rows are compared bit for bit with the
previous publish's tables.pt. A process's first publish has no delta: the tracker saw none of
the steps before it (after a resume, those since the last publish).

A delta names its base by content, not only by step: another run's publish of the same step
has other tables, and patching them would mix two models. `apply` refuses any base whose
tables.pt content digest differs from the one the delta was made against; an artifact that
`apply` built has the digest of the publish it reproduces, so deltas chain.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import get_args

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
from torchrec.distributed.model_tracker.types import Trackers
from torchrec.distributed.types import ShardingPlan

from embeddings.managed import MANAGED_COLLECTIONS, served_tables
from trainer.checkpoint.manager import model_tensors, save_weights
from trainer.checkpoint.safe_load import first_line
from trainer.config import ArtifactFormat, Config, ServedTables
from trainer.config_loader import load_config
from trainer.dist import raise_on_every_rank, side_group
from trainer.run_layout import CONFIG, RunFolder
from trainer.serving.export import (
    PUBLISHED,
    artifact_files,
    check_widths,
    out_folder,
    saved,
    served_model,
    write_artifact,
)

TABLES_FILE, DELTA_FILE = PUBLISHED
TABLE = "ebc.embedding_bags."  # a served table's weight: TABLE + name + ".weight"
ID_MAP = ("keys", "rows", "miss_rows")  # a managed table's id map (embeddings/managed.py `served_tables`)
DELTA_KEYS = {"base_step", "manifest", "dense", "id_maps", "rows", "values"}  # and base_digest, since issue 38


class Publisher:
    """Publishes a training run's model as `<folder>/<name>/` (`publish`, collective), for the
    training loop's publishing component (trainer/components/publisher.py, [publish]): after every
    publish.every_steps steps and at every partition's end (publish.every_partition). Built
    before the run is restored: it tracks lookups from there (a restore looks none up).
    `previous` is its state: the delta's base."""

    def __init__(self, cfg: Config, model: DistributedModelParallel, run_dir: Path):
        p = cfg.publish
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        self.folder = RunFolder(run_dir, publish_folder=p.folder).publish
        # (name, step, tables_digest) of this process's last publish: the delta's base (the digest on rank 0 only)
        self.previous: tuple[str, int, str | None] | None = None
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
        error, digest = None, None
        if dist.get_rank() == 0:
            try:
                # rank 0 alone reads the whole weights: one whole-model copy in the job, not one per rank
                tensors = model_tensors(staged)
                digest = self._write(name, step, partition, tensors, gathered, time.perf_counter() - started)
            except ValueError as e:
                error = str(e)
            finally:
                shutil.rmtree(staged.resolve(), ignore_errors=True)  # the artifact holds the weights now
                staged.unlink(missing_ok=True)
        raise_on_every_rank(error)
        self.previous = (name, step, digest)
        return self.folder / name

    def _write(self, name: str, step: int, partition: str | None, tensors: dict[str, torch.Tensor],
               gathered: list[dict], save_seconds: float) -> str:
        """Rank 0: the artifact of the model's whole `tensors`, with tables.pt and delta.pt;
        returns the digest of its tables.pt content, the next delta's base."""
        tic = time.perf_counter()
        state, id_maps = served_tables(tensors)
        p = self.cfg.publish
        model = served_model(self.cfg, state, id_maps, step, p.tables, f"{self.run_dir} at step {step}")
        files, manifest = artifact_files(self.cfg, model, p.format, p.tables)
        manifest.update(checkpoint=str(self.run_dir), step=step)
        tables, dense = split_tables(state)
        files[TABLES_FILE] = saved(lambda f: torch.save({"tables": tables, "id_maps": _maps(id_maps)}, f))
        digest = tables_digest(tables, _maps(id_maps))
        artifact_seconds, tic = time.perf_counter() - tic, time.perf_counter()
        delta = None
        if self.previous is not None:
            changed = self._changed_rows(tables, gathered)
            files[DELTA_FILE] = saved(lambda f: torch.save(
                {"base_step": self.previous[1], "base_digest": self.previous[2], "manifest": json.dumps(manifest),
                 "dense": dense, "id_maps": _maps(id_maps), "rows": changed,
                 "values": {t: tables[t][r] for t, r in changed.items()}},
                f))
            delta = {"base": self.previous[0], "base_step": self.previous[1], "base_digest": self.previous[2],
                     "file": DELTA_FILE, "rows": {t: len(r) for t, r in changed.items()}}
        full = len(files[manifest["file"]])
        manifest["publish"] = {
            "name": name, "partition": partition, "step": step, "metrics": self._latest_metrics(),
            "table_bytes": manifest["table_bytes"], "tables_digest": digest, "full_bytes": full,
            "delta_bytes": len(files[DELTA_FILE]) if delta else None,
            "delta_over_full": len(files[DELTA_FILE]) / full if delta else None, "delta": delta,
            "seconds": {"save": save_seconds, "artifact": artifact_seconds, "delta": time.perf_counter() - tic},
            "published_at": time.time()}
        (self.folder / name).parent.mkdir(parents=True, exist_ok=True)  # a partition may be date=.../hour=...
        write_artifact(self.cfg, self.folder / name, files, manifest)
        return digest

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
        path = RunFolder(self.run_dir).metrics
        latest = {}
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            latest[record["kind"]] = record
        return latest


def track_lookups(model: DistributedModelParallel) -> ModelDeltaTrackerTrec:
    """TorchRec's ModelDeltaTracker of the plain tables' lookups, stepped by the model's forward.

    Built here rather than by DistributedModelParallel.init_torchrec_delta_tracker, which reads
    `.module` of the model it wraps: there is none at world size 1, where the dense side is not
    DDP-wrapped (embeddings/torchrec_compat.py `ReplicateAcrossRanks`). The managed tables (of
    bags and of attended sequences) are skipped: their sharded collections run their tables'
    compute and output dist as two calls, and the tracker records lookups in
    `compute_and_output_dist` only, so it would see none of theirs (and their table names, which
    their MCH modules share, map to the wrong module)."""
    managed = [path for path, _, _ in MANAGED_COLLECTIONS]
    tracker = ModelDeltaTrackerTrec(model, delete_on_read=True, auto_compact=True, fqns_to_skip=managed)
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


def tables_digest(tables: dict[str, torch.Tensor], id_maps: dict[str, dict[str, torch.Tensor]]) -> str:
    """sha256 of a tables.pt's content: every table's and id map's name, dtype, shape and bytes,
    in name order. Content, not the file's bytes, so that an artifact `apply` built, whose
    tables.pt is another file of the same tensors, is the base of the next delta."""
    h = hashlib.sha256()
    named = sorted(tables.items())
    named += [(f"{t}/{key}", m[key]) for t, m in sorted(id_maps.items()) for key in ID_MAP]
    for name, tensor in named:
        h.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


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


def _base_tables(base: str) -> tuple[dict, int]:
    """(tables.pt's content, step) of the published folder `base`."""
    what, folder = f"--base {base}", Path(base)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what} is a file: give a published artifact's folder (it holds {TABLES_FILE})")
    loaded = load_tensors(folder / TABLES_FILE, what)
    tables, maps = (loaded.get(key) if isinstance(loaded, dict) else None for key in ("tables", "id_maps"))
    if not (_tensors(tables) and _id_maps(maps)):
        raise ValueError(f"{what}: {folder / TABLES_FILE} is not a published tables file")
    return loaded, _published_step(folder, what)


def _delta(delta: str) -> dict:
    """The delta `delta` names: a published folder's delta.pt, or the file itself."""
    path = Path(delta)
    change = load_tensors(path / DELTA_FILE if path.is_dir() else path, f"--delta {delta}")
    if not (isinstance(change, dict) and change.keys() >= DELTA_KEYS and _tensors(change["rows"])
            and _tensors(change["values"]) and _tensors(change["dense"]) and _id_maps(change["id_maps"])
            and _artifact_manifest(change["manifest"])):
        raise ValueError(f"--delta {delta} is not a delta: give the published folder after the base, "
                         f"or its {DELTA_FILE}")
    return change


def _artifact_manifest(text) -> bool:
    """Is `text` an artifact's manifest, with what `apply` reads of it?"""
    try:
        manifest = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return False
    return (isinstance(manifest, dict) and type(manifest.get("step")) is int
            and manifest.get("format") in get_args(ArtifactFormat) and manifest.get("tables") in get_args(ServedTables))


def _tensors(d) -> bool:
    return isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items())


def _id_maps(maps) -> bool:
    return isinstance(maps, dict) and all(isinstance(m, dict) and m.keys() == set(ID_MAP) and _tensors(m)
                                          for m in maps.values())


def _check_base(base: str, delta: str, tables: dict, base_step: int, change: dict) -> None:
    """The delta was made against exactly `base`'s tables: the same step and the same content."""
    if change["base_step"] != base_step:
        raise ValueError(f"--delta {delta} applies to the publish of step {change['base_step']}, "
                         f"but --base {base} is of step {base_step}")
    wanted = change.get("base_digest")
    if not isinstance(wanted, str):
        raise ValueError(f"--delta {delta} names its base by step only (an older rankmix wrote it), so it cannot "
                         f"be checked against --base {base}: apply deltas of this version's publishes")
    digest = tables_digest(tables["tables"], tables["id_maps"])
    if digest != wanted:
        raise ValueError(f"--delta {delta} was made against tables of digest {wanted[:16]}, but --base {base} "
                         f"holds tables of digest {digest[:16]}: another run's or another publish's tables, "
                         f"though of the same step; a delta applies to its own base only")


def _check_rows(delta: str, weights: dict[str, torch.Tensor], change: dict) -> None:
    """Every changed row lies in a table of the base, with values of its width and dtype."""
    for table, rows in change["rows"].items():
        weight, values = weights.get(table), change["values"].get(table)
        ok = (weight is not None and values is not None and rows.dtype == torch.int64 and rows.dim() == 1
              and values.dtype == weight.dtype and values.shape == (len(rows), *weight.shape[1:])
              and (len(rows) == 0 or 0 <= int(rows.min()) and int(rows.max()) < len(weight)))
        if not ok:
            raise ValueError(f"--delta {delta}: the changed rows of table {table} do not fit the base's tables")


def apply(base: str, delta: str, out: str) -> dict:
    """The artifact of `delta` (a published folder, or its delta.pt) applied to `base` (the
    published folder whose tables the delta was made against: same step, same content), written
    to folder `out`: the next full artifact, with its own tables.pt. Returns its manifest."""
    folder = out_folder(out)
    tables, base_step = _base_tables(base)
    change = _delta(delta)
    _check_base(base, delta, tables, base_step, change)
    weights = tables["tables"]
    _check_rows(delta, weights, change)
    for table, rows in change["rows"].items():
        weights[table][rows] = change["values"][table]
    id_maps = {t: tuple(m[k] for k in ID_MAP) for t, m in change["id_maps"].items()}
    manifest = json.loads(change["manifest"])
    cfg = load_config(str(Path(base) / CONFIG), [], allow_redacted=True)  # the artifact keeps the run's config
    state = {**{f"{TABLE}{t}.weight": w for t, w in weights.items()}, **change["dense"]}
    model = served_model(cfg, state, id_maps, manifest["step"], manifest["tables"], delta)
    files, _ = artifact_files(cfg, model, manifest["format"], manifest["tables"])
    files[TABLES_FILE] = saved(lambda f: torch.save({"tables": weights, "id_maps": change["id_maps"]}, f))
    write_artifact(cfg, folder, files, manifest)
    return manifest
