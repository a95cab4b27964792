"""embeddings.weight_decay (embeddings/decay.py): an L2 penalty on the pooled lookups, in their
gradient only; through the real fused Adagrad it equals the penalty added to the loss, the rows
a batch does not look up are untouched, and the pipelined loop trains as the plain one."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType

from cli import rankmix
from embeddings.decay import decay_lookups
from embeddings.sharding import local_shards, shard_model
from embeddings.sparse_config import EmbeddingsConfig
from embeddings.tables import fuse_optimizer
from trainer.config_loader import load_config

ROWS, COEF = 6, 0.5
TABLES = {"t": 4, "u": 8}


def test_the_gradient_is_the_penalty_s_and_the_values_are_unchanged():
    values = torch.randn(5, 7, requires_grad=True)
    upstream = torch.randn(5, 7)
    pooled = KeyedTensor(keys=["a", "b"], length_per_key=[3, 4], values=values)
    decayed = decay_lookups(pooled, COEF)
    assert decayed.keys() == ["a", "b"] and decayed.length_per_key() == [3, 4]
    assert torch.equal(decayed.values(), values.detach())
    (decayed.values() * upstream).sum().backward()
    reference = values.detach().clone().requires_grad_()
    ((reference * upstream).sum() + COEF / 2 * (reference * reference).sum() / 5).backward()
    torch.testing.assert_close(values.grad, reference.grad, rtol=0, atol=1e-6)
    assert decay_lookups(pooled, 0.0) is pooled


def _sharded(optimizer: str) -> nn.Module:
    """Two sharded tables under the fused `optimizer`, their rows set to known values."""
    cfg = EmbeddingsConfig(optimizer=optimizer, lr=0.1)
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=name, num_embeddings=ROWS, embedding_dim=dim, feature_names=[name], pooling=PoolingType.SUM)
        for name, dim in TABLES.items()], device=torch.device("meta"))
    fuse_optimizer(model.ebc, cfg)
    sharded = shard_model(model, cfg, torch.device("cpu"))
    for name, dim in TABLES.items():
        (shard, _), = local_shards(sharded.state_dict()[f"ebc.embedding_bags.{name}.weight"])
        with torch.no_grad():
            shard.copy_(torch.linspace(-1, 1, ROWS * dim).reshape(ROWS, dim))
    return sharded


def _rows(sharded: nn.Module) -> dict[str, torch.Tensor]:
    return {name: local_shards(sharded.state_dict()[f"ebc.embedding_bags.{name}.weight"])[0][0].clone()
            for name in TABLES}


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_through_the_fused_optimizer_it_is_the_penalty_added_to_the_loss(world_of_one, optimizer):
    # bag 0 looks t's row 1 up twice and u's row 2; bag 1 t's row 4 and u's row 2
    batch = KeyedJaggedTensor.from_lengths_sync(keys=["t", "u"], values=torch.tensor([1, 1, 4, 2, 2]),
                                                lengths=torch.tensor([2, 1, 1, 1]))
    upstream = torch.linspace(-2, 3, 2 * sum(TABLES.values())).reshape(2, -1)
    decayed, reference, plain = _sharded(optimizer), _sharded(optimizer), _sharded(optimizer)
    start = _rows(decayed)
    for _ in range(2):  # Adagrad's first step is the gradient's sign (per row's mean): the second tells
        (decay_lookups(decayed.module.ebc(batch), COEF).values() * upstream).sum().backward()
        values = reference.module.ebc(batch).values()
        ((values * upstream).sum() + COEF / 2 * (values * values).sum() / 2).backward()
        (plain.module.ebc(batch).values() * upstream).sum().backward()
    after, expected = _rows(decayed), _rows(reference)
    for name in TABLES:
        torch.testing.assert_close(after[name], expected[name], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(after[name], _rows(plain)[name])  # the decay moved the rows it saw
    unseen = {"t": [0, 2, 3, 5], "u": [0, 1, 3, 4, 5]}
    for name, rows in unseen.items():
        assert torch.equal(after[name][rows], start[name][rows])


def test_the_pipelined_loop_decays_as_the_plain_one(tmp_path):
    def losses(*args: str) -> list[float]:
        run = tmp_path / "-".join(args)
        done = rankmix("train", "--config", "configs/debug.toml", f"--train.run_dir={run}", "--train.steps=20",
                       f"--data.cache_dir={tmp_path / 'cache'}", "--data.synth_rows=6000",
                       "--metrics.tensorboard=false", "--metrics.progress=false", "--checkpoint.enabled=false",
                       *args)
        assert done.returncode == 0, done.stderr[-2000:]
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"train"' in line]

    plain = losses("--train.pipeline=none", "--embeddings.weight_decay=0.5")
    assert losses("--train.pipeline=sparse_dist", "--embeddings.weight_decay=0.5") == plain
    assert losses("--train.pipeline=none") != plain


def test_a_negative_decay_is_refused_naming_the_option():
    with pytest.raises(ValueError) as e:
        load_config(None, ["--embeddings.weight_decay=-0.1"])
    assert str(e.value) == "embeddings.weight_decay=-0.1 must be >= 0"
