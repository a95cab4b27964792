"""Launchers: torchrun through `rankmix launch`, a real torchx local run, scheduler specs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tomli_w

from dense.model_config import TaskSpec
from trainer.config_loader import to_dict
from trainer.data.datasets import synth_features
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader
from trainer.offline.synth import write_synthetic

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def bare_env() -> dict[str, str]:
    """A shell's environment without the virtual environment: no .venv/bin on PATH, no
    VIRTUAL_ENV, no torchrun variables, and no make variables of a `make test ARGS=...` that
    runs the suite (a `make train` in a test would take its ARGS). What a new terminal has."""
    path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p).resolve() != BIN.resolve()]
    env = {**os.environ, "PATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}
    for var in ("VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS"):
        env.pop(var, None)
    return env


def run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=bare_env(), capture_output=True, text=True, timeout=timeout)


def last_json(text: str) -> dict:
    lines = [line for line in text.splitlines() if '"auc"' in line]
    return json.loads(lines[-1][lines[-1].index("{"):])


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    """Three training files of 2,000, 300 and 200 rows, one row group each, and a config
    with the synthetic schema for them."""
    root = tmp_path_factory.mktemp("uneven")
    (root / "features.toml").write_text(tomli_w.dumps({"features": [to_dict(f) for f in synth_features()]}))
    write_synthetic(root / "src", rows=3_000, files=1, seed=5)
    table = pq.read_table(root / "src" / "train")
    (root / "train").mkdir()
    for i, (start, rows) in enumerate([(0, 2_000), (2_000, 300), (2_300, 200)]):
        pq.write_table(table.slice(start, rows), root / "train" / f"part-{i}.parquet", row_group_size=5_000)
    return root


@pytest.mark.slow
def test_torchrun_with_uneven_files_finishes_on_every_rank(uneven, tmp_path):
    # Files of 2,000, 300 and 200 rows in one row group each: the ranks split the rows, not
    # the row groups, so both train on 1,250 rows an epoch and stop after the same step.
    proc = run(sys.executable, "-m", "launch.cli", "launch", "--nproc-per-node", "2",
               "--data.dataset=parquet", f"--data.train_path={uneven / 'train'}",
               f"--data.eval_path={uneven / 'src' / 'valid'}", "--data.batch_size=50", "--train.epochs=3",
               "--model.num_tokens=4", "--model.hidden_dim=16", f"--train.run_dir={tmp_path}",
               "--metrics.progress=false", "--config", str(uneven / "features.toml"), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    readers = [ParquetReader(str(uneven / "train"), RowEncoder(synth_features(), [TaskSpec()]),
                             ReaderOptions(batch_size=50, rank=r, world_size=2)) for r in (0, 1)]
    expected = sum(readers[0].steps_in_epoch(e) for e in range(3))
    assert expected == sum(readers[1].steps_in_epoch(e) for e in range(3))
    assert summary["steps"] == expected == 3 * (2_500 // 2 // 50)  # the even split, whatever the row groups


@pytest.mark.slow
def test_torchx_local_run_with_two_processes(tmp_path):
    """As the README types it, from a shell where the environment is not activated: the job
    starts the interpreter that runs torchx, not a `torchrun` looked up on PATH."""
    proc = run(str(BIN / "torchx"), "run", "--workspace", "", "-s", "local_cwd", "launch/component.py:train",
               "--nproc_per_node", "2", "--config", "configs/debug.toml", "--",
               f"--train.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}",
               "--train.steps=8", "--metrics.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in proc.stderr + proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 8 and 0 < summary["auc"] < 1
    assert "rank:1/cpu" in (tmp_path / "run" / "plan.txt").read_text()  # tables really on two ranks


def test_slurm_job_spec(tmp_path):
    proc = run(str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", "-s", "slurm",
               "launch/component.py:train", "--nnodes", "2", "--nproc_per_node", "8", "--gpu", "8",
               "--memMB", "65536", "--cpu", "32", "--data_on_every_node", "True", "--config", "configs/movielens.toml",
               "--", "--train.steps=100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = proc.stdout
    assert "#SBATCH hetjob" in script  # one het-group per node
    assert script.count("--gpus-per-task=8") == 2 and "--mem=65536" in script and "--cpus-per-task=32" in script
    assert ("--nnodes 2 --nproc_per_node 8" in script and "--rdzv_backend c10d" in script)
    assert "-m launch.cli train --config configs/movielens.toml --train.steps=100" in script
    assert f"{sys.executable} -m torch.distributed.run --rdzv_backend" in script and "torchrun" not in script


def test_kubernetes_job_spec():
    proc = run(str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", "-s", "kubernetes",
               "launch/component.py:train", "--image", "registry.example/rankmix:1", "--nnodes", "2",
               "--nproc_per_node", "4", "--gpu", "4", "--python", "python3", "--data_on_every_node", "True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = proc.stdout
    assert "kind: Job" in spec and "apiVersion: batch.volcano.sh/v1alpha1" in spec
    assert spec.count("image: registry.example/rankmix:1") == 2
    assert spec.count("nvidia.com/gpu: '4'") == 4  # limits and requests of both pods
    assert "--nnodes 2 --nproc_per_node 4" in spec and "-m launch.cli train --config configs/debug.toml" in spec
    assert "python3 -m torch.distributed.run" in spec  # the image's interpreter


def test_credentials_never_go_into_a_job_spec():
    proc = run(str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", "-s", "slurm",
               "launch/component.py:train", "--", "--data.train_path=s3://AKID:s3cr3t@bucket/train")
    assert proc.returncode != 0
    assert ("--data.train_path=s3://***@bucket/train: credentials in a URI would be written into the job spec; "
            "give them to the job as AWS_* environment variables or a secret") in proc.stderr
    assert "s3cr3t" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("scheduler", ["slurm", "kubernetes"])
@pytest.mark.parametrize("env", ["AWS_SECRET_ACCESS_KEY=s3cr3t", "AWS_SESSION_TOKEN=s3cr3t", "HF_TOKEN=s3cr3t",
                                 "DATA=s3://AKID:s3cr3t@bucket/train"])
def test_secrets_in_env_never_go_into_a_job_spec(scheduler, env):
    """The sbatch script's `srun --export` line and the pod spec show env in plain text."""
    proc = run(str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", "-s", scheduler, "launch/component.py:train",
               "--image", "registry.example/rankmix:1", "--env", f"LOGLEVEL=INFO,{env}")
    assert proc.returncode != 0
    assert (f"ValueError: env {env.split('=')[0]}: a secret in env would be written into the job spec; give it "
            "through the scheduler's secret mechanisms instead: a Kubernetes Secret, a Slurm environment file "
            "(exported in the shell that submits), or an instance role") in proc.stderr
    assert "s3cr3t" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("scheduler", ["slurm", "kubernetes"])
