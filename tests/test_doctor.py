"""`rankmix doctor`: the real command on this CPU machine, and its verdict on the facts of
machines this one is not (a GPU host with the CPU FBGEMM, wheels of two CUDA versions)."""

import importlib.metadata
import os
from dataclasses import replace

import pytest
import torch

from cli import rankmix, run_env
from launch.doctor import Facts, mismatches

GPU_HOST = Facts(torch="2.13.0+cu128", torch_cuda="12.8", driver_gpus=8,
                 gpus=[("NVIDIA H100 80GB HBM3", 80 * 2**30)] * 8,
                 nccl="2.27.3", fbgemm="fbgemm-gpu 1.8.0+cu128", fbgemm_variant="cuda", torchrec="1.8.0",
                 lookups={"cpu": "ok", "cuda:0": "ok"}, groups={"nccl": "ok", "gloo": "ok"})


def test_doctor_on_this_machine():
    proc = rankmix("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    fbgemm = next(f"{d} {importlib.metadata.version(d)}" for d in ("fbgemm-gpu-cpu", "fbgemm-gpu")
                  if _installed(d))
    assert lines[0] == f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})"
    assert lines[2].startswith(f"FBGEMM {fbgemm} (built for ")
    assert lines[3] == f"TorchRec {importlib.metadata.version('torchrec')}"
    assert "lookup on cpu: ok" in lines and "gloo process group: ok" in lines
    assert lines[-1] == "doctor: ok"


def _installed(name: str) -> bool:
    try:
        return bool(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return False


def test_a_matching_gpu_host_passes():
    assert GPU_HOST.fbgemm_cuda == "12.8" and mismatches(GPU_HOST) == []


@pytest.mark.parametrize("changes,problem", [
    ({"fbgemm": "fbgemm-gpu-cpu 1.8.0", "fbgemm_variant": "cpu"},
     "fbgemm-gpu-cpu 1.8.0 is built for cpu, on a machine with CUDA GPUs: install the CUDA stack "
     "(make setup DEVICE=cuda)"),
    ({"fbgemm": "fbgemm-gpu 1.8.0+cu126"},
     "torch 2.13.0+cu128 is built for CUDA 12.8 but fbgemm-gpu 1.8.0+cu126 for CUDA 12.6: install both "
     "from the same index"),
    ({"torch": "2.13.0+cpu", "torch_cuda": None, "gpus": [], "nccl": None, "groups": {"gloo": "ok"}},
     "nvidia-smi lists 8 GPU(s) but torch 2.13.0+cpu sees none (a CPU build: install the CUDA stack, "
     "make setup DEVICE=cuda)"),
    ({"lookups": {"cpu": "ok", "cuda:0": "RuntimeError: no kernel image is available"}},
     "lookup on cuda:0 failed: RuntimeError: no kernel image is available"),
    ({"groups": {"nccl": "DistBackendError: NCCL error", "gloo": "ok"}},
     "nccl process group failed: DistBackendError: NCCL error"),
    ({"torchrec": None}, "fbgemm-gpu or torchrec is not installed (make setup)"),
])
def test_mismatches_are_named(changes, problem):
    assert mismatches(replace(GPU_HOST, **changes)) == [problem]


def test_doctor_takes_no_arguments():
    proc = rankmix("doctor", "--verbose")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "rankmix: error: rankmix doctor takes no arguments, got ['--verbose']"
    assert "Traceback" not in proc.stderr


def test_doctor_fails_where_the_driver_lists_gpus_that_torch_cannot_use(tmp_path):
    """A machine whose driver lists a GPU, running this CPU stack: what an image built on a
    GPU-less builder gives a GPU node. The driver's listing is an nvidia-smi on PATH."""
    if torch.cuda.is_available():
        pytest.skip("torch sees the GPUs here")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    proc = rankmix("doctor", env=run_env(PATH=f"{tmp_path}:{os.environ['PATH']}"))
    assert proc.returncode == 1
    assert "GPUs (torch): none; nvidia-smi lists 1" in proc.stdout
    assert f"doctor: mismatch: nvidia-smi lists 1 GPU(s) but torch {torch.__version__} sees none" in proc.stdout
