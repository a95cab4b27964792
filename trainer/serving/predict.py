"""`rankmix score --model DIR`: Parquet rows -> the serving artifact's raw inputs -> its
probabilities, for trainer/score.py's Scorer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from embeddings.features import FeatureSpec
from trainer.data.batch import Batch
from trainer.data.encode import RowEncoder, raw_numeric
from trainer.data.ids import encode_ids
from trainer.data.side_fields import check_aligned
from trainer.data.timestamps import TimeGaps
from trainer.serving.export import load


class ArtifactModel:
    """A serving artifact loaded as a server loads it (trainer/serving/export.py `load`)."""

    def __init__(self, folder: str, features: list[FeatureSpec], time_column: str = ""):
        self.folder = folder
        self.features = features  # in the artifact's order (its config.toml), not the encoder's
        self.time_column = time_column  # data.time_column: request times, where a sequence has timestamps
        self.model, self.manifest = load(folder)

    def predict(self, table: pa.Table, encoder: RowEncoder, where: str) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """(logits [B, K] float64, probabilities [B, K] as the artifact gives them, the batch
        of labels and users). The ids are checked here as in training, so that a bad one is
        reported with its file, column and row rather than by the artifact's own check."""
        inputs = raw_inputs(table, self.features, where, self.time_column)
        labels_only = RowEncoder([], encoder.tasks, encoder.user_column)
        batch = labels_only.encode(table, where).to_batch()
        try:
            probs = self.model(*inputs)
        except (RuntimeError, torch.jit.Error) as e:  # the artifact's own checks (e.g. a transform's domain)
            raise ValueError(f"{where}: the model {self.folder} refused the rows: {_message(e)}") from None
        return torch.logit(probs.double()), probs, batch

    def metrics(self) -> dict[str, float]:
        return {}  # an artifact keeps no statistics


def raw_inputs(table: pa.Table, features: list[FeatureSpec], where: str,
               time_column: str = "") -> tuple[torch.Tensor, ...]:
    """The artifact's inputs of `table`: (ids [N] int64, lengths [S, B] int64, numeric [B, F]
    float64 with NaN for nulls), checked as the training pipeline checks them; then, where an
    attended sequence has timestamps, (timestamps [T] int64, now [B] int64) from `time_column`."""
    rows = table.num_rows
    check_aligned(table, features, where)
    ids, lengths = [], []
    for f in features:
        if f.kind == "numeric":
            continue
        values, n = encode_ids(table.column(f.column), f, where, reduce=False)
        ids.append(values)
        lengths.append(np.ones(rows, np.int64) if n is None else n)
    numeric = [raw_numeric(table.column(f.column), f, where) for f in features if f.kind == "numeric"]
    inputs = (torch.from_numpy(np.concatenate(ids) if ids else np.zeros(0, np.int64)),
              torch.from_numpy(np.stack(lengths) if lengths else np.zeros((0, rows), np.int64)),
              torch.from_numpy(np.stack(numeric, axis=1) if numeric else np.zeros((rows, 0))))
    gaps = TimeGaps(features, time_column, 2)
    if not gaps.features:
        return inputs
    gaps.check(table, where)  # the reader's checks: aligned lengths, no null
    stamps = [pc.list_flatten(table.column(f.timestamps)).to_numpy(zero_copy_only=False).astype(np.int64)
              for f in gaps.features]
    now = table.column(time_column).to_numpy().astype(np.int64)
    return (*inputs, torch.from_numpy(np.concatenate(stamps)), torch.from_numpy(now))


def _message(e: Exception) -> str:
    """The check's own words: TorchScript puts them on the last line of its trace."""
    line = next((x for x in reversed(str(e).splitlines()) if x.strip()), type(e).__name__)
    for prefix in ("RuntimeError: ", "AssertionError: "):
        line = line.removeprefix(prefix)
    return line
