"""The torchx component's job specs: the device each node trains on, resources per rank,
mounts, and the shared data a multi-node job needs (dry runs: nothing is submitted)."""

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torchx.specs as specs

from launch.cli import torchrun_args
from launch.component import train

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MOUNT = ["type=bind", "src=/nfs/rankmix", "dst=/shared"]


def command(app: specs.AppDef) -> str:
    return app.roles[0].args[1]


def test_gpu_hosts_train_on_cuda_with_memory_for_every_rank():
    app = train("--train.steps=10", nproc_per_node=8, gpu=8)
    role = app.roles[0]
    assert command(app).endswith("-m launch.cli train --config configs/debug.toml --train.steps=10 "
                                 "--train.device=cuda")
    assert (role.resource.gpu, role.resource.cpu, role.resource.memMB) == (8, 16, 8 * 32768)


def test_cpu_hosts_say_cpu_so_a_node_never_silently_changes():
    app = train(nproc_per_node=2)
    assert command(app).endswith("--config configs/debug.toml --train.device=cpu")
    assert (app.roles[0].resource.gpu, app.roles[0].resource.memMB) == (0, 2 * 8192)


def test_explicit_resources_and_a_fitting_device_are_kept():
    app = train("--train.device=cuda", nproc_per_node=4, gpu=8, cpu=64, memMB=500_000)
    assert command(app).count("--train.device=") == 1
    assert (app.roles[0].resource.cpu, app.roles[0].resource.memMB) == (64, 500_000)


@pytest.mark.parametrize("kwargs,message", [
    ({"nproc_per_node": 8, "gpu": 4}, "--nproc_per_node 8 exceeds --gpu 4: one process per GPU"),
    ({"gpu": 0, "overrides": ("--train.device=cuda",)},
     "--train.device=cuda does not fit --gpu 0: give --gpu N for CUDA"),
    ({"gpu": 2, "overrides": ("--train.device", "cpu")},
     "--train.device=cpu does not fit --gpu 2: a GPU job trains on cuda"),
])
def test_devices_that_do_not_fit_the_hosts_are_refused(kwargs, message):
    overrides = kwargs.pop("overrides", ())
    with pytest.raises(ValueError) as e:
        train(*overrides, **kwargs)
    assert str(e.value) == message


def test_mounts_reach_the_job():
    app = train("--data.cache_dir=/shared/cache", nnodes=2, mounts=MOUNT)
    assert app.roles[0].mounts == [specs.BindMount(src_path="/nfs/rankmix", dst_path="/shared")]


@pytest.mark.parametrize("overrides,mounts,shown", [
    ((), [], "mounted at none, --data.cache_dir=None"),
    (("--data.cache_dir=/local/cache",), MOUNT, "mounted at ['/shared'], --data.cache_dir=/local/cache"),
    (("--data.cache_dir=/shared/cache",), [*MOUNT, "readonly"], "mounted at none, --data.cache_dir=/shared/cache"),
])
def test_multi_node_jobs_need_the_data_cache_on_a_shared_volume(overrides, mounts, shown):
    with pytest.raises(ValueError) as e:
        train(*overrides, nnodes=2, mounts=mounts)
    assert str(e.value) == (f"--nnodes > 1 needs --data.cache_dir on a shared writable volume of --mounts ({shown}); "
                            "give --data_on_every_node where the data is already on every node")


def test_data_on_every_node_needs_no_shared_volume():
    app = train(nnodes=2, data_on_every_node=True)
    assert "--nnodes 2" in command(app) and app.roles[0].mounts == []


def dryrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "torchx"), "run", "--workspace", "", "--dryrun", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_kubernetes_spec_of_a_two_node_gpu_job():
    proc = dryrun("-s", "kubernetes", "launch/component.py:train", "--image", "registry.example/rankmix:1",
                  "--nnodes", "2", "--nproc_per_node", "8", "--gpu", "8", "--python", "python3",
                  "--mounts", "type=volume,src=rankmix-data,dst=/shared", "--", "--data.cache_dir=/shared/cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = proc.stdout
    # GPUs in limits and requests; the memory in limits (requests leave torchx's reserve)
    assert spec.count("nvidia.com/gpu: '8'") == 4 and spec.count("memory: 262144M") == 2
    assert spec.count("claimName: rankmix-data") == 2 and spec.count("mountPath: /shared") == 2
    assert len(re.findall(r"--data\.cache_dir=/shared/cache\s+--train\.device=cuda", spec)) == 2  # YAML wraps lines


def test_torchx_refuses_a_multi_node_job_without_shared_data():
    proc = dryrun("-s", "slurm", "launch/component.py:train", "--nnodes", "2", "--nproc_per_node", "8", "--gpu", "8")
    assert proc.returncode != 0
    assert "ValueError: --nnodes > 1 needs --data.cache_dir on a shared writable volume" in proc.stderr


def test_torchx_takes_data_on_every_node_instead():
    proc = dryrun("-s", "slurm", "launch/component.py:train", "--nnodes", "2", "--data_on_every_node", "True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--nnodes 2 --nproc_per_node 1" in proc.stdout and "--train.device=cpu" in proc.stdout


def torchrun_config(argv: list[str]):
    """What torchrun itself makes of `argv` (its options, then the module and its arguments)."""
    from torch.distributed.run import config_from_args, get_args_parser

    return config_from_args(get_args_parser().parse_args(argv))


def test_an_elastic_range_of_hosts_is_one_torchrun_understands():
    app = train("--data.cache_dir=/shared/cache", nnodes="2:4", max_restarts=3, mounts=MOUNT)
    role = app.roles[0]
    assert (role.min_replicas, role.num_replicas) == (2, 4)  # the scheduler may start 2 to 4 hosts
    argv = shlex.split(command(app))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    config, module, args = torchrun_config(argv[3:])
    assert (config.min_nodes, config.max_nodes, config.max_restarts, config.rdzv_backend) == (2, 4, 3, "c10d")
    assert args[:4] == ["-u", "-m", "launch.cli", "train"]
    fixed, _, _ = torchrun_config(shlex.split(command(train(nnodes="2", data_on_every_node=True)))[3:])
    assert (fixed.min_nodes, fixed.max_nodes, fixed.max_restarts) == (2, 2, 0)


@pytest.mark.parametrize("nnodes,restarts,message", [
    ("2:4", 0, "--nnodes 2:4 is elastic: give --max_restarts N (at least 1), the times torchrun restarts the ranks "
               "when hosts leave or join"),
    ("4:2", 1, "--nnodes 4:2: hosts must be at least 1, and MIN at most MAX"),
    ("two", 1, "--nnodes two: give a number of hosts N, or an elastic range MIN:MAX"),
])
def test_a_range_that_cannot_run_is_refused(nnodes, restarts, message):
    with pytest.raises(ValueError) as e:
        train(nnodes=nnodes, max_restarts=restarts, data_on_every_node=True)
    assert str(e.value) == message


@pytest.mark.parametrize("nnodes,rendezvous", [
    ("1", ["--standalone"]),
    ("2", ["--node-rank", "1", "--master-addr", "h0", "--master-port", "29400"]),
    ("1:3", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400", "--rdzv-id", "rankmix"]),
])
def test_rankmix_launch_gives_torchrun_an_elastic_range_over_c10d(nnodes, rendezvous):
    args = argparse.Namespace(nnodes=nnodes, nproc_per_node=2, node_rank=1, master_addr="h0", master_port=29400,
                              max_restarts=2)
    options = torchrun_args(args)
    assert options == ["--nnodes", nnodes, "--nproc-per-node", "2", "--max-restarts", "2", *rendezvous]
    config, _, _ = torchrun_config([*options, "-m", "launch.cli", "train"])
    low, _, high = nnodes.partition(":")
    assert (config.min_nodes, config.max_nodes, config.max_restarts) == (int(low), int(high or low), 2)
    assert config.rdzv_backend == ("c10d" if high else "static")
    args.max_restarts = 0
    if high:
        with pytest.raises(ValueError, match="^--nnodes 1:3 is elastic: give --max-restarts N"):
            torchrun_args(args)
