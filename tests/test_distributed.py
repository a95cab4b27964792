"""Multi-process training on gloo: plans, equivalence with one process, uneven data, torchrun."""

import json
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from cli import rankmix_ranks, rendezvous_port, spawn, spawn_fresh
from embeddings.sharding import local_shards
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features
from trainer.offline.synth import write_synthetic

REPO = Path(__file__).resolve().parents[1]
ROWS_PER_GROUP = 32  # = the 2-rank per-rank batch: rank r reads row groups r, r+2, ...
STEPS = 6
# Adagrad's and RMSProp's first step moves a weight by about lr * g / (|g| + eps): with the
# default eps of 1e-8 a gradient at float rounding level (1e-9) still moves it by a sizeable
# fraction of lr, in a direction the rounding picks. A larger eps bounds that amplification
# so that summation order alone cannot decide a comparison at 1e-5.
EXTRA = ["--embeddings.eps=1e-3", "--optim.eps=1e-3"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Synthetic rows rewritten into row groups of exactly ROWS_PER_GROUP rows."""
    root = tmp_path_factory.mktemp("dist")
    write_synthetic(root / "src", rows=4_000, files=1, seed=3)
    table = pq.read_table(root / "src" / "train")
    for split, rows in (("train", 2 * STEPS * 2 * ROWS_PER_GROUP), ("valid", 512)):
        (root / split).mkdir()
        part = table.slice(0, rows) if split == "train" else table.slice(table.num_rows - rows)
        pq.write_table(part, root / split / "part-0.parquet", row_group_size=ROWS_PER_GROUP)
    return root


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight as one whole CPU tensor on rank 0 (sharded tables gathered; a
    collective: call on every rank). Other ranks get an empty dict. The tests' reference:
    training never needs whole tables in one place."""
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, (ShardedTensor, DTensor)):
            pieces: list = [None] * dist.get_world_size()
            dist.all_gather_object(pieces, [(t.detach().cpu(), o) for t, o in local_shards(value)])
            full = torch.empty(value.size(), dtype=value.dtype)
            for t, (row, col) in (p for rank_pieces in pieces for p in rank_pieces):
                full[row:row + t.shape[0], col:col + t.shape[1]] = t
            value = full
        if rank == 0:
            out[key] = value.detach().cpu().clone()
    return out


def _train_worker(rank: int, world: int, port: int, overrides: list[str], data: str, out: str,
                  steps: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    from trainer.assembly import build_trainer
    from trainer.dist import shutdown

    cfg = load_config(None, [f"--data.train_path={data}/train", f"--data.eval_path={data}/valid",
                             "--data.dataset=parquet", "--data.shuffle=false", "--metrics.progress=false",
                             "--metrics.tensorboard=false", f"--train.run_dir={out}.run", *overrides])
    cfg.features = synth_features()
    trainer = build_trainer(cfg)
    batches = trainer.batches()
    losses = []
    for _ in range(steps):
        loss = (trainer.train_step(batches) * trainer.task_weights).sum()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    weights = full_state_dict(trainer.model)
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "plan": str(trainer.model.plan),
                    "pipelined": trainer.pipeline is not None}, out)
    batches.close()
    trainer.close()
    shutdown()


