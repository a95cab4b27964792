"""A synthetic log where model capacity matters (`rankmix data synth --teacher capacity`,
`data.synth_teacher = "capacity"`). It is NOT real data: every label comes from the hidden
teacher below, built so that a first-order model is far from the best possible AUC.

Columns: NUM_FIELDS categorical fields `f00`..`f15` (vocabularies of 10 to 7,000 ids),
a target `item` (2,000 ids) and `hist`, the 1 to 20 items the user saw before; every id is
drawn from a Zipf law (exponent 1.1) over a random order of its vocabulary, so a few ids are
frequent and most are rare. `user_id` repeats field USER_FIELD (5,000 ids) for UAUC.
Labels: `click`.

Teacher. Every id v of field f has a latent vector u_f[v] of LATENT_DIM N(0, 1) values and
a scalar bias. The click logit is
    BIAS + first-order biases
         + sum over PAIRS random field pairs      <u_a, u_b>
         + sum over TRIPLES random field triples  sum_k u_a[k] u_b[k] u_c[k]
         + sum over QUADS random field quadruples sum_k u_a[k] u_b[k] u_c[k] u_d[k]
           (the fields of pairs, triples and quadruples drawn among the CROSSED smallest)
         + <mean of u_item over hist, u_item[item]>   (the behaviour sequence)
each order scaled to the standard deviation in ORDER_STD. The interaction terms have mean
zero for every single id, so no first-order model can use them.

Rows are generated in chunks of CHUNK_ROWS, chunk i from a generator seeded with
(seed, 2, i), and streamed into the Parquet files one row group at a time: memory is one
chunk whatever the number of rows, and the rows do not depend on the number of files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from trainer.offline.synth import FIRST_SECOND

NUM_FIELDS = 16
# Vocabularies small enough that a few hundred thousand rows teach every frequent id its
# embedding: what separates the towers is then how well they learn the crosses.
FIELD_VOCAB = [10, 20, 50, 100, 200, 500, 1_000, 2_000, 30, 5_000, 300, 3_000, 40, 700, 70, 7_000]
NUM_ITEMS = 2_000
MAX_HIST = 20
LATENT_DIM = 4
ZIPF_EXPONENT = 1.1
USER_FIELD = 9  # its ids double as user ids
PAIRS, TRIPLES, QUADS = 8, 16, 8
# Crosses are drawn among the CROSSED fields of fewest ids (10 to 200): every combination of
# a triple recurs often enough to be learnt; the larger fields add first-order signal and noise.
CROSSED = 8
ORDER_STD = {"first": 0.4, "pairs": 0.7, "triples": 1.2, "quads": 0.8, "sequence": 0.7}
BIAS = -1.6
CHUNK_ROWS = 65_536


def field_names() -> list[str]:
    return [f"f{i:02d}" for i in range(NUM_FIELDS)]


@dataclass(frozen=True)
class _Teacher:
    """Hidden state; tables are indexed by id (0 is padding and never drawn)."""

    cdfs: list[np.ndarray]  # per field, then the item: Zipf CDF over popularity ranks
    orders: list[np.ndarray]  # per field, then the item: rank -> id
    biases: list[np.ndarray]
    latents: list[np.ndarray]  # [vocab + 1, LATENT_DIM]
    pairs: np.ndarray  # [PAIRS, 2] field indices
    triples: np.ndarray  # [TRIPLES, 3]
    quads: np.ndarray  # [QUADS, 4]


def _teacher(seed: int) -> _Teacher:
    rng = np.random.default_rng([seed, 1])
    vocab = [*FIELD_VOCAB, NUM_ITEMS]
    crossed = np.argsort(FIELD_VOCAB, kind="stable")[:CROSSED]  # the fields of fewest ids
    ranks = [np.arange(1, n + 1, dtype=np.float64) ** -ZIPF_EXPONENT for n in vocab]
    return _Teacher(
        cdfs=[np.cumsum(w) / w.sum() for w in ranks],
        orders=[rng.permutation(n) + 1 for n in vocab],
        biases=[np.r_[0.0, rng.normal(size=n)] for n in vocab],
        latents=[np.vstack([np.zeros(LATENT_DIM), rng.normal(size=(n, LATENT_DIM))]) for n in vocab],
        pairs=crossed[np.array([rng.choice(CROSSED, 2, replace=False) for _ in range(PAIRS)])],
        triples=crossed[np.array([rng.choice(CROSSED, 3, replace=False) for _ in range(TRIPLES)])],
        quads=crossed[np.array([rng.choice(CROSSED, 4, replace=False) for _ in range(QUADS)])])


def _draw(teacher: _Teacher, which: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` Zipf-distributed ids of field `which` (NUM_FIELDS: the item)."""
    rank = np.searchsorted(teacher.cdfs[which], rng.random(n), side="right")
    return teacher.orders[which][np.minimum(rank, len(teacher.orders[which]) - 1)]


