"""Sequence modules against references written out by hand (dense/sequence.py): the transformer
per row from its own layers, recency 0 at the newest behaviour; each timed sequence reading its
own gaps; k tokens that differ; what order each module reads; the features on the sequence's
table pooled beside it, and a candidate from the bags."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchrec import JaggedTensor

from dense.sequence import SequenceInputs, SequenceTransformer, TargetAttention, build_sequences, pad
from dense.sequence_modules import SequenceConfig
from embeddings.features import FeatureSpec, validate_features
from test_sequence import D, jagged, lookups, schema

TIME = (32, 4)  # buckets, width of target attention's time embedding


def target_reference(target: TargetAttention, b: torch.Tensor, v: torch.Tensor, gaps: torch.Tensor | None,
                     tokens: int) -> torch.Tensor:
    """One row: behaviours b [n, D], candidate v [D], gap buckets [n] -> [k, D]; the scorer's one
    hidden layer applied by hand, its time embedding looked up by hand."""
    if b.shape[0] == 0:
        return b.new_zeros(tokens, b.shape[1])
    t = target.time.weight[gaps] if gaps is not None else b[:, :0]
    x = torch.cat([b, v.expand_as(b), b * v, b - v, t], dim=1)
    first, last = target.first, target.rest[-1]
    scores = torch.relu(x @ first.weight.t() + first.bias) @ last.weight.t() + last.bias  # [n, k]
    if target.time_bias is not None:  # one scalar per gap bucket and weighting
        scores = scores + target.time_bias.weight[gaps]
    weights = torch.softmax(scores, dim=0) if target.softmax else 1 / (1 + torch.exp(-scores))
    values = b + target.time_value.weight[gaps] if target.time_value is not None else b
    return weights.t() @ values


def transformer_reference(module: SequenceTransformer, b: torch.Tensor, v: torch.Tensor, gaps: torch.Tensor | None,
                          width: int, layers: int, tokens: int, in_sequence: bool = True) -> torch.Tensor:
    """One row, composed from the module's layers: input projection (none at width = D), the
    recency position n - 1 - m (0: the last, newest), the time gap; the candidate, projected,
    with its own embedding, first (`in_sequence`; else the blocks read the behaviours alone); per
    block pre-norm attention over the candidate and the row's own behaviours and a GELU FFN, each
    added to its input; back to D; target attention of the behaviours' outputs."""
    n = b.shape[0]
    if n == 0:
        return b.new_zeros(tokens, b.shape[1])
    project = (lambda a: a @ module.inp.weight.t() + module.inp.bias) if width != D else (lambda a: a)
    h = project(b) + module.position.weight[torch.arange(n - 1, -1, -1)]
    if gaps is not None:
        h = h + module.time.weight[gaps]
    if in_sequence:
        h = torch.cat([(project(v) + module.candidate).unsqueeze(0), h])
        n += 1
    for i in range(layers):
        block = module.blocks[i]
        heads = block.heads
        q, k, val = block.qkv(block.norm1(h)).chunk(3, dim=1)  # [n, W] each, heads side by side
        q, k, val = (a.reshape(n, heads, -1).transpose(0, 1) for a in (q, k, val))  # [heads, n, W / heads]
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # [heads, n, n]
        if block.time_bias is not None:  # the candidate's bucket is a gap of 0's: 1
            buckets = (torch.cat([torch.ones(1, dtype=torch.long), gaps]) if in_sequence else gaps).tolist()
            scores = scores + torch.stack([torch.stack([
                block.time_bias[:, bi - bj + TIME[0] - 1] for bj in buckets]) for bi in buckets]).permute(2, 0, 1)
        attention = torch.softmax(scores, dim=-1) @ val
        h = h + block.proj(attention.transpose(0, 1).reshape(n, -1))
        first, second = block.ffn[0], block.ffn[-1]
        h = h + second(nn.functional.gelu(first(block.norm2(h))))
    h = h[1:] if in_sequence else h
    h = h @ module.out.weight.t() + module.out.bias if width != D else h
    return target_reference(module.target, h, v, gaps, tokens)


@pytest.mark.parametrize("width,layers,time,weights,time_value,time_bias,in_sequence", [
    (D, 1, None, "softmax", False, False, True), (12, 2, TIME, "softmax", False, False, True),
    (12, 1, TIME, "sigmoid", True, False, True), (12, 2, TIME, "softmax", True, True, True),
    (12, 2, TIME, "softmax", True, True, False), (D, 1, None, "softmax", False, False, False)])