def train(world: int, overrides: list[str], data: Path, out: Path, steps: int = STEPS) -> dict:
    """Losses, gathered weights and plan of `steps` steps on `world` processes."""
    spawn(_train_worker, (world, rendezvous_port(), overrides, str(data), str(out), steps), world)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single(data_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "w.pt"
    return train(1, [f"--data.batch_size={2 * ROWS_PER_GROUP}", *EXTRA], data_dir, out)


@pytest.fixture(scope="module")
def initial(data_dir, tmp_path_factory) -> dict:
    """The weights before any step (1 rank, table-wise)."""
    out = tmp_path_factory.mktemp("initial") / "w.pt"
    return train(1, [f"--data.batch_size={2 * ROWS_PER_GROUP}", *EXTRA], data_dir, out, steps=0)


@pytest.mark.parametrize("plan", ["table_wise", "row_wise", "column_wise"])
def test_two_ranks_match_one_rank_with_twice_the_batch(plan, data_dir, single, initial, tmp_path):
    two = train(2, [f"--data.global_batch_size={2 * ROWS_PER_GROUP}", f"--embeddings.plan={plan}", *EXTRA],
                data_dir, tmp_path / "w.pt")
    assert plan in two["plan"]
    assert two["pipelined"] and not single["pipelined"]  # auto: TrainPipelineSparseDist across ranks
    assert two["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert two["weights"].keys() == single["weights"].keys()
    for key, value in single["weights"].items():
        assert torch.allclose(two["weights"][key], value, atol=1e-5), key
    # and training moved the weights: the comparison is not between two initial states
    table = "ebc.embedding_bags.user_id.weight"
    assert not torch.allclose(single["weights"][table], initial["weights"][table])


def test_initial_embeddings_do_not_depend_on_the_plan(data_dir, initial, tmp_path):
    one = initial  # table-wise on one rank
    two = train(2, ["--embeddings.plan=row_wise", "--embeddings.table_sharding.item=column_wise",
                    "--data.batch_size=32"], data_dir,
                tmp_path / "b.pt", steps=0)
    # async_save shards into DTensors instead of ShardedTensors: the same values too
    dtensor = train(2, ["--embeddings.plan=table_wise", "--checkpoint.async_save=true", "--data.batch_size=32"],
                    data_dir, tmp_path / "c.pt", steps=0)
    assert "column_wise" in two["plan"] and "row_wise" in two["plan"]
    for key, value in one["weights"].items():
        if ".embedding_bags." in key:
            assert torch.equal(two["weights"][key], value), key
            assert torch.equal(dtensor["weights"][key], value), key

def _cli_worker(rank: int, world: int, ports: list[int], run: str, cache: str) -> None:
    """`rankmix train` several times in one process, as a rank of `world`."""
    from launch.cli import main

    for i, port in enumerate(ports):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        code = main(["train", "--config", str(REPO / "configs" / "debug.toml"), "--train.steps=6",
                     "--metrics.eval_batches=2",
                     f"--train.run_dir={run}/{i}", f"--data.cache_dir={cache}", "--metrics.progress=false",
                     "--checkpoint.async_save=true", "--checkpoint.interval=3", "--embeddings.plan=column_wise"])
        assert code == 0
        # Nothing the run started may outlive it: reader prefetch, TensorBoard writer, async save.
        assert [t.name for t in threading.enumerate()] == ["MainThread"], threading.enumerate()


@pytest.mark.slow
def test_repeated_two_rank_runs_exit_cleanly(tmp_path):
    """The full `rankmix train` path (pipeline, async saves, TensorBoard) twice over on 2 ranks:
    every run ends with its threads joined and its collectives finished, so that the second
    starts clean, and both processes exit with status 0 (a rank that aborts at exit fails
    mp.spawn)."""
    spawn_fresh(_cli_worker, (2, [rendezvous_port() for _ in range(2)], str(tmp_path), str(tmp_path / "cache")), 2)
    for i in range(2):
        assert json.loads((tmp_path / str(i) / "summary.json").read_text())["steps"] == 6


def _in_flight_worker(rank: int, port: int, leave_cleanly: bool) -> None:
    """Rank 1 leaves while a collective it started still waits for rank 0; its completion
    runs a Python callback on gloo's worker thread, as TorchRec's awaitables do."""
    import time

    import torch.distributed as dist

    from trainer.dist import shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(0.3)
    work = dist.all_reduce(torch.ones(8), async_op=True)
    work.get_future().then(lambda fut: fut.value())
    if leave_cleanly:
        shutdown()
    elif rank == 0:
        work.wait()
        time.sleep(2)  # rank 1 finalizes meanwhile


@pytest.mark.slow
@pytest.mark.parametrize("leave_cleanly", [False, True])
def test_a_collective_in_flight_at_exit_aborts_unless_shutdown_waits_for_it(leave_cleanly):
    """The root cause of the rank that died with SIGABRT at exit: gloo's thread finishes the
    collective while the interpreter finalizes, needs the GIL, is ended by pthread_exit, and
    the forced unwind through a noexcept frame calls std::terminate. `shutdown()` waits."""
    if leave_cleanly:
        spawn_fresh(_in_flight_worker, (rendezvous_port(), True), 2)
        return
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        spawn_fresh(_in_flight_worker, (rendezvous_port(), False), 2)


def test_uneven_files_on_two_ranks_train_every_row_but_a_bounded_few(data_dir, tmp_path):
    """One 1000-row file written as a single row group (fewer row groups than ranks) and a
    37-row file: both ranks train, and each epoch's rows trained, counted over the ranks,
    are logged against the split's and lose fewer than ranks x batch rows."""
    from trainer.config_loader import dump_toml

    table = pq.read_table(data_dir / "src" / "train")
    uneven = tmp_path / "uneven"
    uneven.mkdir()
    pq.write_table(table.slice(0, 1000), uneven / "a.parquet", row_group_size=1000)
    pq.write_table(table.slice(1000, 37), uneven / "b.parquet", row_group_size=10)
    cfg = load_config(None, [f"--data.train_path={uneven}", f"--data.eval_path={data_dir}/valid",
                             "--data.dataset=parquet", "--data.batch_size=64", "--train.epochs=2"])
    cfg.features = synth_features()
    dump_toml(cfg, tmp_path / "uneven.toml")
    run = tmp_path / "run"
    # the ranks forked as torchrun starts them (torchrun's own run of uneven files is test_launch.py's)
    proc = rankmix_ranks(2, "--config", str(tmp_path / "uneven.toml"), f"--train.run_dir={run}",
                         "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.enabled=false",
                         timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "data"]
    # 1037 rows: 518 and 519 per rank, 8 batches of 64 each
    assert [(r["epoch"], r["rows"], r["rows_trained"], r["rows_dropped"]) for r in epochs] == \
        [(0, 1037, 1024, 13), (1, 1037, 1024, 13)]
    assert [r["step"] for r in epochs] == [8, 16]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["data/rows_dropped"] == 13 < 2 * 64
