"""Process groups: launch.pg_timeout_minutes reaches every group, the side group carries
file work and object collectives, threads follow the CPUs a process may use, and each node's
local rank 0 builds a node-local data cache."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import rendezvous_port, spawn
from trainer.config_loader import load_config

REPO = Path(__file__).resolve().parents[1]


def _late_peer(rank: int, port: int, out: str) -> None:
    """Rank 0 waits in an object collective (the side group's kind of work) that rank 1
    never joins: rank 1 stays up until rank 0 has written its outcome (at most 20 s), so with
    a 3 s timeout rank 0 gives up on a live peer, long before gloo's 30 minutes."""
    import torch.distributed as dist

    from trainer.dist import init_distributed, side_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    init_distributed("auto", "cpu", timeout_minutes=0.05)
    assert side_group() is None and dist.get_backend(side_group()) == "gloo"  # gloo: the default group is it
    if rank == 1:
        deadline = time.monotonic() + 20
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    start = time.monotonic()
    try:
        dist.broadcast_object_list([None], src=1, group=side_group())
        outcome = "completed"
    except RuntimeError:
        outcome = "timed out"
    Path(out).write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start}))


@pytest.mark.slow
def test_pg_timeout_minutes_bounds_a_collective_wait(tmp_path):
    out = tmp_path / "rank0.json"
    spawn(_late_peer, (rendezvous_port(), str(out)), 2)
    result = json.loads(out.read_text())
    assert result["outcome"] == "timed out" and result["seconds"] < 15, result  # 3 s, not gloo's 30 min


def test_pg_timeout_minutes_is_a_launch_option():
    cfg = load_config(None, ["--launch.pg_timeout_minutes=45"])
    assert cfg.launch.pg_timeout_minutes == 45.0
    assert load_config(None, []).launch.pg_timeout_minutes == 30.0


def test_threads_follow_the_cpus_this_process_may_use():
    """Under `taskset -c 0` one CPU is usable, whatever os.cpu_count() says of the host."""
    code = "import os; from trainer.dist import usable_cpus; print(usable_cpus(), os.cpu_count())"
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    usable, count = map(int, proc.stdout.split())
    assert usable == 1 and count == os.cpu_count()


def test_node_memory_is_the_kernels_total_within_the_cgroup_limit():
    from trainer.dist import node_memory_bytes

    expected = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:"))
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().strip() != "max":  # a container's limit
        expected = min(expected, int(limit.read_text()))
    assert node_memory_bytes() == expected


def _node_worker(rank: int, port: int, root: str, shared: bool) -> None:
    """Rank `rank` of 2 nodes x 2 ranks, whose data cache is the node's own folder (or one
    shared folder): every rank must find its training files."""
    import torch.distributed as dist

    from trainer.data.datasets import build_dataset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank % 2),
                      LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=4)
    cache = Path(root) / ("shared" if shared else f"node{rank // 2}")
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.synth_rows=2000", f"--data.cache_dir={cache}"])
    files = build_dataset(cfg)
    Path(root, f"rank{rank}.json").write_text(json.dumps(
        {"train": files.train_path, "found": sorted(p.name for p in Path(files.train_path).iterdir())}))
    dist.destroy_process_group()


@pytest.mark.parametrize("shared", [False, True])
def test_each_node_builds_its_data_cache(tmp_path, shared):
    spawn(_node_worker, (rendezvous_port(), str(tmp_path), shared), 4)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(s["found"] == seen[0]["found"] and s["found"] for s in seen), seen
    caches = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert caches == (["shared"] if shared else ["node0", "node1"])
    for cache in caches:  # each holds one whole dataset, and no leftover temporary folder
        assert [p.name for p in (tmp_path / cache).iterdir()] == ["synth-v2-2000-seed0"]