def test_the_transformer_matches_a_per_row_reference_composed_from_its_layers(width, layers, time, weights,
                                                                              time_value, time_bias, in_sequence):
    """Rows of 3, 1, 6 (= max_len), 0 and 2 behaviours padded to 6: each row's tokens are its
    reference's, with gradients, and the same again without gradients (evaluation's plain ops);
    the candidate inside the blocks (BST) or only their query, the empty row's tokens zeros."""
    torch.manual_seed(0)
    tokens, rows = 2, [3, 1, 6, 0, 2]
    kwargs = {"target_time_bias_lr_mult": 30.0} if time_bias else {}  # else the default: none
    module = SequenceTransformer(D, tokens, max_len=6, layers=layers, heads=2, width=width, ffn_ratio=2,
                                 hidden=[16], time=time, init_std=0.5, weights=weights, time_value=time_value,
                                 time_bias=time_bias, in_sequence=in_sequence, **kwargs)
    assert (module.target.time_bias is None) == (not time_bias)
    if time_value:  # it starts at zero, the values as without it: here they differ
        nn.init.normal_(module.target.time_value.weight)
    for bias in [*(b.time_bias for b in module.blocks), module.target.time_bias.weight] if time_bias else ():
        nn.init.normal_(bias)  # as do the biases, the blocks' and the target attention's
    seqs, gaps = jagged(rows), jagged(rows, width=None, seed=3)
    values = seqs.values().clone().requires_grad_()
    gap_values = torch.randint(0, TIME[0], gaps.values().shape, generator=torch.Generator().manual_seed(4))
    cand = torch.randn(len(rows), D, requires_grad=True)
    x, mask = pad(values, seqs.offsets(), 6)
    g = pad(gap_values, seqs.offsets(), 6)[0] if time else None
    got = module(x, mask, cand, g)
    offsets = seqs.offsets().tolist()
    expected = torch.stack([
        transformer_reference(module, values[offsets[r]:offsets[r + 1]], cand[r],
                              gap_values[offsets[r]:offsets[r + 1]] if time else None, width, layers, tokens,
                              in_sequence)
        for r in range(len(rows))])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], torch.zeros(tokens, D))
    inputs = [values, cand, *module.parameters()]
    direction = torch.randn(len(rows), tokens, D)
    grads = torch.autograd.grad((got * direction).sum(), inputs, allow_unused=True)
    reference = torch.autograd.grad((expected * direction).sum(), inputs, allow_unused=True)
    for mine, theirs in zip(grads, reference):
        if theirs is None:  # the position of an 8th behaviour, say: no row reaches it
            assert mine is None or not mine.any()
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(module(x, mask, cand, g), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["softmax", "sigmoid"])
@pytest.mark.parametrize("tokens,hidden", [(2, [16]), (2, [1]), (1, [16, 8])])
def test_target_attention_without_gradients_is_the_same_function(tokens, hidden, weights):
    """Evaluation and serving run plain ops (no hand-written backward): the same tokens, with time
    or without; a scorer of width 1 under k = 2 included (the backward's broadcast is for k = 1)."""
    torch.manual_seed(0)
    rows = [3, 1, 5, 0]
    seqs = jagged(rows)
    gaps = pad(jagged(rows, width=None, seed=3).values() * 6, seqs.offsets(), 5)[0]  # buckets up to 30
    x, mask = pad(seqs.values(), seqs.offsets(), 5)
    cand = torch.randn(4, D)
    for time in (TIME, None):
        module = TargetAttention(D, tokens, hidden, time, weights, time_value=time is not None,
                                 time_bias_lr_mult=30.0 if time else 0.0)
        if time:
            nn.init.normal_(module.time_value.weight)
            nn.init.normal_(module.time_bias.weight)
        trained = module(x, mask, cand, gaps if time else None)
        with torch.no_grad():
            evaluated = module(x, mask, cand, gaps if time else None)
        torch.testing.assert_close(evaluated, trained, rtol=1e-6, atol=1e-6)
        if hidden == [1]:  # the hand-written backwards against autograd's reference
            values, c = x.detach().clone().requires_grad_(), cand.clone().requires_grad_()
            direction = torch.randn(4, tokens, D)
            params = list(module.parameters())
            mine = torch.autograd.grad((module(values, mask, c, gaps if time else None) * direction).sum(),
                                       [values, c, *params])
            expected = torch.stack([target_reference(module, values[r, :n], c[r], gaps[r, :n] if time else None,
                                                     tokens) for r, n in enumerate(rows)])
            theirs = torch.autograd.grad((expected * direction).sum(), [values, c, *params])
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def two_timed_schema() -> list[FeatureSpec]:
    """Three attended sequences on one table: the first and the third timed, the second not, so the
    third's gaps are the second of the batch's."""
    features = schema("target_attention", timestamps="hist_ts")
    f = FeatureSpec
    features += [f(name="clicks", kind="sequence", table="catalog", num_embeddings=50, embedding_dim=D, max_len=4,
                   sequence_module="transformer", group="clicks"),
                 f(name="buys", kind="sequence", table="catalog", num_embeddings=50, embedding_dim=D, max_len=5,
                   sequence_module="transformer", timestamps="buys_ts", group="buys")]
    validate_features(features)
    return features


