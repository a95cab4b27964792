"""Device placement on CUDA, checked on the CPU (issues 31, 39): under FakeTensorMode, tensors
made with device="cuda" carry no data, mixing them with CPU tensors raises, and so does
reading one back (`.item()`, `.tolist()`, `float()`): a training forward that passes here
keeps everything on the GPU and waits for nothing.

What FakeTensorMode cannot do on this CPU-only build of torch:

- backward: autograd asks the CUDA device guard for a stream as soon as a CUDA tensor needs
  a gradient, and the CPU build aborts the process there (not an exception): the forwards
  here run with parameters that need none;
- views (slicing, transposes) of CUDA tensors need the same guard: they raise, which the
  MoE's fused training step meets (asserted below);
- autocast: torch.autocast("cuda") turns itself off where CUDA is not available (asserted);
- FBGEMM's embedding kernels (TorchRec's sharded tables on CUDA) need the CUDA build of
  fbgemm-gpu and a process group of GPUs: bench/gpu_check.sh runs them on a GPU, and no test
  here pretends to.

Views and backward are checked on the meta device instead: like a fake CUDA tensor a meta
tensor has no data, and reading one back (`.item()`, `float()`, `.tolist()`), copying it to
the host (`.to("cpu")`, `.cpu()`, `copy_`), an output sized by its values (`nonzero`, a
boolean index) and mixing it with a CPU tensor all raise (asserted below), while its views
and autograd work. Every tower's whole training step runs there: forward, heads, task and
extra losses, backward, the gradient checks, the after-step hooks. What only the device
type "cuda" shows (a branch on it, autocast) stays with the fake CUDA forwards, and bf16
autocast with a real GPU (bench/gpu_check.sh). The sequence modules' forwards on fake CUDA and
their steps on meta are in tests/test_sequence.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from dense.heads import TaskHeads, build_tower
from dense.layout import InputLayout
from dense.model_config import ModelConfig
from dense.tower_configs.baseline_towers import MLPConfig
from dense.tower_configs.moe_towers import MoEConfig
from dense.tower_registry import TOWERS
from dense.unimixer import sinkhorn
from embeddings.hooks import TrainingHooks
from trainer.data.datasets import synth_features
from trainer.lifecycle import GRADIENT, LOSS, StepFlags
from trainer.metrics.logger import StepMeter

CUDA = torch.device("cuda", 0)
META = torch.device("meta")
NEEDS_CUDA_GUARD = "PyTorch is not linked with support for cuda devices"
# Towers whose training forward takes a view of a CUDA tensor (see the module docstring):
# `test_a_training_step_on_meta_reads_nothing_back` checks them past it.
VIEWS_ON_CUDA = {"rankmixer_moe", "unimixer", "unimixer_lite", "unimixer_moe"}  # UniMixer: its blocks of D/T


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


def _config(tower_name: str) -> ModelConfig:
    return ModelConfig(tower=tower_name, num_tokens=4, hidden_dim=16, num_layers=2, ffn_ratio=2,
                       mlp=MLPConfig([24, 12]), moe=MoEConfig(num_experts=2))


def _training_forward(tower_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of one training forward of `tower_name`, its heads, the task loss and
    the tower's extra losses on fake CUDA, then its after-step hooks and statistics."""
    layout = InputLayout(synth_features())
    tower = build_tower(_config(tower_name), layout)
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


def _training_step_on_meta(tower_name: str) -> tuple[torch.Tensor, list[nn.Parameter]]:
    """(logits, parameters) of one training step of `tower_name` and its heads on the meta
    device, as `Trainer` runs it: the after-restore hooks, the forward, the per-task and the
    extra losses, the loss's finiteness note, backward, the gradient norm's note and the
    clip, the after-step hooks and the loss meter (`hooks.metrics` read values back by
    design, at log steps only)."""
    layout = InputLayout(synth_features())
    tower = build_tower(_config(tower_name), layout).to(META).train()
    heads = TaskHeads(tower.out_dim, 2).to(META)
    hooks = TrainingHooks.of(tower)
    for after_restore in hooks.after_restore:
        after_restore(0)
    flags, meter = StepFlags(META), StepMeter(2, META)
    logits = heads(tower(torch.randn(8, layout.width, device=META)))
    task_losses = nn.functional.binary_cross_entropy_with_logits(
        logits, torch.ones(8, 2, device=META), reduction="none").mean(dim=0)
    loss = (task_losses * torch.ones(2, device=META)).sum()
    for extra in hooks.extra_losses:
        loss = loss + extra()
    flags.note_non_finite(LOSS, loss, 1)
    loss.backward()
    params = [p for p in [*tower.parameters(), *heads.parameters()] if p.requires_grad]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    flags.note_non_finite(GRADIENT, norm, 1)
    torch.nn.utils.clip_grads_with_norm_([p.grad for p in params if p.grad is not None], 1.0, norm)
    for after_step in hooks.after_optimizer_step:
        after_step(1)
    meter.add(task_losses.detach(), 8, 0.1)
    return logits, params


def _autocast_off_on_meta(autocast):
    """torch.autocast, where a `torch.autocast("meta", enabled=False)` (UniMixer's float32
    Sinkhorn) does nothing: there is no autocast on meta to turn off, and torch raises."""
    def autocast_or_nothing(device_type: str, *args, enabled: bool = True, **kwargs):
        if device_type == "meta" and not enabled:
            return contextlib.nullcontext()
        return autocast(device_type, *args, enabled=enabled, **kwargs)
    return autocast_or_nothing


@pytest.mark.parametrize("tower", sorted(TOWERS.names()))
def test_a_training_step_on_meta_reads_nothing_back(tower, monkeypatch):
    """Past the views fake CUDA stops at: the whole step runs on the device, every
    parameter's gradient with it."""
    monkeypatch.setattr(torch, "autocast", _autocast_off_on_meta(torch.autocast))
    logits, params = _training_step_on_meta(tower)
    assert logits.device == META and logits.shape == (8, 2)
    assert params and all(p.grad is not None and p.grad.device == META for p in params)


def test_meta_catches_what_these_tests_look_for():
    """What the meta device raises on: every way of reading back or copying to the host, an
    output sized by the values, and a CPU tensor in a device op; its views and backward work."""
    x = torch.randn(4, 3, device=META, requires_grad=True)
    y = x.detach()
    for read in (lambda: y.sum().item(), lambda: float(y.sum()), lambda: bool(y.sum() > 0)):
        with pytest.raises(RuntimeError, match="Tensor.item\\(\\) cannot be called on meta tensors"):
            read()
    for copy in (y.tolist, y.cpu, lambda: y.to("cpu"), lambda: torch.empty(4, 3).copy_(y)):
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
            copy()
    for sized in (lambda: torch.nonzero(y), lambda: y[y > 0]):
        with pytest.raises(NotImplementedError, match="torch.nonzero"):
            sized()
    with pytest.raises(RuntimeError, match="Tensor on device cpu is not on the expected device meta"):
        x + torch.ones(4, 3)
    (x[:, 1:].transpose(0, 1) * 2).sum().backward()
    assert x.grad.device == META and x.grad.shape == x.shape


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


def test_sinkhorn_on_cuda_runs_on_the_device():
    """Its Newton systems are solved without the check (solve's would read the result back)."""
    with FakeTensorMode():
        logits = torch.randn(3, 8, 8, device="cuda")
        p = sinkhorn(logits, torch.tensor(0.05, device="cuda"), 12, 3)
        assert p.device == CUDA and p.dtype == torch.float32


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
