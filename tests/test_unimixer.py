"""UniMixer (docs/design.md §3.6): appendix A's TokenMixer equivalence, eq. 14 against eq. 11, the
Sinkhorn constraint, the temperature schedule, analytic costs and CLI training."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import cli
from dense.heads import build_tower
from dense.layout import InputLayout
from dense.model_config import ModelConfig
from dense.rankmixer import token_mixing
from dense.tower_configs.unimixer_towers import UniMixerConfig
from dense.unimixer import (
    PerTokenSwiGLU,
    UniMixing,
    UniMixingLite,
    constrain_all,
    rankmixer_permutation,
    scaling_stages,
    temperature,
)
from embeddings.hooks import TrainingHooks
from test_checkpoint import losses
from test_train import assert_loss_falls
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]


def constrain(weight: torch.Tensor, tau: float, steps: int = 3) -> torch.Tensor:
    """Eq. 15 for one matrix (or a batch of one size) as the default tower's constraint:
    [..., n, n] -> [..., n, n] float32."""
    return constrain_all([weight], tau, scaling_stages(tau, UniMixerConfig.sinkhorn_stages), steps)[0]


def block_permutation(num_tokens: int, heads: int) -> torch.Tensor:
    """G [T H, T H]: block (t, h) of the input goes to block (h, t) of the output."""
    n = num_tokens * heads
    g = torch.zeros(n, n)
    for t in range(num_tokens):
        for h in range(heads):
            g[h * num_tokens + t, t * heads + h] = 1
    return g


def token_mixing_matrix(num_tokens: int, dim: int, heads: int) -> torch.Tensor:
    """The L x L matrix with flatten(TokenMixer(X)) = W_perm flatten(X): column j is the image of e_j."""
    length = num_tokens * dim
    basis = torch.eye(length).view(length, num_tokens, dim)
    return token_mixing(basis, heads).reshape(length, length).T


def test_appendix_a_example_and_kronecker_factorisation():
    x = torch.arange(1.0, 13.0).view(1, 2, 6)  # x1..x12
    assert token_mixing(x, 2)[0].tolist() == [[1, 2, 3, 7, 8, 9], [4, 5, 6, 10, 11, 12]]
    paper_g = torch.tensor([[1.0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]])
    assert torch.equal(block_permutation(2, 2), paper_g)
    w_perm = torch.kron(paper_g, torch.eye(3))
    assert torch.equal(w_perm, token_mixing_matrix(2, 6, 2))
    assert (w_perm @ x.flatten()).tolist() == [1, 2, 3, 7, 8, 9, 4, 5, 6, 10, 11, 12]  # eq. 22-23


@pytest.mark.parametrize("num_tokens,dim", [(2, 6), (4, 8), (3, 12)])
def test_unimixing_at_the_permutation_is_token_mixing(num_tokens, dim):
    q = dim // num_tokens
    length = num_tokens * dim
    mixing = UniMixing(length, q, dim)
    x = torch.randn(5, num_tokens, dim)
    local = torch.eye(q).expand(length // q, q, q)
    out = mixing.mix(x.transpose(0, 1), block_permutation(num_tokens, num_tokens), local).transpose(0, 1)
    assert torch.equal(out, token_mixing(x, num_tokens))
    assert torch.equal(torch.kron(block_permutation(num_tokens, num_tokens), torch.eye(q)),
                       token_mixing_matrix(num_tokens, dim, num_tokens))
    # the permutation init's W_G, at blocks of D/T and of a divisor of it (sub-blocks move together)
    assert torch.equal(rankmixer_permutation(num_tokens, dim, q), block_permutation(num_tokens, num_tokens))
    for block in (b for b in range(1, q) if q % b == 0):
        assert torch.equal(torch.kron(rankmixer_permutation(num_tokens, dim, block), torch.eye(block)),
                           token_mixing_matrix(num_tokens, dim, num_tokens))


def test_fast_path_equals_the_explicit_kronecker_product():
    torch.manual_seed(0)
    num_tokens, dim, block = 3, 10, 5  # no H = T restriction: 6 blocks of 5
    length, n = num_tokens * dim, num_tokens * dim // block
    mixing = UniMixing(length, block, dim)
    w_global, w_local = torch.randn(n, n, dtype=torch.float64), torch.randn(n, block, block, dtype=torch.float64)
    # eq. 11 / 26: block (i, j) of the L x L matrix is W_G[i, j] W_B^j
    big = torch.cat([torch.cat([w_global[i, j] * w_local[j] for j in range(n)], dim=1) for i in range(n)])
    x = torch.randn(4, num_tokens, dim, dtype=torch.float64)
    expected = (x.reshape(4, length) @ big.T).view(4, num_tokens, dim)
    torch.testing.assert_close(mixing.mix(x.transpose(0, 1), w_global, w_local).transpose(0, 1), expected)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_sinkhorn_is_symmetric_doubly_stochastic_float32_under_autocast(tau):
    torch.manual_seed(0)
    weight = torch.randn(6, 16, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = constrain(weight, tau)
    assert p.dtype == torch.float32
    ones = torch.ones(6, 16)
    torch.testing.assert_close(p.sum(-1), ones, atol=1e-4, rtol=0)
    torch.testing.assert_close(p.sum(-2), ones, atol=1e-4, rtol=0)
    assert torch.equal(p, p.mT)


def reference_constraint(weight: torch.Tensor, tau: float, iters: int) -> torch.Tensor:
    """Eq. 15 as written, one matrix at a time, by Sinkhorn-Knopp in probabilities and float64."""
    w = weight.double()
    p = torch.exp((w + w.mT) / (2 * tau))
    for _ in range(iters):
        p = p / p.sum(-1, keepdim=True)
        p = p / p.sum(-2, keepdim=True)
    return (p + p.mT) / 2


def test_batched_constraint_of_mixed_sizes_equals_each_matrix_alone_and_sinkhorn_knopp():
    """At tau = 0.5, where Sinkhorn-Knopp converges in 300 iterations, the Newton scaling
    gives its matrices and (to its accuracy) its gradients; the batch gives each matrix's own."""
    torch.manual_seed(0)
    weights = [torch.randn(8, 8), torch.randn(8, 16, 16), torch.randn(8, 8), torch.randn(8, 16, 16)]
    out = constrain_all(weights, 0.5, scaling_stages(0.5, 3), 3)
    for w, p in zip(weights, out):
        assert p.shape == w.shape
        torch.testing.assert_close(p.double(), reference_constraint(w, 0.5, 300), atol=2e-6, rtol=1e-5)
    leaves = [w.clone().requires_grad_() for w in weights]
    cotangents = [torch.randn_like(w) for w in weights]
    sum((p * c).sum() for p, c in zip(constrain_all(leaves, 0.5, scaling_stages(0.5, 3), 3), cotangents)).backward()
    for leaf, w, c in zip(leaves, weights, cotangents):
        alone = leaf.detach().clone().requires_grad_()
        (constrain(alone, 0.5) * c).sum().backward()
        torch.testing.assert_close(leaf.grad, alone.grad, atol=1e-5, rtol=1e-4)
        knopp = w.double().requires_grad_()
        (reference_constraint(knopp, 0.5, 300) * c).sum().backward()
        torch.testing.assert_close(leaf.grad.double(), knopp.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("n,batch", [(8, 64), (16, 16), (64, 4)])
@pytest.mark.parametrize("init", ["random", "permutation"])
def test_sinkhorn_converges_at_tau_005(n, batch, init):
    """Issue 42: at tau = 0.05, 50 Sinkhorn-Knopp iterations left rows 3.5% off 1 (and 200,
    1%). The scaling's rows and columns are within 1e-3 of 1, for unit-variance logits and
    for logits at a permutation plus small noise (the permutation init's), and the result is
    a finite, near-sparse matrix with finite gradients."""
    torch.manual_seed(0)
    if init == "random":
        logits = torch.randn(batch, n, n)
    else:
        perm = torch.stack([torch.eye(n)[torch.randperm(n)] for _ in range(batch)])
        logits = math.log(n - 1) * (perm + perm.mT) / 2 + 0.1 * torch.randn(batch, n, n)
    leaf = logits.requires_grad_()
    p = constrain(leaf, 0.05)
    ones = torch.ones(batch, n)
    torch.testing.assert_close(p.sum(-1), ones, atol=1e-3, rtol=0)
    torch.testing.assert_close(p.sum(-2), ones, atol=1e-3, rtol=0)
    assert p.amax(-1).mean() > 0.5  # sharp: a fifth of tau = 1's temperature
    (p * torch.randn_like(p)).sum().backward()
    assert torch.isfinite(leaf.grad).all()
    one_stage = constrain_all([logits.detach()], 0.05, 1, 3)[0]  # no epsilon scaling: far off
    assert (one_stage.sum(-1) - 1).abs().amax() > 1e-2


@pytest.mark.parametrize("tower", ["unimixer", "unimixer_lite"])
@pytest.mark.parametrize("block", [0, 4, 8, 16])  # blk = D/T (the default), < D, = D (block-major is token-major), > D
def test_tower_constrains_every_layer_as_each_layer_alone_would(tower, block):
    """The tower's one batched constraint gives the forward of layer-by-layer constraints."""
    cfg = ModelConfig(tower=tower, num_tokens=4, hidden_dim=8, num_layers=3,
                      unimixer=UniMixerConfig(block_size=block, init="permutation" if block == 0 else "random"))
    model = build_tower(cfg, InputLayout(synth_features()))
    e_input = torch.randn(5, InputLayout(synth_features()).width)
    x = model.tokenizer.forward_tm(e_input)
    y = x
    for layer in model.layers:
        x, y = layer(x, y, layer.block.mixing.weights(model.tau, model.stages, model.newton_steps))
    torch.testing.assert_close(model(e_input), (x + model.norm_out(y)).mean(dim=0), atol=1e-6, rtol=1e-5)


def test_swiglu_backward_equals_autograd():
    """The fused forward, the inference path and the hand-written backward against eq. 19
    written out token by token: (x W_up + b_up) * SiLU(x W_gate + b_gate) W_down + b_down,
    SiLU(g) = g sigmoid(g), through autograd."""
    torch.manual_seed(0)
    ffn = PerTokenSwiGLU(num_tokens=3, dim=8, hidden=16)
    x = torch.randn(3, 5, 8, requires_grad=True)  # token-major [T, B, D]
    cotangent = torch.randn(3, 5, 8)
    params = [x, *ffn.parameters()]
    (ffn(x) * cotangent).sum().backward()
    fast = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    hidden = ffn.w_down.shape[1]  # W_in holds W_up's columns, then W_gate's
    tokens = []
    for i in range(3):
        up = x[i] @ ffn.w_in[i, :, :hidden] + ffn.b_in[i, 0, :hidden]
        gate = x[i] @ ffn.w_in[i, :, hidden:] + ffn.b_in[i, 0, hidden:]
        tokens.append((up * gate * torch.sigmoid(gate)) @ ffn.w_down[i] + ffn.b_down[i, 0])
    reference = torch.stack(tokens)
    (reference * cotangent).sum().backward()
    torch.testing.assert_close(ffn(x), reference)
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), reference)  # the inference path
    for got, p in zip(fast, params):
        torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=1e-5)


