"""The token-major RankMixer block/tower against a straightforward reference: definition
token mixing, a per-token loop FFN and nn.LayerNorm, forward and gradients."""

import pytest
import torch
from torch import nn

from dense.rankmixer import RankMixerBlock, RankMixerTower, token_mixing
from dense.tokenizer import SliceTokenizer

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def ref_token_mixing(x):
    """out[b, h, t*q + r] = x[b, t, h*q + r] with H = T heads, element by element."""
    b, t, d = x.shape
    q = d // t
    cols = [x[:, tok, head * q:(head + 1) * q] for head in range(t) for tok in range(t)]
    return torch.cat(cols, dim=1).view(b, t, d)


def ref_block(block, x):
    d = x.shape[-1]
    norm1, norm2 = nn.LayerNorm(d), nn.LayerNorm(d)  # fresh LayerNorms sharing the block's gamma, beta
    norm1.weight, norm1.bias = block.norm1.weight, block.norm1.bias
    norm2.weight, norm2.bias = block.norm2.weight, block.norm2.bias
    f = block.ffn
    s = norm1(ref_token_mixing(x) + x)
    v = torch.stack([nn.functional.gelu(s[:, i] @ f.w1[i] + f.b1[i, 0]) @ f.w2[i] + f.b2[i, 0]
                     for i in range(s.shape[1])], dim=1)
    return norm2(v + s)


def ref_tower(tower, e):
    tok = tower.tokenizer
    pad = tok.num_tokens * tok.token_dim - tok.input_dim
    padded = torch.cat([e, e.new_zeros(e.shape[0], pad)], dim=1)
    x = torch.stack([padded[:, i * tok.token_dim:(i + 1) * tok.token_dim] @ tok.weight[i] + tok.bias[i]
                     for i in range(tok.num_tokens)], dim=1)
    for block in tower.blocks:
        x = ref_block(block, x)
    return x.mean(dim=1)


def randomize(module):
    with torch.no_grad():  # non-trivial LayerNorm affine parameters too
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))


