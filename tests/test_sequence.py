"""Sequence modules (dense/sequence.py): target attention against a per-row loop, padding and
empty sequences, the transformer's masking, the candidate looked up through the sequence table,
the config's checks, a forward on fake CUDA and a training step on meta that read nothing back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torchrec import JaggedTensor

from dense.layout import InputLayout
from dense.sequence import SequenceInputs, TargetAttention, build_sequences, pad
from dense.sequence_modules import SequenceConfig
from embeddings.features import FeatureSpec, validate_features
from embeddings.tables import sequence_table_configs, table_configs
from test_fake_cuda import CUDA, META, on_fake_cuda

D = 8


def schema(module: str = "target_attention", tokens: int = 1, timestamps: str = "") -> list[FeatureSpec]:
    """An item table shared by the candidate, a tag-like list and the attended history; a user table apart."""
    f = FeatureSpec
    return [f(name="user", num_embeddings=10, embedding_dim=4, group="user"),
            f(name="item", table="catalog", num_embeddings=50, embedding_dim=D, group="item"),
            f(name="also", kind="id_list", table="catalog", num_embeddings=50, embedding_dim=D, pooling="mean",
              max_len=3, group="item"),
            f(name="hist", kind="sequence", table="catalog", num_embeddings=50, embedding_dim=D, max_len=6,
              pooling="mean", sequence_module=module, sequence_tokens=tokens, timestamps=timestamps, group="behaviour")]


def jagged(lengths: list[int], width: int | None = D, seed: int = 0, device="cpu") -> JaggedTensor:
    """Rows of `lengths` random vectors of `width` (None: gap buckets in 1..5) on `device`
    (made there: under FakeTensorMode a CPU tensor cannot move to CUDA)."""
    n = sum(lengths)
    if device == "cpu":
        g = torch.Generator().manual_seed(seed)
        values = torch.randn(n, width, generator=g) if width else torch.randint(1, 6, (n,), generator=g)
    else:
        values = torch.randn(n, width, device=device) if width else torch.randint(1, 6, (n,), device=device)
    offsets = [0]
    for k in lengths:
        offsets.append(offsets[-1] + k)
    return JaggedTensor(values, lengths=torch.tensor(lengths, device=device),
                        offsets=torch.tensor(offsets, device=device))


def lookups(rows: list[int], seed: int = 0, device="cpu") -> dict[str, JaggedTensor]:
    b = len(rows)
    return {"item": jagged([1] * b, seed=seed, device=device),
            "also": jagged([2, 0, 3, 1][:b], seed=seed + 1, device=device),
            "hist": jagged(rows, seed=seed + 2, device=device)}


@pytest.mark.parametrize("tokens,hidden,time", [(2, [16, 8], (32, 4)), (1, [16], None)])
def test_target_attention_matches_a_per_row_loop(tokens, hidden, time):
    """k score columns, with and without a time embedding: each row's weights are a softmax over
    its own behaviours only, each token is their weighted sum, and every gradient (the scorer's
    hand-written backwards, dense/sequence.py) is the per-row loop's through autograd."""
    torch.manual_seed(0)
    module = TargetAttention(D, tokens=tokens, hidden=hidden, time=time)
    rows = [3, 1, 5, 2]
    seqs, cand, gaps = jagged(rows), torch.randn(4, D), jagged(rows, width=None, seed=3)
    values, cand = seqs.values().requires_grad_(), cand.requires_grad_()
    x, mask = pad(values, seqs.offsets(), 6)
    g, _ = pad(gaps.values(), gaps.offsets(), 6)
    got = module(x, mask, cand, g if time else None)
    expected = torch.zeros(4, tokens, D)
    for r, n in enumerate(rows):
        b = values[seqs.offsets()[r]:seqs.offsets()[r + 1]]
        t = module.time(gaps.values()[seqs.offsets()[r]:seqs.offsets()[r + 1]]) if time else b[:, :0]
        scores = torch.stack([module.score(torch.cat([b[m], cand[r], b[m] * cand[r], b[m] - cand[r], t[m]]))
                              for m in range(n)])  # [n, k]
        weights = torch.softmax(scores, dim=0)
        expected = expected.index_put((torch.tensor(r),), (weights.t() @ b))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    direction = torch.randn(4, tokens, D)
    inputs = [values, cand, *module.parameters()]
    grads = torch.autograd.grad((got * direction).sum(), inputs)
    reference = torch.autograd.grad((expected * direction).sum(), inputs)
    for mine, theirs in zip(grads, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_padding_copies_ragged_rows_and_takes_full_rows_as_they_are():
    """Ragged rows: zeros past each end, the mask, and the gradient back to each value once. Rows
    all of the longest length (N = B L): a view of the values, no copy, the mask all True."""
    seqs = jagged([3, 0, 5, 2])
    values = seqs.values().clone().requires_grad_()
    x, mask = pad(values, seqs.offsets(), 6)
    expected = torch.zeros(4, 6, D)
    for r, (start, end) in enumerate(zip(seqs.offsets()[:-1].tolist(), seqs.offsets()[1:].tolist())):
        expected[r, :end - start] = values[start:end]
        assert mask[r].tolist() == [m < end - start for m in range(6)]
    assert torch.equal(x, expected)
    (x * torch.arange(1.0, 7.0).view(1, 6, 1)).sum().backward()
    positions = torch.cat([torch.arange(1.0, n + 1) for n in [3, 0, 5, 2]])
    assert torch.equal(values.grad, positions.unsqueeze(1).expand(-1, D))
    full = jagged([4, 4, 4])
    x, mask = pad(full.values(), full.offsets(), 4)
    assert x.data_ptr() == full.values().data_ptr() and torch.equal(x, full.values().view(3, 4, D))
    assert mask.all() and mask.shape == (3, 4)


@pytest.mark.parametrize("module", ["target_attention", "transformer"])
def test_padding_changes_nothing_and_an_empty_sequence_gives_zeros(module):
    """The same rows padded to their longest (5) and to 6 give the same vectors; row 1 has no
    behaviour: zeros, and finite gradients through the rest."""
    torch.manual_seed(0)
    features = schema(module, tokens=2, timestamps="hist_ts")
    inputs = SequenceInputs(features, SequenceConfig())
    rows = [3, 0, 5, 2]
    gaps = (jagged(rows, width=None, seed=7).values(),)
    tight = inputs({}, lookups(rows), (1, 3, 5), gaps)
    loose = inputs({}, lookups(rows), (1, 3, 6), gaps)
    assert set(tight) == {"item", "also", "hist.0", "hist.1"}
    for key in tight:
        torch.testing.assert_close(tight[key], loose[key], rtol=1e-6, atol=1e-6)
    assert torch.equal(tight["hist.0"][1], torch.zeros(D)) and torch.equal(tight["hist.1"][1], torch.zeros(D))
    sum(v.sum() for v in tight.values()).backward()
    assert all(torch.isfinite(p.grad).all() for p in inputs.parameters() if p.grad is not None)


def test_the_candidate_and_other_features_on_the_sequence_table_pool_as_the_bags_did():
    """The candidate is its row; a mean-pooled list is the mean of its rows (0 for an empty one)."""
    inputs = SequenceInputs(schema(), SequenceConfig())
    looked = lookups([2, 2, 2, 2])
    out = inputs({}, looked, (1, 3, 2))
    assert torch.equal(out["item"], looked["item"].values())
    also = looked["also"]
    for r, n in enumerate([2, 0, 3, 1]):
        rows = also.values()[also.offsets()[r]:also.offsets()[r + 1]]
        torch.testing.assert_close(out["also"][r], rows.mean(0) if n else torch.zeros(D))


def test_an_attended_table_is_unpooled_and_every_feature_on_it_comes_with_it():
    features = schema()
    assert [t.name for t in table_configs(features)] == ["user"]
    [table] = sequence_table_configs(features)
    assert table.name == "catalog" and table.feature_names == ["item", "also", "hist"]
    pooled = schema("pool")
    assert sequence_table_configs(pooled) == [] and [t.name for t in table_configs(pooled)] == ["user", "catalog"]


def test_each_token_of_a_sequence_is_a_group_of_its_own():
    layout = InputLayout(schema(tokens=2))
    assert layout.groups == ["user", "item", "behaviour.0", "behaviour.1"]
    assert [s.name for s in layout.slots] == ["user", "item", "also", "hist.0", "hist.1"]
    assert InputLayout(schema(tokens=1)).groups == ["user", "item", "behaviour"]


@pytest.mark.parametrize("change,message", [
    ({"max_len": 0}, "features.hist.sequence_module='target_attention' needs max_len > 0 (the behaviours kept, "
                     "most recent last), got 0"),
    ({"candidate": "user"}, "features.hist.candidate='user' has embedding_dim 4, the sequence 8: they must match"),
    ({"candidate": "also"}, "features.hist.candidate='also' is not an id feature"),
    ({"hashing": "managed"}, "features.hist: shares table 'catalog' with features.item, so both must be managed with "
                             "the same eviction_policy and eviction_interval, or neither"),
])
def test_config_errors_name_the_option(change, message):
    features = schema()
    features[3] = dataclasses.replace(features[3], **change)
    with pytest.raises(ValueError) as e:
        validate_features(features)
    assert str(e.value) == message


def test_a_managed_table_holds_an_attended_sequence_in_a_collection_of_its_own():
    """Managed, the item table leaves the plain EmbeddingCollection for the managed one
    (embeddings/managed.py `build_managed_sequences`), with every feature on it."""
    features = schema()
    for f in features[1:]:
        f.hashing = "managed"
    validate_features(features)
    assert sequence_table_configs(features, managed=False) == []
    [table] = sequence_table_configs(features, managed=True)
    assert table.name == "catalog" and table.feature_names == ["item", "also", "hist"]
    assert [t.name for t in table_configs(features)] == ["user"]


def test_an_unknown_module_name_lists_the_choices(tmp_path):
    from trainer.config import Config
    from trainer.config_loader import validate

    cfg = Config()
    cfg.features = schema("din")
    with pytest.raises(ValueError) as e:
        validate(cfg)
    assert str(e.value) == ("features.hist.sequence_module='din' is not one of "
                            "['pool', 'target_attention', 'transformer']")


@pytest.mark.parametrize("module", ["pool", "target_attention", "transformer"])
def test_a_forward_on_fake_cuda_stays_on_the_device_and_reads_nothing_back(module):
    """Each sequence module's forward with every input and parameter a fake CUDA tensor, where a
    CPU tensor made inside (a device-less arange) raises, and so does a read back (`.item()`).
    The forward avoids what this CPU build cannot run there (slicing, `~`: test_fake_cuda's
    docstring). `pool` has no dense module: TorchRec's bag pools it (FBGEMM's kernels, checked on
    a GPU by bench/gpu_check.sh); a list pooled on an attended table runs here with the others."""
    features = schema(module, tokens=2, timestamps="" if module == "pool" else "ts")
    if module == "pool":
        assert build_sequences(features, SequenceConfig()) is None
        return
    inputs = SequenceInputs(features, SequenceConfig())
    with FakeTensorMode():
        on_fake_cuda(inputs)
        out = inputs({}, lookups([3, 0, 5, 2], device="cuda"), (1, 3, 5), (torch.randint(0, 32, (10,), device="cuda"),))
        assert {k: (v.shape, v.device) for k, v in out.items()} == {
            k: ((4, D), CUDA) for k in ["item", "also", "hist.0", "hist.1"]}
        with pytest.raises(DataDependentOutputException):
            out["hist.0"].sum().item()


@pytest.mark.parametrize("module,time_bias,search_k", [
    ("target_attention", False, 0), ("transformer", False, 0), ("transformer", True, 0),
    ("target_attention", False, 3), ("target_attention", True, 3)])
def test_a_training_step_on_meta_reads_nothing_back(module, time_bias, search_k):
    """Padding, attention and backward on the meta device, which raises on every read back, copy to
    the host, value-sized output and CPU tensor in a device op (tests/test_fake_cuda.py): the
    backward, which fake CUDA cannot run on this CPU build (test_fake_cuda's docstring). With the
    time biases (the transformer's `~` is beyond fake CUDA) and the soft search too."""
    cfg = SequenceConfig()
    cfg.transformer.time_bias = cfg.target_attention.time_bias = time_bias
    features = [dataclasses.replace(f, search_k=search_k) if f.name == "hist" else f
                for f in schema(module, timestamps="ts")]
    inputs = SequenceInputs(features, cfg).to(META)
    looked = {k: JaggedTensor(v.values().to(META).requires_grad_(v.values().is_floating_point()),
                              lengths=v.lengths().to(META), offsets=v.offsets().to(META))
              for k, v in lookups([3, 0, 5, 2]).items()}
    gaps = (torch.zeros(10, dtype=torch.int64, device=META),)
    out = inputs({}, looked, (1, 3, 5), gaps)
    sum(v.sum() for v in out.values()).backward()
    params = list(inputs.parameters())
    assert params and all(p.grad is not None and p.grad.device == META for p in params)
    assert looked["hist"].values().grad.device == META


def test_under_bf16_autocast_the_softmax_runs_in_fp32():
    """bf16 scores, fp32 weights: 1,000 behaviours' weights sum to 1 within 1e-5 (bf16 sums miss by ~1e-2), and the
    module's output stays near its fp32 self."""
    from dense.sequence import masked_softmax

    torch.manual_seed(0)
    scores = (torch.randn(2, 1000, 1) * 3).bfloat16()
    mask = torch.ones(2, 1000, 1, dtype=torch.bool)
    weights = masked_softmax(scores, mask, dim=1)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(2, 1), rtol=0, atol=1e-5)  # bf16: ~1e-2
    module = TargetAttention(D, tokens=1, hidden=[16])
    seqs, cand = jagged([300, 1000]), torch.randn(2, D)
    x, m = pad(seqs.values(), seqs.offsets(), 1000)
    expected = module(x, m, cand)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module(x, m, cand)
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("module", ["target_attention", "transformer"])
def test_under_bf16_autocast_each_module_with_time_trains_near_its_fp32_self(module):
    """The scorer's in-place batched matmul takes no part in autocast: its operands follow the
    first Linear's dtype (bf16 here), with the transformer's bf16 behaviours too; the time bias,
    fp32, lifts the bf16 scores to fp32 and takes a finite gradient."""
    torch.manual_seed(0)
    cfg = SequenceConfig()
    cfg.target_attention.time_bias = True
    inputs = SequenceInputs(schema(module, tokens=2, timestamps="ts"), cfg)
    bias = [p for n, p in inputs.named_parameters() if n.endswith("time_bias.weight")]
    assert len(bias) == 1
    torch.nn.init.normal_(bias[0])  # it starts at zero: here it counts
    rows = [3, 0, 5, 2]
    gaps = (jagged(rows, width=None, seed=7).values(),)
    expected = inputs({}, lookups(rows), (1, 3, 5), gaps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = inputs({}, lookups(rows), (1, 3, 5), gaps)
    sum(v.float().sum() for v in got.values()).backward()
    for key in expected:
        torch.testing.assert_close(got[key].float(), expected[key], rtol=0.05, atol=0.05)
    assert all(torch.isfinite(p.grad).all() for p in inputs.parameters() if p.grad is not None)
    assert bias[0].grad is not None and bias[0].grad.abs().sum() > 0


def test_rankmix_plan_plans_the_sequence_table_beside_the_bags():
    """`rankmix plan`: the attended sequence's table in the EmbeddingCollection's plan (row-wise,
    where the bags may not be), and its rows' all-to-all counted."""
    from pathlib import Path

    from launch.plan import plan_cluster
    from trainer.config_loader import load_config

    config = Path(__file__).resolve().parents[1] / "configs" / "sequence.toml"
    cfg = load_config(str(config), ["--features.hist_items.sequence_module=target_attention",
                                    "--embeddings.plan=row_wise"])
    plan = plan_cluster(cfg, 2, "cuda", 80.0, 64.0, 2)
    assert plan.fits and set(plan.plan.plan) == {"ebc", "sequence_tables"}
    assert set(plan.plan.plan["sequence_tables"]) == {"item"}
    assert plan.plan.plan["sequence_tables"]["item"].sharding_type == "row_wise"
    assert "attended sequences' rows at most" in plan.text