def _crosses(teacher: _Teacher, u: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The interaction terms of every order from the rows' latent vectors [n, LATENT_DIM]."""
    def product(fields: np.ndarray) -> np.ndarray:
        out = np.ones_like(u[0])
        for f in fields:
            out = out * u[f]
        return out.sum(axis=1)
    return {
        "pairs": sum(product(p) for p in teacher.pairs) / np.sqrt(PAIRS * LATENT_DIM),
        "triples": sum(product(t) for t in teacher.triples) / np.sqrt(TRIPLES * LATENT_DIM),
        "quads": sum(product(q) for q in teacher.quads) / np.sqrt(QUADS * LATENT_DIM),
    }


def _chunk(teacher: _Teacher, seed: int, index: int, n: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Chunk `index` of the row stream: (rows, teacher logit, first-order part of it)."""
    rng = np.random.default_rng([seed, 2, index])
    ids = [_draw(teacher, f, rng, n) for f in range(NUM_FIELDS)]
    item = _draw(teacher, NUM_FIELDS, rng, n)
    lengths = rng.integers(1, MAX_HIST + 1, n)
    hist = _draw(teacher, NUM_FIELDS, rng, int(lengths.sum()))
    offsets = np.r_[0, np.cumsum(lengths)]
    item_latent = teacher.latents[NUM_FIELDS]
    hist_mean = np.add.reduceat(item_latent[hist], offsets[:-1], axis=0) / lengths[:, None]
    first = sum(teacher.biases[f][ids[f]] for f in range(NUM_FIELDS)) + teacher.biases[NUM_FIELDS][item]
    terms = _crosses(teacher, [teacher.latents[f][ids[f]] for f in range(NUM_FIELDS)])
    terms["first"] = first / np.sqrt(NUM_FIELDS + 1)
    terms["sequence"] = (hist_mean * item_latent[item]).sum(axis=1) * np.sqrt(MAX_HIST / (2 * LATENT_DIM))
    logit = BIAS + sum(ORDER_STD[k] * v for k, v in terms.items())
    click = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    columns = {name: pa.array(v) for name, v in zip(field_names(), ids)}
    columns["user_id"] = columns[field_names()[USER_FIELD]]
    columns["item"] = pa.array(item)
    columns["hist"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(hist))
    columns["click"] = pa.array(click)
    # one request a second in row order (the times draw nothing): data.split=time can cut the log
    columns["request_time"] = pa.array(FIRST_SECOND + index * CHUNK_ROWS + np.arange(n, dtype=np.int64))
    return pa.table(columns), logit, BIAS + ORDER_STD["first"] * terms["first"]


def check_split_sizes(rows: int, valid_fraction: float, files: int, row_group_size: int) -> None:
    """A generated log's sizes: positive, and a split that leaves rows on both sides."""
    for name, value in (("rows", rows), ("files", files), ("row_group_size", row_group_size)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0 < valid_fraction < 1 or rows < 2:
        raise ValueError(f"valid_fraction={valid_fraction} of rows={rows} must leave rows in both splits")


def write_capacity(out_dir: str | os.PathLike, *, rows: int = 2_000_000, valid_fraction: float = 0.1,
                   files: int = 8, row_group_size: int = 65_536, seed: int = 0) -> dict:
    """Write train/ and valid/ Parquet parts under out_dir, streaming; return a summary with
    the rows, the click rate and, on the valid split, the AUC of the teacher's own logit and
    of its first-order part alone (the best any first-order model can do, in expectation)."""
    check_split_sizes(rows, valid_fraction, files, row_group_size)
    teacher = _teacher(seed)
    valid_rows = min(rows - 1, max(1, round(rows * valid_fraction)))
    splits = {"train": (0, rows - valid_rows, files), "valid": (rows - valid_rows, rows, max(1, files // 4))}
    clicks, valid_scores = 0, []
    for split, (start, stop, nfiles) in splits.items():
        folder = Path(out_dir) / split
        folder.mkdir(parents=True, exist_ok=True)
        bounds = np.linspace(start, stop, nfiles + 1).astype(np.int64)
        for i in range(nfiles):
            with pq.ParquetWriter(folder / f"part-{i:05d}.parquet", _schema()) as writer:
                for table, logit, first in _rows(teacher, seed, int(bounds[i]), int(bounds[i + 1]), row_group_size):
                    writer.write_table(table, row_group_size=row_group_size)
                    clicks += int(np.sum(table["click"]))
                    if split == "valid":
                        valid_scores.append((table["click"].to_numpy(), logit, first))
    labels, logits, firsts = (np.concatenate(v) for v in zip(*valid_scores))
    return {"train_rows": rows - valid_rows, "valid_rows": valid_rows, "ctr": clicks / rows,
            "teacher_auc": _auc(logits, labels), "first_order_auc": _auc(firsts, labels)}


def _schema() -> pa.Schema:
    return pa.schema([*((name, pa.int64()) for name in field_names()), ("user_id", pa.int64()), ("item", pa.int64()),
                      ("hist", pa.list_(pa.int64())), ("click", pa.int64()),
                      ("request_time", pa.int64())])


def _rows(teacher: _Teacher, seed: int, lo: int, hi: int, row_group_size: int):
    """Rows [lo, hi) of the stream, in pieces of at most row_group_size rows that never
    straddle a generator chunk: (table, logit, first-order logit) each."""
    pos, drawn = lo, None
    while pos < hi:
        index, offset = divmod(pos, CHUNK_ROWS)
        if drawn is None or drawn[0] != index:  # whole chunks: rows do not depend on where files cut
            drawn = (index, *_chunk(teacher, seed, index, CHUNK_ROWS))
        _, table, logit, first = drawn
        take = min(hi - pos, CHUNK_ROWS - offset, row_group_size)
        yield table.slice(offset, take), logit[offset:offset + take], first[offset:offset + take]
        pos += take


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    # on use: torchmetrics takes 0.5 s to import, and datasets.py and `rankmix sweep` read this module's schema only
    from trainer.metrics.ranking import auc

    return auc(torch.from_numpy(scores), torch.from_numpy(labels))