def _grads(params):
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b,t,d,k", [(7, 4, 8, 2), (5, 3, 12, 3), (16, 8, 32, 4)])
def test_block_matches_reference(dtype, b, t, d, k):
    torch.manual_seed(b + t + d + k)
    block = RankMixerBlock(t, d, k).to(dtype)
    randomize(block)
    x = torch.randn(b, t, d, dtype=dtype, requires_grad=True)
    w = torch.randn(b, t, d, dtype=dtype)
    _assert_matches_reference(block, ref_block, x, w, "x", TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("e,t,td,d,layers,k,b", [(30, 4, 0, 8, 2, 2, 6), (64, 8, 8, 16, 3, 4, 9),
                                                 (20, 2, 12, 6, 1, 3, 4)])
def test_tower_matches_reference(dtype, e, t, td, d, layers, k, b):
    torch.manual_seed(e + t + d)
    tower = RankMixerTower(SliceTokenizer(e, t, td, d, bias_init="uniform"), layers, d, k).to(dtype)
    randomize(tower)
    inp = torch.randn(b, e, dtype=dtype, requires_grad=True)
    w = torch.randn(b, d, dtype=dtype)
    _assert_matches_reference(tower, ref_tower, inp, w, "e_input", TOL[dtype])


def _assert_matches_reference(module, reference, inp, weight, input_name: str, tol: float) -> None:
    """module(inp) and reference(module, inp), and the gradients of sum(out * weight) with
    respect to inp and every parameter, agree within tol times the larger of 1 and the
    reference's largest magnitude: rounding grows with the values (weight gradients sum
    over the batch reach ~20 here), and the two paths sum in different orders, which also
    change with the ATen kernel level and the thread count (make test-portability)."""
    params = [inp, *module.parameters()]
    out = module(inp)
    (out * weight).sum().backward()
    fast = _grads(params)
    expected = reference(module, inp)
    (expected * weight).sum().backward()
    for name, a, r in zip(["output", input_name, *dict(module.named_parameters())], [out, *fast],
                          [expected, *_grads(params)]):
        assert torch.allclose(a, r, atol=tol * max(1.0, r.abs().max().item()), rtol=0), name


def test_tower_blocks_token_major_path_equals_public_path():
    """The tower's token-major blocks (fused mixing residual, hand-written FFN residual)
    against eq. 1 composed from the public [B, T, D] functions: token_mixing (checked against
    its definition in test_rankmixer.py), the per-token FFN's forward and the LayerNorms."""
    torch.manual_seed(0)
    tower = RankMixerTower(SliceTokenizer(24, 4, 0, 8, bias_init="uniform"), 2, 8, 2).double()
    randomize(tower)
    e = torch.randn(5, 24, dtype=torch.float64)
    x = tower.tokenizer(e)
    for block in tower.blocks:
        s = block.norm1(token_mixing(x, 4) + x)
        x = block.norm2(block.ffn(s) + s)
    assert torch.allclose(tower(e), x.mean(dim=1), atol=1e-12)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_mixing_dropout_drops_the_mixed_values_before_their_residual(norm):
    """model.rankmixer.mixing_dropout against the block by hand: the token mixing's values, not
    the residual, times the mask the block drew (the same draw on ones of the mixed values'
    layout), scaled by 1 / (1 - p); in eval mode the block is the plain one."""
    torch.manual_seed(0)
    block = RankMixerBlock(4, 8, 2, norm=norm, mixing_dropout=0.25).double()
    randomize(block)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    torch.manual_seed(7)
    out = block.train()(x)
    torch.manual_seed(7)
    t, b, d = 4, 3, 8
    # the mixed values' [h, B, t, q] view, in the block's memory layout (dropout draws in memory order):
    # post-norm mixes the batch-major input transposed, pre-norm LN's contiguous output
    base = torch.ones(b, t, d, dtype=torch.float64).transpose(0, 1) if norm == "post" else \
        torch.ones(t, b, d, dtype=torch.float64)
    ones = base.reshape(t, b, t, d // t).permute(2, 1, 0, 3)
    mask = nn.functional.dropout(ones, 0.25, training=True).reshape(t, b, d).transpose(0, 1)  # [B, H, D]
    assert set(mask.unique().tolist()) == {0.0, 1 / 0.75}
    f = block.ffn

    def ffn(s):
        return torch.stack([nn.functional.gelu(s[:, i] @ f.w1[i] + f.b1[i, 0]) @ f.w2[i] + f.b2[i, 0]
                            for i in range(t)], dim=1)
    if norm == "post":
        s = block.norm1(x + ref_token_mixing(x) * mask)
        expected = block.norm2(s + ffn(s))
    else:
        s = x + ref_token_mixing(block.norm1(x)) * mask
        expected = s + ffn(block.norm2(s))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    plain = RankMixerBlock(4, 8, 2, norm=norm).double()
    plain.load_state_dict(block.state_dict())
    assert torch.equal(block.eval()(x), plain.eval()(x))
    assert not torch.allclose(out, plain.train()(x))


def test_mixing_dropout_reaches_every_block_of_the_towers_built_from_the_config():
    from dense.heads import build_tower
    from dense.layout import InputLayout
    from trainer.config_loader import load_config
    from trainer.data.datasets import synth_features

    for tower in ("rankmixer", "rankmixer_moe"):
        cfg = load_config(None, [f"--model.tower={tower}", "--model.rankmixer.mixing_dropout=0.3"])
        model = build_tower(cfg.model, InputLayout(synth_features()))
        assert [blk.mixing_dropout.p for blk in model.blocks] == [0.3] * cfg.model.num_layers
    with pytest.raises(ValueError) as e:
        load_config(None, ["--model.rankmixer.mixing_dropout=1"])
    assert str(e.value) == "model.rankmixer.mixing_dropout=1.0 must be a probability in [0, 1)"