def test_mixing_weights_stay_float32_inside_a_bf16_tower():
    for mixing in (UniMixing(32, 4, 8), UniMixingLite(32, 4, 8, num_basis=3, rank=2)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            w_global, w_local = mixing.weights(torch.tensor(0.05), 13, 3)
            out = mixing(torch.randn(4, 2, 8), w_global, w_local)  # token-major [T, B, D]
        assert w_global.dtype == w_local.dtype == torch.float32
        assert w_global.shape == (8, 8) and w_local.shape == (8, 4, 4)
        assert out.shape == (4, 2, 8) and torch.isfinite(out).all()


def test_temperature_schedule_is_linear_between_its_end_points():
    assert temperature(0, 1.0, 0.05, 100) == 1.0
    assert temperature(100, 1.0, 0.05, 100) == pytest.approx(0.05)
    assert temperature(10_000, 1.0, 0.05, 100) == pytest.approx(0.05)
    assert temperature(50, 1.0, 0.05, 100) == pytest.approx(0.525)
    assert temperature(25, 1.0, 0.05, 100) - temperature(26, 1.0, 0.05, 100) == pytest.approx(0.0095)
    assert temperature(500, 0.05, 0.05, 0) == 0.05  # J = 0 holds tau_start


@pytest.mark.parametrize("tower", ["unimixer", "unimixer_lite"])
@pytest.mark.parametrize("tokenizer,block", [("slice", 0), ("slice", 8), ("group", 4)])
def test_parameter_and_flop_counts_match_the_formulas(tower, tokenizer, block):
    cfg = ModelConfig(tower=tower, tokenizer=tokenizer, num_tokens=4, hidden_dim=16, num_layers=2, ffn_ratio=2,
                      unimixer=UniMixerConfig(block_size=block, num_basis=3, global_rank=2,
                                              init="random" if block == 8 else "permutation"))
    layout = InputLayout(synth_features())
    model = build_tower(cfg, layout)
    params, flops = model.cost()
    assert sum(p.numel() for p in model.parameters()) == params

    def counted(batch: int) -> int:
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(batch, layout.width))
        return counter.get_total_flops()

    assert counted(7) - counted(3) == 4 * flops  # per sample: building the weights is batch-independent


