"""`rankmix score --model DIR`: Parquet rows -> the serving artifact's raw inputs -> its
probabilities, for trainer/score.py's Scorer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from embeddings.features import FeatureSpec, shared_sequences
from trainer.data.batch import Batch
from trainer.data.encode import RowEncoder, raw_numeric
from trainer.data.ids import encode_ids
from trainer.data.requests import check_shared, holders, keep_held, request_rows
from trainer.data.side_fields import check_aligned, list_lengths
from trainer.data.timestamps import TimeGaps
from trainer.serving.export import load


class ArtifactModel:
    """A serving artifact loaded as a server loads it (trainer/serving/export.py `load`)."""

    def __init__(self, folder: str, features: list[FeatureSpec], time_column: str = "", request_column: str = ""):
        self.folder = folder
        self.features = features  # in the artifact's order (its config.toml), not the encoder's
        self.time_column = time_column  # data.time_column: request times, where a sequence has timestamps
        self.model, self.manifest = load(folder)
        # data.request_column, where the artifact takes requests (an older one's manifest lists no inputs)
        self.request_column = request_column if "holders" in self.manifest.get("inputs", ()) else ""

    def predict(self, table: pa.Table, encoder: RowEncoder, where: str) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        """(logits [B, K] float64, probabilities [B, K] as the artifact gives them, the batch
        of labels and users). The ids are checked here as in training, so that a bad one is
        reported with its file, column and row rather than by the artifact's own check."""
        inputs = raw_inputs(table, self.features, where, self.time_column, self.request_column)
        labels_only = RowEncoder([], encoder.tasks, encoder.user_column)
        batch = labels_only.encode(table, where).to_batch()
        try:
            probs = self.model(*inputs)
        except (RuntimeError, torch.jit.Error) as e:  # the artifact's own checks (e.g. a transform's domain)
            raise ValueError(f"{where}: the model {self.folder} refused the rows: {_message(e)}") from None
        return torch.logit(probs.double()), probs, batch

    def metrics(self) -> dict[str, float]:
        return {}  # an artifact keeps no statistics


def raw_inputs(table: pa.Table, features: list[FeatureSpec], where: str, time_column: str = "",
               request_column: str = "") -> tuple[torch.Tensor, ...]:
    """The artifact's inputs of `table`: (ids [N] int64, lengths [S, B] int64, numeric [B, F]
    float64 with NaN for nulls), checked as the training pipeline checks them; then, where an
    attended sequence has timestamps, (timestamps [T] int64, now [B] int64) from `time_column`;
    then, with `request_column` (data.request_column), (holders [R], request [B]): each request's
    shared sequences sent once, at its first row, after checking that its rows agree."""
    rows = table.num_rows
    check_aligned(table, features, where)
    first = request_rows(table, request_column, where)[1] if request_column else None
    shared = {f.name for f in shared_sequences(features)} if request_column else set()
    requests = holders(first) if request_column else None  # (is_holder [B], holders [R], request [B])
    ids, lengths = [], []
    for f in features:
        if f.kind == "numeric":
            continue
        values, n = encode_ids(table.column(f.column), f, where, reduce=False)
        n = np.ones(rows, np.int64) if n is None else n
        if f.name in shared:
            check_shared(np.r_[0, np.cumsum(n)], values, first, table, where, f.column, request_column)
            values, n = keep_held(values, n, requests[0])
        ids.append(values)
        lengths.append(n)
    numeric = [raw_numeric(table.column(f.column), f, where) for f in features if f.kind == "numeric"]
    inputs = (torch.from_numpy(np.concatenate(ids) if ids else np.zeros(0, np.int64)),
              torch.from_numpy(np.stack(lengths) if lengths else np.zeros((0, rows), np.int64)),
              torch.from_numpy(np.stack(numeric, axis=1) if numeric else np.zeros((rows, 0))))
    gaps = TimeGaps(features, time_column, 2)
    if gaps.features:
        gaps.check(table, where)  # the reader's checks: aligned lengths, no null
        stamps = []
        now = table.column(time_column).to_numpy().astype(np.int64)
        if any(f.name in shared for f in gaps.features):  # one request, one time: the same gaps in all its rows
            check_shared(None, now, first, table, where, time_column, request_column)
        for f in gaps.features:
            values = pc.list_flatten(table.column(f.timestamps)).to_numpy(zero_copy_only=False).astype(np.int64)
            if f.name in shared:
                n = list_lengths(table.column(f.timestamps))
                check_shared(np.r_[0, np.cumsum(n)], values, first, table, where, f.timestamps, request_column)
                values = keep_held(values, n, requests[0])[0]
            stamps.append(values)
        inputs += (torch.from_numpy(np.concatenate(stamps)), torch.from_numpy(now))
    if requests is None:
        return inputs
    return (*inputs, torch.from_numpy(requests[1]), torch.from_numpy(requests[2]))


def _message(e: Exception) -> str:
    """The check's own words: TorchScript puts them on the last line of its trace."""
    line = next((x for x in reversed(str(e).splitlines()) if x.strip()), type(e).__name__)
    for prefix in ("RuntimeError: ", "AssertionError: "):
        line = line.removeprefix(prefix)
    return line
