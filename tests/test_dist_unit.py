"""trainer/dist.py in this process (issue 56), for mutation testing: the malloc tuning that training
keeps (`tune_malloc`), its trims (`trim_heap`), evaluation's return of the heap and the tuning
restored after it (`memory_returned`), the own-arena thread (`on_own_arena`), the cgroup limits
(`usable_cpus`, `node_memory_bytes`), the restart attempt's store (`_attempt_store`) and
`raise_on_every_rank` without a group. What needs a group of ranks (`init_distributed`,
`shutdown`, the comm hook) is the multi-rank tests' (test_process_groups.py,
test_reduction_order.py, test_distributed.py). test_malloc.py checks the malloc figures in fresh
processes too."""

import ctypes
import os
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainer.dist as dist_module
from cli import rendezvous_port
from trainer.dist import (
    _attempt_store,
    memory_returned,
    node_memory_bytes,
    on_own_arena,
    raise_on_every_rank,
    trim_heap,
    tune_malloc,
    usable_cpus,
)

BLOCK_MB = 256


def rss_mb() -> float:
    return int(re.search(r"^VmRSS:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def freed_block_mb(mb: int = BLOCK_MB) -> float:
    """A tensor of `mb` MB written (its pages resident), then freed: how much of it stays resident
    (what the free does not hand back; the block may reuse memory kept from before)."""
    block = torch.ones(mb << 18)
    written = rss_mb()
    del block
    return mb - (written - rss_mb())


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL("libc.so.6")  # an instance of our own: these signatures are not trainer.dist's
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
    return libc


def new_block_mb(mb: int = BLOCK_MB) -> float:
    """A block of `mb` MB that malloc maps or grows the heap for, written, then freed: how much of it
    stays resident. malloc fills free memory of the heap (a free range, or the top's) before it maps
    anything or grows the heap, whatever its thresholds, and this process's heap has such memory
    from earlier tests: the blocks it hands out from it are kept filled meanwhile, and freed afterwards."""
    libc, size, fillers = _libc(), mb << 20, []
    while True:
        end = libc.sbrk(0)
        block = libc.malloc(size)
        if ctypes.c_size_t.from_address(block - 8).value & 2 or libc.sbrk(0) != end:  # IS_MMAPPED, or grown
            break
        assert len(fillers) < 16, "malloc keeps handing out free memory of the heap"
        fillers.append(block)
    ctypes.memset(block, 1, size)
    written = rss_mb()
    libc.free(block)
    stays = mb - (written - rss_mb())
    for filler in fillers:
        libc.free(filler)
    return stays


@pytest.fixture
def tuned():
    """Training's malloc tuning from glibc's defaults (mallopt's settings are the whole process's, and
    outlive an earlier test's tuning), and after the test a trim, so that the process keeps nothing."""
    libc = dist_module._libc()
    for parameter in (-1, -3):  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD: glibc's defaults, 128 KiB
        libc.mallopt(parameter, 128 << 10)
    assert tune_malloc() == "malloc keeps freed memory"
    yield
    dist_module._libc().malloc_trim(0)


def test_tuned_malloc_keeps_a_freed_block_and_trims_every_fifth_step(tuned):
    assert new_block_mb() > 200  # from the heap's top, and not trimmed at its free: kept, resident
    assert freed_block_mb() > 200
    before = rss_mb()
    assert trim_heap(4) is False and before - rss_mb() < 20
    assert trim_heap(10) is True and before - rss_mb() > 200  # handed back
    assert [s for s in range(1, 10) if trim_heap(s, every=3)] == [3, 6, 9]
    assert [s for s in range(1, 12) if trim_heap(s)] == [5, 10]


def test_memory_returned_hands_the_heap_back_and_restores_trainings_tuning(tuned):
    assert new_block_mb() > 200
    before = rss_mb()
    with memory_returned():
        assert before - rss_mb() > 200  # entering trims the kept block
        assert new_block_mb() < 20  # a large block within is mapped, and unmapped when freed
        inside = rss_mb()
        small = torch.ones(28 << 18)  # 28 MB, under glibc's 32 MB: from the heap, kept when freed
        del small
        assert rss_mb() - inside > 20
    assert rss_mb() - inside < 10  # leaving trims again
    assert new_block_mb() > 200  # training's tuning is back in force after it, with no call of ours


def test_memory_returned_restores_the_tuning_when_its_body_raises(tuned):
    with pytest.raises(RuntimeError, match="inside"):
        with memory_returned():
            raise RuntimeError("inside")
    assert new_block_mb() > 200


def test_without_glibc_malloc_is_left_alone(monkeypatch):
    monkeypatch.setattr(dist_module, "_libc", lambda: None)  # a host without glibc (musl), which this one is not
    assert tune_malloc() == "malloc untouched (no glibc)"
    assert trim_heap(5) is False
    ran = []
    with memory_returned():
        ran.append(True)
    assert ran == [True]


class RefusingLibc:
    """A C library whose mallopt refuses every setting, as glibc does one it does not know."""

    def mallopt(self, parameter: int, value) -> int:
        return 0


def test_a_refused_tuning_says_so(monkeypatch):
    monkeypatch.setattr(dist_module, "_libc", RefusingLibc)  # glibc here takes both settings
    assert tune_malloc() == "malloc tuning refused"


def test_on_own_arena_runs_on_a_thread_of_its_own_and_raises_here():
    assert on_own_arena(lambda a, b=0: (threading.current_thread().name, a + b), 2, b=3) == ("rankmix-own-arena", 5)
    assert on_own_arena(threading.current_thread).daemon
    with pytest.raises(RuntimeError, match=re.escape("Trying to create tensor with negative dimension -1: [-1]")):
        on_own_arena(torch.ones, -1)
    assert on_own_arena(lambda: None) is None


@pytest.mark.parametrize("quota,expected", [(None, None), ("max 100000", None), ("50000 100000", 1),
                                            ("100000 100000", 1), ("150000 100000", 2), ("400000 100000", 4)])
def test_usable_cpus_are_the_affinity_within_the_cgroup_quota(quota, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(dist_module, "CGROUP", tmp_path)
    if quota is not None:
        (tmp_path / "cpu.max").write_text(quota + "\n")
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus() == (affinity if expected is None else min(affinity, expected))


def test_a_quota_below_the_affinity_is_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(dist_module, "CGROUP", tmp_path)
    affinity = len(os.sched_getaffinity(0))
    if affinity < 2:
        pytest.skip("one CPU: no quota can be below it")
    (tmp_path / "cpu.max").write_text(f"{(affinity - 1) * 100000 - 50000} 100000")  # ceil: affinity - 1
    assert usable_cpus() == affinity - 1


def physical_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:"))


@pytest.mark.parametrize("limit", [None, "max", "", "1073741824"])
def test_node_memory_is_physical_memory_within_the_cgroup_limit(limit, tmp_path, monkeypatch):
    monkeypatch.setattr(dist_module, "CGROUP", tmp_path)
    if limit is not None:
        (tmp_path / "memory.max").write_text(limit)
    expected = 1 << 30 if limit == "1073741824" else physical_bytes()
    assert node_memory_bytes() == expected


def test_a_cgroup_limit_above_physical_memory_is_not_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(dist_module, "CGROUP", tmp_path)
    (tmp_path / "memory.max").write_text(str(physical_bytes() * 4))
    assert node_memory_bytes() == physical_bytes()


def test_a_restart_attempt_gets_a_store_of_its_own(monkeypatch, capfd):
    """Under torchrun with the agent's store (TORCHELASTIC_USE_AGENT_STORE): a client of the store
    at MASTER_PORT, every key under rankmix/attempt-<n>/ (rank 0 too: a server of its own would fail
    to bind the agent's port, which torch logs as an error and ignores); without a restart count,
    the environment's."""
    port = rendezvous_port()  # a store this process holds, as torchrun's agent holds one
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert _attempt_store() == {}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    got = _attempt_store()
    assert (got["rank"], got["world_size"]) == (0, 2)
    got["store"].set("key", "value")
    agent = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    assert agent.get("rankmix/attempt-3/key") == b"value"
    assert agent.check(["rankmix/attempt-3/key"]) and not agent.check(["key"])
    assert "failed to bind" not in capfd.readouterr().err


def test_a_restart_attempt_without_the_agents_store_is_served_by_rank_0(monkeypatch):
    """Rank 0 serves the attempt's store itself where the agent holds none, at once: the other
    ranks connect when they get there."""
    probe = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe  # a port just free again: the store below binds it
    for name, value in (("TORCHELASTIC_RESTART_COUNT", "0"), ("RANK", "0"), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    made: dict = {}
    thread = threading.Thread(target=lambda: made.update(_attempt_store()), daemon=True)
    thread.start()
    thread.join(20)  # a server waiting for rank 1 would wait for minutes
    assert not thread.is_alive(), "rank 0's store waited for the other ranks"
    got = made
    got["store"].set("key", "value")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    assert client.get("rankmix/attempt-0/key") == b"value"


def test_raise_on_every_rank_without_a_group_raises_rank_0s_error():
    raise_on_every_rank(None)  # no group, or one of this process alone: nothing to share
    raise_on_every_rank("")
    with pytest.raises(ValueError, match="^checkpoint.load_path: no such folder$"):
        raise_on_every_rank("checkpoint.load_path: no such folder")
