"""Sequence modules: a user's behaviours, looked up unpooled, read against the candidate.

    target_attention  a_m = MLP([b_m, v, b_m * v, b_m - v, t_m]) (+ c_t(m)),  alpha = softmax_m(a)  (masked, fp32),
                      e_s = sum_m alpha_m b_m                       (RankMixer's seeds §2.3; DIN)
    transformer       self-attention blocks over b_m + position + time, then target attention (BST, LONGER)

`SequenceInputs` turns the EmbeddingCollection's jagged output into the dict that
dense/layout.py assembles: each attended sequence's k vectors, and the pooled vector of every
other feature on its table (the candidate id among them). Sequences are padded to a length the
caller gives as a Python int (the batch's longest, counted by the reader on the host; an
artifact's max_len), so nothing is read back from the device. docs/models.md, "Sequence module".
"""

from __future__ import annotations

import math

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm's jagged ops)
import torch
from torch import nn

from dense.sequence_registry import SEQUENCE_MODULES, token_slots
from embeddings.features import (
    FeatureSpec,
    attended,
    attended_tables,
    default_candidate,
    shared_sequences,
    side_fields,
    unpooled_features,
)
from embeddings.hooks import ScaledLearningRate

_MIN = torch.finfo(torch.float32).min  # a masked score: exp(min - max) is exactly 0 beside any real one


class _JaggedToPadded(torch.autograd.Function):
    """FBGEMM's jagged -> padded copy, its backward the padded -> jagged copy: no scatter, and
    (unlike the op's own autograd, registered for CPU and CUDA only) a gradient on meta too."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, offsets: torch.Tensor, length: int) -> torch.Tensor:
        ctx.save_for_backward(offsets)
        ctx.rows = values.shape[0]
        return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [length], 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        return torch.ops.fbgemm.jagged_to_padded_dense_backward(grad.contiguous(), [offsets], ctx.rows), None, None


def pad(values: torch.Tensor, offsets: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged rows -> padded. values [N, ...], offsets [B + 1] -> ([B, L, ...] with zeros past
    each row's end, mask [B, L] True at real positions); L = `length` >= every row's length, so
    no size is read from the device, and N = B L (Python ints) means every row is full: a view.
    Otherwise one copy each way (FBGEMM's jagged ops); narrow, not a slice, of the offsets: a
    slice of a CUDA tensor needs the CUDA build (tests/test_fake_cuda.py)."""
    rows = offsets.shape[0] - 1
    if values.shape[0] == rows * length:  # every row holds `length`: already padded, no copy
        return values.view(rows, length, *values.shape[1:]), values.new_ones((rows, length), dtype=torch.bool)
    lengths = offsets.narrow(0, 1, rows) - offsets.narrow(0, 0, rows)
    mask = torch.arange(length, device=values.device) < lengths.unsqueeze(1)
    flat = values.reshape(values.shape[0], math.prod(values.shape[1:]))  # the op's values are 2-D (-1: not at N = 0)
    padded = _JaggedToPadded.apply(flat, offsets, length)
    return padded.reshape(rows, length, *values.shape[1:]), mask


def held_offsets(offsets: torch.Tensor, holders: torch.Tensor) -> torch.Tensor:
    """Offsets [B + 1] of a batch whose lists are at the rows `holders` [R] (ascending) only, every
    other row empty (data.request_column) -> the offsets [R + 1] of those R lists: a holder's list
    ends where the next one starts."""
    return torch.cat([offsets.index_select(0, holders), offsets.narrow(0, offsets.shape[0] - 1, 1)])