@pytest.mark.parametrize("tower", ["unimixer", "unimixer_lite"])
@pytest.mark.parametrize("layers,ffn_ratio", [(2, 4), (4, 2)])
def test_default_width_spends_rankmixers_flops(tower, layers, ffn_ratio):
    """Issue 42: at equal FLOPs by default. The per-token SwiGLU's default width is the widest
    at which UniMixer's forward FLOPs per sample stay within RankMixer's, less than one
    hidden unit (6 T D FLOPs) per layer below, at the default model (T 8, D 64, blocks of D/T)."""
    layout = InputLayout(synth_features())
    rankmixer = build_tower(ModelConfig(num_layers=layers, ffn_ratio=ffn_ratio), layout).cost()[1]
    model = build_tower(ModelConfig(tower=tower, num_layers=layers, ffn_ratio=ffn_ratio), layout)
    assert model.layers[0].block.mixing.block == 8 and model.layers[0].block.ffn.w_down.shape[1] > 32
    assert 0 <= rankmixer - model.cost()[1] < layers * 6 * 8 * 64


def test_mixing_parameters_get_their_own_learning_rate():
    from trainer.optimizer import param_groups

    cfg = ModelConfig(tower="unimixer_lite", num_tokens=4, hidden_dim=8, unimixer=UniMixerConfig(mixing_lr_mult=7.0))
    model = build_tower(cfg, InputLayout(synth_features()))
    groups = param_groups(model, list(model.parameters()), 0.002)
    mixing = {id(p) for layer in model.layers for p in layer.block.mixing.parameters(recurse=False)}  # not its norm
    assert [g["lr"] for g in groups] == [0.002, pytest.approx(0.014)]
    assert {id(p) for p in groups[1]["params"]} == mixing and len(mixing) == 2 * 4
    plain = build_tower(ModelConfig(num_tokens=4, hidden_dim=8), InputLayout(synth_features()))
    assert [g["lr"] for g in param_groups(plain, list(plain.parameters()), 0.002)] == [0.002]


