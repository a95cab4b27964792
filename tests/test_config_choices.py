"""Each fixed choice of the config is one Literal type, declared with its section: the loader checks
values against it, and every table that maps a choice to what implements it covers exactly
the type's values, so a choice added to the type without its implementation fails here,
not in a run."""

from typing import get_args

import pytest

from dense import rankmixer
from dense.tower_configs import rankmixer_towers
from embeddings import features, managed, sparse_config, tables
from embeddings.features import validate_features
from trainer import config
from trainer.config_loader import load_config
from trainer.data.datasets import SYNTH_TEACHERS


@pytest.mark.parametrize("mapping, choice", [
    (tables._POOLING, features.Pooling),
    (tables._DATA_TYPES, sparse_config.TableDataType),
    (tables._OPTIMIZERS, sparse_config.SparseOptimizer),
    (SYNTH_TEACHERS, config.SynthTeacherName),
    (managed.EVICTION_POLICIES, features.EvictionPolicy),
])
def test_every_choice_has_its_implementation(mapping, choice):
    assert set(mapping) == set(get_args(choice))


def test_the_towers_implement_the_choices_of_the_types():
    assert (rankmixer.NORMS == get_args(rankmixer_towers.BlockNorm)
            and rankmixer.POOLINGS == get_args(rankmixer_towers.TowerPooling))


@pytest.mark.parametrize("override, message", [
    ("--train.device=tpu", "train.device must be one of ('auto', 'cpu', 'cuda'), got 'tpu'"),
    ("--model.rankmixer.norm=mid", "model.rankmixer.norm must be one of ('post', 'pre'), got 'mid'"),
    ("--embeddings.table_sharding.item=diagonal", "embeddings.table_sharding.item must be one of ('table_wise', "
     "'column_wise', 'table_column_wise', 'row_wise', 'table_row_wise'), got 'diagonal'"),
    ("--features.item_id.hashing=xor", "features.item_id.hashing must be one of ('modulo', 'none', 'managed', 'log2'), "
     "got 'xor'"),
])
def test_a_value_outside_its_type_is_one_error_naming_the_key(override, message):
    with pytest.raises(ValueError) as e:
        load_config("configs/synth.toml", [override])
    assert str(e.value) == message


@pytest.mark.parametrize("teacher", sorted(SYNTH_TEACHERS))
def test_the_built_in_schemas_are_valid(teacher):
    """Built-in schemas are code, validated here once rather than at every run."""
    features = SYNTH_TEACHERS[teacher].features()
    validate_features(features)
    assert all(f.column == f.name and (f.kind == "numeric" or f.table) for f in features)


def test_every_numeric_transform_has_both_forms_that_agree():
    """One table of transforms serves the reader (NumPy) and the artifact (torch); both
    forms give the same values on the same inputs, inside each transform's domain."""
    import numpy as np
    import torch

    from trainer.data.feature_ops import TRANSFORMS

    assert set(TRANSFORMS) == set(get_args(features.NumericTransform))
    spec = features.FeatureSpec(name="x", kind="numeric", clip_min=-0.5, clip_max=2.0, mean=0.25, std=4.0)
    x = np.array([-0.9, -0.5, 0.0, 0.3, 1.5, 7.0])
    for name, t in TRANSFORMS.items():
        assert np.allclose(t.numpy(x, spec), t.torch(torch.from_numpy(x), spec).numpy(), rtol=1e-12), name
    expected = {"log1p": np.log(1 + x), "clip": np.minimum(np.maximum(x, -0.5), 2.0), "standardize": (x - 0.25) / 4}
    for name, want in expected.items():  # written out here, independent of the table
        assert np.allclose(TRANSFORMS[name].numpy(x, spec), want, rtol=1e-12), name
    assert TRANSFORMS["log1p"].valid(np.array([-1.0, -0.999])).tolist() == [False, True]


def test_the_hashing_table_gives_the_reader_and_serving_the_same_rows():
    """One table of id hashings: the NumPy form (reader, on the column's own type) and the
    torch form (artifact, on int64 bit patterns) agree on ids across the whole uint64 range,
    and modulo is the unsigned remainder, written out here with Python integers."""
    import numpy as np
    import torch

    from trainer.data.feature_ops import HASHINGS

    assert set(HASHINGS) == set(get_args(features.Hashing))
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 2 ** 64, 2000, dtype=np.uint64),
                          np.array([0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1], dtype=np.uint64)])
    for n in (1, 7, 1000, 2 ** 40 + 3):
        sizes = torch.full((len(ids),), n, dtype=torch.int64)
        for name, h in HASHINGS.items():
            if h.in_range:
                continue
            served = h.torch(torch.from_numpy(ids.view(np.int64)), sizes).numpy()
            read = h.numpy(ids, n)
            assert read.dtype == served.dtype == np.int64, name  # table rows, as FBGEMM takes them
            np.testing.assert_array_equal(read, served, err_msg=f"{name}, num_embeddings={n}")
        assert HASHINGS["modulo"].numpy(ids, n).tolist() == [int(u) % n for u in ids]
        assert HASHINGS["log2"].numpy(ids, n).tolist() == [min(int(u).bit_length(), n - 1) for u in ids]
    powers = np.array([0, 1, 2, 3, 4, 7, 8, 2 ** 53 - 1, 2 ** 53, 2 ** 62 - 1, 2 ** 62], dtype=np.uint64)
    assert HASHINGS["log2"].numpy(powers, 100).tolist() == [0, 1, 2, 2, 3, 3, 4, 53, 54, 62, 63]
    small = np.arange(50, dtype=np.int32)
    assert HASHINGS["none"].numpy(small, 50).tolist() == small.tolist()
