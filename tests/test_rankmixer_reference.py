"""RankMixer (dense/rankmixer.py) against references outside its code: torch's FLOP
counter and parameter count for `cost()`, autograd for the hand-written backward under
bf16 autocast, nn.Linear's initial range, and the blocks' one default, the config's."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dense.heads import build_tower
from dense.layout import InputLayout
from dense.model_config import ModelConfig
from dense.rankmixer import PerTokenFFN, RankMixerBlock, RankMixerTower, uniform_init
from dense.tokenizer import SliceTokenizer
from trainer.data.datasets import synth_features

T, D = 4, 8


@pytest.mark.parametrize("layers,ratio", [(1, 2), (3, 3)])
def test_cost_is_the_parameter_count_and_the_counted_flops_per_sample(layers, ratio):
    tower = RankMixerTower(SliceTokenizer(20, T, 6, D, bias_init="uniform"), layers, D, ffn_ratio=ratio)
    batch = 5
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(torch.randn(batch, 20))
    assert tower.cost() == (sum(p.numel() for p in tower.parameters()), counter.get_total_flops() // batch)
    ffn = tower.blocks[0].ffn
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ffn(torch.randn(batch, T, D))
    assert ffn.cost() == (sum(p.numel() for p in ffn.parameters()), counter.get_total_flops() // batch)


def test_hand_written_backward_under_bf16_autocast_equals_autograds():
    torch.manual_seed(0)
    ffn = PerTokenFFN(T, D, 2)
    x = torch.randn(T, 6, D, requires_grad=True)
    cotangent = torch.randn(T, 6, D)
    grads = []
    for step in (ffn.residual_tm, lambda v: v + ffn.forward_tm(v)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = step(x)
        (out.float() * cotangent).sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in ffn.parameters())])
        x.grad = None
        ffn.zero_grad(set_to_none=True)
    for fast, ref in zip(*grads):
        assert fast.dtype == torch.float32
        torch.testing.assert_close(fast, ref, atol=0.1, rtol=0.05)  # bf16 products, summed in another order


def test_initial_weights_fill_nn_linears_range():
    torch.manual_seed(0)
    w = uniform_init((64, 64), 16)
    bound = 1 / math.sqrt(16)
    assert -bound <= w.min() < -0.9 * bound and 0.9 * bound < w.max() <= bound


def test_the_ffn_width_has_one_default_the_configs():
    """model.ffn_ratio's default is the only one: the blocks take k from the config."""
    k = ModelConfig().ffn_ratio
    assert k == 4
    assert RankMixerBlock(T, D, k).ffn.w1.shape == (T, D, k * D)
    tower = build_tower(ModelConfig(num_tokens=T, hidden_dim=D, num_layers=1), InputLayout(synth_features()))
    assert tower.blocks[0].ffn.w1.shape == (T, D, k * D)
    for cls in (RankMixerBlock, RankMixerTower, PerTokenFFN):
        assert inspect.signature(cls).parameters["ffn_ratio"].default is inspect.Parameter.empty, cls


def test_blocks_take_the_ffn_they_are_given():
    ffn = PerTokenFFN(T, D, 3)
    assert RankMixerBlock(T, D, 3, ffn=ffn).ffn is ffn
    made: list[PerTokenFFN] = []

    def make() -> PerTokenFFN:
        made.append(PerTokenFFN(T, D, 1))
        return made[-1]

    tower = RankMixerTower(SliceTokenizer(20, T, 6, D, bias_init="uniform"), 2, D, 1, ffn=make)
    assert len(made) == 2 and all(b.ffn is m for b, m in zip(tower.blocks, made))


def test_mean_pooling_gives_one_token_width():
    tower = RankMixerTower(SliceTokenizer(20, T, 6, D, bias_init="uniform"), 1, D, 2)
    assert tower.out_dim == D and tower(torch.randn(3, 20)).shape == (3, D)


def test_an_unknown_norm_is_an_error():
    with pytest.raises(ValueError) as err:
        RankMixerBlock(T, D, 2, norm="mid")
    assert str(err.value) == "model.rankmixer.norm must be one of ('post', 'pre'), got 'mid'"