def test_unimixer_moe_routes_and_counts_as_rankmixers_moe():
    """The sparse per-token MoE tower: its FFNs are RankMixer's `PerTokenMoE`s after the
    UniMixing; a training forward leaves the inference router's terms for the loss and the
    lambda adaptation, and sparse inference's FLOPs are counted as the counter counts them:
    the mixing, each layer's inference router, the active (token, expert) pairs' experts."""
    from dense.moe import PerTokenMoE

    cfg = ModelConfig(tower="unimixer_moe", num_tokens=4, hidden_dim=16, ffn_ratio=2)
    layout = InputLayout(synth_features())
    model = build_tower(cfg, layout)
    assert all(isinstance(moe, PerTokenMoE) for moe in model.moes) and len(model.moes) == 2
    hooks = TrainingHooks.of(model)
    assert len(hooks.extra_losses) == 1 and len(hooks.after_optimizer_step) == 2  # lambda and temperature
    e_input = torch.randn(32, layout.width)
    model.train()(e_input).sum().backward()
    assert float(model.aux_loss()) > 0 and model.aux_loss() == 0  # taken once
    before = [float(m.l1_coef) for m in model.moes]
    for after_step in hooks.after_optimizer_step:
        after_step(1)
    assert [float(m.l1_coef) for m in model.moes] != before
    model.eval()
    with torch.no_grad():
        weights = model.mixing_weights()
        x = model.tokenizer.forward_tm(e_input)
        y = x  # as UniMixerTower.mix: the second stream starts as the tokens
        actives = []
        for layer, w in zip(model.layers, weights):  # the gates each layer's MoE sees
            s = layer.block.mixing(x + layer.norm_y(y), *w)
            actives.append(int((layer.block.ffn.gates(s, "infer") > 0).sum()))
            o = layer.block.ffn(s)
            x, y = layer.norm_x(x + o), y + o
        with FlopCounterMode(display=False) as counter:
            model(e_input)
    t, d, e, h = 4, 16, cfg.moe.num_experts, 2 * 16 // cfg.moe.num_experts
    mixing = model.dense_flops() - model.tokenizer.cost()[1]
    expected = 32 * (model.tokenizer.cost()[1] + mixing) + sum(2 * 32 * t * d * e + a * 4 * d * h for a in actives)
    assert counter.get_total_flops() == expected
    active = sum(actives) / (len(actives) * 32 * t * e)
    assert model.inference_flops(active) == pytest.approx(expected / 32)


