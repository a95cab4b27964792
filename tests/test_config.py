"""Tests for the configuration tree (trainer.config): loading, overrides, validation, writing."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest

from dense.model_config import TaskSpec
from dense.tower_configs.moe_towers import MoEConfig
from embeddings.features import FeatureSpec
from embeddings.tables import table_configs
from trainer.config import Config, DataConfig, OptimConfig
from trainer.config_loader import describe, dump_toml, field_docs, load_config, validate

FEATURES_TOML = """
[[features]]
name = "user_id"
num_embeddings = 1000
group = "user"

[[features]]
name = "item_id"
column = "item"
num_embeddings = 500
embedding_dim = 8
hashing = "none"

[[features]]
name = "hist"
kind = "sequence"
table = "item_id"
column = "hist_items"
num_embeddings = 500
embedding_dim = 8
max_len = 20

[[features]]
name = "price"
kind = "numeric"
transform = ["log1p", "clip"]
clip_max = 5
"""


def write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def err(text: str) -> str:
    return re.escape(text)


# ----------------------------------------------------------------------------- precedence


def test_defaults_without_file_or_overrides():
    cfg = load_config()
    expected = Config()
    validate(expected)  # fills defaults such as the task's label
    assert cfg == expected
    assert cfg.data.batch_size == DataConfig().batch_size
    assert cfg.optim.lr == OptimConfig().lr
    assert cfg.model.tasks == [TaskSpec(name="click", label="click", weight=1.0)]
    assert cfg.features == []


def test_defaults_then_toml_then_cli(tmp_path):
    path = write(tmp_path, """
[data]
batch_size = 128
shuffle_buffer = 1000