def test_two_timed_sequences_each_read_their_own_gaps():
    """Each sequence's tokens are its module's on its own rows and its own gap buckets; changing
    one sequence's gaps changes its tokens and no other's."""
    torch.manual_seed(0)
    inputs = SequenceInputs(two_timed_schema(), SequenceConfig())
    rows = {"hist": [3, 0, 5, 2], "clicks": [1, 4, 2, 3], "buys": [2, 5, 1, 4]}
    looked = lookups(rows["hist"]) | {"clicks": jagged(rows["clicks"], seed=5), "buys": jagged(rows["buys"], seed=6)}
    longest = (1, 3, 5, 4, 5)  # item, also, hist, clicks, buys: the reader's order (schema order)
    gaps = {"hist": jagged(rows["hist"], width=None, seed=7).values(),
            "buys": jagged(rows["buys"], width=None, seed=8).values() + 10}
    out = inputs({}, looked, longest, (gaps["hist"], gaps["buys"]))
    cand = looked["item"].values()
    for name, length in [("hist", 5), ("clicks", 4), ("buys", 5)]:
        x, mask = pad(looked[name].values(), looked[name].offsets(), length)
        g = pad(gaps[name], looked[name].offsets(), length)[0] if name in gaps else None
        expected = inputs.attention[name](x, mask, cand, g)
        torch.testing.assert_close(out[name], expected.squeeze(1), rtol=0, atol=0)
    changed = inputs({}, looked, longest, (gaps["hist"], gaps["buys"].flip(0)))
    assert torch.equal(changed["hist"], out["hist"]) and torch.equal(changed["clicks"], out["clicks"])
    assert not torch.allclose(changed["buys"], out["buys"], atol=1e-4)


@pytest.mark.parametrize("module", ["target_attention", "transformer"])
def test_k_tokens_are_k_different_vectors(module):
    """sequence_tokens = 3: three attention distributions, so three different vectors for every row
    of two or more behaviours (one behaviour: each token is it; none: zeros)."""
    torch.manual_seed(0)
    inputs = SequenceInputs(schema(module, tokens=3, timestamps="ts"), SequenceConfig())
    rows = [3, 1, 5, 0]
    out = inputs({}, lookups(rows), (1, 3, 5), (jagged(rows, width=None, seed=7).values(),))
    tokens = torch.stack([out[f"hist.{j}"] for j in range(3)], dim=1)  # [B, 3, D]
    for r in (0, 2):
        for i in range(3):
            for j in range(i):
                assert (tokens[r, i] - tokens[r, j]).abs().max() > 1e-3, (r, i, j)
    if module == "target_attention":  # a single behaviour takes all the weight of every distribution
        torch.testing.assert_close(tokens[1], lookups(rows)["hist"].values()[3].expand(3, D))
    assert torch.equal(tokens[3], torch.zeros(3, D))


@pytest.mark.parametrize("weights", ["softmax", "sigmoid"])
def test_the_time_value_starts_at_zero_the_values_as_without_it(weights):
    """A new module with time_value gives what the same module without it gives: the gaps reach
    the values only as they are trained."""
    torch.manual_seed(0)
    rows = [3, 1, 5]
    seqs = jagged(rows)
    gaps = pad(jagged(rows, width=None, seed=3).values() * 6, seqs.offsets(), 5)[0]
    x, mask = pad(seqs.values(), seqs.offsets(), 5)
    cand = torch.randn(3, D)
    with_values = TargetAttention(D, 2, [16], TIME, weights, time_value=True)
    without = TargetAttention(D, 2, [16], TIME, weights, time_value=False)
    without.load_state_dict({k: v for k, v in with_values.state_dict().items() if not k.startswith("time_value.")})
    assert torch.equal(with_values(x, mask, cand, gaps), without(x, mask, cand, gaps))


