"""torchx component: `rankmix train` as a multi-node, multi-process job.

    torchx run -s local_cwd launch/component.py:train --nproc_per_node 2 --config configs/debug.toml
    torchx run -s slurm launch/component.py:train --nnodes 4 --nproc_per_node 8 --gpu 8 \\
        --mounts type=bind,src=/shared,dst=/shared --config configs/criteo_1tb.toml -- \\
        --data.cache_dir=/shared/cache --train.run_dir=/shared/runs/criteo --train.steps=100000
    torchx run -s kubernetes launch/component.py:train --image REGISTRY/rankmix:TAG --python python3 ...

Each node runs `PYTHON -m torch.distributed.run --nnodes N --nproc_per_node M -m launch.cli
train ...` with c10d rendezvous (torchx's own dist.ddp); the scheduler chooses the hosts.
PYTHON is the interpreter that holds rankmix, so the job never depends on a `torchrun` that
the node's PATH may not have. An elastic `--nnodes MIN:MAX` (with `--max_restarts N`) runs on
as many hosts as there are in the range: a job that loses one restarts its ranks on the rest,
which resume the newest checkpoint at the smaller world size, inside its epoch too
(trainer/data/elastic.py). The job states its device (`--gpu` > 0: CUDA, else CPU), so a
node without a visible GPU fails instead of training on its CPU.
"""

# torchx's component linter reads annotations as written: no `from __future__ import
# annotations`, and Optional / Dict rather than `X | None` / `dict` (hence the noqa for ruff's UP rules).
import shlex
import sys
from pathlib import PurePosixPath
from typing import Dict, List, Optional  # noqa: UP035

import torchx.specs as specs
from torchx.components.dist import ddp

from launch.cli import config_args, nodes_range
from trainer.credentials import has_credentials, is_secret_name, redact_uri, secret_kind

# Host memory per rank by default: a CPU rank holds its tables and the tower; a GPU rank's
# host side holds the reader's prefetched and pinned batches, and DCP's staged copy of its
# shards during an async save.
MEM_MB_PER_RANK = {"cpu": 8192, "cuda": 32768}


def train(
    *overrides: str,
    config: str = "configs/debug.toml",
    nnodes: str = "1",
    nproc_per_node: int = 1,
    cpu: int = 0,  # 0 for "derived": torchx parses an Optional[int] option as a string
    gpu: int = 0,
    memMB: int = 0,
    image: str = ".",
    python: str = sys.executable,
    name: str = "rankmix",
    max_retries: int = 0,
    max_restarts: int = 0,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    allow_env: Optional[List[str]] = None,  # noqa: UP006, UP045
    rdzv_port: int = 29500,
    mounts: Optional[List[str]] = None,  # noqa: UP006, UP045
    data_on_every_node: bool = False,
) -> specs.AppDef:
    """Train with `config` on nnodes x nproc_per_node processes.

    Args:
        overrides: `--section.key=value` options passed to `rankmix train` (no secrets: the job spec shows them;
            see check_overrides)
        config: TOML run config, relative to the image's working directory
        nnodes: number of hosts, or an elastic range MIN:MAX: when a host is lost or joins, torchrun restarts the
            ranks on the hosts there are (max_restarts) and the run resumes from its newest checkpoint at the new
            world size, mid-epoch included
        nproc_per_node: processes (one per GPU on GPU hosts) per host
        cpu: CPUs per host (0: 2 per process)
        gpu: GPUs per host; more than 0 trains on CUDA (--train.device=cuda), 0 on CPU
        memMB: memory per host in MB (0: 8192 per process on CPU, 32768 per process on GPU hosts)
        image: container image (Slurm and local_cwd: the working directory holding the repo)
        python: interpreter with rankmix installed, as the hosts see it (default: the one running torchx; in a
            container image, its own, e.g. python3)
        name: job name
        max_retries: times the scheduler restarts a failed job
        max_restarts: times torchrun restarts the ranks inside the job, each resuming from the newest checkpoint
            (an elastic nnodes range needs at least 1)
        env: extra environment variables (no secrets: the job spec shows them; see check_env)
        allow_env: names of env variables refused as secrets that are none (NAME,NAME2): they go into the job spec
            as given
        rdzv_port: c10d rendezvous port on the first host
        mounts: volumes for every host, as torchx's ddp takes them (type=bind,src=/shared,dst=/shared or
            type=volume,src=PVC,dst=/shared); with nnodes > 1, --data.cache_dir must be on a writable one
        data_on_every_node: with nnodes > 1, the data is already on every host (a node-local copy, or an object
            store), so --data.cache_dir needs no shared volume
    """
    check_overrides(list(overrides), config)
    check_env(env or {}, allow_env or [])
    options = dict(o.split("=", 1) for o in config_args(list(overrides), environment=False)[1] if "=" in o)
    device = check_device(options.get("--train.device"), gpu, nproc_per_node)
    low, high = nodes_range(nnodes, max_restarts, "--nnodes", "--max_restarts")
    if high > 1 and not data_on_every_node:
        check_shared_cache(options.get("--data.cache_dir"), mounts or [])
    # stated even where it is the default, so that a node never silently trains elsewhere
    device_option = [] if "--train.device" in options else [f"--train.device={device}"]
    app = ddp("train", "--config", config, *overrides, *device_option,
              m="launch.cli", image=image, name=name, cpu=cpu or 2 * nproc_per_node, gpu=gpu,
              memMB=memMB or MEM_MB_PER_RANK[device] * nproc_per_node,
              j=f"{low}:{high}x{nproc_per_node}" if low < high else f"{low}x{nproc_per_node}", env=env,
              max_retries=max_retries, rdzv_port=rdzv_port, mounts=mounts)
    role = app.roles[0]
    # ddp's command line starts with a bare `torchrun`, looked up on the node's PATH.
    flag, command = role.args
    assert flag == "-c" and command.startswith("torchrun "), role.args
    restarts = f"--max_restarts {max_restarts} " if max_restarts else ""
    role.args = [flag, f"{shlex.quote(python)} -m torch.distributed.run {restarts}{command[len('torchrun '):]}"]
    return app


