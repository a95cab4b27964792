"""`rankmix score --model DIR`: Parquet rows -> the serving artifact's raw inputs -> its
probabilities, for trainer/score.py's Scorer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from embeddings.features import FeatureSpec
from trainer.data.batch import Batch
from trainer.data.encode import RowEncoder, raw_numeric
from trainer.data.ids import encode_ids
from trainer.serving.export import load


class ArtifactModel:
    """A serving artifact loaded as a server loads it (trainer/serving/export.py `load`)."""

    def __init__(self, folder: str, features: list[FeatureSpec]):
        self.folder = folder
        self.features = features  # in the artifact's order (its config.toml), not the encoder's
        self.model, self.manifest = load(folder)

    def predict(self, table: pa.Table, encoder: RowEncoder, where: str) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """(logits [B, K] float64, probabilities [B, K] as the artifact gives them, the batch
        of labels and users). The ids are checked here as in training, so that a bad one is
        reported with its file, column and row rather than by the artifact's own check."""
        ids, lengths, numeric = raw_inputs(table, self.features, where)
        labels_only = RowEncoder([], encoder.tasks, encoder.user_column)
        batch = labels_only.encode(table, where).to_batch()
        try:
            probs = self.model(ids, lengths, numeric)
        except (RuntimeError, torch.jit.Error) as e:  # the artifact's own checks (e.g. a transform's domain)
            raise ValueError(f"{where}: the model {self.folder} refused the rows: {_message(e)}") from None
        return torch.logit(probs.double()), probs, batch

    def metrics(self) -> dict[str, float]:
        return {}  # an artifact keeps no statistics


def raw_inputs(table: pa.Table, features: list[FeatureSpec], where: str) -> tuple[torch.Tensor, ...]:
    """The artifact's inputs of `table`: (ids [N] int64, lengths [S, B] int64, numeric [B, F]
    float64 with NaN for nulls), checked as the training pipeline checks them."""
    rows = table.num_rows
    ids, lengths = [], []
    for f in features:
        if f.kind == "numeric":
            continue
        values, n = encode_ids(table.column(f.column), f, where, reduce=False)
        ids.append(values)
        lengths.append(np.ones(rows, np.int64) if n is None else n)
    numeric = [raw_numeric(table.column(f.column), f, where) for f in features if f.kind == "numeric"]
    return (torch.from_numpy(np.concatenate(ids) if ids else np.zeros(0, np.int64)),
            torch.from_numpy(np.stack(lengths) if lengths else np.zeros((0, rows), np.int64)),
            torch.from_numpy(np.stack(numeric, axis=1) if numeric else np.zeros((rows, 0))))


def _message(e: Exception) -> str:
    """The check's own words: TorchScript puts them on the last line of its trace."""
    line = next((x for x in reversed(str(e).splitlines()) if x.strip()), type(e).__name__)
    for prefix in ("RuntimeError: ", "AssertionError: "):
        line = line.removeprefix(prefix)
    return line
