"""Tokenizers (dense/tokenizer.py) against references outside their code: the model config
that builds them, torch's FLOP counter and parameter count for `cost()`, and nn.Linear's
initial range for the slice projections."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dense.model_config import ModelConfig
from dense.tokenizer import GroupTokenizer, SliceTokenizer, build_tokenizer

WIDTHS = [3, 5, 4]


def test_the_config_builds_a_slice_tokenizer_over_every_group():
    tok = build_tokenizer(ModelConfig(tokenizer="slice", num_tokens=5, token_dim=4, hidden_dim=6,
                                      tokenizer_bias="zero"), WIDTHS)
    assert isinstance(tok, SliceTokenizer)
    assert (tok.input_dim, tok.num_tokens, tok.token_dim) == (12, 5, 4)
    assert tok.weight.shape == (5, 4, 6) and not tok.bias.any()


def test_the_config_builds_a_group_tokenizer_of_one_token_per_group():
    tok = build_tokenizer(ModelConfig(tokenizer="group", hidden_dim=6, tokenizer_bias="zero"), WIDTHS)
    assert isinstance(tok, GroupTokenizer) and tok.num_tokens == 3
    assert [(p.in_features, p.out_features) for p in tok.proj] == [(3, 6), (5, 6), (4, 6)]
    assert all(not p.bias.any() for p in tok.proj)


def test_an_unknown_tokenizer_is_an_error():
    with pytest.raises(ValueError) as err:
        build_tokenizer(ModelConfig(tokenizer="hash"), WIDTHS)
    assert str(err.value) == "model.tokenizer must be slice or group, got 'hash'"


@pytest.mark.parametrize("tok", [SliceTokenizer(12, 5, 3, 6, bias_init="uniform"),
                                 SliceTokenizer(12, 4, 0, 6, bias_init="uniform"),
                                 GroupTokenizer(WIDTHS, 6, bias_init="uniform"),
                                 GroupTokenizer([12], 6, bias_init="uniform")],
                         ids=["slice-padded", "slice", "groups", "one-group"])
def test_cost_is_the_parameter_count_and_the_counted_flops_per_sample(tok):
    batch = 7
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tok(torch.randn(batch, 12))
    assert tok.cost() == (sum(p.numel() for p in tok.parameters()), counter.get_total_flops() // batch)


def test_slice_projections_start_in_nn_linears_range():
    torch.manual_seed(0)
    tok = SliceTokenizer(64, 4, 16, 32, bias_init="uniform")
    bound = 1 / math.sqrt(16)  # fan-in: the slice width
    for p in (tok.weight, tok.bias):
        assert -bound <= p.min() < -0.9 * bound and 0.9 * bound < p.max() <= bound
