"""RankMixer maths against its definition, a per-token loop and the worked example of docs/design.md §1."""

import math

import pytest
import torch

from dense.heads import TaskHeads
from dense.rankmixer import PerTokenFFN, RankMixerBlock, RankMixerTower, token_mixing
from dense.tokenizer import GroupTokenizer, SliceTokenizer
from test_rankmixer_fast import randomize, ref_block
from trainer.config_loader import load_config
from trainer.metrics.ranking import logloss


@pytest.mark.parametrize("b,t,d,h", [(3, 4, 8, 4), (2, 16, 32, 16), (5, 3, 12, 3), (2, 4, 8, 2), (1, 6, 12, 4)])
def test_token_mixing_matches_definition(b, t, d, h):
    x = torch.randn(b, t, d)
    out = token_mixing(x, h)
    q = d // h
    expected = torch.empty(b, h, t * q)
    for head in range(h):  # out[h, t q + r] = X[t, h q + r], 0-based
        for tok in range(t):
            for r in range(q):
                expected[:, head, tok * q + r] = x[:, tok, head * q + r]
    assert out.shape == (b, h, t * q)
    assert torch.equal(out, expected)


def test_token_mixing_rejects_indivisible_width():
    with pytest.raises(ValueError, match="hidden_dim=10 divisible by the 4 heads"):
        token_mixing(torch.randn(2, 4, 10), 4)
    with pytest.raises(ValueError, match="hidden_dim=10 divisible by the number of tokens 4"):
        RankMixerBlock(num_tokens=4, dim=10, ffn_ratio=2)


# Seed 003, section 6: MovieLens user 253 x movie 465, T = H = D = 4, L = 1, k = 2.
X0 = [[0.2511, 0.6716, 0.1599, 1.1765], [-0.7646, 0.4844, -0.8943, 0.5317],
      [0.1167, 0.2708, 1.0803, 1.3909], [0.0631, 0.7123, -0.1801, 0.8389]]
MIXED = [[0.5022, -0.0929, 0.2766, 1.2396], [-0.0929, 0.9689, -0.6235, 1.2440],
         [0.2766, -0.6235, 2.1605, 1.2108], [1.2396, 1.2440, 1.2108, 1.6778]]
S0 = [[0.0428, -1.1802, -0.4208, 1.5582], [-0.6128, 0.7803, -1.3088, 1.1413],
      [-0.4618, -1.3287, 1.3526, 0.4379], [-0.5340, -0.5113, -0.6828, 1.7281]]
V = [[0.0682, -0.0856, -0.1294, 0.0860], [0.0834, 0.0034, -0.1546, 0.0809],
     [0.0428, -0.0371, -0.0404, 0.0224], [0.0886, -0.0460, -0.0780, -0.0453]]
X1 = [[0.1174, -1.1637, -0.4978, 1.5441], [-0.5005, 0.7334, -1.3783, 1.1454],
      [-0.4173, -1.3670, 1.3194, 0.4649], [-0.4297, -0.5427, -0.7483, 1.7207]]
POOLED = [-0.3075, -0.5850, -0.3262, 1.2188]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64).unsqueeze(0)


def test_worked_example_first_layer_norm():
    block = RankMixerBlock(num_tokens=4, dim=4, ffn_ratio=2).double()  # LN: gamma 1, beta 0, eps 1e-5
    x0 = _t(X0)
    mixed = token_mixing(x0, 4) + x0
    assert torch.allclose(mixed, _t(MIXED), atol=1e-4)
    assert torch.allclose(block.norm1(mixed), _t(S0), atol=1e-4)


