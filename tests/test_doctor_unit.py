"""`rankmix doctor`'s judgement (launch/doctor.py `mismatches`, `report`, `_try`) on facts
written here, in-process, so that `make test-mutation` reaches it: a CPU machine, missing
packages, several mismatches at once, and the printed report line by line.
tests/test_doctor.py runs the command itself."""

from dataclasses import replace

import pytest

from launch.doctor import Facts, _try, mismatches, report
from test_doctor import GPU_HOST

CPU_HOST = Facts(torch="2.13.0+cpu", torch_cuda=None, driver_gpus=0, gpus=[], nccl=None,
                 fbgemm="fbgemm-gpu-cpu 1.8.0", fbgemm_variant="cpu", torchrec="1.8.0",
                 lookups={"cpu": "ok"}, groups={"gloo": "ok"})


def test_a_cpu_machine_with_the_cpu_stack_passes():
    assert mismatches(CPU_HOST) == []


@pytest.mark.parametrize("changes, problems", [
    ({"gpus": []}, ["nvidia-smi lists 8 GPU(s) but torch 2.13.0+cu128 sees none"]),  # a CUDA build: no advice
    ({"fbgemm": None, "fbgemm_variant": None}, ["fbgemm-gpu or torchrec is not installed (make setup)"]),
    ({"fbgemm": None, "torchrec": None, "lookups": {}}, ["fbgemm-gpu or torchrec is not installed (make setup)"]),
    ({"fbgemm_variant": "rocm"}, ["fbgemm-gpu 1.8.0+cu128 is built for rocm, on a machine with CUDA GPUs: install the "
                                  "CUDA stack (make setup DEVICE=cuda)"]),
    ({"fbgemm": "fbgemm-gpu 1.8.0"}, []),  # no CUDA tag to compare
    ({"torch_cuda": None}, []),  # nothing to compare it with
    ({"fbgemm": "fbgemm-gpu 1.8.0+cu130", "torch": "2.13.0+cu130", "torch_cuda": "13.0"}, []),
    ({"fbgemm": "fbgemm-gpu 1.8.0+cu118"}, ["torch 2.13.0+cu128 is built for CUDA 12.8 but fbgemm-gpu 1.8.0+cu118 for "
                                             "CUDA 11.8: install both from the same index"]),
    ({"lookups": {"cpu": "ValueError: x", "cuda:0": "ok", "cuda:1": "RuntimeError: y"}},
     ["lookup on cpu failed: ValueError: x", "lookup on cuda:1 failed: RuntimeError: y"]),
])
def test_each_mismatch_on_a_gpu_host(changes, problems):
    assert mismatches(replace(GPU_HOST, **changes)) == problems


def test_every_mismatch_at_once_in_order():
    facts = replace(GPU_HOST, torch="2.13.0+cu126", torch_cuda="12.6", gpus=[], fbgemm_variant="cpu",
                    lookups={"cpu": "RuntimeError: no kernel"}, groups={"nccl": "ok", "gloo": "TimeoutError: late"})
    assert mismatches(facts) == [
        "nvidia-smi lists 8 GPU(s) but torch 2.13.0+cu126 sees none",
        "torch 2.13.0+cu126 is built for CUDA 12.6 but fbgemm-gpu 1.8.0+cu128 for CUDA 12.8: install both from "
        "the same index",
        "lookup on cpu failed: RuntimeError: no kernel",
        "gloo process group failed: TimeoutError: late"]
    # a CPU build on a GPU host: the CPU FBGEMM then passes, torch's build is the finding
    cpu_build = replace(CPU_HOST, driver_gpus=2)
    assert mismatches(cpu_build) == ["nvidia-smi lists 2 GPU(s) but torch 2.13.0+cpu sees none (a CPU build: "
                                     "install the CUDA stack, make setup DEVICE=cuda)"]


def test_the_report_of_a_gpu_host():
    facts = replace(GPU_HOST, gpus=[("NVIDIA H100 80GB HBM3", 80 * 2**30), ("NVIDIA A10", 23 * 2**30 + 2**29)],
                    driver_gpus=2)
    assert report(facts) == [
        "torch 2.13.0+cu128 (CUDA 12.8)",
        "NCCL 2.27.3",
        "FBGEMM fbgemm-gpu 1.8.0+cu128 (built for cuda, CUDA 12.8)",
        "TorchRec 1.8.0",
        "GPUs (torch): 0: NVIDIA H100 80GB HBM3 80.0 GB, 1: NVIDIA A10 23.5 GB; nvidia-smi lists 2",
        "lookup on cpu: ok",
        "lookup on cuda:0: ok",
        "nccl process group: ok",
        "gloo process group: ok"]


def test_the_report_of_a_machine_without_gpus_or_packages():
    facts = replace(CPU_HOST, fbgemm=None, fbgemm_variant=None, torchrec=None, lookups={},
                    groups={"gloo": "RuntimeError: no"})
    assert report(facts) == [
        "torch 2.13.0+cpu (CUDA none: CPU build)",
        "NCCL none",
        "FBGEMM not installed (built for unknown)",
        "TorchRec not installed",
        "GPUs (torch): none; nvidia-smi lists 0",
        "gloo process group: RuntimeError: no"]


def _raise(error: Exception):
    def check():
        raise error
    return check


@pytest.mark.parametrize("check, result", [
    (lambda: None, "ok"),
    (_raise(RuntimeError("wrong pooled sums")), "RuntimeError: wrong pooled sums"),
    (_raise(ValueError("  first line\nsecond line ")), "ValueError: first line"),
    (_raise(OSError()), "OSError: "),
    (_raise(RuntimeError(" \n ")), "RuntimeError: "),
    (_raise(KeyError("  ")), "KeyError: '  '"),
])
def test_a_checks_result_is_ok_or_its_error_in_one_line(check, result):
    assert _try(check) == result
