"""Batches assembled from parts of windows (trainer.data.batch.Part, assemble): gathered by a
permutation or copied from slices, one part or several, they equal the rows picked one by one."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_reader_rows import assert_rows, random_rows
from trainer.data.batch import Part, Rows, assemble


def test_a_part_picked_by_an_index_is_those_rows():
    rng = np.random.default_rng(3)
    rows, ref = random_rows(rng, 300, flat_null=True)
    order = rng.permutation(300)
    part = Part(rows, order)
    assert_rows(part.slice(40, 140).as_rows(), [ref[i] for i in order[40:140]])
    assert part.slice(290).num_rows == 10


@pytest.mark.parametrize("flat_null", [False, True])
def test_a_batch_across_parts_equals_the_reference(flat_null):
    rng = np.random.default_rng(11)
    a, ref_a = random_rows(rng, 200, flat_null)
    b, ref_b = random_rows(rng, 120, not flat_null)
    order = rng.permutation(200)
    parts = [Part(a, order[150:]), Part(b.slice(0, 30)), Part(b, np.array([7, 7, 0]))]
    batch = assemble(parts)
    expected = [ref_a[i] for i in order[150:]] + ref_b[:30] + [ref_b[7], ref_b[7], ref_b[0]]
    assert_rows(Rows.concat([p.as_rows() for p in parts]), expected)
    got = Rows.concat([p.as_rows() for p in parts]).to_batch()
    for x, y in ((batch.sparse.values(), got.sparse.values()), (batch.sparse.lengths(), got.sparse.lengths()),
                 (batch.dense, got.dense), (batch.labels, got.labels), (batch.users, got.users)):
        assert x.dtype == y.dtype and x.tolist() == y.tolist()
    assert len(batch) == len(expected) == 83


def test_a_gathered_batch_shares_no_memory_with_the_window():
    rows, _ = random_rows(np.random.default_rng(0), 64)
    batch = assemble([Part(rows, np.arange(63, -1, -1))])
    batch.dense.zero_()
    batch.sparse.values().zero_()
    assert rows.dense.any() and rows.values[0].any()
