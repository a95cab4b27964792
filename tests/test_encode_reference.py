"""Row encoding (trainer.data.encode) where tests/test_reader.py does not look: the order of
the sparse features, schemas without numeric features or tasks, list columns of either
list type, and the float32 range check after the transforms, against values written out
here."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyarrow as pa
import pytest

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from trainer.data.encode import RowEncoder


def _item(**kw) -> FeatureSpec:
    return FeatureSpec(name="item", num_embeddings=10, **kw)


def test_managed_features_come_last_in_the_order_given():
    managed = dict(num_embeddings=10, hashing="managed")
    features = [FeatureSpec(name="user", **managed), _item(), FeatureSpec(name="price", kind="numeric"),
                FeatureSpec(name="shop", **managed), FeatureSpec(name="tag", num_embeddings=5)]
    encoder = RowEncoder(features, [TaskSpec(name="click", label="click")])
    assert [f.name for f in encoder.sparse] == ["item", "tag", "user", "shop"]
    table = pa.table({"user": [3, 4], "item": [1, 2], "price": [0.5, 1.5], "shop": [7, 8], "tag": [6, 9],
                      "click": [1, 0]})
    rows = encoder.encode(table, "w")
    assert rows.keys == ["item", "tag", "user", "shop"] and rows.num_managed == 2
    assert [v.tolist() for v in rows.values[:2]] == [[1, 2], [1, 4]]  # tag 6, 9 modulo 5


def test_a_schema_without_numeric_features_or_tasks_gives_empty_float32_columns():
    encoder = RowEncoder([_item()], [])
    rows = encoder.encode(pa.table({"item": [1, 2, 3]}), "w")
    assert rows.num_rows == 3
    assert rows.dense.shape == (3, 0) and rows.dense.dtype == np.float32
    assert rows.labels.shape == (3, 0) and rows.labels.dtype == np.float32


@pytest.mark.parametrize("typ", [pa.list_(pa.int32()), pa.large_list(pa.int64())])
def test_either_list_type_holds_an_id_list(typ):
    encoder = RowEncoder([FeatureSpec(name="tags", kind="id_list", num_embeddings=10)], [])
    table = pa.table({"tags": pa.array([[1, 2], [], [3]], typ)})
    encoder.check_schema(table.schema, "f.parquet")
    rows = encoder.encode(table, "w")
    assert rows.values[0].tolist() == [1, 2, 3] and rows.offsets[0].tolist() == [0, 2, 2, 3]


@pytest.mark.parametrize("typ,shown", [(pa.int64(), "int64"), (pa.large_list(pa.string()), "large_list<item: string>")])
def test_an_id_list_in_another_type_is_an_error_naming_file_and_column(typ, shown):
    encoder = RowEncoder([FeatureSpec(name="tags", kind="id_list", num_embeddings=10)], [])
    with pytest.raises(ValueError) as err:
        encoder.check_schema(pa.schema([("tags", typ)]), "f.parquet")
    assert str(err.value) == (f"f.parquet: column 'tags' has type {shown}, "
                              "expected a list of integer ids for feature 'tags'")


def test_transforms_run_in_the_order_given():
    values = [-0.5, 0.0, 3.0, 40.0]
    spec = FeatureSpec(name="p", kind="numeric", transform=["clip", "log1p", "standardize"], clip_min=0.0,
                       clip_max=20.0, mean=1.0, std=2.0)
    rows = RowEncoder([spec], []).encode(pa.table({"p": values}), "w")
    expected = [(math.log1p(min(max(v, 0.0), 20.0)) - 1.0) / 2.0 for v in values]
    assert rows.dense[:, 0].tolist() == np.array(expected, np.float32).tolist()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the cast that finds the value
def test_a_value_beyond_float32_after_the_transforms_is_an_error_naming_the_row():
    # finite in float64, infinite in float32: the first one (row 1) is named, with its value
    spec = FeatureSpec(name="p", kind="numeric", transform=["log1p", "standardize"], std=1e-38)
    table = pa.table({"p": [0.0, 1e10, 1e20]})
    with pytest.raises(ValueError) as err:
        RowEncoder([spec], []).encode(table, "f, row group 2")
    shown = f"{math.log1p(1e10) / 1e-38:g}"
    assert str(err.value) == (f"f, row group 2, column 'p': {shown} at row 1 is beyond float32's range "
                              "(after log1p, standardize)")
    plain = FeatureSpec(name="p", kind="numeric")
    with pytest.raises(ValueError) as err:
        RowEncoder([plain], []).encode(pa.table({"p": [1.0, -3e38, 1e39]}), "w")
    assert str(err.value) == "w, column 'p': 1e+39 at row 2 is beyond float32's range"


def test_the_float32_overflow_is_the_error_alone_not_also_a_numpy_warning():
    plain = FeatureSpec(name="p", kind="numeric")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" would be raised here
        with pytest.raises(ValueError, match=r"^w, column 'p': 1e\+39 at row 0 is beyond float32's range$"):
            RowEncoder([plain], []).encode(pa.table({"p": [1e39]}), "w")
