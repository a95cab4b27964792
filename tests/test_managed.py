"""Managed-collision tables (`hashing = "managed"`, TorchRec's MCH): ids spread over the
range MCH routes by, training on 1 and 2 ranks with row-wise tables, the optimizer rows of
evicted ids reset, exact resume from a checkpoint taken at an eviction, and serving
artifacts that remap raw ids as each training rank's MCH does."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec import JaggedTensor
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, _mch_remap

from cli import rankmix, rendezvous_port, spawn
from cli import rankmix_ranks as train_ranks
from embeddings.features import MANAGED_ID_RANGE, FeatureSpec
from embeddings.managed import TrackedMCH, served_tables
from test_checkpoint import assert_same_state, tensors
from trainer.checkpoint.manager import model_tensors
from trainer.config_loader import load_config
from trainer.data.feature_ops import spread, spread_ids
from trainer.data.ids import encode_ids
from trainer.serving.served_model import ManagedRows

# The user table and the item table that item_id and hist_items share, both managed, both with
# fewer rows than the log has ids.
MANAGED = ["--config", "configs/synth.toml", "--data.synth_rows=20000", "--metrics.progress=false",
           "--metrics.tensorboard=false", "--checkpoint.keep=0",
           *(f"--features.{f}.{key}={value}" for f, rows in (("user_id", 2000), ("item_id", 1000), ("hist_items", 1000))
             for key, value in (("hashing", "managed"), ("num_embeddings", rows), ("eviction_interval", 5)))]
MCH = "model.managed_tables._managed_collision_collection._managed_collision_modules."


def test_ids_are_spread_over_the_routed_range_whatever_their_type():
    ids = np.array([0, 1, 2, 5000, 2 ** 40, 2 ** 62, 2 ** 63 - 1], dtype=np.int64)
    mixed = spread(ids)
    assert len(set(mixed.tolist())) == len(ids) and ((0 <= mixed) & (mixed < MANAGED_ID_RANGE)).all()
    np.testing.assert_array_equal(spread(ids.astype(np.uint64)), mixed)  # the same bits, the same row
    np.testing.assert_array_equal(spread(ids[:4].astype(np.int32)), mixed[:4])
    words = [0, 1, 5000, 2 ** 63 + 5, 2 ** 64 - 1]  # against splitmix64 in Python's own integers
    np.testing.assert_array_equal(spread(np.array(words, dtype=np.uint64)), [_splitmix(w) for w in words])
    many = np.random.default_rng(0).integers(0, 2 ** 64, 100_000, dtype=np.uint64)
    np.testing.assert_array_equal(spread_ids(torch.from_numpy(many.view(np.int64))).numpy(), spread(many))  # served
    consecutive = spread(np.arange(10_000, dtype=np.int64))  # clustered ids reach every rank's part alike
    assert abs((consecutive < MANAGED_ID_RANGE // 2).mean() - 0.5) < 0.02
    spec = FeatureSpec(name="u", num_embeddings=10, hashing="managed")
    values, _ = encode_ids(pa.array(np.array([3, 2 ** 63 + 5], dtype=np.uint64)), spec, "f")  # beyond the table
    np.testing.assert_array_equal(values, spread(np.array([3, 2 ** 63 + 5], dtype=np.uint64)))
    with pytest.raises(ValueError, match="f, column 'u': negative id -4 at row 1"):
        encode_ids(pa.array([1, -4]), spec, "f")


def _splitmix(word: int) -> int:
    mask = 2 ** 64 - 1
    word ^= word >> 30
    word = word * 0xBF58476D1CE4E5B9 & mask
    word ^= word >> 27
    word = word * 0x94D049BB133111EB & mask
    return (word ^ word >> 31) % MANAGED_ID_RANGE


@pytest.mark.parametrize("overrides,message", [
    (["--features.user_id.eviction_policy=fifo"],
     "features.user_id.eviction_policy must be one of ('lfu', 'lru'), got 'fifo'"),
    (["--features.user_id.eviction_interval=0"], "features.user_id.eviction_interval must be at least 1, got 0"),
    (["--features.item_id.hashing=managed"],
     "features.hist_items: shares table 'item' with features.item_id, so both must be managed"),
    (["--features.user_id.eviction_interval=7", "--checkpoint.interval=10"],
     "checkpoint.interval=10 must be a multiple of every managed table's eviction_interval (not of [7])"),
    (["--embeddings.table_sharding.user_id=table_wise"],
     "embeddings.table_sharding names managed tables ['user_id']: those are always row-wise"),
])
def test_bad_managed_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config("configs/synth.toml", ["--features.user_id.hashing=managed", *overrides])


def train(world: int, run: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    proc = train_ranks(world, *MANAGED, f"--train.run_dir={run}", f"--data.cache_dir={cache}", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def trained(made_once, world: int) -> tuple[Path, Path]:
    """(the run folder, the data cache) of 20 steps on `world` ranks, checkpointed at steps 10 and 20."""
    cache = made_once("managed-cache", lambda folder: None)
    folder = made_once(f"managed-{world}", lambda folder: train(world, folder / "run", cache, "--train.steps=20",
                                                                 "--checkpoint.interval=10"))
    return folder / "run", cache


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_managed_tables_train_row_wise_and_resume_exactly_from_an_eviction(world, tmp_path, made_once):
    reference, cache = trained(made_once, world)
    resumed = tmp_path / "resumed"
    assert "user_id | row_wise" in (reference / "plan.txt").read_text()
    shutil.copytree(reference / "checkpoints" / "step-10", resumed / "checkpoints" / "step-10")
    assert "at step 10" in train(world, resumed, cache, "--train.steps=20", "--checkpoint.interval=10").stdout
    assert_same_state(reference / "checkpoints" / "step-20", resumed / "checkpoints" / "step-20", tmp_path)
    maps = [tensors(reference / "checkpoints" / f"step-{step}", tmp_path) for step in (10, 20)]
    ids = {table: [set(m[MCH + f"{table}._mch_sorted_raw_ids"].tolist()) - {torch.iinfo(torch.int64).max}
                   for m in maps] for table in ("user_id", "item")}
    occupied = len(ids["user_id"][1])
    assert 1000 < occupied < 2000  # 5000 users for 2000 rows: ids were admitted
    # The logged figures: occupancy as the checkpoint's map has it (one miss row per rank).
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["managed/user_id.occupancy"] == pytest.approx(occupied / (2000 - world))
    assert 0 < summary["managed/user_id.miss_rate"] < 1
    for table, (at_10, at_20) in ids.items():
        # An id of the step-10 map missing from the step-20 one lost its row to another id in
        # between: a lower bound. A row changes hands only in a full table, and the user table
        # of one rank never fills (2 ranks read twice the ids and fill theirs).
        evicted = summary[f"managed/{table}.evicted"]
        assert evicted >= len(at_10 - at_20) and (evicted == 0) == (summary[f"managed/{table}.occupancy"] < 1), \
            (table, evicted, len(at_10 - at_20))
    logged = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert any("managed/user_id.miss_rate" in r for r in logged if r["kind"] == "train")


@pytest.mark.slow
def test_managed_tables_resume_only_at_the_world_size_that_trained_them(made_once, tmp_path):
    reference, cache = trained(made_once, 1)
    shutil.copytree(reference / "checkpoints" / "step-10", tmp_path / "checkpoints" / "step-10")
    proc = train_ranks(2, *MANAGED, f"--train.run_dir={tmp_path}", f"--data.cache_dir={cache}",
                       "--train.steps=20", "--checkpoint.interval=10")
    assert proc.returncode == 2
    assert (f"rankmix: error: {tmp_path}/checkpoints/step-10 was saved at world size 1: managed tables ['item', "
            "'user_id'] load only at the world size that trained them") in proc.stderr
    two_ranks, _ = trained(made_once, 2)  # scored on one rank: ids outside the maps would take other miss rows
    proc = rankmix("score", "--checkpoint", str(two_ranks), "--data", str(next(cache.glob("*/valid"))),
                   "--out", str(tmp_path / "scored"))
    assert proc.returncode == 2 and "was saved at world size 2: managed tables ['item', 'user_id'] load only at" \
        in proc.stderr and f"rankmix export --checkpoint {two_ranks} --out DIR, then rankmix score --model DIR" \
        in proc.stderr


# The managed table each collection's eviction is tested on, and the overrides that make it.
EVICTED = {"managed_tables": ("user_id", ["--features.user_id.hashing=managed"]),
           "managed_sequence_tables": ("item", ["--features.hist_items.sequence_module=target_attention",
                                                "--features.item_id.hashing=managed",
                                                "--features.hist_items.hashing=managed"])}


def _evict_worker(rank: int, port: int, optimizer: str, collection: str, out: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from embeddings.sharding import shard_model
    from trainer.ranking_model import build_model

    dist.init_process_group("gloo", rank=0, world_size=1)
    table, overrides = EVICTED[collection]
    cfg = load_config("configs/synth.toml", [*overrides, f"--embeddings.optimizer={optimizer}"])
    model = shard_model(build_model(cfg), cfg.embeddings, torch.device("cpu"))
    managed = getattr(model.module, collection)
    tbe, index = managed._table_to_tbe_and_index[table]
    tables = managed._embedding_module
    weight = (tables.embedding_bags if managed.bagged else tables.embeddings).get_parameter(f"{table}.weight")
    with torch.no_grad():
        for state in tbe.split_optimizer_states()[int(index)]:
            state.fill_(7.0)
        weight.fill_(5.0)
    managed._evict({table: torch.tensor([3, 11])})
    states = [s.clone() for s in tbe.split_optimizer_states()[int(index)]]
    torch.save({"states": states, "weight": weight.detach().clone()}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("optimizer,collection", [("adagrad", "managed_tables"), ("rowwise_adagrad", "managed_tables"),
                                                  ("adagrad", "managed_sequence_tables")])
def test_an_evicted_row_starts_afresh_whatever_the_optimizer(optimizer, collection, tmp_path):
    """In a collection of bags, and in one of an attended sequence's tables (unpooled)."""
    spawn(_evict_worker, (rendezvous_port(), optimizer, collection, str(tmp_path / "out.pt")), 1)
    result = torch.load(tmp_path / "out.pt")
    evicted = torch.zeros(result["weight"].shape[0], dtype=torch.bool)
    evicted[[3, 11]] = True
    for state in result["states"]:  # [rows, dim] exact Adagrad, [rows] row-wise
        assert (state[evicted] == 0).all() and (state[~evicted] == 7).all()
    weight = result["weight"]
    assert (weight[~evicted] == 5).all()
    bound = weight.shape[0] ** -0.5  # TorchRec's default init: uniform(+-1/sqrt(rows))
    assert (weight[evicted].abs() <= bound).all() and (weight[evicted] != 0).any()