[optim]
lr = 0.5
warmup_steps = 10
""")
    cfg = load_config(path, ["--optim.lr=0.2", "--data.shuffle_buffer=7"])
    assert cfg.data.batch_size == 128          # TOML over default
    assert cfg.data.shuffle_buffer == 7        # CLI over TOML
    assert cfg.optim.lr == 0.2                 # CLI over TOML
    assert cfg.optim.warmup_steps == 10        # TOML
    assert cfg.data.eval_batch_size == 4096    # untouched default
    assert cfg.optim.alpha == OptimConfig().alpha
    # a later override wins over an earlier one
    cfg = load_config(path, ["--optim.lr=0.2", "--optim.lr=0.3"])
    assert cfg.optim.lr == 0.3


def test_the_paper_recipe_replaces_defaults_but_not_given_keys(tmp_path):
    ours = load_config(None, ["--model.recipe=rankmix"])
    assert (ours.model.recipe, ours.model.tokenizer_bias, ours.optim.dense_warmup_steps) == ("rankmix", "zero", 300)
    # auto is rankmix's defaults (the width it narrows is chosen when a run starts: test_auto_width)
    auto = load_config()
    assert auto.model.recipe == "auto" and dataclasses.replace(auto, model=dataclasses.replace(
        auto.model, recipe="rankmix")) == ours
    paper = load_config(None, ["--model.recipe=paper"])
    assert (paper.model.tokenizer_bias, paper.optim.dense_warmup_steps) == ("uniform", 0)
    # and nothing else: the recipe's two keys are the whole difference
    paper.model.recipe, paper.model.tokenizer_bias, paper.optim.dense_warmup_steps = "rankmix", "zero", 300
    assert paper == ours
    # a key set in the file or on the command line keeps its value, whichever comes first
    path = write(tmp_path, '[model]\nrecipe = "paper"\n\n[optim]\ndense_warmup_steps = 50\n')
    cfg = load_config(path, ["--model.tokenizer_bias=zero"])
    assert (cfg.model.tokenizer_bias, cfg.optim.dense_warmup_steps) == ("zero", 50)
    # the resolved config written into a run folder reads back to the same recipe
    dump_toml(cfg, tmp_path / "resolved.toml")
    assert load_config(tmp_path / "resolved.toml") == cfg
    with pytest.raises(ValueError, match=r"^model.recipe must be one of \('auto', 'rankmix', 'paper'\), got 'papers'$"):
        load_config(None, ["--model.recipe=papers"])


def test_missing_and_invalid_toml_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match=err(f"config file not found: {missing}")):
        load_config(missing)
    bad = write(tmp_path, "[data\nbatch_size = 1\n")
    with pytest.raises(ValueError, match=err(f"config file {bad} is not valid TOML")):
        load_config(bad)


# ----------------------------------------------------------------------------- unknown keys, types


@pytest.mark.parametrize("text, key", [
    ("[nosuch]\na = 1\n", "nosuch"),
    ("toplevel = 1\n", "toplevel"),
    ("[data]\nbatch_sise = 1\n", "data.batch_sise"),
    ("[model]\n[model.extra]\nx = 1\n", "model.extra"),
    ("[[features]]\nname = 'a'\nnum_embeddings = 3\nbogus = 1\n", "features.a.bogus"),
    ("[[model.tasks]]\nname = 'a'\nlable = 'x'\n", "model.tasks.a.lable"),
])
def test_unknown_key_in_toml(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=err(f"unknown config key: {key}")):
        load_config(path)


@pytest.mark.parametrize("override, key", [
    ("--nosuch.a=1", "nosuch"),
    ("--data.batch_sise=1", "data.batch_sise"),
    ("--optim.lr.x=1", "optim.lr"),
])
def test_unknown_key_in_cli(override, key):
    with pytest.raises(ValueError, match=err(f"unknown config key: {key}")):
        load_config(None, [override])


def test_a_free_table_takes_a_dotted_key_whole(tmp_path):
    """pyiceberg's property names hold dots: past a table of free keys, the rest of the override is its key."""
    cfg = load_config(None, ["--data.catalog.s3.endpoint=http://minio:9000", "--data.catalog.uri=sqlite:///c.db",
                             "--embeddings.table_sharding.item=row_wise"])
    assert cfg.data.catalog == {"s3.endpoint": "http://minio:9000", "uri": "sqlite:///c.db"}
    assert cfg.embeddings.table_sharding == {"item": "row_wise"}
    path = tmp_path / "c.toml"
    path.write_text('[data.catalog]\n"s3.region" = "eu-west-1"\nname = "lake"\n')
    cfg = load_config(str(path), ["--data.catalog.name=other"])
    assert cfg.data.catalog == {"s3.region": "eu-west-1", "name": "other"}
    assert load_config(None, ["--data.catalog.s3.port=3"]).data.catalog == {"s3.port": "3"}  # str values
    with pytest.raises(ValueError, match=err("unknown config key: data.catalogue")):
        load_config(None, ["--data.catalogue.s3.endpoint=x"])


def test_override_of_a_whole_section_is_a_type_error():
    with pytest.raises(ValueError, match=err("config key data must be a table, got int")):
        load_config(None, ["--data=1"])


@pytest.mark.parametrize("override", ["data.batch_size=3", "--data.batch_size", "-data.batch_size=3"])
def test_malformed_override(override):
    with pytest.raises(ValueError, match=err(f"override {override!r} must look like --section.key=value")):
        load_config(None, [override])


