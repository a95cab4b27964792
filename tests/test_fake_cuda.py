"""Device placement on CUDA, checked on the CPU (issue 31): under FakeTensorMode, tensors made
with device="cuda" carry no data, mixing them with CPU tensors raises, and so does reading
one back (`.item()`, `.tolist()`, `float()`): a training forward that passes here keeps
everything on the GPU and waits for nothing.

What FakeTensorMode cannot do on this CPU-only build of torch, and so stays for a real GPU
(bench/gpu_check.sh):

- backward: autograd asks the CUDA device guard for a stream as soon as a CUDA tensor needs
  a gradient, and the CPU build aborts the process there (not an exception): the forwards
  here run with parameters that need none;
- views (slicing, transposes) of CUDA tensors need the same guard: they raise, which the
  MoE's fused training step meets (asserted below);
- autocast: torch.autocast("cuda") turns itself off where CUDA is not available (asserted);
- FBGEMM's embedding kernels (TorchRec's sharded tables on CUDA) need the CUDA build of
  fbgemm-gpu and a process group of GPUs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from dense.layout import InputLayout
from dense.model import TaskHeads
from dense.towers import TOWERS, build_tower
from dense.unimixer import sinkhorn
from trainer.config import MLPConfig, ModelConfig, MoEConfig
from trainer.data.datasets import synth_features
from trainer.hooks import TrainingHooks
from trainer.lifecycle import GRADIENT, LOSS, StepFlags
from trainer.metric_logger import StepMeter

CUDA = torch.device("cuda", 0)
NEEDS_CUDA_GUARD = "PyTorch is not linked with support for cuda devices"
# Towers whose training forward takes a view of a CUDA tensor (see the module docstring).
VIEWS_ON_CUDA = {"rankmixer_moe"}


def on_fake_cuda(module: nn.Module) -> nn.Module:
    """`module` with every parameter and buffer a fake CUDA tensor of the same shape and dtype
    (call inside FakeTensorMode); parameters need no gradient (see the module docstring)."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda"),
                                                   requires_grad=False)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return module


def _training_forward(tower_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of one training forward of `tower_name`, its heads, the task loss and
    the tower's extra losses on fake CUDA, then its after-step hooks and statistics."""
    cfg = ModelConfig(tower=tower_name, num_tokens=4, hidden_dim=16, num_layers=2, ffn_ratio=2,
                      mlp=MLPConfig([24, 12]), moe=MoEConfig(num_experts=2))
    layout = InputLayout(synth_features())
    tower = build_tower(cfg, layout)
    heads = TaskHeads(tower.out_dim, 2)
    hooks = TrainingHooks.of(tower)
    with FakeTensorMode():
        on_fake_cuda(tower).train()
        on_fake_cuda(heads)
        labels = torch.ones(8, 2, device="cuda")
        logits = heads(tower(torch.randn(8, layout.width, device="cuda")))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        for extra in hooks.extra_losses:
            loss = loss + extra()
        for after_step in hooks.after_optimizer_step:
            after_step(1)
        StepMeter(2, CUDA).add(loss.detach().expand(2), 8, 0.1)
    return logits, loss


@pytest.mark.parametrize("tower", sorted(TOWERS.names()))
def test_a_training_forward_stays_on_cuda_and_reads_nothing_back(tower):
    if tower in VIEWS_ON_CUDA:
        with pytest.raises(RuntimeError, match=NEEDS_CUDA_GUARD):
            _training_forward(tower)
        return
    logits, loss = _training_forward(tower)
    assert logits.device == CUDA and logits.shape == (8, 2) and loss.device == CUDA


def test_fake_cuda_catches_what_these_tests_look_for():
    """The two failures the forwards above would meet: a read back, and a CPU tensor in a CUDA op."""
    with FakeTensorMode():
        x = torch.randn(4, device="cuda")
        with pytest.raises(DataDependentOutputException):
            x.sum().item()
        with pytest.raises(DataDependentOutputException):
            x.tolist()
        with pytest.raises(RuntimeError, match="found at least two devices, cuda:0 and cpu"):
            x + torch.ones(4)


def test_sinkhorn_on_cuda_decides_its_stop_on_the_device():
    with FakeTensorMode():
        logits = torch.randn(3, 8, 8, device="cuda")
        p, used = sinkhorn(logits, 50, 1e-5)
        assert p.device == CUDA and p.dtype == torch.float32 and used.device == CUDA


def test_step_flags_are_noted_on_cuda_and_read_back_once():
    with FakeTensorMode():
        flags = StepFlags(CUDA)
        flags.note_non_finite(LOSS, torch.randn((), device="cuda"), 3)
        flags.note_non_finite(GRADIENT, torch.randn((), device="cuda"), 3)
        assert {noted.device for noted in flags.noted.values()} == {CUDA}
        with pytest.raises(DataDependentOutputException):  # the read, at a check step
            flags.read(stop=True, save=False, world_size=1)


def test_autocast_on_cuda_is_off_in_a_cpu_build():
    """Why bf16 on CUDA is not checked here (it is on the CPU: tests/test_step_checks.py)."""
    with pytest.warns(UserWarning, match="CUDA is not available"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert not torch.is_autocast_enabled("cuda")


@pytest.mark.skip(reason="FBGEMM's table-batched embedding kernels on CUDA need the CUDA build of "
                         "fbgemm-gpu and GPUs for the sharded tables' process group; bench/gpu_check.sh "
                         "runs them")
def test_sharded_tables_on_cuda():
    """TorchRec's sharded EmbeddingBagCollection on CUDA: not reachable with fake tensors here."""