def test_set_step_moves_the_temperature():
    cfg = ModelConfig(tower="unimixer", num_tokens=4, hidden_dim=8, unimixer=UniMixerConfig(tau_anneal_steps=10))
    model = build_tower(cfg, InputLayout(synth_features()))
    assert model.tau.item() == 1.0
    model.set_step(5)
    assert model.tau.item() == pytest.approx(0.525) and model.stages == 3 == scaling_stages(0.525, 3)
    model.set_step(10)
    assert model.stages == 13  # 3 per halving from 1 to 0.05
    assert "tau" not in model.state_dict()


@pytest.mark.parametrize("tower", ["unimixer", "unimixer_lite", "unimixer_moe"])
def test_a_tower_at_the_configs_defaults_anneals_as_eq_21(tower):
    """The study kept eq. 21's anneal as the default schedule (docs/results.md, third run):
    a run that names only its tower cools from tau_start to tau_end (linearly: the schedule's
    own test), starting at RankMixer's permutation with the mixing at its own learning rate."""
    cfg = load_config(None, [f"--model.tower={tower}"])
    u = cfg.model.unimixer
    assert u.schedule == "anneal" and u.init == "permutation" and u.mixing_lr_mult > 1
    assert u.tau_end < u.tau_start
    model = build_tower(cfg.model, InputLayout(synth_features()))
    assert model.tau.item() == u.tau_start
    model.set_step(u.tau_anneal_steps)
    assert model.tau.item() == pytest.approx(u.tau_end)


# ---------------------------------------------------------------- through the CLI