@pytest.mark.parametrize("text, message", [
    ('[data]\nbatch_size = "big"\n', "config key data.batch_size must be int, got 'big'"),
    ("[data]\nbatch_size = 1.5\n", "config key data.batch_size must be int, got 1.5"),
    ("[data]\nbatch_size = true\n", "config key data.batch_size must be int, got True"),
    ('[optim]\nlr = "fast"\n', "config key optim.lr must be float, got 'fast'"),
    ("[train]\ndeterministic = 1\n", "config key train.deterministic must be bool, got 1"),
    ("[train]\nrun_dir = 3\n", "config key train.run_dir must be str, got 3"),
    ('[embeddings]\nsharding_types = "row_wise"\n', "config key embeddings.sharding_types must be a list"),
    ("[embeddings]\nsharding_types = [1]\n", "embeddings.sharding_types[0] must be one of ('table_wise', "
     "'column_wise', 'table_column_wise', 'row_wise', 'table_row_wise'), got 1"),
    ("data = 3\n", "config key data must be a table, got int"),
    ("[[features]]\nname = 'a'\nnum_embeddings = 'many'\n",
     "config key features.a.num_embeddings must be int, got 'many'"),
    ("[[features]]\nname = 'p'\nkind = 'numeric'\nfill_null = 'zero'\n",
     "config key features.p.fill_null has the wrong type: 'zero'"),
])
def test_wrong_type_in_toml(tmp_path, text, message):
    with pytest.raises(ValueError, match=err(message)):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("override, message", [
    ("--data.batch_size=big", "config key data.batch_size must be int, got 'big'"),
    ("--data.batch_size=1.5", "config key data.batch_size must be int, got 1.5"),
    ("--optim.lr=fast", "config key optim.lr must be float, got 'fast'"),
    ("--train.deterministic=no", "config key train.deterministic must be bool, got 'no'"),
    ("--train.deterministic=1", "config key train.deterministic must be bool, got 1"),
])
def test_wrong_type_in_cli(override, message):
    with pytest.raises(ValueError, match=err(message)):
        load_config(None, [override])


def test_int_widens_to_float(tmp_path):
    cfg = load_config(write(tmp_path, "[optim]\nlr = 1\nmomentum = 0\n"))
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert type(cfg.optim.momentum) is float
    cfg = load_config(None, ["--optim.lr=2", "--embeddings.lr=3"])
    assert cfg.optim.lr == 2.0 and type(cfg.optim.lr) is float
    assert cfg.embeddings.lr == 3.0 and type(cfg.embeddings.lr) is float


def test_cli_parsing_of_bools_strings_floats_and_lists():
    cfg = load_config(None, [
        "--train.deterministic=false",
        "--metrics.tensorboard=false",
        "--metrics.progress=true",
        "--train.run_dir=123",           # str fields keep the text, never parsed
        "--data.user_column=",           # empty string disables UAUC
        "--optim.eps=1e-6",
        "--embeddings.sharding_types=table_wise,row_wise",
    ])
    assert cfg.train.deterministic is False
    assert cfg.metrics.tensorboard is False
    assert cfg.metrics.progress is True
    assert cfg.train.run_dir == "123"
    assert cfg.data.user_column == ""
    assert cfg.optim.eps == 1e-6
    assert cfg.embeddings.sharding_types == ["table_wise", "row_wise"]
    cfg = load_config(None, ['--embeddings.sharding_types=["column_wise"]'])
    assert cfg.embeddings.sharding_types == ["column_wise"]


# ----------------------------------------------------------------------------- features


def test_features_array_of_tables(tmp_path):
    cfg = load_config(write(tmp_path, FEATURES_TOML))
    assert [type(f) for f in cfg.features] == [FeatureSpec] * 4
    user, item, hist, price = cfg.features
    assert (user.name, user.column, user.table, user.num_embeddings, user.group) == \
        ("user_id", "user_id", "user_id", 1000, "user")  # column / table default to name
    assert (item.column, item.table, item.embedding_dim, item.hashing) == ("item", "item_id", 8, "none")
    assert (hist.kind, hist.table, hist.column, hist.max_len) == ("sequence", "item_id", "hist_items", 20)
    assert price.kind == "numeric" and price.transform == ["log1p", "clip"]
    assert price.clip_max == 5.0 and type(price.clip_max) is float
    assert price.clip_min == -math.inf
    assert price.fill_null is None  # unset: a null is an error


