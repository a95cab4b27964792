"""The per-token MoE (dense/moe.py) paths that tests/test_moe.py leaves open, against a
reference written out here one token and one expert at a time from the documented weight
layout: the unfused training forward (the pre-norm block's FFN slot) with its router
terms, the FFN slot outside training, the routing statistics, and bf16 autocast."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from dense.moe import EVAL, TRAIN, PerTokenMoE, expert_hidden

T, D, E, H, B = 3, 8, 4, 5, 11


def make_moe() -> PerTokenMoE:
    torch.manual_seed(0)
    return PerTokenMoE(T, D, E, H, budget=0.5, l1_init=1e-3, l1_rate=0.1, consistency=0.7)


def ref_gates(moe: PerTokenMoE, s: torch.Tensor, router: str) -> torch.Tensor:
    """ReLU(s_t W_t + b_t) of the router, per token: [T, B, D] -> [T, B, E]."""
    w, b = (moe.router_train, moe.router_train_bias) if router == "train" else (moe.router_infer, moe.router_infer_bias)
    return torch.stack([F.relu(s[t] @ w[t] + b[t, 0]) for t in range(T)])


def ref_expert(moe: PerTokenMoE, t: int, j: int, x: torch.Tensor) -> torch.Tensor:
    """Expert j of token t: w1[t] columns j h .. (j+1) h, w2[t] rows the same, b2[t, j]."""
    cols = slice(j * H, (j + 1) * H)
    return F.gelu(x @ moe.w1[t, :, cols] + moe.b1[t, 0, cols]) @ moe.w2[t, cols] + moe.b2[t, j]


def ref_combine(moe: PerTokenMoE, s: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    return torch.stack([sum(gates[t, :, j:j + 1] * ref_expert(moe, t, j, s[t]) for j in range(E))
                        for t in range(T)])


def test_expert_width_is_an_integer():
    assert expert_hidden(16, 2, 4, 0) == 8 and type(expert_hidden(16, 2, 4, 0)) is int


def test_unfused_training_forward_combines_by_the_training_router_and_sets_the_router_terms():
    moe = make_moe()
    s = torch.randn(T, B, D, requires_grad=True)
    v = moe.forward_tm(s)  # the pre-norm block's FFN slot: forward_tm, not residual_tm
    with torch.no_grad():
        expected = ref_combine(moe, s, ref_gates(moe, s, "train"))
        g_infer = ref_gates(moe, s, "infer")
        v_infer = ref_combine(moe, s, g_infer)
        l1 = g_infer.sum() / B  # every token's and expert's gates, per row
        consistency = ((v_infer - expected) ** 2).sum() / (T * B * D)
    torch.testing.assert_close(v, expected)
    torch.testing.assert_close(moe.pending_loss, moe.l1_coef * l1 + 0.7 * consistency)
    active = moe.take_pending()
    assert active.shape == (T, E)
    torch.testing.assert_close(active, (g_infer > 0).float().mean(dim=1))
    assert moe.take_pending() is None


def test_the_ffn_slot_outside_training_adds_sparse_inference_to_the_input():
    moe = make_moe().eval()
    s = torch.randn(T, B, D)
    expected = s + ref_combine(moe, s, ref_gates(moe, s, "infer"))
    torch.testing.assert_close(moe.residual_tm(s), expected)  # grad enabled, as under a probe
    moe.train()
    with torch.no_grad():  # training mode without grad (a FLOP count): the training combination
        torch.testing.assert_close(moe.residual_tm(s), s + ref_combine(moe, s, ref_gates(moe, s, "train")))


def test_evaluation_and_training_statistics_go_to_their_own_rows():
    moe = make_moe().eval()
    s = torch.randn(T, B, D)
    moe.forward_tm(s)
    moe.forward_tm(2 * s)
    expected = ((ref_gates(moe, s, "infer") > 0).float().mean(dim=1)
                + (ref_gates(moe, 2 * s, "infer") > 0).float().mean(dim=1)) / 2
    assert math.isnan(moe.take_stats(TRAIN)[0, 0])  # no training step yet
    torch.testing.assert_close(moe.take_stats(EVAL), expected)
    active = torch.rand(T, E)
    moe.adapt(active)
    assert math.isnan(moe.take_stats(EVAL)[0, 0])
    torch.testing.assert_close(moe.take_stats(TRAIN), active)


def test_sparse_inference_runs_under_bf16_autocast():
    moe = make_moe().eval()
    s = torch.randn(T, B, D)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe.forward_tm(s)
        gates = ref_gates(moe, s, "infer")
        expected = ref_combine(moe, s, gates)
    assert out.dtype == s.dtype
    torch.testing.assert_close(out, expected.float(), atol=0.05, rtol=0.05)  # bf16 products

