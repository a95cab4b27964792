"""A training step reads nothing back from the device (issue 31): the finiteness checks, the
stop-signal and timed-save votes are read once every train.check_every steps; a non-finite
step is found at the next read and never reaches a checkpoint. bf16 runs through the
pipeline and DDP on the CPU, and the CUDA precision settings."""

from __future__ import annotations

import json
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from cli import rankmix, spawn
from test_checkpoint import tensors
from test_distributed import free_port
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
TORCH = Path(torch.__file__).parent
# What a step would read back with: each waits for the device's queue on a GPU.
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "barrier")


@pytest.fixture(scope="module")
def cache(made_once) -> Path:
    return made_once("step-checks-cache", lambda folder: None)


def _caller() -> str | None:
    """`file:line` of the innermost caller outside torch, when it is rankmix's own code."""
    frame = sys._getframe(2)
    while frame is not None and Path(frame.f_code.co_filename).is_relative_to(TORCH):
        frame = frame.f_back
    path = Path(frame.f_code.co_filename) if frame is not None else None
    if path is None or not path.is_relative_to(REPO) or ".venv" in path.parts:
        return None
    return f"{path.relative_to(REPO)}:{frame.f_lineno}"


@contextmanager
def counting(calls: list, step: list[int]):
    """Record (step[0], name, caller) for each read of a tensor by rankmix's code and each
    object collective or barrier, on this thread (the reader's prefetch threads work on host
    data). A counting wrapper: every call still runs."""
    main = threading.current_thread()
    saved = {}

    def wrap(owner, name: str, ours_only: bool) -> None:
        original = saved[owner, name] = getattr(owner, name)

        def counted(*args, **kwargs):
            if threading.current_thread() is main:
                where = _caller()
                if where is not None or not ours_only:
                    calls.append((step[0], name, where))
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    for name in READS:
        wrap(torch.Tensor, name, True)
    for name in OBJECT_COLLECTIVES:
        wrap(dist, name, False)
    try:
        yield
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)