def rankmix(*args: str) -> tuple[dict, str]:
    proc = cli.rankmix("train", "--config", "configs/debug.toml", "--metrics.progress=false",
                       "--metrics.tensorboard=false", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.trained
@pytest.mark.parametrize("tower", ["unimixer", "unimixer_lite"])
def test_towers_train_through_the_cli(tmp_path, cache_dir, tower):
    summary, _ = rankmix(f"--model.tower={tower}", "--model.unimixer.tau_anneal_steps=8",
                         "--train.steps=8", f"--train.run_dir={tmp_path}", f"--data.cache_dir={cache_dir}",
                         "--metrics.log_every=1")
    assert summary["steps"] == 8 and 0 < summary["auc"] < 1
    assert_loss_falls(tmp_path)


@pytest.mark.trained
def test_two_stage_recipe_trains_hot_then_cold_from_the_hot_weights(tmp_path, cache_dir):
    """The two-stage recipe of section 4.5 as one option: train at tau 1.0 (run_dir/hot,
    checkpointed), then from its weights at tau 0.05 (run_dir)."""
    run = tmp_path / "run"
    summary, out = rankmix("--model.tower=unimixer", "--train.steps=6", f"--data.cache_dir={cache_dir}",
                           "--metrics.log_every=1", "--model.unimixer.schedule=two_stage", f"--train.run_dir={run}",
                           "--checkpoint.enabled=false")
    hot = run / "hot"
    assert summary["steps"] == 6 and 0 < summary["auc"] < 1 and 0 < summary["hot/auc"] < 1
    assert f"initialised weights from {hot / 'checkpoints' / 'step-6'}" in out, out
    assert (hot / "summary.json").exists() and not (run / "checkpoints").exists()
    assert [line for line in (run / "config.toml").read_text().splitlines() if line.startswith("tau_")] == [
        "tau_start = 0.05", "tau_end = 0.05", "tau_anneal_steps = 0"]
    tau = [row["unimixer/tau"] for row in map(json.loads, (hot / "metrics.jsonl").read_text().splitlines())
           if "unimixer/tau" in row]
    assert tau and set(tau) == {1.0}
    # Both stages start on the same first batch, the hot one from initial weights and the cold
    # one from the hot one's. Over seeds 0-2 their first losses were 0.83-1.26 and 0.65-0.73,
    # 0.18 apart at least (a cold run from initial weights logs 0.85-1.23).
    assert losses(run)[1] < losses(hot)[1] - 0.1, (losses(run), losses(hot))
    assert_loss_falls(hot)


def test_the_cold_stage_starts_from_the_hot_stages_best_validation_where_there_is_one(tmp_path):
    from trainer.config_loader import load_config
    from trainer.unimixer_two_stage import cold_stage, hot_stage, two_stages

    cfg = load_config(None, ["--model.tower=unimixer_lite", "--model.unimixer.schedule=two_stage",
                             f"--train.run_dir={tmp_path}", "--checkpoint.enabled=false"])
    assert two_stages(cfg) and not two_stages(load_config(None, []))
    hot = hot_stage(cfg)
    assert (hot.train.run_dir, hot.checkpoint.enabled, hot.model.unimixer.tau_anneal_steps) == (
        str(tmp_path / "hot"), True, 0)
    assert cold_stage(cfg).checkpoint.load_path == str(tmp_path / "hot")
    (tmp_path / "hot" / "best").mkdir(parents=True)
    (tmp_path / "hot" / "best" / ".metadata").touch()
    cold = cold_stage(cfg)
    assert (cold.checkpoint.load_path, cold.checkpoint.load_mode) == (str(tmp_path / "hot" / "best"), "weights")
    assert (cold.model.unimixer.tau_start, cold.model.unimixer.tau_anneal_steps, cold.train.run_dir) == (
        0.05, 0, str(tmp_path))


@pytest.mark.trained
def test_default_mixing_mixes_at_init_and_after_a_short_run_and_moves(tmp_path, cache_dir):
    """Issue 42 found the default mixing a near rank-1 average (the full L x L matrix's median
    singular value 0.008 at init, 0.015 trained) whose logits barely moved. At the defaults
    (RankMixer's permutation at init, the mixing at 10x the learning rate, the anneal on),
    the median singular value is 0.1 or more at init (0.2: W_G and the W_B each hold half of
    every row there) and after 40 steps, and the learned
    logits have moved by more than their initial spread (the dense warm-up off: it would hold
    these 40 steps below 14% of the rate)."""
    from dense.unimixer import UniMixerTower, mixing_health
    from trainer.assembly import build_trainer
    from trainer.config_loader import load_config

    args = ["--model.tower=unimixer_lite", "--train.steps=40", "--model.unimixer.tau_anneal_steps=40",
            "--optim.dense_warmup_steps=0",
            "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.enabled=false",
            f"--train.run_dir={tmp_path}", f"--data.cache_dir={cache_dir}"]
    trainer = build_trainer(load_config(str(REPO / "configs" / "debug.toml"), args))
    tower = next(m for m in trainer.model.modules() if isinstance(m, UniMixerTower))
    with torch.no_grad():
        start = [[p.detach().clone() for p in layer.block.mixing.parameters(recurse=False)] for layer in tower.layers]
        health = [mixing_health(*w) for w in tower.mixing_weights()]
    try:
        trainer.fit()
    finally:
        trainer.close()
    with torch.no_grad():
        trained = [mixing_health(*w) for w in tower.mixing_weights()]
    for before, after in zip(health, trained):
        assert before["sv_median"] > 0.1 and after["sv_median"] > 0.1, (health, trained)
        assert before["global_sv2"] > 0.3 and after["global_sv2"] > 0.3
    moved = [(p - p0).abs().amax() / p0.std() for layer, s in zip(tower.layers, start)
             for p, p0 in zip(layer.block.mixing.parameters(recurse=False), s)]
    assert min(moved) > 1, moved
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("unimixer/layer0/sv_median" in row for row in logged)
