"""`rankmix doctor`: does this machine's stack train? Versions, GPUs, one FBGEMM lookup per
device and a one-process group per backend, then the mismatches that would fail a run.

The facts are gathered once (`gather`) and judged apart (`mismatches`), so that the verdict on
a GPU machine's facts is testable on a CPU one.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GB = 2**30


@dataclass(frozen=True)
class Facts:
    """What `rankmix doctor` found on this machine."""

    torch: str
    torch_cuda: str | None  # the CUDA version torch was built for (None: a CPU build)
    driver_gpus: int  # GPUs `nvidia-smi -L` lists (0 without a driver)
    gpus: list[tuple[str, int]]  # (name, bytes) of the GPUs torch sees
    nccl: str | None
    fbgemm: str | None  # "<distribution> <version>", e.g. "fbgemm-gpu 1.8.0+cu128"
    fbgemm_variant: str | None  # what the fbgemm_gpu wheel was built for: cpu | cuda | rocm
    torchrec: str | None
    lookups: dict[str, str] = field(default_factory=dict)  # device -> "ok" or the error
    groups: dict[str, str] = field(default_factory=dict)  # backend -> "ok" or the error

    @property
    def fbgemm_cuda(self) -> str | None:
        """The CUDA version in the fbgemm-gpu wheel's local tag (`+cu128`: 12.8), if it has one."""
        found = re.search(r"\+cu(\d+)(\d)$", self.fbgemm or "")
        return f"{found[1]}.{found[2]}" if found else None


def mismatches(facts: Facts) -> list[str]:
    """What would fail a run on this machine, one line each (none: the stack trains)."""
    problems = []
    if facts.driver_gpus and not facts.gpus:
        problems.append(f"nvidia-smi lists {facts.driver_gpus} GPU(s) but torch {facts.torch} sees none"
                        + ("" if facts.torch_cuda else
                           " (a CPU build: install the CUDA stack, make setup DEVICE=cuda)"))
    if facts.fbgemm is None or facts.torchrec is None:
        problems.append("fbgemm-gpu or torchrec is not installed (make setup)")
    elif facts.gpus and facts.fbgemm_variant != "cuda":
        problems.append(f"{facts.fbgemm} is built for {facts.fbgemm_variant}, on a machine with CUDA GPUs: "
                        "install the CUDA stack (make setup DEVICE=cuda)")
    if facts.torch_cuda and facts.fbgemm_cuda and facts.torch_cuda != facts.fbgemm_cuda:
        problems.append(f"torch {facts.torch} is built for CUDA {facts.torch_cuda} but {facts.fbgemm} for "
                        f"CUDA {facts.fbgemm_cuda}: install both from the same index")
    problems += [f"lookup on {device} failed: {error}" for device, error in facts.lookups.items() if error != "ok"]
    problems += [f"{backend} process group failed: {error}" for backend, error in facts.groups.items() if error != "ok"]
    return problems


def report(facts: Facts) -> list[str]:
    """The lines `rankmix doctor` prints before its verdict."""
    gpus = ", ".join(f"{i}: {name} {size / GB:.1f} GB" for i, (name, size) in enumerate(facts.gpus)) or "none"
    return [f"torch {facts.torch} (CUDA {facts.torch_cuda or 'none: CPU build'})",
            f"NCCL {facts.nccl or 'none'}",
            f"FBGEMM {facts.fbgemm or 'not installed'} (built for {facts.fbgemm_variant or 'unknown'}"
            + (f", CUDA {facts.fbgemm_cuda}" if facts.fbgemm_cuda else "") + ")",
            f"TorchRec {facts.torchrec or 'not installed'}",
            f"GPUs (torch): {gpus}; nvidia-smi lists {facts.driver_gpus}",
            *(f"lookup on {device}: {result}" for device, result in facts.lookups.items()),
            *(f"{backend} process group: {result}" for backend, result in facts.groups.items())]


def gather() -> Facts:
    """This machine's facts: imports FBGEMM, runs a lookup per device, starts groups."""
    gpus = [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    fbgemm = _distribution("fbgemm-gpu", "fbgemm-gpu-cpu")
    devices = ["cpu", *(f"cuda:{i}" for i in range(len(gpus)))]
    return Facts(torch=torch.__version__, torch_cuda=torch.version.cuda, driver_gpus=_driver_gpus(), gpus=gpus,
                 nccl=_nccl_version(), fbgemm=fbgemm, fbgemm_variant=_fbgemm_variant() if fbgemm else None,
                 torchrec=_version("torchrec"),
                 lookups={d: _try(lambda d=d: _lookup(d)) for d in devices} if fbgemm else {},
                 groups={b: _try(lambda b=b: _one_rank_group(b)) for b in (["nccl"] if gpus else []) + ["gloo"]})


def doctor(argv: list[str]) -> int:
    """`rankmix doctor`: print the facts, then ok (exit 0) or each mismatch (exit 1)."""
    if argv:
        raise ValueError(f"rankmix doctor takes no arguments, got {argv}")
    facts = gather()
    print("\n".join(report(facts)))
    problems = mismatches(facts)
    print("\n".join(f"doctor: mismatch: {p}" for p in problems) if problems else "doctor: ok", flush=True)
    return 1 if problems else 0


def _distribution(*names: str) -> str | None:
    """"<name> <version>" of the first of `names` installed, or None."""
    found = [f"{name} {_version(name)}" for name in names if _version(name)]
    return found[0] if found else None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fbgemm_variant() -> str:
    import fbgemm_gpu  # on use: a missing FBGEMM is a finding of the doctor's, not an import error

    return fbgemm_gpu.__variant__


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    return ".".join(map(str, torch.cuda.nccl.version()))


def _driver_gpus() -> int:
    """GPUs the driver lists; 0 without nvidia-smi or when it fails (no driver loaded)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def _lookup(device: str) -> None:
    """One pooled lookup through FBGEMM's fused training kernel (the one TorchRec's sharded
    tables run) on `device`, checked against the rows it sums."""
    # on use: a missing or broken FBGEMM is a finding of the doctor's, not an import error
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    on_cpu = device == "cpu"
    spec = (10, 4, EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE,
            ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA)
    tbe = SplitTableBatchedEmbeddingBagsCodegen([spec], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                device=torch.device(device))
    ids, offsets = torch.tensor([1, 2, 3], device=device), torch.tensor([0, 2, 3], device=device)
    pooled = tbe(ids, offsets).cpu()
    weights = tbe.split_embedding_weights()[0].cpu()
    if not torch.allclose(pooled, torch.stack([weights[1] + weights[2], weights[3]])):
        raise RuntimeError("wrong pooled sums")


def _one_rank_group(backend: str) -> None:
    """A process group of this process alone on `backend`, and one all-reduce on it."""
    device = "cuda" if backend == "nccl" else "cpu"
    with tempfile.TemporaryDirectory(prefix="rankmix-doctor-") as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            value = torch.ones(1, device=device)
            dist.all_reduce(value)
            if value.item() != 1:
                raise RuntimeError(f"all-reduce of one rank gave {value.item()}")
        finally:
            dist.destroy_process_group()


def _try(check) -> str:
    """"ok", or the check's error in one line."""
    try:
        check()
    except Exception as e:  # the report names any failure; the verdict counts it
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return "ok"
