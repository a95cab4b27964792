"""Process lifecycle: SIGTERM (what Slurm and Kubernetes send first) saves a checkpoint and
stops every rank with the documented exit code; the run resumes from it."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cli import read_output, run_env, start_rankmix
from test_checkpoint import REPO, ok, train, train_args
from trainer.checkpoint.manager import complete_steps


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def signalled(world: int, run: Path, args: list[str], after_step: int, timeout: float = 240) -> tuple[
        subprocess.CompletedProcess, list[dict]]:
    """Start a run, send SIGTERM to its first process (torchrun's agent for world > 1, which
    passes it on to the ranks, as on Kubernetes) once `after_step` is logged; wait for it.
    One rank runs forked from tests/cli.py's preloaded server (the signal goes to the trainer
    alone, as to a real interpreter; no seconds of imports); torchrun needs a real one."""
    env = run_env()
    with tempfile.TemporaryDirectory(prefix="rankmix-signalled-") as tmp:
        out_file, err_file = Path(tmp) / "stdout", Path(tmp) / "stderr"
        if world == 1:
            proc = start_rankmix(["train", *args], REPO, env, out_file, err_file)
            running = proc.is_alive
            send = lambda: os.kill(proc.pid, signal.SIGTERM)  # noqa: E731
        else:
            with out_file.open("w") as out, err_file.open("w") as err:  # the child holds its own copies
                proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", "--nproc-per-node",
                                         str(world), *args], cwd=REPO, stdout=out, stderr=err, env=env)
            running = lambda: proc.poll() is None  # noqa: E731
            send = lambda: proc.send_signal(signal.SIGTERM)  # noqa: E731
        try:
            metrics = run / "metrics.jsonl"
            deadline = time.monotonic() + timeout
            while not (metrics.exists() and any(json.loads(line)["step"] >= after_step
                                                for line in metrics.read_text().splitlines())):
                assert running() and time.monotonic() < deadline, read_output(err_file)[-3000:]
                time.sleep(0.05)
            send()
            if world == 1:
                proc.join(timeout)
                code = proc.exitcode
            else:
                code = proc.wait(timeout)
        finally:
            proc.kill()
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        proc = subprocess.CompletedProcess(["rankmix", *args], code, read_output(out_file), read_output(err_file))
        return proc, records


def test_sigterm_saves_at_once_and_the_run_resumes_there(cache, tmp_path):
    run = tmp_path / "run"
    args = train_args(run, cache, 10_000)
    stopped, records = signalled(1, run, args, after_step=3)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = max(r["step"] for r in records if r["kind"] == "train")
    assert complete_steps(run / "checkpoints") == [last]  # saved after the step in flight, nothing after it
    assert f"rankmix: stopped: stopped by SIGTERM after step {last}; resume from" in stopped.stderr
    resumed = ok(train(1, *train_args(run, cache, last + 2)))
    assert f"at step {last}" in resumed.stdout
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == last + 2


@pytest.mark.slow
def test_sigterm_through_torchrun_trains_on_to_a_save_due_within_the_grace(cache, tmp_path):
    run = tmp_path / "run"
    args = train_args(run, cache, 10_000, "--checkpoint.interval=6", "--checkpoint.signal_grace_steps=5",
                      "--checkpoint.keep=0")
    stopped, records = signalled(2, run, args, after_step=2)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "rankmix: stopped by SIGTERM" in stopped.stderr
    last = max(r["step"] for r in records if r["kind"] == "train")
    assert last % 6 == 0  # the scheduled save, not an extra one
    assert complete_steps(run / "checkpoints") == list(range(6, last + 1, 6))
