"""The dense model's activation bytes (dense/cost.py `activation_bytes`), which `rankmix plan`
counts per rank: a forward's live tensors worked out by hand, and training's on fake tensors
against torch's MemTracker on real tensors at the batch."""

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from dense.cost import activation_bytes
from launch.plan import dense_activations, rmsprop_temporaries
from trainer.config_loader import load_config

WIDTH, HIDDEN = 10, 64


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


@pytest.mark.parametrize("rows", [1000, 4096])
def test_evaluation_holds_the_input_and_two_hidden_layers_at_its_peak(rows):
    # no_grad: the input [B, 10], the first product [B, 64] and its ReLU [B, 64] are alive at
    # once (the product is freed only after the ReLU returns); the output [B, 1] comes later
    assert activation_bytes(mlp(), WIDTH, rows, training=False) == 4 * rows * (WIDTH + 2 * HIDDEN)


def deeper() -> nn.Module:
    """An MLP whose training peak moves with the batch: late in the backward, among the
    gradients, at tens of rows; at the backward's start at thousands."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 1))


@pytest.mark.parametrize("make", [mlp, deeper])
def test_training_on_fake_tensors_matches_real_tensors_at_the_batch(make):
    model, rows = make(), 3000
    tracker = MemTracker()
    with tracker:
        model(torch.randn(rows, WIDTH)).sum().backward()
    model.zero_grad(set_to_none=True)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    real = peak[_MemRefType.ACT] + peak[_MemRefType.TEMP]
    estimated = activation_bytes(model, WIDTH, rows, training=True)
    assert real > 4 * rows * (WIDTH + 2 * HIDDEN)  # more than evaluation holds: the saved tensors and gradients
    # fake tensors keep a gradient's copy the real step hands over: a little over, never under
    assert real <= estimated <= 1.01 * real
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind


def test_bf16_autocast_halves_what_the_products_keep_and_adds_its_weight_copies():
    model = mlp()
    fp32 = activation_bytes(model, WIDTH, 4096, training=False)
    bf16 = activation_bytes(model, WIDTH, 4096, training=False, autocast=torch.bfloat16)
    # at the peak: the fp32 input, the bf16 product and its ReLU, and autocast's bf16 copies of the
    # first layer's weight and bias (the input's bf16 copy is gone by then)
    assert fp32 == 4 * 4096 * (WIDTH + 2 * HIDDEN)
    assert bf16 == 4 * 4096 * WIDTH + 2 * 4096 * 2 * HIDDEN + 2 * (WIDTH * HIDDEN + HIDDEN)


def test_the_plan_measures_training_at_the_ranks_batch_and_evaluation_at_its_own():
    cfg = load_config(None, ["--data.batch_size=128", "--data.eval_batch_size=2048"])
    model = mlp()
    assert dense_activations(cfg, model, WIDTH, 128, "cpu") == (
        activation_bytes(model, WIDTH, 128, True), activation_bytes(model, WIDTH, 2048, False))
    # a GPU rank steps in bf16 by default, a CPU rank in fp32
    on_gpu = dense_activations(cfg, model, WIDTH, 128, "cuda")
    assert on_gpu == (activation_bytes(model, WIDTH, 128, True, torch.bfloat16),
                      activation_bytes(model, WIDTH, 2048, False, torch.bfloat16))
    assert on_gpu[0] < activation_bytes(model, WIDTH, 128, True)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_rmsprops_step_makes_the_temporaries_the_plan_counts(weight_decay):
    cfg = load_config(None, [f"--optim.weight_decay={weight_decay}"])
    model = mlp()
    params = list(model.parameters())
    optimizer = torch.optim.RMSprop(params, lr=0.01, weight_decay=weight_decay, foreach=True)  # as trainer/optimizer.py
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # its state (the square average) exists before the measured step
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        optimizer.step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    state = sum(p.numel() + 1 for p in params) * 4  # the square average and a step count per tensor
    assert peak[_MemRefType.OPT] - state == rmsprop_temporaries(cfg, model)


def test_a_wide_model_at_a_tiny_batch_is_planned_at_its_optimizers_step():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(WIDTH, 4096), nn.ReLU(), nn.Linear(4096, 1))
    cfg = load_config(None, ["--data.batch_size=1", "--optim.weight_decay=0.01"])
    training, _ = dense_activations(cfg, wide, WIDTH, 1, "cpu")
    assert training == rmsprop_temporaries(cfg, wide) > activation_bytes(wide, WIDTH, 1, True)


def test_measuring_the_peak_draws_nothing_from_the_runs_seeded_generator():
    # the Trainer measures it after seeding, and the sizes it tries depend on the machine's speed:
    # drawing from the global generator made a resumed run's RNG state differ from an unbroken one's
    from dense.cost import peak_flops

    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert peak_flops(torch.device("cpu")) > 0
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("part", ["tokenizer", "sequence"])
def test_a_parts_own_weight_decay_is_planned_as_a_decayed_step(part):
    """A decay set apart for one part makes RMSProp add the decayed weight to that part's
    gradients: the plan counts the temporary for every parameter (an upper bound)."""
    model = mlp()
    plain = rmsprop_temporaries(load_config(None, []), model)
    assert rmsprop_temporaries(load_config(None, [f"--optim.{part}_weight_decay=0.01"]), model) == 2 * plain
    assert rmsprop_temporaries(load_config(None, [f"--optim.{part}_weight_decay=0"]), model) == plain
