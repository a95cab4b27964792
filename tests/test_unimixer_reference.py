"""UniMixer's parts against references worked out apart (issue 56, mutation testing of
dense/unimixer.py): the mixing's initial logits and their offsets, eq. 16's residual, the Newton
step's bound, the health figures against numpy, the frozen serving form against the tower, the
logged values, the analytic costs and widths at their edges."""

import math

import numpy as np
import pytest
import torch

from dense.heads import build_tower
from dense.layout import InputLayout
from dense.model_config import ModelConfig
from dense.tower_configs.unimixer_towers import UniMixerConfig
from dense.unimixer import (
    FrozenMixing,
    UniMixerTower,
    UniMixing,
    UniMixingLite,
    _newton_step,
    full_mixing,
    matched_ffn_hidden,
    mixing_health,
    rankmixer_permutation,
    scaling_stages,
    temperature,
    unimixer_cost,
)
from embeddings.hooks import TrainingHooks
from test_unimixer import constrain
from trainer.data.datasets import synth_features


def tower(kind: str = "unimixer", layers: int = 2, **unimixer) -> UniMixerTower:
    cfg = ModelConfig(tower=kind, num_tokens=4, hidden_dim=8, num_layers=layers,
                      unimixer=UniMixerConfig(tau_anneal_steps=10, **unimixer))
    return build_tower(cfg, InputLayout(synth_features()))


# ---------------------------------------------------------------- the mixing's parameters


@pytest.mark.parametrize("cls", [UniMixing, UniMixingLite])
def test_permutation_init_offsets_the_logits_by_log_n_minus_1(cls):
    """T 4, D 8, blocks of 2 (head 2): n = 16 blocks; W_G's offset ln(15) on RankMixer's
    permutation, each W_B's ln(1) = 0 on the identity (blocks of 2); learned logits at 0.1."""
    torch.manual_seed(0)
    extra = (3, 2) if cls is UniMixingLite else ()
    mixing = cls(32, 2, 8, *extra, init="permutation", lr_mult=7.0)
    assert mixing.lr_mult == 7.0 and mixing.learned_std == 0.1
    assert mixing.prior_global.shape == (16, 16)
    torch.testing.assert_close(mixing.prior_global, math.log(15) * rankmixer_permutation(4, 8, 2), rtol=0, atol=0)
    assert torch.equal(mixing.prior_local, torch.zeros(2, 2))  # ln(2 - 1)
    wide = cls(64, 4, 16, *extra, init="permutation")  # T 4, D 16, blocks of 4: n = 16, W_B's offset ln(3)
    torch.testing.assert_close(wide.prior_local, math.log(3) * torch.eye(4), rtol=0, atol=0)
    torch.testing.assert_close(wide.prior_global, math.log(15) * rankmixer_permutation(4, 16, 4), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [UniMixing, UniMixingLite])
def test_one_block_has_no_offset(cls):
    """One token of D 2 in one block of 2: ln(max(n - 1, 1)) = ln(max(block - 1, 1)) = 0."""
    extra = (3, 2) if cls is UniMixingLite else ()
    mixing = cls(2, 2, 2, *extra, init="permutation")
    assert torch.equal(mixing.prior_global, torch.zeros(1, 1)) and torch.equal(mixing.prior_local, torch.zeros(2, 2))


@pytest.mark.parametrize("cls", [UniMixing, UniMixingLite])
def test_random_init_is_unit_variance_without_offsets(cls):
    torch.manual_seed(0)
    extra = (3, 2) if cls is UniMixingLite else ()
    mixing = cls(32, 4, 8, *extra)  # the defaults: random, lr_mult 1
    assert mixing.lr_mult == 1.0 and mixing.learned_std == 1.0
    assert torch.equal(mixing.prior_global, torch.zeros(8, 8)) and torch.equal(mixing.prior_local, torch.zeros(4, 4))


def test_unimixings_learned_logits_have_the_inits_spread():
    torch.manual_seed(0)
    for init, std in (("random", 1.0), ("permutation", 0.1)):
        mixing = UniMixing(256, 4, 32, init)  # T 8, D 32, blocks of 4: n = 64
        for p in (mixing.w_global, mixing.w_local):
            assert p.std().item() == pytest.approx(std, rel=0.1)
        w_global, w_local = mixing.logits()
        assert torch.equal(w_global, mixing.w_global + mixing.prior_global)
        assert torch.equal(w_local, mixing.w_local + mixing.prior_local)