@pytest.mark.bench
def test_the_comparison_bench_prints_both_modes():
    proc = subprocess.run([sys.executable, "bench/managed.py", "--seeds", "1", "--synth-rows", "4000", "--epochs", "1",
                           "--rows", "500"], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [line[0] for line in lines] == ["modulo", "managed"]
    assert lines[0][1] == "collision" and 0 < float(lines[0][2]) <= 1
    assert lines[1][1] == "miss" and 0 <= float(lines[1][2]) <= 1 and lines[1][3] == "evicted"


def _mch_reference(ids: torch.Tensor, state: dict[str, torch.Tensor], table: str) -> torch.Tensor:
    """Rows of raw ids as the ranks' MCH modules remap them in evaluation: each spread id goes to
    the rank whose range holds it (TorchRec's row-wise buckets), which runs TorchRec's own remap
    on its part of the map."""
    buffers = {k[len(MCH) + len(table) + 1:]: v for k, v in state.items() if k.startswith(f"{MCH}{table}.")}
    segments = buffers["_output_segments_tensor"][buffers["_output_segments_tensor"] >= 0].tolist()
    mixed = torch.from_numpy(spread(ids.numpy()))
    bucket = mixed // -(-MANAGED_ID_RANGE // (len(segments) - 1))
    out = torch.full_like(ids, -1)
    for rank, (start, end) in enumerate(zip(segments, segments[1:])):
        mine = bucket == rank
        remapped = _mch_remap({"f": JaggedTensor(mixed[mine], lengths=torch.ones(int(mine.sum()), dtype=torch.int64))},
                              buffers["_mch_sorted_raw_ids"][start:end],
                              buffers["_mch_remapped_ids_mapping"][start:end], end - 1)
        out[mine] = remapped["f"].values()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_the_artifacts_id_map_remaps_as_each_ranks_mch_does(world, made_once, tmp_path):
    run, cache = trained(made_once, world)
    state = tensors(run / "checkpoints" / "step-20", tmp_path)
    _, maps = served_tables({k[len("model."):]: v for k, v in state.items()})
    assert sorted(maps) == ["item", "user_id"]
    rng = np.random.default_rng(0)
    valid = pq.read_table(next(cache.glob("*/valid")))
    for table, column in (("user_id", "user_id"), ("item", "item_id")):
        logged = valid.column(column).to_numpy().astype(np.int64)
        ids = torch.from_numpy(np.concatenate([logged, rng.integers(0, 2 ** 64, 1000, dtype=np.uint64).view(np.int64)]))
        expected = _mch_reference(ids, state, table)
        got = ManagedRows(*maps[table])(spread_ids(ids))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        missed = torch.isin(expected, maps[table][2])
        assert 0 < missed[:len(logged)].float().mean() < 1  # the log's ids: in the map or not
        assert missed[len(logged):].all() and len(set(expected[len(logged):].tolist())) == world  # one miss row a rank


def export_and_score(run: Path, valid: Path, out: Path, fmt: str = "pt2", compare: bool = False) -> tuple[dict, dict]:
    """Export `run` in `fmt` and score `valid` with the artifact: its AUC and logloss are the
    run's own evaluation's, on its ranks. With `compare`, `score --checkpoint` (one rank) too,
    prediction by prediction within 1e-5. -> (the export's manifest, the checkpoint's scores or {})."""
    manifest = json.loads(rankmix("export", "--checkpoint", str(run), "--out", str(out / "model"),
                                  "--format", fmt).stdout.splitlines()[-1])
    proc = rankmix("score", "--model", str(out / "model"), "--data", str(valid), "--out", str(out / "b"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.splitlines()[-1])
    summary = json.loads((run / "summary.json").read_text())
    assert served["logloss"] == pytest.approx(summary["logloss"], abs=1e-6)
    # Row-wise pooling sums each bag's rows rank by rank: float rounding may swap a pair's order.
    assert served["auc"] == pytest.approx(summary["auc"], abs=2e-5)
    if not compare:
        return manifest, {}
    proc = rankmix("score", "--checkpoint", str(run), "--data", str(valid), "--out", str(out / "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    served_rows, checkpoint_rows = pq.read_table(out / "b"), pq.read_table(out / "a")
    predictions = [name for name in checkpoint_rows.column_names if name.startswith("pred_")]
    assert predictions and served_rows.column_names == checkpoint_rows.column_names
    for name in predictions:
        np.testing.assert_allclose(served_rows.column(name).to_numpy(), checkpoint_rows.column(name).to_numpy(),
                                   atol=1e-5, rtol=0)
    return manifest, json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("world,fmt", [(1, "pt2"), (2, "torchscript")])
def test_an_artifact_with_managed_tables_scores_as_its_training_run_evaluated(world, fmt, made_once, tmp_path):
    run, cache = trained(made_once, world)
    valid = next(cache.glob("*/valid"))
    # one rank: the same weights and map in TorchRec's modules, prediction by prediction
    manifest, scored = export_and_score(run, valid, tmp_path, fmt, compare=world == 1)
    assert manifest["managed"]["user_id"]["ranks"] == world and manifest["managed"]["item"]["ranks"] == world
    assert 1000 < manifest["managed"]["user_id"]["ids"] <= 2000 - world
    if world == 1:  # score reports the share of the scored users that fell on the miss row
        _, maps = served_tables(model_tensors(run / "checkpoints" / "step-20"))
        users = torch.from_numpy(pq.read_table(valid).column("user_id").to_numpy().astype(np.int64))
        missed = torch.isin(ManagedRows(*maps["user_id"])(spread_ids(users)), maps["user_id"][2]).double().mean()
        assert 0 < missed < 1 and scored["managed/user_id.miss_rate"] == pytest.approx(float(missed), abs=1e-6)


@pytest.mark.slow
def test_a_model_whose_tables_are_all_managed_trains_on_two_ranks_and_serves(made_once, tmp_path):
    cache = made_once("managed-cache", lambda folder: None)
    sparse = [f.name for f in load_config("configs/synth.toml").features if f.kind != "numeric"]
    every = [f"--features.{f}.hashing=managed" for f in sparse] + ["--features.user_gender.num_embeddings=4"]
    proc = train(2, tmp_path / "run", cache, *every, "--train.steps=10", "--checkpoint.interval=100")
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert "module: ebc" not in (tmp_path / "run" / "plan.txt").read_text()
    tables = {f.table for f in load_config("configs/synth.toml").features if f.kind != "numeric"}
    assert {k.split("/")[1].split(".")[0] for k in summary if k.startswith("managed/")} == tables
    export_and_score(tmp_path / "run", next(cache.glob("*/valid")), tmp_path)


@pytest.mark.parametrize("start,evictions", [(0, [5, 10]), (10, [15, 20]), (13, [15, 20])])
def test_evictions_stay_on_multiples_of_the_interval_after_any_resume(start, evictions):
    """TorchRec's MCH would evict at 18 and 23 after a resume at iteration 13."""
    mch = TrackedMCH(zch_size=50, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(),
                     eviction_interval=5, input_hash_size=MANAGED_ID_RANGE, name="t")
    mch._current_iter_tensor.fill_(start)  # as a checkpoint saved at that iteration loads it
    seen = []
    for _ in range(10):
        mch.profile({"f": JaggedTensor(torch.arange(8), lengths=torch.ones(8, dtype=torch.int64))})
        if mch.evict() is not None:
            seen.append(mch._current_iter)
    assert seen == evictions