def test_feature_override_by_name(tmp_path):
    path = write(tmp_path, FEATURES_TOML)
    cfg = load_config(path, ["--features.user_id.num_embeddings=77", "--features.price.clip_max=2",
                             "--features.price.transform=log1p,standardize"])
    assert cfg.features[0].num_embeddings == 77
    assert cfg.features[1].num_embeddings == 500  # other features untouched
    assert cfg.features[3].clip_max == 2.0
    assert cfg.features[3].transform == ["log1p", "standardize"]
    # overriding one feature of a shared table alone breaks the sharing rule
    with pytest.raises(ValueError, match=err("features.hist: shares table 'item_id' with features.item_id")):
        load_config(path, ["--features.item_id.num_embeddings=77"])
    cfg = load_config(path, ["--features.item_id.num_embeddings=77", "--features.hist.num_embeddings=77"])
    assert [f.num_embeddings for f in cfg.features[1:3]] == [77, 77]


def test_feature_override_unknown_name_or_key(tmp_path):
    path = write(tmp_path, FEATURES_TOML)
    with pytest.raises(ValueError, match=err("unknown config key: features.nope (no entry named 'nope')")):
        load_config(path, ["--features.nope.num_embeddings=1"])
    with pytest.raises(ValueError, match=err("unknown config key: features.item_id.num_embedding")):
        load_config(path, ["--features.item_id.num_embedding=1"])
    with pytest.raises(ValueError, match=err("config key features.item_id.num_embeddings must be int")):
        load_config(path, ["--features.item_id.num_embeddings=lots"])


def test_a_fill_value_must_be_finite(tmp_path):
    path = write(tmp_path, FEATURES_TOML)
    with pytest.raises(ValueError, match=err("features.price.fill_null must be a finite number, got inf")):
        load_config(path, ["--features.price.fill_null=inf"])


def test_a_table_named_like_a_module_dict_attribute_is_refused(tmp_path):
    path = write(tmp_path, FEATURES_TOML)
    with pytest.raises(ValueError, match=err("features.user_id.table: 'items' is a name TorchRec cannot give "
                                             "a table (it keeps tables in a torch ModuleDict")):
        load_config(path, ["--features.user_id.table=items"])


def test_task_override_by_name(tmp_path):
    path = write(tmp_path, "[[model.tasks]]\nname = 'click'\n\n[[model.tasks]]\nname = 'like'\nlabel = 'liked'\n")
    cfg = load_config(path, ["--model.tasks.like.weight=0.5"])
    assert [(t.name, t.label, t.weight) for t in cfg.model.tasks] == \
        [("click", "click", 1.0), ("like", "liked", 0.5)]


# ----------------------------------------------------------------------------- validate


def features_toml(*tables: str) -> str:
    return "".join(f"[[features]]\n{t}\n" for t in tables)


@pytest.mark.parametrize("text, message", [
    (features_toml("name = 'a'\ntable = 't'\nnum_embeddings = 10",
                   "name = 'b'\ntable = 't'\nnum_embeddings = 20"),
     "features.b: shares table 't' with features.a but their num_embeddings / embedding_dim differ"),
    (features_toml("name = 'a'\ntable = 't'\nnum_embeddings = 10",
                   "name = 'b'\ntable = 't'\nnum_embeddings = 10\nembedding_dim = 4"),
     "features.b: shares table 't' with features.a"),
    (features_toml("name = 'x'\nkind = 'dense'\nnum_embeddings = 3"),
     "features.x.kind must be one of ('id', 'id_list', 'sequence', 'numeric'), got 'dense'"),
    (features_toml("name = 'p'\nkind = 'numeric'\ntransform = ['log1p', 'sqrt']"),
     "features.p.transform[1] must be one of ('log1p', 'clip', 'standardize'), got 'sqrt'"),
    (features_toml("name = 'p'\nkind = 'numeric'\nstd = 0"), "features.p.std must be positive, got 0.0"),
    (features_toml("name = 'a'"), "features.a: num_embeddings and embedding_dim must be positive"),
    (features_toml("name = 'a'\nnum_embeddings = 3\nhashing = 'xor'"),
     "features.a.hashing must be one of ('modulo', 'none', 'managed', 'log2'), got 'xor'"),
    (features_toml("name = 'a'\nnum_embeddings = 3\npooling = 'max'"),
     "features.a.pooling must be one of ('sum', 'mean'), got 'max'"),
    (features_toml("name = 'a'\nnum_embeddings = 3", "name = 'a'\nnum_embeddings = 3"),
     "features.a: duplicate feature name"),
    (features_toml("num_embeddings = 3"), "features: every feature needs a name"),
    ("[data]\nbatch_size = 0\n", "data.batch_size must be positive, got 0"),
    ("[data]\nshuffle_buffer = -1\n", "data.shuffle_buffer must be >= 0, got -1"),
    ("[train]\ndevice = 'tpu'\n", "train.device must be one of ('auto', 'cpu', 'cuda'), got 'tpu'"),
    ("[train]\nepochs = 0\n", "train.steps and train.epochs are both 0: nothing to train"),
    ("[embeddings]\nsharding_types = ['data_parallel']\n", "embeddings.sharding_types[0] must be one of "
     "('table_wise', 'column_wise', 'table_column_wise', 'row_wise', 'table_row_wise'), got 'data_parallel'"),
    ("[embeddings]\nsharding_types = []\n", "embeddings.sharding_types is empty"),
    ("[model]\ntasks = []\n", "model.tasks is empty"),
    ("[[model.tasks]]\nname = 'a'\n[[model.tasks]]\nname = 'a'\n", "model.tasks has duplicate names: ['a', 'a']"),
])
def test_validate_errors(tmp_path, text, message):
    with pytest.raises(ValueError, match=err(message)):
        load_config(write(tmp_path, text))


