"""The sequence modules' config, builders and registry (dense/sequence_modules.py,
dense/sequence_registry.py): every module built from a
config reads the time gaps (and one without timestamps has no time path), reads its table, and
each check of [model.sequence] names its option and passes at its limit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from dense.sequence import SequenceInputs
from dense.sequence_modules import SequenceConfig, SequenceFields, TargetAttentionConfig, TransformerConfig
from dense.sequence_registry import SEQUENCE_MODULES, SEQUENCE_TABLES, register_sequence, token_slots
from test_sequence import jagged, lookups, schema

ATTENDED = [name for name in SEQUENCE_MODULES.names() if SEQUENCE_MODULES.get(name) is not None]


def test_the_registry_holds_pool_and_the_attended_modules_each_with_its_table():
    assert SEQUENCE_MODULES.get("pool") is None and ATTENDED == ["target_attention", "transformer"]
    assert SEQUENCE_TABLES == {"target_attention": TargetAttentionConfig, "transformer": TransformerConfig}
    cfg = SequenceConfig()
    assert isinstance(cfg, SequenceFields) and (cfg.time_buckets, cfg.time_dim) == (32, 8)
    assert cfg.target_attention == TargetAttentionConfig() and cfg.transformer == TransformerConfig()
    docs = {f.name: f.metadata.get("doc") for f in dataclasses.fields(cfg)}
    assert docs["transformer"] == "Self-attention over the behaviours (BST / LONGER), before the target attention."
    assert docs["target_attention"] == "The behaviour scorer of target attention (DIN)."


def test_register_sequence_declares_a_module_and_the_table_it_reads():
    """A new module by name, its config table by key; another table under a key already taken is
    refused (an invariant); `pool`-like modules (no table) leave the tables as they are."""

    class ProbeConfig:
        key = "probe_table"

    def build(cfg, f):
        return None

    tables = dict(SEQUENCE_TABLES)
    try:
        assert register_sequence("probe", ProbeConfig)(build) is build
        assert SEQUENCE_MODULES.get("probe") is build and SEQUENCE_TABLES == tables | {"probe_table": ProbeConfig}
        register_sequence("probe_pool")(None)
        assert SEQUENCE_MODULES.get("probe_pool") is None and SEQUENCE_TABLES == tables | {"probe_table": ProbeConfig}
        with pytest.raises(AssertionError):
            register_sequence("probe_other", type("Other", (), {"key": "probe_table"}))(build)
    finally:
        for name in ("probe", "probe_pool", "probe_other"):
            SEQUENCE_MODULES._builders.pop(name, None)  # the registry has no unregister: the test's own cleanup
        SEQUENCE_TABLES.pop("probe_table", None)
    assert SEQUENCE_TABLES == tables


@pytest.mark.parametrize("module", ATTENDED)
def test_different_gaps_give_different_outputs_for_every_module_built_from_a_config(module):
    """Built from a config with timestamps, each module's tokens change with the gap buckets alone;
    built without, it has no time embedding and takes none."""
    torch.manual_seed(0)
    cfg = SequenceConfig()
    cfg.time_buckets, cfg.time_dim = 8, 3
    inputs = SequenceInputs(schema(module, timestamps="ts"), cfg)
    rows = [3, 2, 5, 2]  # two behaviours at least (one alone takes all the weight, whatever its gap)
    near, far = torch.ones(12, dtype=torch.int64), torch.full((12,), 7)
    out = {name: inputs({}, lookups(rows), (1, 3, 5), (gaps,))["hist"] for name, gaps in [("near", near), ("far", far)]}
    assert ((out["near"] - out["far"]).abs().amax(dim=1) > 1e-4).all(), out
    times = [m for m in inputs.attention["hist"].modules() if isinstance(m, nn.Embedding) and m.num_embeddings == 8]
    assert times, "no embedding of the 8 time buckets"
    untimed = SequenceInputs(schema(module), cfg)
    assert untimed.timed == [] and not any(
        isinstance(m, nn.Embedding) and m.num_embeddings == 8 for m in untimed.attention["hist"].modules())
    untimed({}, lookups(rows), (1, 3, 5))


def test_each_builder_reads_its_table_and_the_features_shape():
    cfg = SequenceConfig()
    cfg.time_buckets, cfg.time_dim = 5, 3
    cfg.target_attention.hidden = [6, 4]
    cfg.transformer = TransformerConfig(layers=3, heads=4, width=12, ffn_ratio=3)
    features = schema("target_attention", tokens=2, timestamps="ts")
    target = SEQUENCE_MODULES.get("target_attention")(cfg, features[3])
    linears = [m for m in [target.first, *target.rest] if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(4 * 8 + 3, 6), (6, 4), (4, 2)]
    assert (target.time.num_embeddings, target.time.embedding_dim) == (5, 3)
    transformer = SEQUENCE_MODULES.get("transformer")(cfg, features[3])
    assert len(transformer.blocks) == 3 and transformer.blocks[0].heads == 4
    assert (transformer.inp.in_features, transformer.inp.out_features) == (8, 12)
    assert transformer.blocks[0].ffn[0].out_features == 36 and transformer.position.num_embeddings == 6
    assert (transformer.time.num_embeddings, transformer.time.embedding_dim) == (5, 12)
    assert transformer.target.time.embedding_dim == 3 and transformer.target.first.out_features == 6
    assert target.softmax and transformer.target.softmax  # the defaults: softmax, the gap in the value
    assert target.time_value.weight.shape == transformer.target.time_value.weight.shape == (5, 8)
    cfg.target_attention.weights, cfg.target_attention.time_value = "sigmoid", False
    for module in (SEQUENCE_MODULES.get("target_attention")(cfg, features[3]),
                   SEQUENCE_MODULES.get("transformer")(cfg, features[3]).target):
        assert not module.softmax and module.time_value is None
    cfg.transformer.width = 0  # the table's width
    assert isinstance(SEQUENCE_MODULES.get("transformer")(cfg, features[3]).inp, nn.Identity)
    assert target.time_bias is None and transformer.target.time_bias is None  # the default: none
    cfg.target_attention.time_bias, cfg.target_attention.time_bias_lr_mult = True, 30.0
    for module in (SEQUENCE_MODULES.get("target_attention")(cfg, features[3]),
                   SEQUENCE_MODULES.get("transformer")(cfg, features[3]).target):
        assert module.time_bias.weight.shape == (5, 2) and module.time_bias.lr_mult == 30.0
        assert not module.time_bias.weight.any()
    untimed = schema("target_attention", tokens=2)[3]  # no gaps, so no bias to read them
    assert SEQUENCE_MODULES.get("target_attention")(cfg, untimed).time_bias is None


def test_the_time_bias_trains_at_its_multiple_of_the_dense_rate():
    from trainer.optimizer import param_groups

    cfg = SequenceConfig()
    cfg.target_attention.time_bias, cfg.target_attention.time_bias_lr_mult = True, 30.0
    module = SEQUENCE_MODULES.get("target_attention")(cfg, schema("target_attention", timestamps="ts")[3])
    groups = param_groups(module, list(module.parameters()), 0.002)
    assert [g["lr"] for g in groups] == [0.002, pytest.approx(0.06)]
    assert [id(p) for p in groups[1]["params"]] == [id(module.time_bias.weight)]
    assert len(groups[0]["params"]) == len(list(module.parameters())) - 1
    # under optim.sequence_lr_mult the module's own rate, then the bias's multiple of it
    everything = {id(p) for p in module.parameters()}
    groups = param_groups(module, list(module.parameters()), 0.002, sequence=everything, sequence_mult=5.0)
    assert [(g["lr"], g["part"], len(g["params"])) for g in groups if g["params"]] == [
        (pytest.approx(0.01), "sequence", len(everything) - 1), (pytest.approx(0.3), "sequence", 1)]


def test_the_transformers_own_embeddings_start_at_the_scale_of_the_sequences_table():
    """Rows of a table of n start uniform in +-1/sqrt(n) (std 1/sqrt(3n)): the position, time and
    candidate embeddings start at that std, not at N(0, 1), which drowned the behaviour's vector."""
    torch.manual_seed(0)
    cfg = SequenceConfig()
    cfg.time_buckets, cfg.transformer.width = 64, 64
    f = schema("transformer", timestamps="ts")[3]
    f.num_embeddings, f.max_len = 300, 200
    module = SEQUENCE_MODULES.get("transformer")(cfg, f)
    std = 1 / math.sqrt(3 * 300)
    for table in (module.position.weight, module.time.weight):  # 12,800 and 4,096 draws: within 5%
        assert abs(float(table.std()) / std - 1) < 0.05 and abs(float(table.mean())) < 0.1 * std
    assert 0.5 * std < float(module.candidate.std()) < 1.5 * std  # 64 draws


