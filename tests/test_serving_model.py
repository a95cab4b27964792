"""The serving artifact of every tower, in both formats, against the training code's own
evaluation: raw Parquet values through the artifact (hashing, list cuts, null fills and
transforms inside it) give the probabilities that RowEncoder + RankingModel give."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from torchrec import EmbeddingBagCollection

from dense.heads import build_dense
from dense.model_config import TaskSpec
from dense.tower_registry import TOWERS
from embeddings.features import FeatureSpec, validate_features
from embeddings.hooks import TrainingHooks
from embeddings.tables import table_configs
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.ranking_model import RankingModel
from trainer.serving.export import (
    FORMATS,
    drop_state_dict_views,
    example_inputs,
    save_model,
    serving_model,
    trace_model,
)
from trainer.serving.predict import raw_inputs

ROWS = 64
U64 = 2 ** 64


def features() -> list[FeatureSpec]:
    """Every input path: uint64 ids above 2^63 (modulo), checked ids (none), shared tables,
    lists and sequences cut to max_len, null bags, numeric nulls, each transform."""
    f = FeatureSpec
    spec = [
        f(name="user", num_embeddings=50, embedding_dim=8, group="user"),
        f(name="num_a", kind="numeric", transform=["log1p", "clip"], clip_max=2.0, fill_null=0.5, group="user"),
        f(name="item", table="item_rows", num_embeddings=30, embedding_dim=8, hashing="none", group="item"),
        f(name="tags", kind="id_list", num_embeddings=20, embedding_dim=4, pooling="mean", max_len=3, group="item"),
        f(name="num_b", kind="numeric", transform=["standardize"], mean=3.0, std=2.0, group="item"),
        f(name="history", kind="sequence", table="item_rows", num_embeddings=30, embedding_dim=8, hashing="none",
          max_len=4, group="context"),
        f(name="num_c", kind="numeric", group="context"),
    ]
    validate_features(spec)
    return spec


def table(seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, U64, ROWS, dtype=np.uint64)
    users[:4] = [0, 49, U64 - 1, 2 ** 63]
    bags = [list(rng.integers(0, 1000, rng.integers(0, 7))) for _ in range(ROWS)]
    history = [list(rng.integers(0, 30, rng.integers(0, 9)).astype(np.int32)) for _ in range(ROWS)]
    num_a = rng.uniform(-0.5, 20, ROWS)
    return pa.table({
        "user": pa.array(users, mask=np.arange(ROWS) % 9 == 4),
        "num_a": pa.array(num_a, mask=np.arange(ROWS) % 7 == 3),
        "item": pa.array(rng.integers(0, 30, ROWS).astype(np.int32)),
        "tags": pa.array([None if i % 11 == 5 else b for i, b in enumerate(bags)], pa.list_(pa.int64())),
        "num_b": pa.array(rng.normal(3, 2, ROWS).astype(np.float32)),
        "history": pa.array(history, pa.list_(pa.int32())),
        "num_c": pa.array(rng.integers(-5, 5, ROWS)),
        "click": pa.array(rng.integers(0, 2, ROWS)),
        "like": pa.array(rng.integers(0, 2, ROWS)),
    })


def reference(tower: str, *overrides: str, rows_scale: int = 1) -> tuple[object, RankingModel]:
    """(config, the training code's model in evaluation mode) with seeded weights; tables
    `rows_scale` times their usual rows."""
    uses = TOWERS.get(tower)
    sizes = {"--model.hidden_dim=16": uses.tokens, "--model.num_tokens=4": uses.tokens and
             "--model.tokenizer=group" not in overrides, "--model.mlp.hidden=[16, 8]": "mlp" in uses.tables,
             "--model.unimixer.tau_anneal_steps=10": "unimixer" in uses.tables}
    cfg = load_config(None, [f"--model.tower={tower}", *(s for s, read in sizes.items() if read), *overrides])
    cfg.features = features()
    for f in cfg.features:
        f.num_embeddings *= rows_scale
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    torch.manual_seed(0)
    layout, tower_module, heads = build_dense(cfg.model, cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, tower_module, heads)
    for hook in TrainingHooks.of(model).after_restore:  # UniMixer at a temperature below its start
        hook(7)
    return cfg, model.eval()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tower,overrides", [*((name, ()) for name in TOWERS.names()),
                                             ("rankmixer", ("--model.tokenizer=group", "--model.hidden_dim=12",
                                                            "--model.rankmixer.pooling=flatten")),
                                             ("unimixer", ("--model.tokenizer=group", "--model.unimixer.block_size=8",
                                                           "--model.unimixer.init=random"))])
def test_the_artifact_of_every_tower_scores_raw_rows_as_training_evaluates_them(tower, overrides, fmt):
    cfg, model = reference(tower, *overrides)
    rows = table()
    encoder = RowEncoder(cfg.features, cfg.model.tasks)
    with torch.no_grad():
        expected = torch.sigmoid(model(encoder.encode(rows, "test").to_batch()))
        served = serving_model(cfg, model.state_dict(), step=7)
        program = trace_model(served, example_inputs(served), fmt)
        artifact = program if fmt == "torchscript" else program.module()
        probs = artifact(*raw_inputs(rows, cfg.features, "test"))
        one_row = artifact(*raw_inputs(rows.slice(3, 1), cfg.features, "test"))  # another batch size
    assert probs.shape == (ROWS, 2) and probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(one_row, expected[3:4], atol=1e-6, rtol=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tables,bound", [("fp16", 2e-4), ("int8", 2e-3), ("int4", 2e-2)])
def test_quantized_tables_are_torchrecs_stay_near_fp32_and_are_saved_once(tables, bound, fmt, tmp_path):
    cfg, model = reference("rankmixer", rows_scale=200)  # tables that outweigh the tower in the file
    inputs = raw_inputs(table(), cfg.features, "test")
    with torch.no_grad():
        fp32 = serving_model(cfg, model.state_dict(), step=7)
        expected = fp32(*inputs)
        served = serving_model(cfg, model.state_dict(), step=7, tables=tables)
        assert type(served.ebc).__module__ == "torchrec.quant.embedding_modules"
        drop_state_dict_views(served)
        program = trace_model(served, example_inputs(served), fmt)
        probs = (program if fmt == "torchscript" else program.module())(*inputs)
        files = {"fp32": trace_model(fp32, example_inputs(fp32), fmt), tables: program}
        for name, traced in files.items():
            save_model(traced, tmp_path / name, fmt)
    sizes = [(tmp_path / name).stat().st_size for name in files]
    difference = (probs - expected).abs().max().item()
    assert 0 < difference < bound, difference
    table_bytes = sum(f.num_embeddings * f.embedding_dim * 4 for f in cfg.features if f.kind == "id")
    assert sizes[1] < sizes[0] - table_bytes / 3, sizes  # quantized tables, stored once


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_artifact_refuses_what_training_refuses(fmt):
    cfg, model = reference("mlp")
    with torch.no_grad():
        served = serving_model(cfg, model.state_dict(), step=0)
        program = trace_model(served, example_inputs(served), fmt)
    artifact = program if fmt == "torchscript" else program.module()
    ids, lengths, numeric = raw_inputs(table(), cfg.features, "test")
    item = int(lengths[0].sum())  # the first id of feature 1, `item` (hashing none, 30 rows)
    bad_ids = ids.clone()
    bad_ids[item] = 30
    low = numeric.clone()
    low[5, 0] = -1.0  # log1p's domain
    unfilled = numeric.clone()
    unfilled[2, 1] = float("nan")  # num_b has no fill_null
    out_of_range = "sparse feature 'item': an id is out of range for its 30 rows (hashing 'none')"
    for args, message in [((bad_ids, lengths, numeric), out_of_range),
                          ((ids, lengths, low), "numeric feature 'num_a': log1p needs values > -1"),
                          ((ids, lengths, unfilled), "numeric feature 'num_b': a null or non-finite value"),
                          ((ids[1:], lengths, numeric), "lengths must add up to the number of ids"),
                          ((ids, -lengths, numeric), "lengths must not be negative")]:
        with pytest.raises((RuntimeError, torch.jit.Error), match=message.replace("(", r"\(").replace(")", r"\)")):
            artifact(*args)