def test_validate_rejects_zero_batch_size_from_cli():
    with pytest.raises(ValueError, match=err("data.batch_size must be positive, got 0")):
        load_config(None, ["--data.batch_size=0"])
    with pytest.raises(ValueError, match=err("data.eval_batch_size must be positive, got 0")):
        load_config(None, ["--data.eval_batch_size=0"])


def test_validate_rejects_negative_max_len():
    with pytest.raises(ValueError, match=err("features.hist.max_len must be >= 0, got -1")):
        validate(Config(features=[FeatureSpec(name="hist", kind="sequence", num_embeddings=10, max_len=-1)]))


def test_validate_rejects_negative_eval_batches():
    with pytest.raises(ValueError, match=err("metrics.eval_batches must be >= 0, got -1")):
        load_config(None, ["--metrics.eval_batches=-1"])


def test_validate_accepts_shared_table_with_equal_shapes():
    """Features naming one table share its rows when their shapes agree, and only then."""
    def features(dim_b: int) -> list[FeatureSpec]:
        return [FeatureSpec(name="a", table="t", num_embeddings=10, embedding_dim=8),
                FeatureSpec(name="b", table="t", num_embeddings=10, embedding_dim=dim_b, kind="sequence")]

    cfg = Config(features=features(8))
    validate(cfg)
    [table] = table_configs(cfg.features)
    assert (table.name, table.num_embeddings, table.embedding_dim, table.feature_names) == ("t", 10, 8, ["a", "b"])
    with pytest.raises(ValueError, match=err("features.b: shares table 't' with features.a but their "
                                             "num_embeddings / embedding_dim differ")):
        validate(Config(features=features(4)))


# ----------------------------------------------------------------------------- writing


def test_dump_then_load_round_trip_defaults(tmp_path):
    cfg = load_config()
    dump_toml(cfg, tmp_path / "out.toml")
    assert load_config(tmp_path / "out.toml") == cfg


