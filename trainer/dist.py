"""Process group and device set-up: gloo on CPU, NCCL on CUDA, the same code for both."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import DataUnavailableError

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEPT = 1 << 30  # blocks below 1 GiB come from the heap, and the heap is never trimmed
_RETURNED = 32 << 20  # glibc's own largest threshold: larger blocks are mapped, and unmapped when freed
HEAP_TRIM_EVERY = 5  # training steps between trims of the kept heap (`trim_heap`)
CGROUP = Path("/sys/fs/cgroup")  # this process's cgroup (v2): its CPU quota and memory limit


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> str:
    """Keep freed memory in the process (no mmap per large tensor, no trimming): glibc
    returns every block over 32 MiB to the OS, so each step would page-fault its large
    activations back in (up to 15% of a CPU step). Returns what was done."""
    libc = _libc()
    if libc is None:
        return "malloc untouched (no glibc)"
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_KEPT)) and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_KEPT))
    return "malloc keeps freed memory" if ok else "malloc tuning refused"


def trim_heap(step: int, every: int = HEAP_TRIM_EVERY) -> bool:
    """At every `every`-th step, hand the free pages of training's kept heap back (glibc's
    malloc_trim); True if it did. Batches differ in size (lookups, all-to-all buffers), so
    the kept heap fragments and each step touches some free range it had not: untrimmed, a
    4-rank RankMixer T16 D256 run crept to 1.23-1.36 of `rankmix plan` in 40 steps, trimmed
    every 5 steps 0.98 on every rank. A trim costs the next step's page faults of what it
    returned (about 1 GB there, a few percent of one step), so not every step."""
    libc = None if step % every else _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@contextlib.contextmanager
def memory_returned():
    """Within: the heap training kept is handed back and large blocks are mapped and unmapped
    again, then training's tuning is restored. Evaluation's activations at its own batch are
    larger than training's, and in a heap that keeps freed memory they would fragment it and
    stay resident on top of training's (measured: 2.2-2.7 GB for a 1.5 GB forward of RankMixer
    T16 D256 at 8,192 rows); so the rank's peak is what `rankmix plan` counts."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.malloc_trim(0)
    libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_RETURNED))
    try:
        yield
    finally:
        libc.malloc_trim(0)
        tune_malloc()