@pytest.mark.parametrize("change,message", [
    ({"time_buckets": 1}, "model.sequence.time_buckets must be at least 2, got 1"),
    ({"time_dim": 0}, "model.sequence.time_dim must be positive, got 0"),
    ({"target_attention": TargetAttentionConfig(hidden=[16, 0])},
     "model.sequence.target_attention.hidden must be positive, got [16, 0]"),
    ({"target_attention": TargetAttentionConfig(hidden=[])},
     "model.sequence.target_attention.hidden must name at least one width (the scorer's hidden layers), got []"),
    ({"target_attention": TargetAttentionConfig(time_bias_lr_mult=0.0)},
     "model.sequence.target_attention.time_bias_lr_mult must be positive, got 0.0"),
    ({"transformer": TransformerConfig(layers=0)}, "model.sequence.transformer.layers must be positive, got 0"),
    ({"transformer": TransformerConfig(heads=0)}, "model.sequence.transformer.heads must be positive, got 0"),
    ({"transformer": TransformerConfig(ffn_ratio=-1)}, "model.sequence.transformer.ffn_ratio must be positive, got -1"),
    ({"transformer": TransformerConfig(width=-2)},
     "model.sequence.transformer.width=-2 must be >= 0 and divisible by model.sequence.transformer.heads=2"),
    ({"transformer": TransformerConfig(width=9)},
     "model.sequence.transformer.width=9 must be >= 0 and divisible by model.sequence.transformer.heads=2"),
])
def test_each_check_names_its_option(change, message):
    cfg = dataclasses.replace(SequenceConfig(), **change)
    with pytest.raises(ValueError) as e:
        cfg.validate()
    assert str(e.value) == message


