"""Checkpoints: bitwise resume at world sizes 1 and 2, a killed rank under torchrun, a kill
during a save, resharding on load, retention and the non-finite stop."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cli import rankmix, rankmix_ranks
from trainer.checkpoint.manager import complete_steps
from trainer.checkpoint.state import decode_state
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
STEPS = 60  # of the shared 2-rank reference, saved every 10 steps


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def cache(made_once) -> Path:
    """The data cache, and beside it the config of every run here: the debug model on the
    synthetic log, its behaviour sequence read by target attention (an unpooled
    EmbeddingCollection for the item table beside the bags), so that resume, resharding and
    the async save cover both kinds of table."""
    def make(folder: Path) -> None:
        cfg = load_config(str(REPO / "configs" / "debug.toml"))
        cfg.features = synth_features()
        next(f for f in cfg.features if f.name == "hist_items").sequence_module = "target_attention"
        dump_toml(cfg, folder / "config.toml")
    return made_once("checkpoint-cache", make)


@pytest.fixture(scope="module")
def reference(cache, made_once) -> Path:
    """An uninterrupted 2-rank run of STEPS steps with synchronous saves every 10 steps, all
    kept: what the interrupted, resumed and async-saving runs must end bitwise equal to."""
    def make(run: Path) -> None:
        ok(train(2, *train_args(run, cache, STEPS, "--checkpoint.interval=10", "--checkpoint.keep=0")))
    return made_once("checkpoint-reference", make)


def run_from(reference: Path, run: Path, *steps: int) -> Path:
    """A run folder holding copies of the reference's checkpoints at `steps`."""
    for step in steps:
        shutil.copytree(reference / "checkpoints" / f"step-{step}", run / "checkpoints" / f"step-{step}")
    return run


def train_args(run: Path, cache: Path, steps: int, *extra: str) -> list[str]:
    """A short run's options: the config beside the data cache where its fixture wrote one (this
    module's `cache`), else configs/debug.toml (the other modules that import this)."""
    config = cache / "config.toml" if (cache / "config.toml").is_file() else REPO / "configs" / "debug.toml"
    return ["--config", str(config), f"--train.run_dir={run}", f"--data.cache_dir={cache}",
            f"--train.steps={steps}", "--metrics.log_every=1", "--metrics.progress=false",
            "--metrics.tensorboard=false", *extra]


def train(world: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`rankmix train` on `world` ranks, forked as torchrun starts them (`rankmix_ranks`). The
    tests of torchrun itself (a killed rank's restart, its error report) run `rankmix launch`."""
    return rankmix_ranks(world, *args, timeout=timeout)


def tensors(step_dir: Path, tmp: Path) -> dict[str, object]:
    """Every value of a DCP checkpoint, flattened, as whole tensors."""
    out = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))

    def flat(d, prefix=""):
        items = {}
        for k, v in d.items():
            items.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return items
    return flat(torch.load(out, weights_only=True))


def assert_same_state(a: Path, b: Path, tmp: Path, sequences: bool = False) -> None:
    """Weights and both optimizers' states bitwise equal; same step and data position; with
    `sequences`, the attended sequence's EmbeddingCollection among them."""
    ta, tb = tensors(a, tmp), tensors(b, tmp)
    model_and_optim = [k for k in ta if k.startswith(("model.", "optim."))]
    assert any(".embedding_bags." in k for k in model_and_optim) and any("sparse" in k for k in model_and_optim)
    assert any("sequence_tables.embeddings." in k for k in model_and_optim) == sequences
    assert set(ta) == set(tb)
    for key in model_and_optim:
        assert torch.equal(ta[key], tb[key]), key
    for key in ("trainer.step", "trainer.epoch", "trainer.epoch_step"):
        assert ta[key] == tb[key], key
    # every rank's reader position and RNG states
    assert same(decode_state(ta["ranks"], "a"), decode_state(tb["ranks"], "b"))


def same(a, b) -> bool:
    """Deep equality across tensors, arrays and containers."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def losses(run: Path) -> dict[int, float]:
    """Training loss per step; a step trained twice (after a restart) keeps its last value."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record["loss"]
    return out


