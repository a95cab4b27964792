"""A managed table that holds an attended sequence (`hashing = "managed"` with
`sequence_module = "target_attention"`): the candidate item and the behaviours share one
TorchRec ManagedCollisionEmbeddingCollection, and so one MCH remapping. It trains row-wise on 1
and 2 ranks, evicts and counts it, resumes bit-exactly from a checkpoint taken at an eviction,
gives an id one row whichever feature looks it up, and serves as `rankmix score --checkpoint`
scores it."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torchrec import KeyedJaggedTensor

from cli import rankmix_ranks as train_ranks
from embeddings.features import validate_features
from embeddings.managed import build_managed_sequences, served_tables
from embeddings.torchrec_compat import mc_table_configs, mch_module
from test_checkpoint import assert_same_state, tensors
from test_managed import export_and_score
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.data.feature_ops import spread, spread_ids
from trainer.serving.served_model import ManagedRows

ROWS = 1000  # the item table's rows: the log has about twice as many items
SEQUENCE = ["--features.hist_items.sequence_module=target_attention",
            *(f"--features.{f}.{key}={value}" for f in ("item_id", "hist_items")
              for key, value in (("hashing", "managed"), ("num_embeddings", ROWS), ("eviction_interval", 5)))]
ARGS = ["--config", "configs/synth.toml", "--data.synth_rows=6000", "--metrics.progress=false",
        "--metrics.tensorboard=false", "--checkpoint.keep=0", *SEQUENCE]
MCH = "model.managed_sequence_tables._managed_collision_collection._managed_collision_modules.item."
FREE = torch.iinfo(torch.int64).max


def train(world: int, run: Path, cache: Path, *args: str):
    proc = train_ranks(world, *ARGS, f"--train.run_dir={run}", f"--data.cache_dir={cache}", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def trained(made_once, world: int) -> tuple[Path, Path]:
    """(the run folder, the data cache) of 10 steps on `world` ranks, checkpointed at steps 5 and 10."""
    cache = made_once("managed-sequence-cache", lambda folder: None)
    folder = made_once(f"managed-sequence-{world}", lambda folder: train(
        world, folder / "run", cache, "--train.steps=10", "--checkpoint.interval=5"))
    return folder / "run", cache


def cfg():
    return load_config("configs/synth.toml", SEQUENCE)


def test_the_candidate_and_the_sequence_share_one_managed_collection_and_one_batch_key_set():
    config = cfg()
    validate_features(config.features)  # no longer refused
    mc = build_managed_sequences(config.features, config.embeddings, buckets=2)
    [table] = mc_table_configs(mc)
    assert (table.name, table.feature_names, table.num_embeddings) == ("item", ["item_id", "hist_items"], ROWS)
    assert mch_module(mc, "item").table_name == "item"
    encoder = RowEncoder(config.features, config.model.tasks)
    assert [f.name for f in encoder.sparse[-2:]] == ["item_id", "hist_items"]
    assert (encoder.num_sequence, encoder.num_managed_sequence, encoder.num_managed) == (0, 2, 0)


def test_the_managed_sequence_table_starts_as_it_would_unmanaged():
    """The plan-independent init (embeddings/init.py) finds the table inside the managed
    collection: it draws the values it draws in the plain EmbeddingCollection."""
    from torch import nn

    from embeddings.init import init_embeddings
    from embeddings.tables import build_sequence_tables

    managed, plain = cfg(), load_config("configs/synth.toml", SEQUENCE[:1] + [
        f"--features.{f}.num_embeddings={ROWS}" for f in ("item_id", "hist_items")])
    weights = []
    for config, path, build in ((managed, "managed_sequence_tables", build_managed_sequences),
                                (plain, "sequence_tables", build_sequence_tables)):
        holder = nn.Module()
        module = build(config.features, config.embeddings, **({"buckets": 1} if path.startswith("managed") else {}))
        holder.add_module(path, module.to_empty(device="cpu"))
        init_embeddings(holder, seed=3)
        [weight] = [v for k, v in holder.state_dict().items() if k.endswith("item.weight")]
        weights.append(weight)
    assert weights[0].shape == (ROWS, 16) and torch.equal(weights[0], weights[1])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_managed_sequence_trains_row_wise_evicts_and_resumes_exactly(world, tmp_path, made_once):
    reference, cache = trained(made_once, world)
    plan = (reference / "plan.txt").read_text()
    assert "module: managed_sequence_tables" in plan and "module: sequence_tables" not in plan
    assert re.search(r"\nitem +\| row_wise +\| fused", plan.split("module: managed_sequence_tables")[1])
    resumed = tmp_path / "resumed"
    shutil.copytree(reference / "checkpoints" / "step-5", resumed / "checkpoints" / "step-5")
    assert "at step 5" in train(world, resumed, cache, "--train.steps=10", "--checkpoint.interval=5").stdout
    assert_same_state(reference / "checkpoints" / "step-10", resumed / "checkpoints" / "step-10", tmp_path)
    at_5, at_10 = ({i for i in tensors(reference / "checkpoints" / f"step-{step}", tmp_path)[
        MCH + "_mch_sorted_raw_ids"].tolist() if i != FREE} for step in (5, 10))
    summary = json.loads((reference / "summary.json").read_text())
    # An id of the step-5 map missing from the step-10 one lost its row in between: a lower bound.
    assert summary["managed/item.evicted"] >= len(at_5 - at_10) > 0
    assert summary["managed/item.occupancy"] == pytest.approx(len(at_10) / (ROWS - world))
    assert 0 < summary["managed/item.miss_rate"] < 1


def test_an_id_has_its_own_row_in_the_candidate_and_in_the_sequence(made_once, tmp_path):
    """The trained collection, rebuilt unsharded from the checkpoint: the item ids of the
    validation rows, as candidates and as behaviours, each get the row the map gives them,
    the same in both features; ids that modulo hashing would fold together (x and x + ROWS)
    hold rows of their own."""
    run, cache = trained(made_once, 1)
    config = cfg()
    mc = build_managed_sequences(config.features, config.embeddings, buckets=1).to_empty(device="cpu")
    state = tensors(run / "checkpoints" / "step-10", tmp_path)
    prefix = "model.managed_sequence_tables."
    missing, unexpected = mc.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                                             strict=False)
    assert not unexpected and all("weight" not in k for k in missing)  # non-persistent counters only
    valid = pq.read_table(next(cache.glob("*/valid")))
    items = valid.column("item_id").to_numpy().astype(np.int64)[:500]
    history = valid.column("hist_items").combine_chunks()
    lengths = np.diff(history.offsets.to_numpy())[:500]
    behaviours = history.values.to_numpy().astype(np.int64)[:lengths.sum()]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "hist_items"], values=torch.from_numpy(spread(np.concatenate([items, behaviours]))),
        lengths=torch.from_numpy(np.concatenate([np.ones(len(items), np.int64), lengths])))
    with torch.no_grad():
        out = mc.eval()(kjt)[0]
    weight = state[prefix + "_embedding_module.embeddings.item.weight"]
    _, maps = served_tables({k[len("model."):]: v for k, v in state.items()})
    id_map = ManagedRows(*maps["item"])
    for name, ids in (("item_id", items), ("hist_items", behaviours)):
        rows = id_map(spread_ids(torch.from_numpy(ids)))
        torch.testing.assert_close(out[name].values(), weight[rows], rtol=0, atol=0)
    rows = {int(i): int(r) for i, r in zip(np.concatenate([items, behaviours]),
                                            id_map(spread_ids(torch.from_numpy(np.concatenate([items, behaviours])))))}
    held = {i: r for i, r in rows.items() if r not in maps["item"][2].tolist()}
    assert len(set(held.values())) == len(held)  # one row per held id
    beyond = [i for i in held if i >= ROWS]
    assert len(beyond) > 50 and any(i - ROWS in held or i + ROWS in held for i in held)
    shared = set(items.tolist()) & set(behaviours.tolist()) & set(held)
    assert len(shared) > 10  # ids looked up as candidate and as behaviour: one row, checked above


@pytest.mark.parametrize("world,fmt", [(1, "pt2"), (2, "torchscript")])
def test_an_artifact_of_a_managed_sequence_scores_as_its_training_run(world, fmt, made_once, tmp_path):
    run, cache = trained(made_once, world)
    manifest, _ = export_and_score(run, next(cache.glob("*/valid")), tmp_path, fmt, compare=world == 1)
    assert manifest["managed"]["item"]["ranks"] == world and 0 < manifest["managed"]["item"]["ids"] <= ROWS - world


# A second attended sequence, on a table of its own that is not managed (the item tags read as a
# sequence, attending with the user's vector), and a managed table of bags: all four collections.
MIXED = """
[[features]]
name = "tag_seq"
column = "item_tags"
kind = "sequence"
num_embeddings = 201
embedding_dim = 16
max_len = 5
sequence_module = "transformer"
candidate = "user_id"
group = "behaviour"
"""
MIXED_ARGS = ["--features.user_id.hashing=managed", "--features.user_id.eviction_interval=5"]


def mixed_config(folder: Path) -> Path:
    path = folder / "mixed.toml"
    path.write_text((Path(__file__).resolve().parents[1] / "configs" / "synth.toml").read_text() + MIXED)
    return path


@pytest.mark.slow
def test_plain_and_managed_sequences_train_together_on_two_ranks_and_serve(made_once, tmp_path):
    cache = made_once("managed-sequence-cache", lambda folder: None)
    config = mixed_config(tmp_path)
    proc = train(2, tmp_path / "run", cache, "--config", str(config), *MIXED_ARGS, "--train.steps=5",
                 "--checkpoint.interval=5")
    summary = json.loads(proc.stdout.splitlines()[-1])
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert all(f"module: {m}\n" in plan
               for m in ("ebc", "sequence_tables", "managed_tables", "managed_sequence_tables"))
    assert {"managed/item.miss_rate", "managed/user_id.miss_rate"} <= summary.keys()
    export_and_score(tmp_path / "run", next(cache.glob("*/valid")), tmp_path)


def test_rankmix_plan_counts_the_managed_sequence_table_row_wise():
    from launch.plan import plan_cluster

    plan = plan_cluster(cfg(), 2, "cuda", 80.0, 64.0, 2)
    assert plan.fits and "item" not in plan.plan.plan.get("sequence_tables", {}) | plan.plan.plan.get("ebc", {})
    assert "item | row_wise | 2 x 500" in plan.text