def check_device(device: str | None, gpu: int, nproc_per_node: int) -> str:
    """The job's device: cuda with --gpu, else cpu; ValueError where --train.device or
    --nproc_per_node does not fit --gpu."""
    expected = "cuda" if gpu > 0 else "cpu"
    if device not in (None, expected):
        raise ValueError(f"--train.device={device} does not fit --gpu {gpu}: "
                         f"{'give --gpu N for CUDA' if device == 'cuda' else 'a GPU job trains on cuda'}")
    if gpu > 0 and nproc_per_node > gpu:
        raise ValueError(f"--nproc_per_node {nproc_per_node} exceeds --gpu {gpu}: one process per GPU")
    return expected


def check_shared_cache(cache_dir: str | None, mounts: list[str]) -> None:
    """ValueError unless --data.cache_dir is on a writable mount: every node reads the data
    from it (say --data_on_every_node where each node has its own copy)."""
    shared = [m.dst_path for m in specs.parse_mounts(mounts)
              if isinstance(m, (specs.BindMount, specs.VolumeMount)) and not m.read_only]
    if cache_dir is None or not any(PurePosixPath(cache_dir).is_relative_to(d) for d in shared):
        raise ValueError(f"--nnodes > 1 needs --data.cache_dir on a shared writable volume of --mounts "
                         f"(mounted at {shared or 'none'}, --data.cache_dir={cache_dir}); give --data_on_every_node "
                         "where the data is already on every node")


def check_overrides(overrides: list[str], config: str) -> None:
    """ValueError for a secret in the job's command line, which the job spec shows: in every
    override (as given, and as `--key=value` where the value is a separate argument) and in
    --config, by its value (URI credentials, found by trainer.credentials' one parser, wherever
    '?' and '#' stand in the secret) and by its kind (a key of a known format, a random key).
    The message never shows the secret."""
    given = [*config_args(overrides, environment=False)[1], *overrides, config]
    for option in given:
        if has_credentials(option):
            raise ValueError(f"{redact_uri(option)}: credentials in a URI would be written into the job "
                             "spec; give them to the job as AWS_* environment variables or a secret")
    for option in given:
        name, equals, value = option.partition("=")
        kind = secret_kind(value if equals and name.startswith("--") else option)
        if kind:
            shown = name if equals and name.startswith("--") else "an option"
            raise ValueError(f"{shown}: its value looks like {kind}, and the job spec would show it; give it "
                             "to the job through the scheduler's secret mechanisms instead: a Kubernetes Secret, "
                             "a Slurm environment file (exported in the shell that submits), or an instance role")


def check_env(env: dict[str, str], allow: list[str] = ()) -> None:
    """ValueError for a secret in `env`, by its name or its value (trainer.credentials), unless
    `allow` names it: Slurm's `srun --export` line and the Kubernetes pod spec show env in
    plain text to whoever can read the job. The message never shows the value."""
    for name, value in env.items():
        if name in allow:
            continue
        kind = secret_kind(value)
        if kind or is_secret_name(name):
            what = f"its value looks like {kind}" if kind else "its name says so"
            raise ValueError(f"env {name}: a secret in env would be written into the job spec; give it through "
                             "the scheduler's secret mechanisms instead: a Kubernetes Secret, a Slurm environment "
                             f"file (exported in the shell that submits), or an instance role ({what}; if it is "
                             f"no secret, pass --allow_env {name})")