def _count_worker(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trainer.dist import shutdown
    from trainer.train import Trainer

    trainer = Trainer(load_config(str(REPO / "configs" / "debug.toml"), args))
    calls: list = []
    step = [0]
    train_step = trainer.train_step

    def step_counted(batches):  # what follows is attributed to the step it starts
        step[0] = trainer.step + 1
        return train_step(batches)
    trainer.train_step = step_counted
    try:
        with counting(calls, step):
            trainer.fit()
    finally:
        trainer.close()
        shutdown()
    Path(f"{out}.{rank}").write_text(json.dumps({"calls": calls, "pipelined": trainer.pipeline is not None}))


@pytest.mark.parametrize("tower", ["rankmixer", "rankmixer_moe"])
def test_steps_between_checks_read_nothing_back(tower, cache, tmp_path):
    """10 steps on 2 ranks (pipelined, DDP), checks, logs and saves every 5 steps, a timed
    save configured: steps 1-4 and 6-9 make no read and no object collective, on either rank;
    steps 5 and 10 read the flags once."""
    args = [f"--model.tower={tower}", "--train.steps=10", "--train.check_every=5", "--metrics.log_every=5",
            "--checkpoint.interval=5", "--checkpoint.interval_minutes=600", "--metrics.eval_batches=1",
            "--metrics.progress=false", "--metrics.tensorboard=false", f"--train.run_dir={tmp_path / 'run'}",
            f"--data.cache_dir={cache}"]
    spawn(_count_worker, (2, free_port(), args, str(tmp_path / "calls")), 2)
    for rank in range(2):
        result = json.loads((tmp_path / f"calls.{rank}").read_text())
        assert result["pipelined"]
        calls = result["calls"]
        assert [c for c in calls if c[0] not in (5, 10)] == [], rank
        flag_reads = [c for c in calls if c[1] == "tolist" and c[2].startswith("trainer/lifecycle.py")]
        assert [c[0] for c in flag_reads] == [5, 10], calls


def _nan_data(tmp_path: Path, row: int) -> Path:
    """A config of the debug model on a 2000-row synthetic log whose raw `item_price` is 3e38
    at `row`: finite in float32, and non-finite once the tokenizer sums it."""
    data = tmp_path / "data"
    proc = rankmix("data", "synth", "--out", str(data), "--rows", "2000", "--files", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    part = data / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    values = table.column("item_price").to_numpy().astype(np.float32)
    values[row] = 3e38
    pq.write_table(table.set_column(table.schema.get_field_index("item_price"), "item_price", pa.array(values)),
                   part, row_group_size=table.num_rows)
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
    cfg.features = synth_features()
    next(f for f in cfg.features if f.name == "item_price").transform = []  # the raw value reaches the model
    dump_toml(cfg, tmp_path / "config.toml")
    return data


def test_a_non_finite_step_is_found_at_the_next_check_and_no_checkpoint_holds_it(tmp_path):
    """Step 7's batch overflows (batch 16, rows in order); checks and saves every 5 steps: the
    run stops at step 10's check with exit code 3, naming step 7; the checkpoint of step 5
    is the last and finite, step 10's never written."""
    data = _nan_data(tmp_path, row=6 * 16 + 3)
    run = tmp_path / "run"
    proc = rankmix("train", "--config", str(tmp_path / "config.toml"), f"--data.train_path={data / 'train'}",
                   f"--data.eval_path={data / 'valid'}", "--data.shuffle=false", "--data.batch_size=16",
                   "--train.steps=12", "--train.check_every=5", "--metrics.log_every=0", "--checkpoint.interval=5",
                   f"--train.run_dir={run}", "--metrics.progress=false", "--metrics.tensorboard=false")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("rankmix: stopped: non-finite loss at step 7 (read after step 10); "
                                            "training stopped: no checkpoint holds an update of step 7 or later")
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-5"]
    state = tensors(run / "checkpoints" / "step-5", tmp_path)
    weights = [v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()]
    assert weights and all(torch.isfinite(w).all() for w in weights)


def _bf16_worker(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.nn.parallel import DistributedDataParallel

    from dense.rankmixer import RankMixerTower
    from trainer.dist import shutdown
    from trainer.train import Trainer

    trainer = Trainer(load_config(str(REPO / "configs" / "debug.toml"), args))
    tower = next(m for m in trainer.model.modules() if isinstance(m, RankMixerTower))
    dtypes: list[str] = []
    tower.register_forward_hook(lambda module, inputs, output: dtypes.append(str(output.dtype)))
    batches = trainer.batches()
    losses = [float((trainer.train_step(batches) * trainer.task_weights).sum()) for _ in range(4)]
    ddp = any(isinstance(m, DistributedDataParallel) for m in trainer.model.modules())
    batches.close()
    trainer.close()
    shutdown()
    Path(f"{out}.{rank}").write_text(json.dumps({"losses": losses, "dtypes": dtypes, "ddp": ddp,
                                                 "pipelined": trainer.pipeline is not None}))


def test_bf16_trains_through_the_pipeline_and_ddp_on_two_cpu_ranks(cache, tmp_path):
    args = ["--train.mixed_precision=bf16", "--train.device=cpu", "--metrics.progress=false",
            "--metrics.tensorboard=false", f"--train.run_dir={tmp_path / 'run'}", f"--data.cache_dir={cache}"]
    spawn(_bf16_worker, (2, free_port(), args, str(tmp_path / "out")), 2)
    for rank in range(2):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        assert result["pipelined"] and result["ddp"]
        assert result["dtypes"] and set(result["dtypes"]) == {"torch.bfloat16"}
        assert all(np.isfinite(result["losses"])) and result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("choice,device,dtype,matmul", [
    ("auto", "cuda", torch.bfloat16, "high"), ("bf16", "cuda", torch.bfloat16, "high"),
    ("none", "cuda", None, "highest"), ("auto", "cpu", None, "highest"), ("bf16", "cpu", torch.bfloat16, "highest")])
def test_precision_choices(choice, device, dtype, matmul):
    """auto is bf16 autocast with TF32 matmuls on CUDA and float32 on the CPU; none opts out of both."""
    from trainer.train import autocast_dtype, set_matmul_precision

    assert autocast_dtype(choice, torch.device(device)) == dtype
    try:
        set_matmul_precision(choice, torch.device(device))
        assert torch.get_float32_matmul_precision() == matmul
    finally:
        torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("tau,converges", [(1.0, True), (0.05, False)])
def test_sinkhorn_decided_on_the_device_is_bit_for_bit_the_read_back_one(tau, converges):
    """The GPU's form of the tolerance test (every iteration run, the first within tol kept
    on the device) against the CPU's (read back, stop): the same matrices, iterations and
    gradients, bit for bit, whether it stops early or runs all 50 iterations."""
    from dense.unimixer import sinkhorn

    torch.manual_seed(0)
    logits = torch.randn(6, 8, 8) / tau
    out, grads, used = {}, {}, {}
    for on_device in (False, True):
        leaf = logits.clone().requires_grad_()
        p, used[on_device] = sinkhorn(leaf, 50, 1e-5, on_device=on_device)
        (p * torch.linspace(-1, 1, p.numel()).view_as(p)).sum().backward()
        out[on_device], grads[on_device] = p.detach(), leaf.grad
    assert int(used[True]) == int(used[False]) and (int(used[True]) < 50) == converges
    assert torch.equal(out[True], out[False])
    assert torch.equal(grads[True], grads[False])