def per_row(request: torch.Tensor | None, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each of `tensors` [R, ...] (one a request; None passes) -> [B, ...], row b its request
    `request[b]`'s; as they are where `request` is None."""
    if request is None:
        return tensors
    return tuple(None if t is None else t.index_select(0, request) for t in tensors)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax over `dim` of the real positions, in fp32 (also under bf16 autocast); a row with
    none gives zeros, not NaN. `mask` broadcasts against `scores`."""
    weights = torch.softmax(torch.where(mask, scores.float(), _MIN), dim=dim)
    return weights * mask  # an empty row's uniform weights over padding -> 0


class _Scores(torch.autograd.Function):
    """The scorer's last Linear, h [B, L, H] -> [B, L, k], whose input gradient at k = 1 is a
    broadcast product, one pass over [B, L, H]: autograd's is an outer-product matmul, slower
    on the CPU than ReLU's mask."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        return nn.functional.linear(h, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight = ctx.saved_tensors
        grad = grad.to(h.dtype)  # bf16 scores under autocast, fp32 activations
        w = weight.to(h.dtype)
        into = grad * w.squeeze(0) if w.shape[0] == 1 else torch.matmul(grad, w)
        flat_grad, flat_h = grad.reshape(-1, grad.shape[-1]), h.reshape(-1, h.shape[-1])
        return into, (flat_grad.t() @ flat_h).to(weight.dtype), flat_grad.sum(0).to(weight.dtype)


class _Gather(torch.autograd.Function):
    """table [R, H] rows at index [...] -> [..., H], its backward an index_add_ (no sort)."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = table.shape[0]
        return nn.functional.embedding(index, table)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows, grad.shape[-1])
        return out.index_add_(0, index.flatten(), grad.reshape(-1, grad.shape[-1])), None


class _WeightedSum(torch.autograd.Function):
    """weights [B, L, k], values [B, L, D] -> [B, k, D] = weights^T values. bmm forward; in the
    backward, at k = 1, values' gradient is a broadcast product: bmm's outer products of [L, 1]
    by [1, D] run as a loop of small matmuls on the CPU, and autograd's elementwise form takes
    four passes over [B, L, D]."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, values)
        return torch.matmul(weights.transpose(1, 2), values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights, values = ctx.saved_tensors
        grad = grad.to(values.dtype)
        into_values = weights * grad if weights.shape[2] == 1 else torch.matmul(weights, grad)
        return torch.matmul(values, grad.transpose(1, 2)).to(weights.dtype), into_values


class GapBias(nn.Module, ScaledLearningRate):
    """gap buckets [B, L] int64 -> [B, L, k]: a learned bias c_t per time-gap bucket and weighting,
    added to target attention's scores (HSTU's time bias, on the candidate's row). It reads
    recency straight into the weights, where the scorer's MLP must learn it through a hidden
    layer. It starts at zero (the scores as without it) and trains at `lr_mult` x the dense
    rate: it is a table of one scalar per bucket, not a layer, and at the dense rate it barely
    moves before a small log's early stop (docs/results.md, "The time bias: recency in the
    weights"). Under optim.sequence_lr_mult the two multiples compound: the module's own rate
    times `lr_mult`."""

    def __init__(self, buckets: int, tokens: int, lr_mult: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(buckets, tokens))
        self.lr_mult = lr_mult

    def forward(self, gaps: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(gaps, self.weight)


class TargetAttention(nn.Module):
    """behaviours [B, L, D], mask [B, L], candidate [B, D], gap buckets [B, L] int64 (or None)
    -> [B, k, D]: k weightings, one score column each, of the real behaviours' values.

    A behaviour's value is its vector plus, with gaps, an embedding of its gap (`time_value`):
    what is summed then says how old the matches are, not only the score. `weights`: softmax
    over the behaviours (the weights sum to 1: how many match is lost), or sigmoid, each
    behaviour's weight on its own (DIN's unnormalised weights: the sum keeps the intensity).
    `time_bias_lr_mult` > 0, with gaps: a `GapBias` on the scores, trained at that multiple of the
    dense rate (0: none)."""

    def __init__(self, dim: int, tokens: int, hidden: list[int], time: tuple[int, int] | None = None,
                 weights: str = "softmax", time_value: bool = False, time_bias_lr_mult: float = 0.0):
        super().__init__()
        assert weights in ("softmax", "sigmoid"), weights
        self.time = nn.Embedding(*time) if time else None
        # at zero: the values start as the behaviours' vectors, as without it
        self.time_value = nn.Embedding(time[0], dim, _weight=torch.zeros(time[0], dim)) if time and time_value else None
        self.time_bias = GapBias(time[0], tokens, time_bias_lr_mult) if time and time_bias_lr_mult else None
        self.softmax = weights == "softmax"
        width = 4 * dim + (time[1] if time else 0)
        layers = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, tokens))
        self.first, self.rest = layers[0], nn.Sequential(*layers[1:])  # the first is applied by parts

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """The scoring MLP on a whole input [..., 4D + Dt] (what `first_layer` computes by parts)."""
        return self.rest(self.first(x))

    def forward(self, behaviours: torch.Tensor, mask: torch.Tensor, candidate: torch.Tensor,
                gaps: torch.Tensor | None = None, request: torch.Tensor | None = None) -> torch.Tensor:
        """`request` [B]: behaviours, mask and gaps are [R, L, ...], one a request, row b's its
        request's (data.request_column); each row's candidate reads its request's history."""
        behaviours, mask, gaps = per_row(request, behaviours, mask, gaps)
        x = torch.relu_(self.first_layer(behaviours, candidate, gaps))  # [B, L, H], in place: ours
        for layer in list(self.rest)[1:-1]:  # further hidden layers, if any
            x = layer(x)
        last = self.rest[-1]
        x = _Scores.apply(x, last.weight, last.bias) if torch.is_grad_enabled() else last(x)
        if self.time_bias is not None:
            x = x + self.time_bias(gaps)  # fp32: under autocast the scores go to the fp32 softmax anyway
        if self.softmax:
            weights = masked_softmax(x, mask.unsqueeze(-1), dim=1)  # [B, L, k]
        else:
            weights = torch.sigmoid(x.float()) * mask.unsqueeze(-1)
        weights = weights.to(behaviours.dtype)
        values = behaviours
        if self.time_value is not None:
            values = behaviours + self.time_value(gaps)  # padding's weight is 0
        if torch.is_grad_enabled():
            return _WeightedSum.apply(weights, values)
        return torch.matmul(weights.transpose(1, 2), values)  # evaluation and serving traces: plain ops

    def first_layer(self, b: torch.Tensor, v: torch.Tensor, gaps: torch.Tensor | None) -> torch.Tensor:
        """The first Linear of [b, v, b * v, b - v, t] without building that [B, L, 4D + Dt] input:
        with W = [W1 W2 W3 W4 Wt], (W1 + W4) b + W3 (b * v) = A_r b, one [D, H] matrix per row
        A_r = (W1 + W4) + W3 diag(v), and (W2 - W4) v + bias + Wt t = c_r + Wt t takes one of
        NB values per row, NB the time buckets: a gather from that [B, NB, H] table, then one
        batched matmul adds A_r b in place (the step's cost at long sequences; bench/sequence.py)."""
        linear = self.first
        dim = b.shape[-1]
        w1, w2, w3, w4, wt = torch.split(linear.weight, [dim, dim, dim, dim, linear.in_features - 4 * dim], dim=1)
        per_row = nn.functional.linear(v, w2 - w4, linear.bias)  # [B, H]; bf16 under autocast, which
        b = b.to(per_row.dtype)  # in-place baddbmm_ would not cast: all in the Linear's dtype
        a = ((w1 + w4).t() + v.unsqueeze(2) * w3.t()).to(per_row.dtype)  # [B, D, H]
        if self.time is None:
            return torch.baddbmm(per_row.unsqueeze(1), b, a)
        buckets = self.time.num_embeddings
        table = (per_row.unsqueeze(1) + self.time.weight @ wt.t()).to(per_row.dtype)  # [B, NB, H]
        rows = torch.arange(b.shape[0], device=gaps.device).unsqueeze(1) * buckets
        index, table = gaps + rows, table.flatten(0, 1)
        gathered = _Gather.apply(table, index) if torch.is_grad_enabled() else nn.functional.embedding(index, table)
        return gathered.baddbmm_(b, a)


class SelfAttentionBlock(nn.Module):
    """Pre-norm multi-head self-attention and FFN over [B, L, W]; padded keys are masked, so a
    real position's output does not depend on the padding."""

    def __init__(self, width: int, heads: int, ffn_ratio: int, time_buckets: int):
        super().__init__()
        self.heads = heads
        # relative time bias: per head, by the difference of two positions' gap buckets (T5's
        # relative bias over log time); zeros, so a new block attends as one without it
        self.time_bias = nn.Parameter(torch.zeros(heads, 2 * time_buckets - 1)) if time_buckets else None
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn_ratio * width), nn.GELU(), nn.Linear(ffn_ratio * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, buckets: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, W], mask [B, L], gap buckets [B, L] (with time buckets) -> [B, L, W]. torch's fused
        attention: with a boolean mask memory O(B L W); the time bias is an [B, H, L, L] float mask,
        O(B H L^2). Every row has a key (the transformer's candidate), so none is all masked
        (which would give NaN)."""
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        keys = mask.unsqueeze(1).unsqueeze(1)  # [B, 1, 1, L]
        if self.time_bias is not None:
            relative = buckets.unsqueeze(2) - buckets.unsqueeze(1) + (self.time_bias.shape[1] - 1) // 2  # [B, L, L]
            # a lookup, not time_bias[:, relative]: that index op's None is outside the pt2 allow list
            bias = nn.functional.embedding(relative, self.time_bias.t()).permute(0, 3, 1, 2)  # [B, H, L, L]
            keys = bias.to(q.dtype).masked_fill(~keys, float("-inf"))  # autocast's q: the mask's type must match
        attended_values = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = x + self.proj(attended_values.transpose(1, 2).flatten(-2))  # [B, L, W]
        return x + self.ffn(self.norm2(x))


class SequenceTransformer(nn.Module):
    """behaviours [B, L, D], mask, candidate [B, D], gap buckets -> [B, k, D]: the candidate and
    the behaviours at width W, the candidate first (BST: the behaviours attend to it, and it to
    them) with an embedding of its own, each behaviour with its recency position (0 = the most
    recent) and time gap added; `layers` self-attention blocks; back to D; then target attention
    of the behaviours' outputs against the candidate.

    The position, time and candidate embeddings start at `init_std`, the scale of the sequence's
    table (at N(0, 1) they drowned the behaviour's own vector, and the module did not learn).
    `time_bias` (with gaps) adds each block's relative time bias to its attention scores;
    `target_time_bias_lr_mult` is the target attention's (`TargetAttention`'s `GapBias`).

    `in_sequence` False: the candidate is not a token of the blocks, only the query of the target
    attention after them (the query of the last block): the blocks then read the history alone,
    and run once per request where rows share one (data.request_column)."""

    def __init__(self, dim: int, tokens: int, max_len: int, layers: int, heads: int, width: int, ffn_ratio: int,
                 hidden: list[int], time: tuple[int, int] | None = None, *, init_std: float, weights: str,
                 time_value: bool, time_bias: bool, in_sequence: bool = True,
                 target_time_bias_lr_mult: float = 0.0):
        super().__init__()
        self.in_sequence = in_sequence
        self.inp = nn.Linear(dim, width) if width != dim else nn.Identity()
        self.position = nn.Embedding(max_len, width)
        self.time = nn.Embedding(time[0], width) if time else None
        self.candidate = nn.Parameter(torch.zeros(width))
        for table in (self.position.weight, self.candidate, *([self.time.weight] if time else [])):
            nn.init.normal_(table, std=init_std)
        self.relative_time = bool(time and time_bias)  # each block then holds its own time_bias
        self.blocks = nn.ModuleList(SelfAttentionBlock(width, heads, ffn_ratio, time[0] if self.relative_time else 0)
                                    for _ in range(layers))
        self.out = nn.Linear(width, dim) if width != dim else nn.Identity()
        self.target = TargetAttention(dim, tokens, hidden, time, weights, time_value, target_time_bias_lr_mult)
        self.max_len = max_len

    def forward(self, behaviours: torch.Tensor, mask: torch.Tensor, candidate: torch.Tensor,
                gaps: torch.Tensor | None = None, request: torch.Tensor | None = None) -> torch.Tensor:
        """`request` [B]: behaviours, mask and gaps are [R, L, ...], one a request (TargetAttention's)."""
        if self.in_sequence:  # the blocks read the candidate: one history per row
            behaviours, mask, gaps = per_row(request, behaviours, mask, gaps)
            request = None
        steps = torch.arange(mask.shape[1], device=mask.device)
        recency = (mask.sum(dim=1, keepdim=True) - 1 - steps).clamp(0, self.max_len - 1)  # padding: masked anyway
        h = self.inp(behaviours) + self.position(recency)
        if self.time is not None:
            h = h + self.time(gaps)
        if self.in_sequence:
            first = (self.inp(candidate) + self.candidate).unsqueeze(1)  # [B, 1, W]
            h = torch.cat([first, h], dim=1)  # [B, 1 + L, W]
            keys = torch.cat([torch.ones([mask.shape[0], 1], dtype=torch.bool, device=mask.device), mask], dim=1)
            # the candidate is now: the bucket of a gap of 0 (trainer/data/feature_ops.py)
            now = torch.ones([mask.shape[0], 1], dtype=torch.int64, device=mask.device)  # ones, not ones_like: PT2_OPS
            buckets = torch.cat([now, gaps], dim=1) if self.relative_time else None
        else:
            # an empty history's rows attend to their first (padding) position, which nothing reads
            # after: a row with no key at all would give NaN
            keys = mask | ((steps == 0) & (mask.sum(dim=1, keepdim=True) == 0))
            buckets = gaps  # read by the blocks' time bias, where they have one
        for block in self.blocks:
            h = block(h, keys, buckets)
        outputs = self.out(h.narrow(1, 1, mask.shape[1]) if self.in_sequence else h)
        return self.target(outputs, mask, candidate, gaps, request)


def soft_search(x: torch.Tensor, mask: torch.Tensor, query: torch.Tensor, gaps: torch.Tensor | None,
                k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """SIM's soft search: behaviours x [B, L, D], mask [B, L], query [B, D], gap buckets [B, L] ->
    the k real behaviours most similar to the query (inner product; fewer where a row has fewer,
    padding masked), in their order in time: ([B, k, D], [B, k], [B, k]). The choice takes no
    gradient; what it keeps does."""
    with torch.no_grad():
        scores = torch.where(mask, torch.matmul(x, query.unsqueeze(-1)).squeeze(-1).float(), _MIN)
        chosen = torch.sort(torch.topk(scores, k, dim=1).indices, dim=1).values  # [B, k], oldest first
    picked = x.gather(1, chosen.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return picked, mask.gather(1, chosen), None if gaps is None else gaps.gather(1, chosen)


class SequenceInputs(nn.Module):
    """The features on attended sequences' tables, looked up unpooled -> their entries of the
    dict that dense/layout.py assembles into e_input:

        looked_up  name -> JaggedTensor of [N_f, D] rows (TorchRec's EmbeddingCollection output)
        longest    per key of `keys`: L_f >= its longest row, a Python int
        gaps       per attended sequence with timestamps (`timed`, schema order): [N_f] int64 time-gap
                   buckets aligned with its rows
        pooled     the bags' vectors by name [B, D_f]: a candidate on another table comes from there
        ->         name -> [B, D]: the pooled vector (pooling sum or mean) of every plain feature on
                   these tables, and each attended sequence's token slots (dense/sequence_registry.py)

    A behaviour's vector is its id's plus those of its side fields (`features.<name>.side_of`,
    aligned with it), and the query the candidate's plus its `candidate_fields`': the modules
    read one [B, L, D] and one [B, D] whatever the fields.

        request    (holders [R], index [B]) where rows share their request's sequences
                   (data.request_column, trainer/data/requests.py): a shared sequence's lists are
                   at the holder rows only; it is padded and encoded [R, L, D], once a request
    """

    def __init__(self, features: list[FeatureSpec], cfg):
        super().__init__()
        on = unpooled_features(features)
        self.keys = [f.name for f in on]  # the reader's order of Batch.sequence_ids, then managed_sequence_ids
        self.mean = {f.name for f in on if not attended(f) and f.kind != "id" and f.pooling == "mean"}
        self.attention = nn.ModuleDict({f.name: SEQUENCE_MODULES.get(f.sequence_module)(cfg, f)
                                        for f in on if attended(f)})
        self.candidates = {f.name: [default_candidate(f, features), *f.candidate_fields] for f in on if attended(f)}
        self.sides = {f.name: [g.name for g in side_fields(f, features)] for f in on if attended(f)}
        self.read_padded = set(self.attention) | {name for names in self.sides.values() for name in names}
        self.search_k = {f.name: f.search_k for f in on if attended(f) and f.search_k}
        self.max_len = {f.name: f.max_len for f in on if attended(f)}  # a served model's padded length
        self.slots = {f.name: [slot for slot, _ in token_slots(f)] for f in on if attended(f)}
        self.timed = [f.name for f in features if attended(f) and f.timestamps]  # schema order, as the gaps
        self.shared = {f.name for f in shared_sequences(features)} & set(self.keys)  # one a request, with requests

    def forward(self, pooled: dict[str, torch.Tensor], looked_up: dict, longest: tuple[int, ...] | list[int],
                gaps: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
                request: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        padded, padded_gaps = {}, {}
        for i, name in enumerate(self.keys):
            rows = looked_up[name]
            offsets = rows.offsets()
            held = request is not None and name in self.shared
            if held:
                offsets = held_offsets(offsets, request[0])
            x, mask = pad(rows.values(), offsets, longest[i])
            if name in self.read_padded:
                padded[name] = (x, mask)
                if name in self.timed:
                    padded_gaps[name] = pad(gaps[self.timed.index(name)], offsets, longest[i])[0]
                continue
            total = x.sum(dim=1)
            if name in self.mean:
                total = total / mask.sum(dim=1, keepdim=True).clamp(min=1)  # an integer count: total's dtype
            out[name] = per_row(request[1] if held else None, total)[0]
        out.update(self.attend(out, pooled, padded, padded_gaps, dict(zip(self.keys, longest)),
                               None if request is None else request[1]))
        return out

    def attend(self, own: dict[str, torch.Tensor], pooled: dict[str, torch.Tensor],
               padded: dict[str, tuple[torch.Tensor, torch.Tensor]],
               gaps: dict[str, torch.Tensor], lengths: dict[str, int] | None = None,
               request: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each attended sequence's token slots [B, D] from its and its side fields' padded rows
        (x [B, L, D], mask [B, L]: a side field's mask is its sequence's, their lengths checked
        equal) and gap buckets [B, L]; the query's vectors from `own` (the features on these
        tables) or else `pooled` (the bags). With `request` [B], a shared sequence's rows are
        [R, L, ...], one a request, which each of its rows reads. A served model pads by its own
        means (to max_len, the L of `lengths`' default: a Python int, also while traced) and calls this."""
        out = {}
        for name, module in self.attention.items():
            candidate, *fields = [own[q] if q in own else pooled[q] for q in self.candidates[name]]
            v = sum(fields, candidate)
            x, mask = padded[name]
            x = sum((padded[side][0] for side in self.sides[name]), x)
            gap = gaps.get(name)
            rows = request if name in self.shared else None
            if name in self.search_k and (lengths or self.max_len)[name] > self.search_k[name]:
                x, mask, gap = soft_search(*per_row(rows, x, mask), v, *per_row(rows, gap), self.search_k[name])
                rows = None  # a search per candidate
            vectors = module(x, mask, v, gap, rows)  # [B, k, D]
            for j, slot in enumerate(self.slots[name]):  # narrow: a slice of CUDA needs the CUDA build
                out[slot] = vectors.narrow(1, j, 1).squeeze(1)
        return out


def build_sequences(features: list[FeatureSpec], cfg) -> SequenceInputs | None:
    """The SequenceInputs of `features` under [model.sequence] `cfg`, or None when no sequence is
    attended (every sequence pooled by TorchRec, as before sequence modules)."""
    return SequenceInputs(features, cfg) if attended_tables(features) else None