def test_lites_factors_have_the_inits_spread():
    """Omega at 1/sqrt(b), the bases at the init's spread, A_G and B_G at std^0.5 r^-0.25 each,
    so that A_G B_G's entries have the init's variance."""
    torch.manual_seed(0)
    for init, std in (("random", 1.0), ("permutation", 0.1)):
        mixing = UniMixingLite(256, 4, 32, num_basis=16, rank=8, init=init)
        assert mixing.omega.std().item() == pytest.approx(0.25, rel=0.1)
        assert mixing.basis.std().item() == pytest.approx(std, rel=0.1)
        scale = std ** 0.5 * 8 ** -0.25
        for p in (mixing.a_global, mixing.b_global):
            assert p.std().item() == pytest.approx(scale, rel=0.1)
        assert (mixing.a_global @ mixing.b_global).std().item() == pytest.approx(std, rel=0.15)
        w_global, w_local = mixing.logits()
        assert torch.equal(w_global, mixing.a_global @ mixing.b_global + mixing.prior_global)
        by_hand = torch.stack([sum(mixing.omega[i, k] * mixing.basis[k] for k in range(16)) for i in range(64)])
        torch.testing.assert_close(w_local, by_hand + mixing.prior_local)


def test_a_block_size_that_divides_nothing_is_refused():
    with pytest.raises(ValueError) as e:
        UniMixing(32, 5, 8)
    assert str(e.value) == "model.unimixer.block_size=5 must divide the flattened token length T*D = 32"
    with pytest.raises(ValueError) as e:
        UniMixing(32, 4, 8, "permutation")  # T 4: the head is 2, and blocks of 4 cut across heads
    assert str(e.value) == ("model.unimixer.init='permutation' needs model.unimixer.block_size=4 to divide "
                            "RankMixer's head width D/T = 8/4")
    with pytest.raises(ValueError, match="D/T = 6/4"):
        UniMixing(24, 1, 6, "permutation")  # T 4 does not divide D 6


# ---------------------------------------------------------------- the mixing's forward


def test_block_mixing_is_the_rmsnorm_of_the_residual_and_keeps_the_inputs_dtype():
    """Eq. 16 by hand: RMSNorm(x + W x) with W the explicit L x L matrix of eq. 11."""
    torch.manual_seed(0)
    mixing = UniMixing(32, 4, 8)
    with torch.no_grad():
        mixing.norm.weight.copy_(torch.rand(8) + 0.5)
    w_global, w_local = constrain(torch.randn(8, 8), 0.7), constrain(torch.randn(8, 4, 4), 0.7)
    x = torch.randn(4, 3, 8)  # token-major [T, B, D]
    flat = x.transpose(0, 1).reshape(3, 32)
    mixed = (flat @ full_mixing(w_global, w_local).T).view(3, 4, 8).transpose(0, 1)
    z = x + mixed
    expected = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps) * mixing.norm.weight
    torch.testing.assert_close(mixing(x, w_global, w_local), expected, atol=1e-5, rtol=1e-5)
    half = mixing.mix(x.bfloat16(), w_global, w_local)  # float32 weights, cast to the tokens' dtype
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), mixed, atol=0.1, rtol=0.05)


def test_full_mixing_is_eq_11s_block_matrix():
    torch.manual_seed(0)
    w_global, w_local = torch.randn(3, 3), torch.randn(3, 2, 2)
    full = full_mixing(w_global, w_local)
    assert full.shape == (6, 6)
    for i in range(3):
        for j in range(3):
            assert torch.equal(full[2 * i:2 * i + 2, 2 * j:2 * j + 2], w_global[i, j] * w_local[j])


# ---------------------------------------------------------------- the scaling


def test_far_from_the_solution_a_newton_step_moves_each_potential_by_one_at_most():
    """Potentials of -5 make rows sum to 2 e^-10 (a step of about +10) and of +5 to 2 e^10 (about
    -5): each step is cut to +1 and -1."""
    x = torch.zeros(1, 2, 2)
    assert torch.equal(_newton_step(x, torch.full((1, 2, 1), -5.0)), torch.full((1, 2, 1), -4.0))
    assert torch.equal(_newton_step(x, torch.full((1, 2, 1), 5.0)), torch.full((1, 2, 1), 4.0))
    near = _newton_step(x, torch.full((1, 2, 1), -0.4))  # the solution: -ln(2) / 2 = -0.347
    torch.testing.assert_close(near, torch.full((1, 2, 1), -math.log(2) / 2), atol=2e-3, rtol=0)


