"""The torchx component's job specs: the device each node trains on, resources per rank,
mounts, and the shared data a multi-node job needs (dry runs: nothing is submitted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torchx.specs as specs

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
