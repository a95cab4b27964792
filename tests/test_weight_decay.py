"""Weight decay per part of the dense model (trainer/optimizer.py): optim.weight_decay for the
tower and heads, optim.tokenizer_weight_decay and optim.sequence_weight_decay set apart; each
parameter decays by its own part's, checked against RMSProp steps of each parameter alone,
and on a real trainer's parameter groups."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from cli import rendezvous_port, spawn
from trainer.config import OptimConfig
from trainer.config_loader import load_config
from trainer.optimizer import param_groups, weight_decay_of

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("name", "expected"), [
    ("tower.tokenizer.weight", 0.3), ("_dmp_wrapped_module.module.tower.tokenizer.bias", 0.3),
    ("sequences.attention.hist_items.rest.1.bias", 0.2), ("module.sequences.x", 0.2),
    ("tower.blocks.0.ffn.w1", 0.1), ("heads.heads.0.weight", 0.1),
    ("tower.tokenizer_norm.weight", 0.1), ("tower.mytower.tokenizer.weight", 0.1), ("my_sequences.w", 0.1),
])
def test_each_dense_parameter_decays_by_its_parts_weight_decay(name, expected):
    o = OptimConfig(weight_decay=0.1, tokenizer_weight_decay=0.3, sequence_weight_decay=0.2)
    assert weight_decay_of(name, o) == expected
    # -1 leaves a part at optim.weight_decay; 0 sets it apart without decay
    assert weight_decay_of(name, OptimConfig(weight_decay=0.1)) == 0.1
    assert weight_decay_of(name, OptimConfig(weight_decay=0.1, tokenizer_weight_decay=0.0,
                                             sequence_weight_decay=0.0)) == (0.1 if expected == 0.1 else 0.0)


def test_a_step_decays_each_parameter_as_rmsprop_of_it_alone_would():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    params = list(model.parameters())
    decays = [0.0, 0.5, 0.25, 0.5]  # the optimizer's own (0.0) for the first
    groups = param_groups(model, params, 0.01, {id(p): d for p, d in zip(params, decays) if d})
    assert [(g["lr"], g.get("weight_decay"), len(g["params"])) for g in groups] == [
        (0.01, None, 1), (0.01, 0.5, 2), (0.01, 0.25, 1)]
    optimizer = torch.optim.RMSprop(groups, lr=0.01, weight_decay=0.0, foreach=True)
    alone = [(p.detach().clone().requires_grad_(), d) for p, d in zip(params, decays)]
    references = [torch.optim.RMSprop([q], lr=0.01, weight_decay=d, foreach=True) for q, d in alone]
    for step in range(3):
        for i, (p, (q, _)) in enumerate(zip(params, alone)):
            p.grad = torch.full_like(p, 0.1 * (step + i + 1))
            q.grad = p.grad.clone()
        optimizer.step()
        for reference in references:
            reference.step()
    for p, (q, _) in zip(params, alone):
        assert torch.equal(p, q)
    # without decays apart, the groups (and a checkpoint's) are as before: one at lr
    assert [(g["lr"], len(g["params"])) for g in param_groups(model, params, 0.01)] == [(0.01, 4)]


def test_the_sequence_modules_schedule_is_their_own_group_only_where_set():
    from trainer.optimizer import warmups

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    params = list(model.parameters())
    groups = param_groups(model, params, 0.01, {id(params[3]): 0.5}, {id(params[2]), id(params[3])}, 4.0)
    assert [(g["lr"], g.get("weight_decay"), g.get("part"), len(g["params"])) for g in groups] == [
        (0.01, None, None, 2), (0.04, None, "sequence", 1), (0.04, 0.5, "sequence", 1)]
    o = OptimConfig(warmup_steps=2, dense_warmup_steps=10, sequence_warmup_steps=4)

    class Combined:  # the sparse group first, as CombinedOptimizer lists them
        param_groups = [{"params": []}, *groups]
    factors = [[f(step) for f in warmups(Combined, 1, o)] for step in (0, 3, 9)]
    assert factors == [[0.5, 0.05, 0.125, 0.125], [1.0, 0.4, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    default = [[f(step) for f in warmups(Combined, 1, OptimConfig(dense_warmup_steps=10))] for step in (0, 4)]
    assert default == [[1.0, 0.1, 0.1, 0.1], [1.0, 0.5, 0.5, 0.5]]  # -1: the dense warm-up's


@pytest.mark.parametrize(("overrides", "message"), [
    (["--optim.sequence_warmup_steps=-2"], "optim.sequence_warmup_steps=-2 must be >= 0 (or -1: "
                                           "optim.dense_warmup_steps)"),
    (["--optim.tokenizer_weight_decay=-0.5"], "optim.tokenizer_weight_decay=-0.5 must be >= 0 (or -1: "
                                              "optim.weight_decay)"),
    (["--optim.sequence_weight_decay=nan"], "optim.sequence_weight_decay=nan must be >= 0 (or -1: "
                                            "optim.weight_decay)"),
    (["--optim.weight_decay=-1"], "optim.weight_decay=-1 must be >= 0"),
])
def test_a_negative_weight_decay_is_refused_naming_the_option(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    assert str(e.value) == message
    assert load_config(None, ["--optim.tokenizer_weight_decay=0", "--optim.sequence_weight_decay=-1"])


def _groups_worker(rank: int, port: int, out: str, args: list[str]) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer.assembly import build_trainer
    from trainer.dist import shutdown

    trainer = build_trainer(load_config(str(REPO / "configs" / "sequence.toml"), args))
    try:
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        dense = trainer.optimizer.optimizers[1][1]  # ("dense", its KeyedOptimizerWrapper)
        groups = [{"lr": g["lr"], "weight_decay": g["weight_decay"], "part": g.get("part", ""),
                   "names": sorted(names[id(p)] for p in g["params"])} for g in dense.param_groups]
        Path(out).write_text(json.dumps(groups))
    finally:
        trainer.close()
        shutdown()


def test_a_trainers_tokenizer_and_sequence_module_get_their_own_groups(tmp_path):
    """... and the sequence modules their own learning rate and warm-up: at step 0, 5 x optim.lr
    without warm-up where the others' are 1/300 of theirs (optim.dense_warmup_steps)."""
    args = ["--data.synth_rows=2000", f"--data.cache_dir={tmp_path / 'cache'}", f"--train.run_dir={tmp_path / 'run'}",
            "--features.hist_items.sequence_module=target_attention", "--metrics.tensorboard=false",
            "--metrics.progress=false", "--optim.weight_decay=0.001", "--optim.tokenizer_weight_decay=0.01",
            "--optim.sequence_weight_decay=0", "--optim.lr=0.003", "--optim.sequence_lr_mult=5",
            "--optim.sequence_warmup_steps=0"]
    spawn(_groups_worker, (rendezvous_port(), str(tmp_path / "groups.json"), args), nprocs=1)
    groups = json.loads((tmp_path / "groups.json").read_text())
    by_decay = {g["weight_decay"]: g["names"] for g in groups}
    assert len(groups) == 3 and sorted(by_decay) == [0.0, 0.001, 0.01]
    assert by_decay[0.01] == ["tower.tokenizer.bias", "tower.tokenizer.weight"]
    assert by_decay[0.0] and all(n.startswith("sequences.") for n in by_decay[0.0])
    assert by_decay[0.001] and not any(n.startswith(("sequences.", "tower.tokenizer.")) for n in by_decay[0.001])
    assert any(n.startswith("heads.") for n in by_decay[0.001]) and any(".blocks." in n for n in by_decay[0.001])
    lr = {g["weight_decay"]: g["lr"] for g in groups}
    assert [g["part"] for g in groups if g["weight_decay"] == 0.0] == ["sequence"]
    assert lr[0.0] == pytest.approx(0.015) and lr[0.001] == lr[0.01] == pytest.approx(0.003 / 300)
