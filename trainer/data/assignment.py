"""Which rows each rank reads, in which order: the row groups' pieces, slices and windows.

Assignment. Every rank lists the same row groups (from the files' footers, trainer/data/identity.py).
Each epoch orders them (shuffled with (seed, epoch) unless shuffle is off) and lays them end to
end as one sequence of N rows; a rank's share of that sequence is a list of *pieces*,
(row group, start, stop) row ranges, so ranks read disjoint rows whatever the number and
sizes of the row groups, in training and evaluation alike:

- by default rank r of W takes the contiguous slice [r*N/W, (r+1)*N/W): every rank gets
  N/W rows (+-1) and decodes only the row groups its slice touches.
- unshuffled training (shuffle=False, drop_last=True, W > 1) interleaves at batch
  granularity: rank r takes rows [k*W*B + r*B, k*W*B + (r+1)*B) for k = 0, 1, ... Global
  step k is then rows [k*W*B, (k+1)*W*B) in file order, the batch one rank with batch W*B
  reads, so runs at different world sizes train on the same global batches. The price:
  a row group larger than W*B rows is decoded by every rank (each keeps its pieces).

Data loss. A training epoch is steps_in_epoch = min over ranks of (rank rows // B) steps
on every rank (all ranks compute it from the footers they agree on), so at most
W*B - 1 rows of an epoch are not trained on: contiguous slices leave each rank fewer than
B rows of its own plus at most W-1 rows of imbalance; interleaving leaves only the last,
partial round of W*B rows. `epoch_rows(epoch)` gives the split's rows and the rows used.

Windows. A rank's pieces are cut into *slices* where their row group's rows cross a
multiple of SLICE_ROWS (a piece within one slice stays whole), and the slices are grouped
into *windows* of at least `shuffle_buffer` rows, each read and shuffled at once
(trainer/data/reader.py). The batches a rank has yielded in the epoch fix its position
exactly: the state is just (epoch, step).

Elastic resume. At another world size a position inside an epoch resumes through the units
each rank had left (trainer/data/elastic.py): they become the resumed epoch's sequence of rows
(`resumed`), which the new ranks split as above.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trainer.data.elastic import units_left
from trainer.data.options import ReaderOptions

SLICE_ROWS = 65_536  # rows decoded at once: a larger row group is read in slices of this size


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file, as its footer describes it."""

    path: str
    index: int
    num_rows: int
    first: int = 0  # the row group's row this range starts at (a validation share is its tail)


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one row group: the unit of sharding and reading."""

    group: RowGroup
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class EpochRows:
    """What one epoch makes of the split: for reporting the rows training leaves out."""

    rows: int  # rows in the split
    used: int  # rows the epoch's batches consume over all ranks (every row in evaluation)

    @property
    def dropped(self) -> int:
        return self.rows - self.used


def holdout_split(groups: list[RowGroup], options: ReaderOptions, source: str) -> list[RowGroup]:
    """With `holdout_fraction`: the last share of every row group's rows (`holdout`), or
    the rest. Every row group gives its tail, so the held-out rows spread over the files
    as the training rows do, and no row is in both."""
    fraction, holdout = options.holdout_fraction, options.holdout
    if not fraction:
        return groups
    out = []
    for g in groups:
        held = int(g.num_rows * fraction)
        kept = RowGroup(g.path, g.index, held, g.num_rows - held) if holdout else \
            RowGroup(g.path, g.index, g.num_rows - held)
        if kept.num_rows:
            out.append(kept)
    if not out:
        raise ValueError(f"{source}: a holdout of {fraction} of every row group leaves "
                         f"no {'held-out' if holdout else 'training'} rows")
    return out


def sliced(pieces: list[Piece]) -> list[Piece]:
    """`pieces` cut where their row group's rows cross a multiple of SLICE_ROWS: the units
    read, decoded and windowed. A piece within one slice of its row group stays whole."""
    out = []
    for p in pieces:
        start, first = p.start, p.group.first
        while start < p.stop:
            stop = min(p.stop, ((first + start) // SLICE_ROWS + 1) * SLICE_ROWS - first)
            out.append(Piece(p.group, start, stop))
            start = stop
    return out


class RowAssignment:
    """The rows of `row_groups` each rank reads in each epoch, and in which windows; see the
    module docstring. `resumed`: {"epoch", "units", "rows"}, an epoch resumed at another world size."""

    def __init__(self, row_groups: list[RowGroup], options: ReaderOptions):
        self.row_groups, self.options = row_groups, options
        self.num_rows = sum(g.num_rows for g in row_groups)
        # unshuffled training keeps the global batches of every world size in file order
        self.interleaved = options.drop_last and not options.shuffle and options.world_size > 1
        self.resumed: dict | None = None

    def _spans(self, rank: int, n: int) -> Iterator[tuple[int, int]]:
        """`rank`'s rows as [start, stop) positions in an epoch's sequence of `n` rows."""
        w, b = self.options.world_size, self.options.batch_size
        if self.interleaved:
            return ((k, min(k + b, n)) for k in range(rank * b, n, w * b))
        return iter([(rank * n // w, (rank + 1) * n // w)])

    def _rank_rows(self, rank: int, n: int) -> int:
        """Rows of `rank` in an epoch of `n` rows: the sum over `_spans`, in closed form."""
        w, b = self.options.world_size, self.options.batch_size
        if self.interleaved:
            rounds, rest = divmod(n, w * b)
            return rounds * b + min(max(rest - rank * b, 0), b)
        return (rank + 1) * n // w - rank * n // w

    def fewest_rows(self, epoch: int) -> int:
        """The rows of the rank with the fewest in `epoch`."""
        return min(self._rank_rows(r, self._epoch_size(epoch)) for r in range(self.options.world_size))

    def _order(self, epoch: int) -> list[Piece]:
        """`epoch`'s sequence of rows: its row groups, shuffled with (seed, epoch) unless shuffle
        is off; or, for the epoch a resume at another world size took up, the rows it had left
        (trainer/data/elastic.py)."""
        if self.resumed is not None and self.resumed["epoch"] == epoch:
            return [Piece(self.row_groups[g], start, stop) for g, start, stop in self.resumed["units"]]
        order = self.row_groups
        if self.options.shuffle:
            order = [order[i] for i in np.random.default_rng([self.options.seed, epoch]).permutation(len(order))]
        return [Piece(g, 0, g.num_rows) for g in order]

    def with_units_left(self, state: dict) -> dict:
        """`state`, a position of this rank's reader, with what its epoch has left on this rank
        (`left`: units, `half_read`: consumed rows of a half-read window), for a resume at another
        world size (trainer/data/elastic.py). Once the epoch's batches are all out, nothing is left:
        the rest is drop_last's share, left out in any world size."""
        if state["step"] >= self.steps_in_epoch(state["epoch"]):
            return {**state, "left": [], "half_read": 0}
        positions = {g: i for i, g in enumerate(self.row_groups)}
        slices = [(position + s.start - p.start, positions[s.group], s.start, s.stop)
                  for position, p in self._placed(state["epoch"], self.options.rank) for s in sliced([p])]
        windows = None
        if self.options.shuffle and self.options.shuffle_buffer:
            windows = [len(w) for w in self.windows([Piece(self.row_groups[g], a, b) for _, g, a, b in slices])]
        left, reread = units_left(slices, windows, state["step"] * self.options.batch_size)
        return {**state, "left": [list(u) for u in left], "half_read": reread}

    def _epoch_size(self, epoch: int) -> int:
        """Rows in `epoch`'s sequence."""
        if self.resumed is not None and self.resumed["epoch"] == epoch:
            return self.resumed["rows"]
        return self.num_rows

    def _placed(self, epoch: int, rank: int) -> list[tuple[int, Piece]]:
        """`rank`'s rows in `epoch`, in reading order, each piece with its first row's position
        in the epoch's sequence (the same answer on every rank)."""
        order = self._order(epoch)
        ends = list(itertools.accumulate(p.num_rows for p in order))
        placed = []
        for start, stop in self._spans(rank, ends[-1] if ends else 0):
            i = bisect.bisect_right(ends, start)
            while start < stop:
                p, base = order[i], ends[i] - order[i].num_rows
                end = min(stop, ends[i])
                placed.append((start, Piece(p.group, p.start + start - base, p.start + end - base)))
                start, i = end, i + 1
        return placed

    def pieces(self, epoch: int, rank: int) -> list[Piece]:
        """`rank`'s rows in `epoch`, in reading order (the same answer on every rank)."""
        return [p for _, p in self._placed(epoch, rank)]

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches every rank yields in `epoch`."""
        n, b = self._epoch_size(epoch), self.options.batch_size
        rows = [self._rank_rows(r, n) for r in range(self.options.world_size)]
        if self.options.drop_last:
            return min(rows) // b
        return max(-(-r // b) for r in rows)

    def epoch_rows(self, epoch: int) -> EpochRows:
        """The split's rows (of an epoch resumed at another world size: the rows it had left) and
        those `epoch` consumes on all ranks together; training leaves out fewer than
        world_size * batch_size (module docstring)."""
        if not self.options.drop_last:
            return EpochRows(self.num_rows, self.num_rows)
        used = self.steps_in_epoch(epoch) * self.options.batch_size * self.options.world_size
        return EpochRows(self._epoch_size(epoch), used)

    def windows(self, pieces: list[Piece]) -> list[list[Piece]]:
        """`pieces` grouped, in order, into the fewest that hold at least `shuffle_buffer` rows each."""
        windows: list[list[Piece]] = [[]]
        rows = 0
        for p in pieces:
            if windows[-1] and rows >= max(self.options.shuffle_buffer, 1):
                windows.append([])
                rows = 0
            windows[-1].append(p)
            rows += p.num_rows
        return windows

    def checked_resumed(self, resumed: dict | None) -> dict | None:
        """A resumed epoch's units as a checkpoint holds them: each a row range inside a row group of
        this input, and their rows the sum recorded (a checkpoint is data, not trusted code)."""
        if resumed is None:
            return None
        units, groups = resumed.get("units") if isinstance(resumed, dict) else None, self.row_groups
        if not (isinstance(units, list) and all(
                isinstance(u, list) and len(u) == 3 and all(type(x) is int for x in u)
                and 0 <= u[0] < len(groups) and 0 <= u[1] < u[2] <= groups[u[0]].num_rows for u in units)
                and type(resumed.get("epoch")) is int
                and resumed.get("rows") == sum(stop - start for _, start, stop in units)):
            raise ValueError("data reader state: its resumed epoch's units are not row ranges of this input's "
                             f"{len(groups)} row groups")
        return {"epoch": resumed["epoch"], "units": units, "rows": resumed["rows"]}