def test_worked_example_second_layer_norm_and_head():
    """From X1 on, the example through the project's code: a one-block tower whose tokenizer
    passes X0's rows through and whose FFN outputs V pools X1 over its tokens; its head and
    the logloss give the example's z and loss."""
    block = RankMixerBlock(num_tokens=4, dim=4, ffn_ratio=2).double()
    x1 = block.norm2(_t(S0) + _t(V))
    assert torch.allclose(x1, _t(X1), atol=1e-4)
    tower = RankMixerTower(SliceTokenizer(16, 4, 0, 4, bias_init="uniform"), 1, 4, 2).double()
    heads = TaskHeads(4, 1).double()
    with torch.no_grad():
        tower.tokenizer.weight.copy_(torch.eye(4).expand(4, 4, 4))  # token i = e_input[4 i : 4 i + 4]
        tower.tokenizer.bias.zero_()
        ffn = tower.blocks[0].ffn
        ffn.w1.zero_()
        ffn.w2.zero_()
        ffn.b2.copy_(torch.tensor(V, dtype=torch.float64).unsqueeze(1))  # PFFN(S) == V for any S
        heads.heads[0].weight.copy_(torch.tensor([[0.3031, 0.4582, 0.2000, 0.4263]]))
        heads.heads[0].bias.fill_(0.2727)
        pooled = tower(_t(X0).reshape(1, 16))
        z = heads(pooled)
    assert torch.allclose(pooled, torch.tensor([POOLED], dtype=torch.float64), atol=1e-4)
    assert z.item() == pytest.approx(0.365762, abs=1e-4)
    assert logloss(torch.sigmoid(z), torch.ones(1, 1)) == pytest.approx(0.526896, abs=1e-4)


def test_worked_example_block_end_to_end():
    """The whole block with the FFN forced to output the example's V reproduces X1."""
    block = RankMixerBlock(num_tokens=4, dim=4, ffn_ratio=2).double()
    with torch.no_grad():  # zero weights, bias = V: PFFN(S) == V for any S
        block.ffn.w1.zero_()
        block.ffn.w2.zero_()
        block.ffn.b2.copy_(torch.tensor(V, dtype=torch.float64).unsqueeze(1))
    assert torch.allclose(block(_t(X0)), _t(X1), atol=1e-4)


def test_per_token_ffn_matches_loop_reference():
    torch.manual_seed(0)
    t, d, k = 5, 8, 3
    ffn = PerTokenFFN(t, d, k).double()
    x = torch.randn(7, t, d, dtype=torch.float64)
    expected = torch.stack([
        torch.nn.functional.gelu(x[:, i] @ ffn.w1[i] + ffn.b1[i, 0]) @ ffn.w2[i] + ffn.b2[i, 0]
        for i in range(t)], dim=1)
    assert torch.allclose(ffn(x), expected, atol=1e-12)


def test_per_token_ffn_gradients_match_loop_reference():
    torch.manual_seed(1)
    ffn = PerTokenFFN(3, 4, 2).double()
    x = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    ffn(x).square().sum().backward()
    fast = [p.grad.clone() for p in (x, ffn.w1, ffn.w2)]
    for p in (x, ffn.w1, ffn.w2):
        p.grad = None
    torch.stack([torch.nn.functional.gelu(x[:, i] @ ffn.w1[i] + ffn.b1[i, 0]) @ ffn.w2[i] + ffn.b2[i, 0]
                 for i in range(3)], dim=1).square().sum().backward()
    for a, b in zip(fast, (x.grad, ffn.w1.grad, ffn.w2.grad)):
        assert torch.allclose(a, b, atol=1e-12)


def test_slice_tokenizer_pads_tail_with_zeros():
    torch.manual_seed(0)
    tok = SliceTokenizer(input_dim=10, num_tokens=4, token_dim=0, hidden_dim=6, bias_init="uniform").double()
    assert tok.token_dim == 3  # ceil(10 / 4); the last slice holds 1 real value and 2 zeros
    e = torch.randn(2, 10, dtype=torch.float64)
    out = tok(e)
    padded = torch.cat([e, torch.zeros(2, 2, dtype=torch.float64)], dim=1)
    for i in range(4):
        expected = padded[:, 3 * i:3 * i + 3] @ tok.weight[i] + tok.bias[i]
        assert torch.allclose(out[:, i], expected, atol=1e-12)
    with pytest.raises(ValueError, match="model.token_dim=2 x model.num_tokens=4 is smaller"):
        SliceTokenizer(input_dim=10, num_tokens=4, token_dim=2, hidden_dim=6, bias_init="uniform")


def test_group_tokenizer_projects_each_group_separately():
    torch.manual_seed(0)
    tok = GroupTokenizer([3, 5, 2], hidden_dim=4, bias_init="uniform")
    e = torch.randn(6, 10)
    out = tok(e)
    assert out.shape == (6, 3, 4)
    assert torch.allclose(out[:, 1], tok.proj[1](e[:, 3:8]))