def test_the_checks_pass_at_their_limits_and_reach_the_config_loader(tmp_path):
    from trainer.config_loader import load_config

    cfg = dataclasses.replace(SequenceConfig(), time_buckets=2, time_dim=1,
                              target_attention=TargetAttentionConfig(hidden=[1], time_bias_lr_mult=1e-3),
                              transformer=TransformerConfig(layers=1, heads=1, width=0, ffn_ratio=1))
    cfg.validate()
    TransformerConfig(heads=2, width=4).validate()  # divisible
    path = tmp_path / "c.toml"
    path.write_text("")
    with pytest.raises(ValueError) as e:
        load_config(str(path), ["--model.sequence.time_buckets=1"])
    assert str(e.value) == "model.sequence.time_buckets must be at least 2, got 1"
    assert load_config(str(path), ["--model.sequence.time_buckets=2"]).model.sequence.time_buckets == 2


def test_token_slots_are_one_per_vector_each_in_a_group_of_its_own():
    features = schema(tokens=1)
    assert token_slots(features[3]) == [("hist", "behaviour")]
    three = dataclasses.replace(features[3], sequence_tokens=3)
    assert token_slots(three) == [("hist.0", "behaviour.0"), ("hist.1", "behaviour.1"), ("hist.2", "behaviour.2")]


def test_a_padded_batch_of_gaps_is_read_at_each_behaviour():
    """The gaps travel with their behaviours: rows padded differently give each row its own tokens."""
    torch.manual_seed(0)
    inputs = SequenceInputs(schema("transformer", timestamps="ts"), SequenceConfig())
    rows = [3, 0, 5, 2]
    gaps = (jagged(rows, width=None, seed=7).values(),)
    tight = inputs({}, lookups(rows), (1, 3, 5), gaps)["hist"]
    loose = inputs({}, lookups(rows), (1, 3, 7), gaps)["hist"]
    torch.testing.assert_close(tight, loose, rtol=1e-5, atol=1e-6)
