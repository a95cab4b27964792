"""`rankmix score`: batch scoring of Parquet files with a trained checkpoint, or with a
serving artifact of `rankmix export` (trainer/serving/predict.py).

Every input file gets an output file, row for row, at the input's path relative to the
inputs' common folder under `--out` (so inputs of one name in different folders each keep
theirs), written to a hidden temporary file and renamed when complete: the kept columns
(the task labels and the user column when present, plus `keep`) and one `pred_<task>`
probability per task. The model runs in evaluation mode, so a Sparse-MoE tower uses its
inference router alone (or the dense training router with model.moe.inference=dense).
When the files carry the task labels, AUC, UAUC and logloss are computed too.
"""

from __future__ import annotations

import os
import posixpath
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from embeddings.hooks import TrainingHooks
from embeddings.sharding import shard_model
from trainer.checkpoint import manager
from trainer.checkpoint.state import ModelState, apply_trained_step
from trainer.config import MAX_BATCH_ROWS, Config
from trainer.data.batch import Batch
from trainer.data.encode import RowEncoder
from trainer.data.store import reason, resolve_files
from trainer.dist import DistEnv, init_distributed
from trainer.metrics.streaming import SplitMetrics
from trainer.ranking_model import build_model
from trainer.run_layout import resolve_checkpoint


def _output_paths(fs, files: list[str], out: str) -> list[Path]:
    """Each input's output: its path relative to the inputs' common folder, under `out`.
    Refuses an input listed twice, and an output that would replace an input."""
    twice = [path for path, n in Counter(files).items() if n > 1]
    if twice:
        raise ValueError(f"--data lists {twice[0]} twice")
    base = posixpath.commonpath([posixpath.dirname(p) for p in files])  # '' for inputs in two buckets
    targets = [Path(out) / (posixpath.relpath(p, base) if base else p) for p in files]
    inputs = {Path(p).resolve(): p for p in files} if fs.type_name == "local" else {}
    for target in targets:
        if target.resolve() in inputs:
            raise ValueError(f"--out {out} would overwrite the input {inputs[target.resolve()]}")
    return targets


class CheckpointModel:
    """A trained checkpoint in evaluation mode (world size 1): Parquet rows -> logits."""

    def __init__(self, cfg: Config, checkpoint_path: str):
        self.cfg = cfg
        self.env: DistEnv = init_distributed(cfg.launch.backend, cfg.train.device)
        if self.env.world_size > 1:
            raise ValueError("rankmix score runs as one process; launch it without torchrun")
        self.model = shard_model(build_model(cfg), cfg.embeddings, self.env.device)  # the tower in fp32
        source = resolve_checkpoint(checkpoint_path, "--checkpoint")
        manager.require_saved_world_size(cfg.features, source, 1, advice=(
            f"; its serving artifact keeps every rank's map: rankmix export --checkpoint {checkpoint_path} "
            "--out DIR, then rankmix score --model DIR"))
        manager.load(source, {"model": ModelState(self.model)})
        apply_trained_step(self.model, manager.trained_step(source))
        self.model.eval()

    def predict(self, table: pa.Table, encoder: RowEncoder, where: str) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """(logits [B, K], probabilities [B, K], the encoded batch: its labels and users)."""
        batch = encoder.encode(table, where).to_batch()
        logits = self.model(batch.to(self.env.device)).float().cpu()
        return logits, torch.sigmoid(logits), batch

    def metrics(self) -> dict[str, float]:
        """The MoE's routing at inference, averaged over the batches scored."""
        out = {}
        for hook in TrainingHooks.of(self.model).metrics:
            out.update({k: v for k, v in hook("eval").items() if k.count("/") == 1})
        return out


