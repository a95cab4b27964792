"""Process group and device set-up: gloo on CPU, NCCL on CUDA, the same code for both."""

from __future__ import annotations

import ctypes
import gc
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def tune_malloc() -> str:
    """Keep freed memory in the process (no mmap per large tensor, no trimming): glibc
    returns every block over 32 MiB to the OS, so each step would page-fault its large
    activations back in (up to 15% of a CPU step). Returns what was done."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "malloc untouched (no glibc)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, ctypes.c_int(1 << 30)) and libc.mallopt(m_trim_threshold, ctypes.c_int(1 << 30))
    return "malloc keeps freed memory" if ok else "malloc tuning refused"


def init_distributed(backend: str = "auto", device: str = "auto") -> DistEnv:
    """Join the job `torchrun` describes in the environment, or start a job of one.

    DMP needs a process group even for one process, so a plain `rankmix train` makes
    a world of size 1 on a free local port.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
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
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=dev if use_cuda else None, **_attempt_store())
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)


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
    if dist.is_initialized():
        if wait_for_peers and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # what held the groups goes now, while the interpreter is whole


def raise_on_every_rank(error: str | None) -> None:
    """Raise ValueError(`error`) on every rank when rank 0 found one (collective): a check
    that only rank 0 makes stops the others too, instead of leaving them in a collective."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ValueError(error)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