def test_dump_then_load_round_trip_with_features(tmp_path):
    path = write(tmp_path, FEATURES_TOML + """
[data]
batch_size = 64
user_column = ""

[[model.tasks]]
name = "click"
weight = 0.5

[[model.tasks]]
name = "like"
label = "liked"

[train]
deterministic = false
""")
    cfg = load_config(path, ["--optim.lr=0.125", "--features.price.fill_null=0"])
    assert cfg.features[3].fill_null == 0.0 and type(cfg.features[3].fill_null) is float
    out = tmp_path / "out.toml"
    dump_toml(cfg, out)
    text = out.read_text()
    assert "clip_min = -inf" in text and "clip_max = 5.0" in text  # inf survives the TOML round trip
    assert text.count("clip_max") == 1 and text.count("eviction_interval") == 0  # unread fields are left out
    assert text.count("fill_null") == 1  # unset fill_null is left out (TOML has no null)
    loaded = load_config(out)
    assert loaded == cfg
    assert loaded.features[0].clip_min == -math.inf and loaded.features[0].clip_max == math.inf
    assert loaded.features[0].fill_null is None
    assert loaded.features[3].fill_null == 0.0
    assert loaded.model.tasks[1].label == "liked" and loaded.train.deterministic is False
    # the dump is a fixed point
    dump_toml(loaded, tmp_path / "again.toml")
    assert (tmp_path / "again.toml").read_text() == text


def test_describe_lists_every_leaf_with_its_doc():
    lines = describe()
    assert any(f"--optim.lr={OptimConfig().lr!r}" in line and "Dense learning rate" in line for line in lines)
    assert any(f"--data.batch_size={DataConfig().batch_size}" in line for line in lines)
    assert any("--train.deterministic=True" in line for line in lines)
    assert any(line.strip().startswith("[[features]]") for line in lines)
    assert any(line.strip().startswith("[[model.tasks]]") for line in lines)
    for key, obj, f in leaves(Config(), ""):
        matching = [line for line in lines if line.strip().startswith(f"--{key}=")]
        assert len(matching) == 1, key
        assert matching[0].rstrip().endswith(field_docs(type(obj))[f.name]), (key, matching[0])
        assert f"--{key}={getattr(obj, f.name)!r}" in matching[0]
    # each tower table under a header that names the towers reading it
    assert "[model.moe]  Sparse mixture of experts (rankmixer_moe, unimixer_moe)." in lines
    assert lines.index("[model.moe]  Sparse mixture of experts (rankmixer_moe, unimixer_moe).") < \
        lines.index(f"  --model.moe.budget={MoEConfig().budget!r}  {field_docs(MoEConfig)['budget']}")


def leaves(obj, prefix: str):
    """(dotted key, owner, field) of every non-table field under `obj`, lists of tables left out."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        elif f.name not in ("features", "tasks"):
            yield f"{prefix}{f.name}", obj, f


def config_dataclasses(cls: type = Config) -> list[type]:
    """Every section of the config tree, wherever its component declares it, and its parts."""
    found = [cls]
    for hint in typing.get_type_hints(cls).values():
        for part in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(part) and part not in found:
                found += [c for c in config_dataclasses(part) if c not in found]
    return found


def test_the_config_tree_has_the_expected_sections():
    names = {c.__name__ for c in config_dataclasses()}
    assert {"Config", "FeatureSpec", "TaskSpec", "DataConfig", "EmbeddingsConfig", "ModelConfig", "RankMixerConfig",
            "MoEConfig", "OptimConfig", "TrainConfig", "MetricsConfig", "LaunchConfig"} <= names


@pytest.mark.parametrize("cls", config_dataclasses(), ids=lambda c: c.__name__)
def test_every_field_has_a_one_line_docstring(cls):
    docs = field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert sorted(docs) == sorted(names), f"{cls.__name__}: fields without docstring: {set(names) - set(docs)}"
    for name in names:
        assert docs[name].strip(), f"{cls.__name__}.{name} has an empty docstring"
        assert "\n" not in docs[name], f"{cls.__name__}.{name} docstring spans several lines"


def test_the_spelled_out_synth_schema_is_the_built_in_one():
    from trainer.data.datasets import synth_features

    synth = str(Path(__file__).resolve().parents[1] / "configs" / "synth.toml")
    cfg = load_config(synth, ["--features.user_id.embedding_dim=32"])
    assert [f.name for f in cfg.features] == [f.name for f in synth_features()]
    assert cfg.features[0].embedding_dim == 32
    assert load_config(synth).features == synth_features()