class Scorer:
    """Scores Parquet files with a model (a checkpoint, or a serving artifact), writing one
    output file per input file."""

    def __init__(self, cfg: Config, model):
        self.cfg = cfg
        self.model = model
        self.tasks = [t.name for t in cfg.model.tasks]

    def score(self, data: str, out: str, batch_size: int, keep: list[str]) -> dict:
        """Write predictions of every file of `data` into folder `out`; return a summary."""
        if batch_size > MAX_BATCH_ROWS:
            raise ValueError(f"--batch-size {batch_size} is more rows than a batch can hold: at most {MAX_BATCH_ROWS}")
        fs, files = resolve_files(data, retry_seconds=self.cfg.data.retry_seconds,
                                  retry_attempts=self.cfg.data.retry_attempts)
        targets = _output_paths(fs, files, out)
        footers = [_open(fs, path).metadata for path in files]  # a bad file is refused before any output
        names = footers[0].schema.to_arrow_schema().names
        labelled = all(t.label in names for t in self.cfg.model.tasks)  # else predictions only
        user = self.cfg.data.user_column if self.cfg.data.user_column in names else ""
        encoder = RowEncoder(self.cfg.features, self.cfg.model.tasks if labelled else [], user,
                             self.cfg.data.time_column, self.cfg.model.sequence.time_buckets,
                             self.cfg.data.request_column)
        spill = Path(out) if labelled and user else None  # UAUC's rows wait there, in a hidden folder
        rows = sum(footer.num_rows for footer in footers) if spill else 0  # buckets
        scored = 0
        with SplitMetrics(self.tasks, torch.device("cpu"), spill, rows) as metrics:
            for path, target in zip(files, targets):
                for logits, batch in self._score_file(fs, path, target, encoder, batch_size, keep):
                    if labelled:
                        metrics.add(logits, batch.labels, batch.users)
                    scored += len(logits)
            summary = {"files": len(files), "rows": scored, "out": out}
            if labelled and scored:
                summary.update(metrics.compute())
                del summary["examples"]
        summary.update(self.model.metrics())
        return summary

    def _scored(self, kept: pa.Table, probs: np.ndarray) -> pa.Table:
        """The output rows: the kept columns, then one probability column per task."""
        for k, name in enumerate(self.tasks):
            kept = kept.append_column(f"pred_{name}", pa.array(probs[:, k]))
        return kept

    @torch.no_grad()
    def _score_file(self, fs, path: str, target: Path, encoder: RowEncoder, batch_size: int, keep: list[str]):
        """Score one file batch by batch, writing `target` through a hidden temporary file
        renamed when complete; yields (logits [B, K], batch)."""
        parquet = _open(fs, path)
        schema = parquet.schema_arrow
        encoder.check_schema(schema, path)
        kept = _kept_columns(schema.names, keep, encoder, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        writer = None
        try:
            for i, record_batch in enumerate(_batches(parquet, path, batch_size, list(
                    dict.fromkeys(encoder.columns + kept)))):
                table = pa.Table.from_batches([record_batch])
                logits, probs, batch = self.model.predict(table, encoder, f"{path}, batch {i}")
                scored = self._scored(table.select(kept), probs.numpy())
                if writer is None:
                    writer = pq.ParquetWriter(str(tmp), scored.schema)
                writer.write_table(scored)
                yield logits, batch
            if writer is None:  # no rows: still a file, with the columns a scored one has
                empty = self._scored(schema.empty_table().select(kept), np.empty((0, len(self.tasks)), np.float32))
                writer = pq.ParquetWriter(str(tmp), empty.schema)
            writer.close()
            writer = None
            os.replace(tmp, target)
        finally:
            if writer is not None:
                writer.close()
            tmp.unlink(missing_ok=True)


def _open(fs, path: str) -> pq.ParquetFile:
    """`path` as a Parquet file (its footer read); ValueError naming it if it is not one."""
    try:
        return pq.ParquetFile(path, filesystem=fs)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"cannot read Parquet file {path}: {reason(e)}") from None


def _batches(parquet: pq.ParquetFile, path: str, batch_size: int, columns: list[str]):
    """`parquet`'s record batches; a page that cannot be read is a ValueError naming `path`."""
    try:
        yield from parquet.iter_batches(batch_size, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"cannot read Parquet file {path}: {reason(e)}") from None


def _kept_columns(names: list[str], keep: list[str], encoder: RowEncoder, path: str) -> list[str]:
    """Label and user columns that exist, then `keep` ('*': every column) in order."""
    if keep == ["*"]:
        return list(names)
    missing = [c for c in keep if c not in names]
    if missing:
        raise ValueError(f"{path}: --keep names missing columns {missing}")
    default = [t.label for t in encoder.tasks] + ([encoder.user_column] if encoder.user_column else [])
    return list(dict.fromkeys(c for c in default + keep if c in names))
