"""Elastic resume inside an epoch: what each rank's epoch has left, and how the ranks of
another world size share it (docs/design.md §5.2).

A training reader's position (epoch, step) means the same rows only at the world size and
batch that made it. So a checkpoint also records, per rank, the *units* of the epoch the rank
has not consumed: (position in the epoch's sequence, row group, start, stop) row ranges, the
slices the rank reads (trainer/data/assignment.py, Windows), in its reading order. The
complement, within the epoch's rows, is what was consumed.

- Unshuffled rows (shuffle off, or shuffle_buffer = 0) are consumed in order, so the first
  unit left is cut at the exact row: nothing is read twice.
- A shuffled window is consumed in its permutation's order: once its first rows are out, the
  rows consumed are scattered over it. Such a *half-read* window is left whole, and the rows
  of it already trained on are read again after the resume; the checkpoint counts them
  (`half_read`), and the run's summary reports the total (`data/rows_reread`). Those of them
  that land in the resumed epoch's last rows, which drop_last leaves out, are not trained twice.

At M ranks the units left by all the saved ranks, sorted by their position (the epoch's own
order: rank order for contiguous shares, file order for interleaved ones), become the
resumed epoch's sequence of rows, which the M ranks split as they split any epoch. Every
row of the epoch is then trained once, apart from the declared re-reads and the fewer than
M x batch rows that drop_last leaves at the end of any epoch.
"""

from __future__ import annotations

Unit = tuple[int, int, int, int]
"""(position of the unit's first row in the epoch's sequence, row group's index in the reader's
list, first row, stop row): rows [start, stop) of the row group."""


def units_left(slices: list[Unit], windows: list[int] | None, consumed: int) -> tuple[list[Unit], int]:
    """The units of a rank's `slices` (in its reading order) after its first `consumed` rows,
    and the rows of a half-read window among them that were consumed (read again after a
    resume). `windows`: slices per shuffled window, in order; None where rows are read in order."""
    if windows is None:
        left, skip = [], consumed
        for position, group, start, stop in slices:
            cut = min(skip, stop - start)
            skip -= cut
            if start + cut < stop:
                left.append((position + cut, group, start + cut, stop))
        return left, 0
    first, rows = 0, 0
    for count in windows:
        size = sum(stop - start for _, _, start, stop in slices[first:first + count])
        if rows + size > consumed:
            return list(slices[first:]), consumed - rows
        first, rows = first + count, rows + size
    return [], 0


def shared_units(saved: list[list[Unit]]) -> tuple[list[list[int]], int]:
    """The units left by all the saved ranks as one sequence, in the epoch's order, as
    [row group, start, stop], adjacent ranges of a row group merged; and its rows."""
    units: list[list[int]] = []
    end = None  # where the previous unit ended, as (row group, stop)
    for _, group, start, stop in sorted(tuple(u) for left in saved for u in left):
        if end == (group, start):
            units[-1][2] = stop
        else:
            units.append([group, start, stop])
        end = (group, stop)
    return units, sum(stop - start for _, start, stop in units)


def resumed_epoch(saved: list[dict]) -> tuple[dict, int] | None:
    """The epoch the saved ranks' positions leave, as a reader's `resumed` ({"epoch", "units",
    "rows"}), and the rows it reads again; None where a position records no units (an older
    rankmix saved it)."""
    if not all("left" in s and "half_read" in s for s in saved):
        return None
    try:
        if not all(len(u) == 4 and all(type(x) is int for x in u) for s in saved for u in s["left"]):
            raise TypeError("a unit is not 4 integers")
        units, rows = shared_units([[tuple(u) for u in s["left"]] for s in saved])
        half_read = sum(int(s["half_read"]) for s in saved)
    except (TypeError, ValueError) as e:
        raise ValueError(f"data reader state: the units its ranks had left are not row ranges ({e})") from None
    return {"epoch": saved[0]["epoch"], "units": units, "rows": rows}, half_read