@pytest.mark.parametrize("weights", ["softmax", "sigmoid"])
def test_the_time_bias_starts_at_zero_and_then_weighs_by_the_gap_alone(weights):
    """A new module with a time bias gives what the same module without it gives; set, the bias
    of a gap bucket moves the weight of exactly the behaviours in that bucket, whatever they are."""
    torch.manual_seed(0)
    rows = [3, 1, 5]
    seqs = jagged(rows)
    x, mask = pad(seqs.values(), seqs.offsets(), 5)
    gaps = torch.tensor([[3, 7, 3, 0, 0], [7, 0, 0, 0, 0], [1, 3, 7, 7, 9]])
    cand = torch.randn(3, D)
    biased = TargetAttention(D, 1, [16], TIME, weights, time_value=False, time_bias_lr_mult=30.0)
    plain = TargetAttention(D, 1, [16], TIME, weights, time_value=False)
    plain.load_state_dict({k: v for k, v in biased.state_dict().items() if not k.startswith("time_bias.")})
    assert torch.equal(biased(x, mask, cand, gaps), plain(x, mask, cand, gaps))
    with torch.no_grad():
        biased.time_bias.weight[7] = 50.0  # bucket 7 takes all of softmax's weight; sigmoid's is 1 there
        out = biased(x, mask, cand, gaps)
    in_seven = (gaps == 7) & mask
    scores = plain.score(torch.cat([x, cand.unsqueeze(1).expand_as(x), x * cand.unsqueeze(1),
                                    x - cand.unsqueeze(1), plain.time(gaps)], dim=-1)).squeeze(-1)
    if weights == "softmax":  # bucket 7's behaviours share all the weight, by their own scores
        w = torch.softmax(scores.masked_fill(~in_seven, -math.inf), dim=1)
    else:  # they weigh 1; the others keep their own sigmoid weights
        w = torch.where(in_seven, 1.0, torch.sigmoid(scores) * mask)
    expected = (w.unsqueeze(-1) * x).sum(1)
    torch.testing.assert_close(out.squeeze(1), expected, rtol=1e-5, atol=1e-5)


def test_the_time_bias_starts_at_zero_and_then_reads_each_pairs_gaps():
    """A new transformer with time_bias attends as the same one without it (to rounding); a bias that is not
    zero changes only the rows with two or more behaviours' gaps to compare (or one and the
    candidate's)."""
    torch.manual_seed(0)
    rows = [3, 1, 5, 0]
    seqs = jagged(rows)
    gaps = pad(jagged(rows, width=None, seed=3).values().abs() % TIME[0], seqs.offsets(), 5)[0]
    x, mask = pad(seqs.values(), seqs.offsets(), 5)
    cand = torch.randn(4, D)
    kwargs = dict(max_len=5, layers=2, heads=2, width=12, ffn_ratio=2, hidden=[16], time=TIME, init_std=0.3,
                  weights="softmax", time_value=True)
    biased = SequenceTransformer(D, 2, time_bias=True, **kwargs)
    plain = SequenceTransformer(D, 2, time_bias=False, **kwargs)
    plain.load_state_dict({k: v for k, v in biased.state_dict().items() if not k.endswith(".time_bias")})
    assert all(block.time_bias.shape == (2, 2 * TIME[0] - 1) for block in biased.blocks)
    # the same up to the kernel: a float mask of zeros and -inf takes another path than a boolean one
    torch.testing.assert_close(biased(x, mask, cand, gaps), plain(x, mask, cand, gaps), rtol=0, atol=1e-6)
    with torch.no_grad():
        biased.blocks[0].time_bias.normal_()
    differs = (biased(x, mask, cand, gaps) - plain(x, mask, cand, gaps)).abs().amax(dim=(1, 2))
    assert (differs[:3] > 1e-4).all() and differs[3] == 0
    # under autocast, as training's mixed precision runs it: the bias takes the scores' type
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = biased(x, mask, cand, gaps)
    torch.testing.assert_close(low.float(), biased(x, mask, cand, gaps).detach(), rtol=0.05, atol=0.05)


def test_target_attention_without_time_reads_a_set_and_the_transformer_reads_the_order():
    """Reversing each history: target attention without time gives the same vector (order-free);
    the transformer, whose recency positions count from the newest, another one."""
    torch.manual_seed(0)
    rows = [3, 4, 5]
    seqs, cand = jagged(rows), torch.randn(3, D)
    x, mask = pad(seqs.values(), seqs.offsets(), 5)
    reversed_x = torch.stack([torch.cat([x[r, :n].flip(0), x[r, n:]]) for r, n in enumerate(rows)])
    target = TargetAttention(D, 1, [16])
    torch.testing.assert_close(target(reversed_x, mask, cand), target(x, mask, cand), rtol=1e-5, atol=1e-6)
    transformer = SequenceTransformer(D, 1, 5, 1, 2, D, 2, [16], init_std=0.1, weights="softmax", time_value=False,
                                      time_bias=False)
    differs = (transformer(reversed_x, mask, cand) - transformer(x, mask, cand)).abs().amax(dim=(1, 2))
    assert (differs > 1e-3).all(), differs


