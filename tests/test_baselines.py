"""Comparison towers (docs/design.md §3.7): DCNv2's cross layer, the RankMixer ablations
against naive references and analytic costs against the FLOP counter (CLI training of every
tower: tests/test_towers.py)."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dense.baselines import CrossLayer, SelfAttention, ablation_block
from dense.heads import build_tower
from dense.layout import InputLayout
from dense.model_config import ModelConfig
from dense.rankmixer import PerTokenFFN
from dense.tower_configs.baseline_towers import AttentionConfig, DCNv2Config, MLPConfig
from trainer.data.datasets import synth_features

TOWERS = ["mlp", "dcnv2", "no_token_mixing", "shared_ffn", "self_attention"]


@pytest.mark.parametrize("rank", [0, 3])
def test_cross_layer_equals_the_formula(rank):
    torch.manual_seed(0)
    layer = CrossLayer(10, rank)
    x0, x = torch.randn(6, 10), torch.randn(6, 10)
    if rank:
        u, v = layer.up.weight, layer.down.weight.T  # U, V [E, r]
        assert u.shape == v.shape == (10, rank)
        w = u @ v.T
    else:
        w = layer.up.weight
    expected = x0 * (x @ w.T + layer.up.bias) + x  # rows: x_0 * (W x_l + b) + x_l
    torch.testing.assert_close(layer(x0, x), expected)


def test_no_token_mixing_block_is_ln_of_pffn_plus_input():
    torch.manual_seed(0)
    block = ablation_block("no_token_mixing", 4, 8, 2, 0)
    reference = PerTokenFFN(4, 8, 2)
    block.ffn.load_state_dict(reference.state_dict())
    x = torch.randn(5, 4, 8)
    expected = torch.nn.functional.layer_norm(reference(x) + x, (8,))  # fresh LayerNorm: weight 1, bias 0
    torch.testing.assert_close(block(x), expected)
    assert block.norm1 is None and block.mixing is None


def test_shared_ffn_uses_the_same_weights_for_every_token():
    torch.manual_seed(0)
    ffn = ablation_block("shared_ffn", 4, 8, 2, 0).ffn
    x, perm = torch.randn(5, 4, 8), torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(ffn(x[:, perm]), ffn(x)[:, perm])


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_self_attention_equals_naive_softmax(heads):
    torch.manual_seed(0)
    attn = SelfAttention(8, heads)
    x = torch.randn(3, 5, 8)
    q, k, v = attn.qkv(x).chunk(3, dim=-1)
    q, k, v = (m.view(3, 5, heads, 8 // heads).transpose(1, 2) for m in (q, k, v))  # [B, H, T, q]
    scores = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8 // heads), dim=-1)
    expected = attn.out((scores @ v).transpose(1, 2).reshape(3, 5, 8))
    torch.testing.assert_close(attn(x), expected)


@pytest.mark.parametrize("tower", TOWERS)
@pytest.mark.parametrize("tokenizer,rank,heads", [("slice", 0, 0), ("group", 3, 2)])
def test_parameter_and_flop_counts_match_the_formulas(tower, tokenizer, rank, heads):
    cfg = ModelConfig(tower=tower, tokenizer=tokenizer, num_tokens=4, hidden_dim=16, num_layers=2, ffn_ratio=2,
                      mlp=MLPConfig([24, 12]), dcnv2=DCNv2Config(cross_layers=2, cross_rank=rank),
                      attention=AttentionConfig(num_heads=heads))
    layout = InputLayout(synth_features())
    model = build_tower(cfg, layout)
    params, flops = model.cost()
    assert sum(p.numel() for p in model.parameters()) == params

    # The CPU's fused attention kernel is not in the counter's table (it counts 0); the math
    # backend runs the same attention as matmuls, which it does count.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randn(3, layout.width))
    assert counter.get_total_flops() == 3 * flops