def on_own_arena(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on a thread of its own, which glibc serves from a malloc arena of
    its own. Training's heap, trimmed, is full of free ranges that malloc fills before it maps
    anything, and every page filled stays resident after its free: evaluated there, RankMixer
    T16 D256 at 8,192 rows held 1.85-2.05 GB for a 1.54 GB forward, and 1.56 GB on its own
    thread. The CUDA device, which is per thread, comes along; `fn`'s exception is raised here."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    result: dict[str, object] = {}

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # raised in the caller's thread below
            result["error"] = e

    # a daemon, so that an interrupt of the caller ends the process without waiting for it
    thread = threading.Thread(target=run, name="rankmix-own-arena", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def init_distributed(backend: str = "auto", device: str = "auto", timeout_minutes: float = 30.0) -> DistEnv:
    """Join the job `torchrun` describes in the environment, or start a job of one.

    DMP needs a process group even for one process, so a plain `rankmix train` makes
    a world of size 1 on a free local port. Every group waits `timeout_minutes` for a
    collective (NCCL's own 10 minutes can pass during a save to a slow shared filesystem).
    """
    own_store = None
    if "RANK" not in os.environ:
        # The store binds a port it picks itself: a port found free, released, then bound by the
        # group can be taken by another process in between (parallel runs on one host do).
        own_store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(own_store.port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    tune_malloc()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is available")
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} has no GPU: this host shows {torch.cuda.device_count()}; "
                         "start at most that many processes per node")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if (backend == "nccl") != use_cuda:
        raise ValueError(f"launch.backend={backend!r} does not fit train.device={dev.type!r}: "
                         "NCCL needs CUDA tensors and gloo has no CUDA all-to-all")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > 1:
        # Ranks sharing a host must share its cores: oversubscribed OpenMP pools spin
        # against each other and run many times slower.
        torch.set_num_threads(max(1, usable_cpus() // local_world))
    if not dist.is_initialized():
        rendezvous = {"store": own_store, "rank": 0, "world_size": 1} if own_store else _attempt_store()
        _start_groups(backend, dev if use_cuda else None, timedelta(minutes=timeout_minutes), rendezvous)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def _start_groups(backend: str, device: torch.device | None, timeout: timedelta, rendezvous: dict) -> None:
    """The default group (`rendezvous`: init_process_group's store arguments, empty for the
    environment's), and the gloo side group where the default is not gloo already."""
    global _side_group, _timeout
    _timeout = timeout
    dist.init_process_group(backend=backend, device_id=device, timeout=timeout, **rendezvous)
    # On NCCL, file work and object collectives would queue behind the step's all-to-alls
    # on the GPU; gloo runs them on the host.
    _side_group = gloo_group() if backend != "gloo" else None


_side_group: dist.ProcessGroup | None = None
_timeout: timedelta = timedelta(minutes=30)  # init_distributed's, for the groups made later


def side_group() -> dist.ProcessGroup | None:
    """The gloo group that carries checkpoints (DCP), object collectives and the barriers
    around file work; None where the default group is gloo already."""
    return _side_group


def on_rank0(fn: Callable[[], T]) -> T:
    """`fn()` on rank 0, its result on every rank (over the side group); its ValueError or
    DataUnavailableError raised on every rank alike, so no rank waits on one that failed."""
    box: list = [None, None, ""]  # result, error class name, message
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box[0] = fn()
        except (ValueError, DataUnavailableError) as e:
            box[1:] = [type(e).__name__, str(e)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=side_group())
    if box[1] is not None:
        raise (DataUnavailableError if box[1] == DataUnavailableError.__name__ else ValueError)(box[2])
    return box[0]


def gloo_group() -> dist.ProcessGroup:
    """A new gloo group of every rank (collective), with the job's timeout."""
    return dist.new_group(backend="gloo", timeout=_timeout)


def job_cluster(device: torch.device, batch_size: int):
    """This job's `embeddings.sharding.Cluster` (collective): the smallest GPU and the
    smallest host share of all ranks, since every rank gets shards of the same plan."""
    # on use: TorchRec, which `rankmix data` (it imports this module) does not need
    from embeddings.sharding import Cluster, local_world_size

    local = local_world_size()
    hbm = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    smallest = torch.tensor([hbm, node_memory_bytes() // local], dtype=torch.int64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    hbm, ddr = smallest.tolist()
    return Cluster(dist.get_world_size(), local, device.type, batch_size, hbm, ddr)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity (cpusets), within the cgroup's CPU quota
    (a Kubernetes CPU limit), where os.cpu_count() counts every CPU of the host."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_value("cpu.max")
    if quota is not None:
        limit, period = quota
        cpus = min(cpus, max(1, math.ceil(limit / period)))
    return cpus


def node_memory_bytes() -> int:
    """Memory this process's node gives it: physical memory, within the cgroup's limit (a
    pod's memory limit)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_value("memory.max")
    return min(physical, limit[0]) if limit is not None else physical


def _cgroup_value(name: str) -> tuple[int, ...] | None:
    """The numbers of a cgroup v2 limit file of this process's cgroup, or None where there is
    no limit ("max") or no such file."""
    path = CGROUP / name
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    return tuple(int(f) for f in fields) if fields and fields[0] != "max" else None


def _attempt_store() -> dict:
    """Under torchrun, a store private to this restart attempt.

    torchrun's agent keeps one store across restarts (TORCHELASTIC_USE_AGENT_STORE), so a
    restarted rank could read the gloo address of the rank that was killed and fail to
    connect; a prefix per attempt keeps the rounds apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store, wait_for_workers=False)
    return {"store": dist.PrefixStore(f"rankmix/attempt-{attempt}", store), "rank": rank, "world_size": world}


def shutdown(wait_for_peers: bool = True) -> None:
    """Leave the process group with no collective left running (safe to call twice).

    Why the barrier: gloo's worker threads outlive `destroy_process_group` (C++ objects of
    the sharded model keep the group), and a collective still running when the interpreter
    finalizes, such as the pipeline's read-ahead input dist, ends with its thread releasing
    a tensor that Python owned. That takes the GIL during finalization, where CPython ends
    the thread with pthread_exit, and the forced unwind through a noexcept C++ frame aborts
    the process ("terminate called without an active exception"). gloo's barrier completes
    only after every collective enqueued before it. After a failure the peers may be gone
    (`wait_for_peers=False`): the process is ending with an error anyway.
    """
    global _side_group
    if dist.is_initialized():
        if wait_for_peers and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    _side_group = None
    gc.collect()  # what held the groups goes now, while the interpreter is whole


def raise_on_every_rank(error: str | None) -> None:
    """Raise ValueError(`error`) on every rank when rank 0 found one (collective): a check
    that only rank 0 makes stops the others too, instead of leaving them in a collective."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=side_group())
        error = box[0]
    if error:
        raise ValueError(error)


def reduce_gradients_in_fixed_order(model: nn.Module) -> None:
    """Have the DDP in `model`, if any, all-reduce every dense gradient on its own (`_reduce_each_gradient`)."""
    ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
    # Two addends sum alike in either order; exact resume is promised on CPU (gloo) only.
    if ddp is not None and dist.get_world_size(ddp.process_group) > 2 and \
            dist.get_backend(ddp.process_group) == "gloo":
        ddp.register_comm_hook(ddp.process_group, _reduce_each_gradient)


# gloo's ring all-reduce adds an element's addends in an order set by the element's offset in the
# buffer. DDP reduces buckets of gradients and regroups them after its first step (in the order
# backward produced them), so the first step after a start or a resume would round otherwise than
# the same step of an uninterrupted run. A gradient's own buffer is the same at every step.
def _reduce_each_gradient(group, bucket):  # unannotated: DDP rejects annotations that are strings
    """DDP comm hook: each gradient of `bucket` averaged over the ranks by an all-reduce of its own."""
    size = dist.get_world_size(group)
    futures = []
    for grad in bucket.gradients():  # views into bucket.buffer()
        grad.div_(size)  # before the sum, as DDP's own reduction does
        futures.append(dist.all_reduce(grad, group=group, async_op=True).get_future())
    return torch.futures.collect_all(futures).then(lambda _: bucket.buffer())
