"""torchx component: `rankmix train` as a multi-node, multi-process job.

    torchx run -s local_cwd launch/component.py:train --nproc_per_node 2 --config configs/debug.toml
    torchx run -s slurm launch/component.py:train --nnodes 4 --nproc_per_node 8 --gpu 8 \\
        --config configs/criteo_1tb.toml -- --train.steps=100000
    torchx run -s kubernetes launch/component.py:train --image REGISTRY/rankmix:TAG --python python3 ...

Each node runs `PYTHON -m torch.distributed.run --nnodes N --nproc_per_node M -m launch.cli
train ...` with c10d rendezvous (torchx's own dist.ddp); the scheduler chooses the hosts.
PYTHON is the interpreter that holds rankmix, so the job never depends on a `torchrun` that
the node's PATH may not have.
"""

# torchx's component linter reads annotations as written: no `from __future__ import
# annotations`, and Optional / Dict rather than `X | None` / `dict`.
import shlex
import sys
from typing import Dict, Optional

import torchx.specs as specs
from torchx.components.dist import ddp

from trainer.credentials import has_credentials, is_secret_name, redact_uri


def train(
    *overrides: str,
    config: str = "configs/debug.toml",
    nnodes: int = 1,
    nproc_per_node: int = 1,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    image: str = ".",
    python: str = sys.executable,
    name: str = "rankmix",
    max_retries: int = 0,
    env: Optional[Dict[str, str]] = None,
    rdzv_port: int = 29500,
) -> specs.AppDef:
    """Train with `config` on nnodes x nproc_per_node processes.

    Args:
        overrides: `--section.key=value` options passed to `rankmix train`
        config: TOML run config, relative to the image's working directory
        nnodes: number of hosts
        nproc_per_node: processes (one per GPU on GPU hosts) per host
        cpu: CPUs per host
        gpu: GPUs per host
        memMB: memory per host in MB
        image: container image (Slurm and local_cwd: the working directory holding the repo)
        python: interpreter with rankmix installed, as the hosts see it (default: the one running torchx; in a container image, its own, e.g. python3)
        name: job name
        max_retries: times the scheduler restarts a failed job
        env: extra environment variables (no secrets: the job spec shows them; see check_env)
        rdzv_port: c10d rendezvous port on the first host
    """
    for option in overrides:
        if has_credentials(option):
            raise ValueError(f"{redact_uri(option)}: credentials in a URI would be written into the job "
                             "spec; give them to the job as AWS_* environment variables or a secret")
    check_env(env or {})
    app = ddp("train", "--config", config, *overrides,
              m="launch.cli", image=image, name=name, cpu=cpu, gpu=gpu, memMB=memMB,
              j=f"{nnodes}x{nproc_per_node}", env=env, max_retries=max_retries, rdzv_port=rdzv_port)
    role = app.roles[0]
    # ddp's command line starts with a bare `torchrun`, looked up on the node's PATH.
    flag, command = role.args
    assert flag == "-c" and command.startswith("torchrun "), role.args
    role.args = [flag, f"{shlex.quote(python)} -m torch.distributed.run {command[len('torchrun '):]}"]
    return app


def check_env(env: Dict[str, str]) -> None:
    """ValueError for a secret in `env`: Slurm's `srun --export` line and the Kubernetes pod
    spec show env in plain text to whoever can read the job."""
    for name, value in env.items():
        if is_secret_name(name) or has_credentials(value):
            raise ValueError(f"env {name}: a secret in env would be written into the job spec; give it through "
                             "the scheduler's secret mechanisms instead: a Kubernetes Secret, a Slurm environment "
                             "file (exported in the shell that submits), or an instance role")