def test_resume_on_one_rank_is_bitwise_equal_to_an_uninterrupted_run(cache, tmp_path):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    ok(train(1, *train_args(whole, cache, 24, "--checkpoint.interval=12")))
    ok(train(1, *train_args(halves, cache, 12)))
    assert complete_steps(halves / "checkpoints") == [12]
    resumed = ok(train(1, *train_args(halves, cache, 24)))
    assert f"resumed from {halves / 'checkpoints' / 'step-12'} at step 12" in resumed.stdout
    assert_same_state(whole / "checkpoints" / "step-24", halves / "checkpoints" / "step-24", tmp_path, sequences=True)
    assert losses(halves) == losses(whole) and len(losses(whole)) == 24


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_on_two_ranks_is_bitwise_equal_to_an_uninterrupted_run(mode, reference, cache, tmp_path):
    """The reference's step-30 checkpoint, resumed on 2 ranks, trains on bitwise as the reference
    did; the saves after it, asynchronous ones too (taken while training goes on), are bitwise
    those of the reference's synchronous saves. (A resume from an async save: test_gpu_layouts.py.)"""
    halves, half = run_from(reference, tmp_path / "halves", STEPS // 2), STEPS // 2
    save = f"--checkpoint.async_save={mode == 'async'}".lower()
    resumed = ok(train(2, *train_args(halves, cache, STEPS, save, "--checkpoint.interval=10", "--checkpoint.keep=0")))
    assert f"resumed from {halves / 'checkpoints' / f'step-{half}'} at step {half}" in resumed.stdout
    assert complete_steps(halves / "checkpoints") == list(range(half, STEPS + 1, 10))
    for step in range(half + 10, STEPS + 1, 10):
        assert_same_state(reference / "checkpoints" / f"step-{step}", halves / "checkpoints" / f"step-{step}",
                          tmp_path, sequences=True)
    assert losses(halves) == {k: v for k, v in losses(reference).items() if k > half}
    assert len(losses(reference)) == STEPS


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.slow
def test_killed_rank_restarts_under_torchrun_and_ends_bitwise_equal(reference, cache, tmp_path):
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", "--nproc-per-node", "2",
                             "--max-restarts", "1", *train_args(run, cache, STEPS, "--checkpoint.interval=10")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step-20" / ".metadata").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "training ended before the kill"
            time.sleep(0.02)
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in out  # the restarted workers picked up the newest checkpoint
    assert_same_state(reference / "checkpoints" / f"step-{STEPS}", run / "checkpoints" / f"step-{STEPS}", tmp_path,
                      sequences=True)
    assert losses(run) == losses(reference)


def test_kill_during_save_resumes_from_previous_and_saves_again(reference, cache, tmp_path):
    run = run_from(reference, tmp_path / "run", 10, 20)
    # What SIGKILL inside dcp.save leaves: data files written, no .metadata yet.
    (run / "checkpoints" / "step-20" / ".metadata").unlink()
    assert complete_steps(run / "checkpoints") == [10]
    resumed = ok(train(2, *train_args(run, cache, 20, "--checkpoint.interval=10"), timeout=120))
    assert f"resumed from {run / 'checkpoints' / 'step-10'} at step 10" in resumed.stdout
    assert complete_steps(run / "checkpoints") == [10, 20]  # step-20 written again, no deadlock
    assert_same_state(reference / "checkpoints" / "step-20", run / "checkpoints" / "step-20", tmp_path, sequences=True)


def test_retention_keeps_exactly_k_and_skips_an_incomplete_newest(cache, tmp_path):
    run = tmp_path / "run"
    ok(train(1, *train_args(run, cache, 25, "--checkpoint.interval=5", "--checkpoint.keep=2")))
    assert complete_steps(run / "checkpoints") == [20, 25]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-20", "step-25"]
    shutil.copytree(run / "checkpoints" / "step-25", run / "checkpoints" / "step-30")
    (run / "checkpoints" / "step-30" / ".metadata").unlink()
    resumed = ok(train(1, *train_args(run, cache, 30, "--checkpoint.interval=5", "--checkpoint.keep=2")))
    assert "at step 25" in resumed.stdout
    assert complete_steps(run / "checkpoints") == [25, 30]


@pytest.mark.slow
def test_row_wise_on_two_ranks_loads_into_table_wise_on_one(cache, tmp_path):
    two = tmp_path / "two"
    ok(train(2, *train_args(two, cache, 10, "--embeddings.plan=row_wise")))
    assert "row_wise" in (two / "plan.txt").read_text()
    saved = ok(rankmix("export", "--checkpoint", str(two), "--out", str(tmp_path / "two.pt"), "--format", "weights"))
    assert json.loads(saved.stdout)["tensors"] > 20
    # Weights only, into one rank with table-wise tables, then exported again before any step.
    one = tmp_path / "one"
    ok(train(1, *train_args(one, cache, 1, "--embeddings.plan=table_wise", f"--checkpoint.load_path={two}",
                            "--checkpoint.load_mode=weights", "--optim.lr=1e-30", "--embeddings.lr=1e-30")))
    assert "table_wise" in (one / "plan.txt").read_text()
    expected, loaded = torch.load(tmp_path / "two.pt"), tensors(one / "checkpoints" / "step-1", tmp_path)
    for key, value in expected.items():
        assert torch.allclose(loaded[f"model.{key}"], value, atol=1e-20), key


def test_world_size_change_mid_epoch_trains_the_rest_of_the_epoch_or_the_next_when_asked(reference, cache, tmp_path):
    # debug.toml: 20k rows, 14k training rows in windows of 8192; 2 ranks x 256 rows x 10 steps
    # stop inside each rank's first window, so 1 rank reads those 5120 rows again.
    run = run_from(reference, tmp_path / "run", 10)
    resumed = ok(train(1, *train_args(run, cache, 20)))
    assert "at step 10" in resumed.stdout
    assert "epoch 0 resumed at world size 1 from 2: its" in resumed.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data/rows_reread"] == 2 * 10 * 256 and summary["steps"] == 20
    moved = run_from(reference, tmp_path / "moved", 10)
    ok(train(1, *train_args(moved, cache, 12, "--checkpoint.data_position=next_epoch")))
    assert json.loads((moved / "summary.json").read_text())["data/rows_reread"] == 0
    states = decode_state(tensors(moved / "checkpoints" / "step-12", tmp_path)["ranks"], "ranks")
    assert (states[0]["reader"]["epoch"], states[0]["reader"]["step"]) == (1, 2)


def test_a_run_folder_of_another_model_is_a_one_line_error(reference, cache, tmp_path):
    run = run_from(reference, tmp_path / "run", 10)
    proc = train(1, *train_args(run, cache, 20, "--model.num_layers=3"))
    assert proc.returncode == 2
    assert (f"rankmix: error: {run / 'checkpoints' / 'step-10'} does not fit this run (Missing key in checkpoint "
            "state_dict: model.tower.blocks.2.") in proc.stderr
    assert "Give this run a folder of its own (--train.run_dir)" in proc.stderr and "Traceback" not in proc.stderr


def test_non_finite_loss_stops_before_the_update_and_keeps_the_last_checkpoint(cache, tmp_path):
    run = tmp_path / "run"
    proc = rankmix("launch", "--nproc-per-node", "2", *train_args(run, cache, 30, "--checkpoint.interval=1",
                                                                    "--optim.lr=1e30"))
    assert proc.returncode == 3  # trainer/errors.py, passed on by `rankmix launch`
    # torchrun's report names the real error from the ranks' error files (`record`), not <N/A>
    assert "error_file: <N/A>" not in proc.stderr and "NonFiniteLossError: non-finite loss" in proc.stderr
    message = [line for line in proc.stderr.splitlines() if "rankmix: stopped: non-finite" in line]
    assert message, proc.stderr[-2000:]
    step = int(message[0].split(" at step ")[1].split()[0])
    assert complete_steps(run / "checkpoints")[-1] == step - 1
    tensors(run / "checkpoints" / f"step-{step - 1}", tmp_path)  # the last good one loads


@pytest.mark.slow
def test_time_interval_saves_agree_across_ranks(cache, tmp_path):
    # A 6 ms interval makes the ranks' clocks disagree about "due" at some step; rank 0's
    # verdict must reach both, or the one that saves waits for the other forever.
    run = tmp_path / "run"
    ok(train(2, *train_args(run, cache, 8, "--checkpoint.interval_minutes=0.0001", "--checkpoint.keep=0"),
             timeout=180))
    assert len(complete_steps(run / "checkpoints")) >= 4


@pytest.mark.parametrize("optimizer,data_type", [("adagrad", "fp32"), ("rowwise_adagrad", "fp32"),
                                                 ("adagrad", "fp16")])
def test_the_sparse_optimizer_and_table_type_are_the_ones_configured(optimizer, data_type, cache, tmp_path):
    """FBGEMM's fused kernel really runs row-wise Adagrad when asked (configs/criteo_1tb.toml
    does): its accumulator has one value per row, 1/dim of plain Adagrad's. fp16 tables hold
    half-precision weights; the accumulator stays fp32."""
    run = tmp_path / "run"
    ok(train(1, *train_args(run, cache, 2, f"--embeddings.optimizer={optimizer}",
                            f"--embeddings.data_type={data_type}")))
    state = tensors(run / "checkpoints" / "step-2", tmp_path)
    # a bag table: this module's runs attend the item table's sequence (an EmbeddingCollection)
    weight = state["model.ebc.embedding_bags.user_id.weight"]
    accumulator = state["optim.state.sparse.ebc.embedding_bags.user_id.weight.user_id.momentum1"]
    rows, dim = weight.shape
    assert tuple(accumulator.shape) == ((rows,) if optimizer == "rowwise_adagrad" else (rows, dim))
    assert weight.dtype == {"fp32": torch.float32, "fp16": torch.float16}[data_type]
    assert accumulator.dtype == torch.float32
