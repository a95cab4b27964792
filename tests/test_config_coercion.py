"""Config coercion (trainer/config_loader.py) on the paths tests/test_config.py leaves open:
tables of free keys (`embeddings.table_sharding`) from TOML and from the command line,
override values that hold '=', and paths through a list of plain values."""

from __future__ import annotations

import pytest

from trainer.config import Config
from trainer.config_loader import apply_override, load_config

CHOICES = "('table_wise', 'column_wise', 'table_column_wise', 'row_wise', 'table_row_wise')"


def _error(call, *args) -> str:
    with pytest.raises(ValueError) as err:
        call(*args)
    return str(err.value)


def test_a_free_key_table_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[embeddings.table_sharding]\nitem = "row_wise"\n7 = "column_wise"\n')
    assert load_config(path).embeddings.table_sharding == {"item": "row_wise", "7": "column_wise"}
    path.write_text('[embeddings.table_sharding]\nitem = "diagonal"\n')
    assert _error(load_config, path) == f"embeddings.table_sharding.item must be one of {CHOICES}, got 'diagonal'"
    path.write_text('[embeddings]\ntable_sharding = "row_wise"\n')
    assert _error(load_config, path) == "config key embeddings.table_sharding must be a table, got 'row_wise'"


def test_a_free_key_table_entry_from_the_command_line():
    cfg = Config()
    apply_override(cfg, "--embeddings.table_sharding.item=row_wise")
    apply_override(cfg, "--embeddings.table_sharding.user=table_wise")
    assert cfg.embeddings.table_sharding == {"item": "row_wise", "user": "table_wise"}
    assert _error(apply_override, cfg, "--embeddings.table_sharding.item=3") == (
        f"embeddings.table_sharding.item must be one of {CHOICES}, got 3")


def test_an_override_value_may_hold_equals_signs():
    cfg = Config()
    apply_override(cfg, "--data.train_path=s3://bucket/day=1/hour=2")
    assert cfg.data.train_path == "s3://bucket/day=1/hour=2"


def test_a_path_through_a_list_of_plain_values_is_an_unknown_key():
    assert _error(apply_override, Config(), "--embeddings.sharding_types.row_wise.x=1") == (
        "unknown config key: embeddings.sharding_types.row_wise (no entry named 'row_wise')")


def test_a_list_entry_without_a_string_name_is_named_by_its_index(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[[features]]\nname = 3\n")
    assert _error(load_config, path) == "config key features[0].name must be str, got 3"
