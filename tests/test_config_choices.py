"""Each fixed choice of the config is one Literal type (trainer/config.py): the loader checks
values against it, and every table that maps a choice to what implements it covers exactly
the type's values, so a choice added to the type without its implementation fails here,
not in a run."""

from typing import get_args

import pytest

from dense import rankmixer
from embeddings import managed, tables
from trainer import config
from trainer.config_loader import load_config, validate_features
from trainer.data.datasets import SYNTH_TEACHERS


@pytest.mark.parametrize("mapping, choice", [
    (tables._POOLING, config.Pooling),
    (tables._DATA_TYPES, config.TableDataType),
    (tables._OPTIMIZERS, config.SparseOptimizer),
    (SYNTH_TEACHERS, config.SynthTeacherName),
    (managed.EVICTION_POLICIES, config.EvictionPolicy),
])
def test_every_choice_has_its_implementation(mapping, choice):
    assert set(mapping) == set(get_args(choice))


def test_the_towers_read_their_choices_from_the_types():
    assert rankmixer.NORMS == get_args(config.BlockNorm) and rankmixer.POOLINGS == get_args(config.TowerPooling)


@pytest.mark.parametrize("override, message", [
    ("--train.device=tpu", "train.device must be one of ('auto', 'cpu', 'cuda'), got 'tpu'"),
    ("--model.norm=mid", "model.norm must be one of ('post', 'pre'), got 'mid'"),
    ("--embeddings.table_sharding.item=diagonal", "embeddings.table_sharding.item must be one of ('table_wise', "
     "'column_wise', 'table_column_wise', 'row_wise', 'table_row_wise'), got 'diagonal'"),
    ("--features.item_id.hashing=xor", "features.item_id.hashing must be one of ('modulo', 'none', 'managed'), "
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