@pytest.mark.parametrize("t,d,layers,k,e", [(16, 64, 2, 4, 200), (4, 8, 3, 2, 7)])
def test_parameter_count_matches_eq12_plus_tokenizer(t, d, layers, k, e):
    tower = RankMixerTower(SliceTokenizer(e, t, 0, d, bias_init="uniform"), layers, d, k)
    token_dim = math.ceil(e / t)
    ffn = 2 * k * layers * t * d * d                        # eq. 12: weights of the per-token FFNs
    ffn_bias = layers * t * (k * d + d)
    norms = layers * 2 * 2 * d                             # two LayerNorms (gamma, beta) per block
    tokenizer = t * token_dim * d + t * d
    assert sum(p.numel() for p in tower.parameters()) == ffn + ffn_bias + norms + tokenizer


def test_tower_output_is_mean_over_tokens():
    """The tower against eq. 1 written out ([B, T, D], a loop per token), then the mean of the T tokens."""
    torch.manual_seed(0)
    tower = RankMixerTower(SliceTokenizer(12, 4, 0, 8, bias_init="uniform"), 2, 8, 2).double()
    randomize(tower)
    e = torch.randn(3, 12, dtype=torch.float64)
    x = tower.tokenizer(e)
    for block in tower.blocks:
        x = ref_block(block, x)
    assert torch.allclose(tower(e), (x[:, 0] + x[:, 1] + x[:, 2] + x[:, 3]) / 4, atol=1e-12)


def test_pre_norm_block_and_flatten_pooling_match_a_composition_of_the_parts():
    """norm="pre": S = X + TokenMixing(LN1(X)), X' = S + FFN(LN2(S)), one LN before pooling;
    pooling="flatten": the T x D tokens concatenated, token by token."""
    torch.manual_seed(0)
    tower = RankMixerTower(SliceTokenizer(12, 4, 0, 8, bias_init="uniform"), 2, 8, 2, norm="pre",
                           pooling="flatten").double()
    for p in tower.parameters():  # LayerNorms away from gamma 1, beta 0, so that a misplaced one shows
        torch.nn.init.normal_(p, std=0.5)
    e = torch.randn(3, 12, dtype=torch.float64)
    x = tower.tokenizer(e)
    for block in tower.blocks:
        s = x + token_mixing(block.norm1(x), 4)
        x = s + block.ffn(block.norm2(s))
    assert tower.out_dim == 32
    assert torch.allclose(tower(e), tower.final_norm(x).reshape(3, 32), atol=1e-12)
    extra = sum(p.numel() for p in tower.final_norm.parameters())
    assert tower.cost()[0] == sum(p.numel() for p in tower.parameters()) and extra == 16
    with pytest.raises(ValueError, match="model.rankmixer.pooling must be one of \\('mean', 'flatten'\\), got 'max'"):
        RankMixerTower(SliceTokenizer(12, 4, 0, 8, bias_init="uniform"), 2, 8, 2, pooling="max")


def test_zero_tokenizer_bias_changes_nothing_else():
    torch.manual_seed(0)
    uniform = SliceTokenizer(12, 4, 0, 8, bias_init="uniform")
    torch.manual_seed(0)
    zero = SliceTokenizer(12, 4, 0, 8, bias_init="zero")
    assert torch.equal(zero.weight, uniform.weight) and not zero.bias.any() and uniform.bias.abs().min() > 0
    torch.manual_seed(0)
    group = GroupTokenizer([3, 5], 4, bias_init="zero")
    assert all(not p.bias.any() for p in group.proj)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_dropout_acts_in_training_only(norm):
    torch.manual_seed(0)
    plain = RankMixerTower(SliceTokenizer(12, 4, 0, 8, bias_init="uniform"), 2, 8, 2, norm=norm).double()
    torch.manual_seed(0)
    dropped = RankMixerTower(SliceTokenizer(12, 4, 0, 8, bias_init="uniform"), 2, 8, 2, norm=norm, dropout=0.5).double()
    e = torch.randn(5, 12, dtype=torch.float64)
    assert torch.allclose(dropped.eval()(e), plain.eval()(e), atol=1e-12)  # same weights, no dropout in eval
    assert not torch.allclose(dropped.train()(e), plain.train()(e))
    with pytest.raises(ValueError, match=r"model.rankmixer.dropout=1.0 must be a probability in \[0, 1\)"):
        load_config(None, ["--model.rankmixer.dropout=1.0"])