def test_env_without_secrets_goes_into_the_job_spec(scheduler):
    allowed = {"AWS_PROFILE": "prod", "AWS_ACCESS_KEY_ID": "AKID", "TOKENIZERS_PARALLELISM": "false",
               "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/token", "DATA": "s3://bucket/train"}
    proc = run(str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", "-s", scheduler, "launch/component.py:train",
               "--image", "registry.example/rankmix:1", "--env", ",".join(f"{k}={v}" for k, v in allowed.items()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    if scheduler == "slurm":
        assert "--export=ALL," + ",".join(f"{k}={v}" for k, v in allowed.items()) + "," in proc.stdout
    else:
        for name, value in allowed.items():
            assert re.search(rf"- name: {name}\n +value: '?{re.escape(value)}'?\n", proc.stdout), name


def _failure(exitcode: int, timestamp: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="")
    failure.timestamp = timestamp
    return failure


def test_the_exit_code_passed_on_is_the_first_of_a_rank_that_failed_by_itself():
    from launch.cli import _first_failure

    # rank 1 stopped by torchrun (SIGTERM) is stamped a second before rank 0's own error
    rank, failure = _first_failure({0: _failure(3, 101), 1: _failure(-15, 100)})
    assert (rank, failure.exitcode) == (0, 3)
    rank, failure = _first_failure({0: _failure(1, 102), 1: _failure(-15, 100), 2: _failure(3, 101)})
    assert (rank, failure.exitcode) == (2, 3)
    # every rank signalled: the first of them, ties to the lower rank
    rank, failure = _first_failure({1: _failure(-9, 100), 0: _failure(-15, 100), 2: _failure(-15, 99)})
    assert (rank, failure.exitcode) == (2, -15)
    rank, failure = _first_failure({1: _failure(-9, 100), 0: _failure(-15, 100)})
    assert (rank, failure.exitcode) == (0, -15)