def test_the_sequence_tables_other_features_pool_beside_it_and_a_candidate_may_come_from_the_bags():
    """A sum-pooled list sums, a mean-pooled one averages, a feature after the attended sequence
    is pooled too; a candidate on another table is the bags' vector (`pooled`), which attends."""
    f = FeatureSpec
    features = [f(name="user", num_embeddings=10, embedding_dim=D, group="user"),
                f(name="hist", kind="sequence", table="catalog", num_embeddings=50, embedding_dim=D, max_len=6,
                  sequence_module="target_attention", candidate="user", group="behaviour"),
                f(name="summed", kind="id_list", table="catalog", num_embeddings=50, embedding_dim=D, max_len=3),
                f(name="averaged", kind="id_list", table="catalog", num_embeddings=50, embedding_dim=D, max_len=3,
                  pooling="mean")]
    validate_features(features)
    torch.manual_seed(0)
    inputs = build_sequences(features, SequenceConfig())
    assert isinstance(inputs, SequenceInputs) and list(inputs.attention) == ["hist"]
    looked = {"hist": jagged([3, 0, 5, 2], seed=1), "summed": jagged([2, 0, 3, 1], seed=2),
              "averaged": jagged([2, 0, 3, 1], seed=3)}
    user = torch.randn(4, D)
    out = inputs({"user": user}, looked, (6, 3, 3))
    assert set(out) == {"hist", "summed", "averaged"}
    for name, mean in [("summed", False), ("averaged", True)]:
        rows, offsets = looked[name].values(), looked[name].offsets().tolist()
        for r in range(4):
            part = rows[offsets[r]:offsets[r + 1]]
            expected = part.sum(0) / max(len(part), 1) if mean else part.sum(0)
            torch.testing.assert_close(out[name][r], expected)
    x, mask = pad(looked["hist"].values(), looked["hist"].offsets(), 6)
    torch.testing.assert_close(out["hist"], inputs.attention["hist"](x, mask, user).squeeze(1), rtol=0, atol=0)
    assert build_sequences(features[:1] + features[2:], SequenceConfig()) is None  # nothing attended


def test_build_sequences_builds_each_attended_module_from_the_config():
    cfg = SequenceConfig()
    cfg.target_attention.hidden = [5, 3]
    inputs = build_sequences(schema("target_attention", tokens=2), cfg)
    module = inputs.attention["hist"]
    assert isinstance(module, TargetAttention)
    assert [m.out_features for m in [module.first, *module.rest] if isinstance(m, nn.Linear)] == [5, 3, 2]
    assert inputs.candidates == {"hist": ["item"]} and inputs.slots == {"hist": ["hist.0", "hist.1"]}
    assert inputs.keys == ["item", "also", "hist"] and inputs.mean == {"also"}


@pytest.mark.parametrize("longest", [0, 2])
def test_a_batch_whose_rows_are_all_empty_gives_zeros_not_nan(longest):
    """Every row empty, padded to the reader's longest (0) or to more (pad's contract: any length
    >= every row's): zeros, no NaN."""
    torch.manual_seed(0)
    inputs = SequenceInputs(schema("transformer", timestamps="ts"), SequenceConfig())
    looked = {"item": jagged([1, 1]), "also": jagged([0, 0]), "hist": JaggedTensor(
        torch.zeros(0, D), lengths=torch.tensor([0, 0]), offsets=torch.tensor([0, 0, 0]))}
    out = inputs({}, looked, (1, longest, longest), (torch.zeros(0, dtype=torch.int64),))
    assert torch.equal(out["hist"], torch.zeros(2, D)) and torch.equal(out["also"], torch.zeros(2, D))


def test_the_padding_backward_gives_each_value_its_slots_gradient():
    """Fewer values than their width (3 of width 8): each value's gradient is its own padded slot's."""
    values = torch.randn(3, D, requires_grad=True)
    x, mask = pad(values, torch.tensor([0, 2, 2, 3]), 4)
    weight = torch.randn(3, 4, D)
    (x * weight).sum().backward()
    assert torch.equal(values.grad, torch.stack([weight[0, 0], weight[0, 1], weight[2, 0]]))
    assert mask.tolist() == [[True, True, False, False], [False] * 4, [True, False, False, False]]