def test_scaling_stages_at_and_above_tau_1_is_one():
    assert scaling_stages(1.0, 3) == 1 and scaling_stages(2.0, 3) == 1
    assert scaling_stages(0.9, 1) == 1  # ceil(0.15): one stage, not fewer
    assert scaling_stages(0.5, 3) == 3 and scaling_stages(0.05, 3) == 13


def test_temperature_of_a_one_step_anneal():
    assert temperature(0, 1.0, 0.05, 1) == 1.0 and temperature(1, 1.0, 0.05, 1) == pytest.approx(0.05)


# ---------------------------------------------------------------- health


def reference_health(w_global: torch.Tensor, w_local: torch.Tensor, full: bool = True) -> dict[str, float]:
    """mixing_health's figures in numpy float64, the full matrix built block by block."""
    g, loc = w_global.double().numpy(), w_local.double().numpy()
    values = {}
    for name, w in (("global", g), ("local", loc)):
        n = w.shape[-1]
        entropy = (-(w * np.log(np.maximum(w, 1e-30))).sum(-1)).mean() / math.log(n) if n > 1 else 0.0
        values |= {f"{name}_row_max": w.max(-1).mean(), f"{name}_entropy": entropy}
    sv = np.linalg.svd(g, compute_uv=False)
    values |= {"global_sv2": sv[1] if len(sv) > 1 else 0.0, "global_sv3": sv[2] if len(sv) > 2 else 0.0}
    if full:
        n, blk = loc.shape[0], loc.shape[-1]
        big = np.zeros((n * blk, n * blk))
        for i in range(n):
            for j in range(n):
                big[i * blk:(i + 1) * blk, j * blk:(j + 1) * blk] = g[i, j] * loc[j]
        s = np.sort(np.linalg.svd(big, compute_uv=False))
        values |= {"sv_median": s[(len(s) - 1) // 2], "sv_above_half": (s > 0.5).mean()}  # torch's lower median
    return values


@pytest.mark.parametrize("n,blk", [(1, 4), (2, 3), (3, 1), (6, 4)])
def test_health_figures_equal_numpys(n, blk):
    torch.manual_seed(n)
    w_global, w_local = constrain(torch.randn(n, n), 0.5), constrain(torch.randn(n, blk, blk), 0.5)
    got = mixing_health(w_global, w_local)
    expected = reference_health(w_global, w_local)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-5), key


def test_health_of_a_permutation_and_of_an_average():
    perm, eye = rankmixer_permutation(4, 8, 2), torch.eye(2).expand(16, 2, 2)
    assert mixing_health(perm, eye) == pytest.approx({
        "global_row_max": 1.0, "global_entropy": 0.0, "local_row_max": 1.0, "local_entropy": 0.0,
        "global_sv2": 1.0, "global_sv3": 1.0, "sv_median": 1.0, "sv_above_half": 1.0}, abs=1e-6)
    average = mixing_health(torch.full((4, 4), 0.25), torch.full((4, 2, 2), 0.5))
    assert average == pytest.approx({
        "global_row_max": 0.25, "global_entropy": 1.0, "local_row_max": 0.5, "local_entropy": 1.0,
        "global_sv2": 0.0, "global_sv3": 0.0, "sv_median": 0.0, "sv_above_half": 0.125}, abs=1e-6)
    # singular values of 1 and exactly 0.5: only those above half count
    halves = mixing_health(torch.diag(torch.tensor([1.0, 0.5])), torch.eye(2).expand(2, 2, 2))
    assert (halves["sv_median"], halves["sv_above_half"]) == (0.5, 0.5)


def test_the_full_matrix_is_measured_up_to_its_limit_only():
    torch.manual_seed(0)
    w_global, w_local = constrain(torch.randn(4, 4), 0.5), constrain(torch.randn(4, 3, 3), 0.5)
    assert "sv_median" in mixing_health(w_global, w_local, full_limit=12)
    assert mixing_health(w_global, w_local, full_limit=11).keys() == {
        "global_row_max", "global_entropy", "local_row_max", "local_entropy", "global_sv2", "global_sv3"}
    # by default up to L = 2048: 3 blocks of 683 are over it
    big = torch.eye(683).expand(3, 683, 683)
    assert "sv_median" not in mixing_health(torch.eye(3), big)


# ---------------------------------------------------------------- the tower


@pytest.mark.parametrize("kind,removed", [("unimixer", {"w_global", "w_local"}),
                                          ("unimixer_lite", {"basis", "omega", "a_global", "b_global"})])
def test_the_serving_form_freezes_the_weights_at_the_towers_temperature(kind, removed):
    torch.manual_seed(0)
    model = tower(kind).eval()
    model.set_step(5)
    e_input = torch.randn(6, InputLayout(synth_features()).width)
    with torch.no_grad():
        expected, weights = model(e_input), model.mixing_weights()
        hot = model.mix(e_input, [(constrain(g, 1.0), constrain(b, 1.0)) for g, b in
                                  (layer.block.mixing.logits() for layer in model.layers)])
    assert (hot - expected).abs().max() > 1e-3  # tau 0.525 shows
    frozen = model.serving_form()
    assert isinstance(frozen, FrozenMixing) and frozen.tower is model
    for i, (w_global, w_local) in enumerate(weights):
        assert torch.equal(getattr(frozen, f"global_{i}"), w_global)
        assert torch.equal(getattr(frozen, f"local_{i}"), w_local)
    with torch.no_grad():
        torch.testing.assert_close(frozen(e_input), expected, atol=1e-6, rtol=0)
    names = {name.rpartition(".")[2] for name in frozen.state_dict()}
    assert not names & (removed | {"prior_global", "prior_local"})
    assert {"global_0", "local_0", "global_1", "local_1"} <= names


def test_the_tower_logs_its_temperature_and_each_layers_health_at_training_logs():
    torch.manual_seed(0)
    model = tower()
    hooks = TrainingHooks.of(model)
    assert hooks.metrics == [model.log_values] and hooks.after_restore == [model.set_step]
    assert hooks.after_optimizer_step == [model.set_step]
    hooks.after_optimizer_step[0](5)
    assert [m("eval") for m in hooks.metrics] == [{}]
    [logged] = [m("train") for m in hooks.metrics]
    assert logged["unimixer/tau"] == pytest.approx(0.525)
    with torch.no_grad():
        health = [mixing_health(*w) for w in model.mixing_weights()]
    assert logged == {"unimixer/tau": logged["unimixer/tau"],
                      **{f"unimixer/layer{i}/{k}": v for i, h in enumerate(health) for k, v in h.items()}}


def test_a_tower_that_starts_cold_scales_in_stages_from_the_start():
    model = tower(tau_start=0.5, tau_end=0.05)
    assert model.tau.item() == 0.5 and model.stages == scaling_stages(0.5, 3) == 3


def test_a_one_layer_towers_cost_is_its_layers():
    model = tower(layers=1)
    params, _ = model.cost()
    assert sum(p.numel() for p in model.parameters()) == params


# ---------------------------------------------------------------- analytic sizes


def test_unimixer_cost_without_the_swiglu_and_in_whole_numbers():
    """T 4, D 8, blocks of 4 (n 8), 2 layers, no SwiGLU: mixing 8^2 + 8 * 4^2 = 192, norms 3 * 8 a
    layer, the output norm 8; FLOPs 2 L blk + 2 L n = 2 * 32 * 4 + 2 * 32 * 8 a layer."""
    params, flops = unimixer_cost(4, 8, 4, 0, 2)
    assert (params, flops) == (2 * (192 + 24) + 8, 2 * (256 + 512))
    assert type(params) is int and type(flops) is int
    params, flops = unimixer_cost(4, 8, 4, 5, 1)  # with a SwiGLU of 5: 4 * (3 * 8 * 5 + 2 * 5 + 8) = 552
    assert (params, flops) == (192 + 552 + 24 + 8, 256 + 512 + 6 * 4 * 8 * 5)


def test_the_narrowest_matched_width_is_one():
    """6 T D h + 2 L (blk + n) <= 4 k T D^2: T 4, D 8, blocks of 4 (n 8), k 1: h = (16 - 12) // 3 = 1;
    T 2, D 4, blocks of 2 (n 4), k 1: (8 - 6) // 3 = 0, refused."""
    assert matched_ffn_hidden(4, 8, 4, 1) == 1
    with pytest.raises(ValueError) as e:
        matched_ffn_hidden(2, 4, 2, 1)
    assert str(e.value) == ("model.unimixer.ffn_hidden=0 matches RankMixer's FLOPs at model.ffn_ratio=1, but the "
                            "mixing alone costs more (4 blocks of 2); set model.unimixer.ffn_hidden")
