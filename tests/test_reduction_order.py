"""Dense gradients round alike at a DDP model's first step and at its later ones, at 4 gloo
ranks: a resumed run's first step is a fresh DDP's first, and must sum as the uninterrupted
run's same step did (docs/checkpoints.md, exact resume)."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cli import rendezvous_port, spawn
from trainer.dist import reduce_gradients_in_fixed_order

WORLD = 4  # at 2 ranks every order of summation rounds alike: a + b == b + a
STEPS = 3  # DDP regroups its gradient buckets before its second step


def _gradients_worker(rank: int, port: int, out: str) -> None:
    """The same batch and weights through one DDP model STEPS times: rank 0 saves the
    reduced gradients of each step and every rank's own gradients."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    # Linear layers of mixed sizes: backward yields their gradients in another order than
    # DDP's first bucket holds them, so the buckets it regroups them into differ
    model = nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 40), nn.ReLU(), nn.Linear(40, 3))
    # as TorchRec's DefaultDataParallelWrapper builds it for the dense side
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, broadcast_buffers=False, static_graph=True)
    reduce_gradients_in_fixed_order(ddp)
    batch = torch.randn(64, 16, generator=torch.Generator().manual_seed(rank))
    local = torch.autograd.grad(model(batch).square().mean(), list(model.parameters()))
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, [g.clone() for g in local])
    steps = []
    for _ in range(STEPS):
        ddp.zero_grad()
        ddp(batch).square().mean().backward()
        steps.append([p.grad.clone() for p in model.parameters()])
    if rank == 0:
        torch.save({"steps": steps, "local": everyone}, out)
    dist.destroy_process_group()


def test_dense_gradients_reduce_bitwise_alike_at_a_ddp_models_first_and_later_steps(tmp_path: Path):
    out = tmp_path / "gradients.pt"
    spawn(_gradients_worker, (rendezvous_port(), str(out)), WORLD)
    saved = torch.load(out, weights_only=True)
    first, *later = saved["steps"]
    for step in later:
        for a, b in zip(first, step, strict=True):
            assert torch.equal(a, b)
    # and they are the mean over the ranks (an independent sum: equal up to rounding)
    means = [torch.stack(grads).mean(0) for grads in zip(*saved["local"])]
    for got, want in zip(first, means, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
