"""Per-token Sparse-MoE (RankMixer eq. 10-11, docs/design.md §3.5): the expert sum against a
per-expert loop, sparse inference against dense inference, its FLOPs, and a training run
whose activation ratio tracks the budget while the inference router stays alive."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from cli import rankmix, rendezvous_port, spawn
from dense.heads import build_tower
from dense.layout import InputLayout
from dense.model_config import ModelConfig
from dense.moe import PerTokenMoE, expert_hidden
from dense.tower_configs.moe_towers import MoEConfig
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
T, D, E, H, B = 3, 8, 4, 5, 11


def make_moe(**kwargs) -> PerTokenMoE:
    torch.manual_seed(0)
    return PerTokenMoE(T, D, E, H, budget=0.5, l1_init=1e-3, l1_rate=0.1, consistency=1.0, **kwargs)


def expert_loop(moe: PerTokenMoE, s: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """sum_j G_tj e_tj(s_t), one token and one expert at a time: [T, B, D] -> [T, B, D]."""
    out = torch.zeros_like(s)
    for t in range(T):
        for j in range(E):
            w1, b1, w2, b2 = moe.expert(t, j)
            out[t] += gates[t, :, j:j + 1] * (F.gelu(s[t] @ w1 + b1) @ w2 + b2)
    return out


def force_gates_on(moe: PerTokenMoE) -> None:
    """Both routers output 1 for every expert."""
    with torch.no_grad():
        for w, b in ((moe.router_train, moe.router_train_bias), (moe.router_infer, moe.router_infer_bias)):
            w.zero_()
            b.fill_(1.0)


def test_all_gates_on_is_the_dense_sum_of_experts_in_training_and_inference():
    moe = make_moe()
    force_gates_on(moe)
    s = torch.randn(T, B, D)
    expected = expert_loop(moe, s, torch.ones(T, B, E))
    torch.testing.assert_close(moe.forward_tm(s), expected)
    moe.eval()
    torch.testing.assert_close(moe.forward_tm(s), expected)


def test_training_step_equals_autograd_through_the_expert_loop_and_the_router_terms():
    """residual_tm's fused step and hand-written backward against autograd of the
    per-expert reference plus the inference router's terms written out: output, pending
    loss, activity, and the gradients of the input and of every parameter."""
    moe = make_moe()
    s = torch.randn(T, B, D, requires_grad=True)
    cotangent = torch.randn(T, B, D)
    out = moe.residual_tm(s)
    pending, active = moe.pending_loss, moe.take_pending()
    ((out * cotangent).sum() + 3 * pending).backward()
    params = [s, *moe.parameters()]
    fast = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    v = expert_loop(moe, s, moe.gates(s, "train"))
    g_infer = moe.gates(s.detach(), "infer")
    with torch.no_grad():  # the inference router's input and the expert outputs are detached
        outputs_detached = moe.experts(s.detach())
    consistency = (moe.combine(g_infer, outputs_detached) - v.detach()).pow(2).mean()
    reference = moe.l1_coef * g_infer.sum(dim=(0, 2)).mean() + moe.consistency * consistency
    torch.testing.assert_close(out, s + v)
    torch.testing.assert_close(pending, reference)
    torch.testing.assert_close(active, (g_infer > 0).float().mean(dim=1))
    ((s + v) * cotangent).sum().add(3 * reference).backward()
    for (name, _), got, want in zip([("s", s), *moe.named_parameters()], fast, (p.grad for p in params)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_sparse_inference_equals_dense_inference_where_gates_are_zero():
    moe = make_moe().eval()
    s = torch.randn(T, B, D)
    gates = moe.gates(s, "infer")
    assert 0.2 < (gates > 0).float().mean() < 0.8  # a real mix of computed and skipped experts
    dense = moe.combine(gates, moe.experts(s))  # every expert computed, zero gates included
    torch.testing.assert_close(moe.forward_tm(s), dense)
    torch.testing.assert_close(moe.forward_tm(s), expert_loop(moe, s, gates))
    # The GPU's eager dispatch (all experts' rows found at once), run here on the CPU.
    torch.testing.assert_close(moe._dispatch_sorted(s, gates), dense)


def test_dense_inference_uses_the_training_router():
    moe = make_moe(sparse_inference=False).eval()
    s = torch.randn(T, B, D)
    torch.testing.assert_close(moe.forward_tm(s), expert_loop(moe, s, moe.gates(s, "train")))


def test_sparse_inference_flops_fall_with_the_active_fraction():
    moe = make_moe().eval()
    s = torch.randn(T, B, D)
    active_pairs = int((moe.gates(s, "infer") > 0).sum())
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        moe.forward_tm(s)
    router = 2 * T * B * D * E
    assert counter.get_total_flops() == router + active_pairs * 4 * D * H
    with torch.no_grad(), FlopCounterMode(display=False) as dense:
        moe.train().forward_tm(s)
    assert counter.get_total_flops() < 0.8 * dense.get_total_flops()


def test_training_forward_sets_the_l1_and_consistency_terms_on_the_inference_router_only():
    moe = make_moe()
    s = torch.randn(T, B, D, requires_grad=True)
    moe.forward_tm(s)
    moe.pending_loss.backward()
    assert moe.router_infer.grad.abs().sum() > 0
    assert moe.router_train.grad is None and moe.w1.grad is None and s.grad is None


def test_lambda_moves_towards_the_budget():
    moe = make_moe()
    moe.budget = 0.1
    start = moe.l1_coef.item()
    moe.forward_tm(torch.randn(T, B, D))
    pending = moe.take_pending()
    active = pending.mean().item()
    moe.adapt(pending)
    expected = start + 0.1 * (active - 0.1) / 0.1 * start
    assert active > 0.1 and moe.l1_coef.item() == pytest.approx(expected)
    assert moe.take_pending() is None  # no training forward since: nothing to adapt
    assert moe.l1_coef.item() == pytest.approx(expected)


def test_lambda_turns_negative_when_the_routers_are_sparser_than_the_budget():
    moe = make_moe()
    moe.budget = 0.9
    for _step in range(1, 80):
        moe.forward_tm(torch.randn(T, B, D))
        moe.adapt(moe.take_pending())
    assert moe.l1_coef.item() < -1e-3  # crossed zero, then grew in magnitude
    moe.forward_tm(torch.randn(T, B, D))
    moe.pending_loss.backward()  # a negative L1 rewards gate mass: the router biases rise
    assert (moe.router_infer_bias.grad < 0).float().mean() > 0.5


def _lambda_worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layout = InputLayout(synth_features())
    tower = build_tower(ModelConfig(tower="rankmixer_moe", num_tokens=4, hidden_dim=16,
                                    moe=MoEConfig(num_experts=4, budget=0.5, l1_init=1e-3, l1_rate=0.1)), layout)
    torch.manual_seed(rank)  # each rank sees other rows, so another active fraction
    tower(torch.randn(B, layout.width) + rank)
    mine = [m._pending.mean().item() for m in tower.moes]
    tower.set_step(1)  # one all_reduce for every layer
    torch.save({"active": mine, "lambda": [m.l1_coef.item() for m in tower.moes]}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_every_rank_adapts_lambda_with_the_activity_averaged_over_ranks(tmp_path):
    spawn(_lambda_worker, (rendezvous_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert ranks[0]["active"] != ranks[1]["active"]
    for layer in range(2):
        mean = (ranks[0]["active"][layer] + ranks[1]["active"][layer]) / 2
        for r in ranks:
            assert r["lambda"][layer] == pytest.approx(1e-3 + 0.1 * (mean - 0.5) / 0.5 * 1e-3, rel=1e-5)


def test_expert_width_splits_the_dense_ffn_or_is_an_error():
    assert expert_hidden(64, 4, 4, 0) == 64
    assert expert_hidden(64, 4, 3, 10) == 10
    with pytest.raises(ValueError, match="model.ffn_ratio x model.hidden_dim = 256 does not split over "
                                         "model.moe.num_experts=3; set model.moe.expert_hidden"):
        expert_hidden(64, 4, 3, 0)


@pytest.mark.trained
def test_activation_ratio_tracks_the_budget_and_the_inference_router_stays_alive(tmp_path):
    proc = rankmix("train", "--config", "configs/debug.toml", "--model.tower=rankmixer_moe",
                   "--model.moe.budget=0.25", "--train.steps=150", "--metrics.log_every=10",
                   f"--train.run_dir={tmp_path}", f"--data.cache_dir={tmp_path}/d", "--metrics.progress=false",
                   "--checkpoint.enabled=false", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # Margins from the spread over seeds 0-2 x ATen kernels (default, avx2, native) x 1 and
    # 2 threads (18 runs): final active ratio 0.266-0.303, per layer 0.236-0.361 (layer 1
    # of seed 0 on the default kernel is still coming down at step 150), in evaluation
    # 0.259-0.312, dead experts 1-5 of 32, every token's least active 0.02 or more, AUC
    # 0.611-0.655. For this seed (0) on every kernel: 0.357 at step 10, lambda x58-67.
    assert train[0]["moe/active_ratio"] > 0.3  # ReLU routers start with about half the gates open
    assert abs(train[-1]["moe/active_ratio"] - 0.25) < 0.08
    assert all(0.2 < train[-1][f"moe/layer{i}/active_ratio"] < 0.4 for i in range(2))
    assert train[-1]["moe/l1_coef"] > 10 * train[0]["moe/l1_coef"]
    final = records[-1]
    assert final["kind"] == "eval"
    assert 0.15 < final["moe/active_ratio"] < 0.4  # sparse inference: the inference router is alive
    assert final["moe/dead_experts"] < 8  # of 2 layers x 4 tokens x 4 experts
    assert all(final[f"moe/layer{i}/token{t}"] > 0 for i in range(2) for t in range(4))  # every token keeps an expert
    assert final["auc"] > 0.55


def test_pipelined_training_adapts_lambda_exactly_like_the_plain_loop(tmp_path):
    """TorchRec's pipeline (the default on GPUs and several ranks) runs the forward through
    its own code: the aux terms and lambda's steps must come out the same."""
    def records(pipeline: str) -> list[tuple]:
        run = tmp_path / pipeline
        proc = rankmix("train", "--config", "configs/debug.toml", "--model.tower=rankmixer_moe",
                       f"--train.pipeline={pipeline}", "--metrics.log_every=10", "--metrics.eval_every=20",
                       f"--train.run_dir={run}", f"--data.cache_dir={tmp_path}/d", "--metrics.progress=false",
                       "--metrics.tensorboard=false", "--checkpoint.enabled=false", timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["kind"], r.get("loss", r.get("auc")), r["moe/l1_coef"], r["moe/active_ratio"]) for r in lines]

    plain = records("none")
    assert len(plain) == 6  # 4 train logs, evaluations at steps 20 and 40
    assert records("sparse_dist") == plain
