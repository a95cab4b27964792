"""The serving module: raw inputs -> one probability per task, everything in between inside.

It repeats at serving time what the data pipeline does at training time
(trainer/data/ids.py, trainer/data/encode.py), so that a server passes what it logs:

    ids      [N] int64      every sparse feature's raw ids, feature after feature, row after
                            row within a feature (a KeyedJaggedTensor's values); unsigned
                            64-bit ids are passed as their bit pattern
    lengths  [S, B] int64   ids per row of each sparse feature (0: a null or empty bag)
    numeric  [B, F] float64 numeric features before their transforms, NaN for null
    and, only where an attended sequence has timestamps (`TimedServingModel`):
    timestamps [T] int64    those sequences' raw timestamps (seconds), feature after feature in
                            schema order, each row's whole list, aligned with its ids in `ids`
    now      [B] int64      each row's request time (data.time_column); every time 0 <= t < 2^62,
                            and a behaviour after its row's is left out, as the reader does
    and, only where the model was trained with data.request_column (`RequestServingModel`), last:
    holders  [R] int64      the row holding each of the batch's R requests' shared sequences
                            (embeddings/features.py `shared_sequences`), ascending; the other rows'
                            lists of those sequences are not read (send them empty)
    request  [B] int64      each row's request in 0..R-1 (request[holders[r]] = r)
    ->       [B, K] float32 probabilities, one column per task

A request's shared sequences are then looked up and encoded once, for all its candidates.

An attended sequence (features.<name>.sequence_module not pool) is cut to its last max_len ids
like every list, then padded to max_len: its rows come from the one bag collection, one id per
bag (its table is there whole, beside the others), and the sequence module reads them.

The per-feature settings are Python values read while the module is traced (torch.export, or
torch.fx for TorchScript), so they end up as constants of the exported graph.
"""


import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torchrec import KeyedJaggedTensor

from dense.layout import InputLayout
from embeddings.features import MANAGED_ID_RANGE, FeatureSpec, attended, managed_tables, shared_sequences
from trainer.data.feature_ops import HASHINGS, TRANSFORMS, gap_buckets_torch
from trainer.data.timestamps import TIME_LIMIT

_NO_LIMIT = 2 ** 62  # a bag length no log reaches: max_len 0 keeps every id


def _require(condition: torch.Tensor, message: str) -> None:
    """Stop the call with `message` unless `condition` holds: an assert op, which torch.export
    keeps; traced by torch.fx for TorchScript, a Python assert, because TorchScript drops the
    op as dead code."""
    if is_fx_symbolic_tracing():
        torch._assert(condition, message)
    else:
        torch._assert_async(condition, message)


class ServingModel(nn.Module):
    """(ids, lengths, numeric) -> probabilities [B, K]; see the module docstring."""

    def __init__(self, features: list[FeatureSpec], ebc: nn.Module, layout: InputLayout, tower: nn.Module,
                 heads: nn.Module, managed: dict[str, "ManagedRows"] | None = None, sequences: nn.Module | None = None,
                 time_buckets: int = 0):
        super().__init__()
        self.sparse = [f for f in features if f.kind != "numeric"]
        self.numeric = [f for f in features if f.kind == "numeric"]
        self.ebc, self.layout, self.tower, self.heads = ebc, layout, tower, heads
        self.id_maps = nn.ModuleDict(managed or {})  # table -> its id map (hashing = "managed")
        assert sorted(self.id_maps) == managed_tables(features)
        self.sequences = sequences  # dense/sequence.py SequenceInputs, or None: no attended sequence
        self.attended = [(s, f) for s, f in enumerate(self.sparse) if attended(f)]
        self.timed = [(s, f) for s, f in self.attended if f.timestamps]
        index = {f.name: s for s, f in enumerate(self.sparse)}
        self.sides = [(s, index[f.side_of]) for s, f in enumerate(self.sparse) if f.side_of]  # (side, its sequence)
        # the sparse features padded for the sequence modules: the attended sequences and their side fields
        self.padded = self.attended + [(s, self.sparse[s]) for s, seq in self.sides if attended(self.sparse[seq])]
        # each sparse feature's block of `timestamps`: its own, or its sequence's for a side field (-1: none)
        block = {index[f.name]: k for k, (_, f) in enumerate(self.timed)}
        block |= {s: block[seq] for s, seq in self.sides if seq in block}
        self.stamp_block = [block.get(s, -1) for s in range(len(self.sparse))]
        # hard searches: (the sequence and its side fields, the searched field, the query), by index
        self.searched = [([s] + [side for side, seq in self.sides if seq == s], index[f.search_field],
                          index[f.search_query]) for s, f in enumerate(self.sparse) if f.search_field]
        self.time_buckets = time_buckets
        shared = {f.name for f in shared_sequences(features)}
        self.shared = {s for s, f in enumerate(self.sparse) if f.name in shared}  # used in request mode only
        self.shared_bags = [f.name for s, f in enumerate(self.sparse) if s in self.shared and (s, f) not in self.padded]

    INPUTS = ("ids", "lengths", "numeric")
    """The forward's inputs by name (trainer/serving/export.py's example_inputs.pt)."""

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        return self.predict(ids, lengths, numeric, None, None)

    def predict(self, ids: torch.Tensor, lengths: torch.Tensor, numeric: torch.Tensor,
                timestamps: torch.Tensor | None, now: torch.Tensor | None,
                holders: torch.Tensor | None = None, request: torch.Tensor | None = None) -> torch.Tensor:
        # No-ops for the documented dtypes; TorchScript, which checks none, then computes as pt2 does.
        ids, lengths, numeric = ids.long(), lengths.long(), numeric.double()
        dense = self.transform_numeric(numeric)
        pooled = {}
        for side, seq in self.sides:
            _require((lengths[side] == lengths[seq]).all(), f"sparse feature {self.sparse[side].name!r} must hold one "
                     f"value per id of sequence {self.sparse[seq].name!r} in each row (its side field)")
        if timestamps is not None:
            timestamps, now = timestamps.long(), now.long()
            self.check_times(lengths, timestamps, now)
        if holders is not None:
            holders, request = holders.long(), request.long()
            self.check_requests(holders, request, lengths.shape[1])
        if timestamps is not None or self.searched:
            ids, lengths, timestamps = self.keep_behaviours(ids, lengths, timestamps, now)
        if self.sparse:
            values, cut = self.hash_ids(ids, lengths)
            kjt = KeyedJaggedTensor(keys=[f.name for f in self.sparse], values=values, lengths=cut.flatten())
            pooled = self.ebc(kjt).to_dict()
            if holders is not None and self.shared_bags:  # a request's bags of its sequences: at its holder row
                at = holders.index_select(0, request)
                pooled.update({name: pooled[name].index_select(0, at) for name in self.shared_bags})
            if self.sequences is not None:
                padded = {f.name: self.behaviours(values, cut, s, f, holders if s in self.shared else None)
                          for s, f in self.padded}
                gaps = {} if timestamps is None else self.gaps(timestamps, now, lengths, cut, holders)
                # the candidates are bags here
                pooled.update(self.sequences.attend({}, pooled, padded, gaps, request=request))
        e_input = self.layout.assemble(pooled, dense)
        return torch.sigmoid(self.heads(self.tower(e_input)))

    def behaviours(self, rows: torch.Tensor, cut: torch.Tensor, s: int, f: FeatureSpec,
                   holders: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attended sequence `f` (sparse feature `s`) padded to max_len: (x [B, L, D], mask [B, L]),
        or of the rows `holders` alone ([R, L, ...]). Its table rows [B, L] (0 past a row's end) go
        through the bag collection as B x L bags of one id each, every other feature's bags empty:
        static shapes, one table, any table type."""
        length = f.max_len
        flat = cut.flatten()
        starts, count = (torch.cumsum(flat, 0) - flat).view_as(cut)[s], cut[s]
        if holders is not None:
            starts, count = starts.index_select(0, holders), count.index_select(0, holders)
        steps = torch.arange(length, device=rows.device)
        mask = steps < count.unsqueeze(1)
        positions = torch.where(mask, starts.unsqueeze(1) + steps, rows.shape[0])
        table_rows = torch.cat([rows, rows.new_zeros(1)])[positions.flatten()]
        slots = table_rows.shape[0]
        ones = torch.ones(slots, dtype=torch.int64, device=rows.device)
        bags = torch.cat([ones if i == s else ones * 0 for i in range(len(self.sparse))])
        kjt = KeyedJaggedTensor(keys=[g.name for g in self.sparse], values=table_rows, lengths=bags)
        x = self.ebc(kjt)[f.name].view(-1, length, f.embedding_dim)
        return x * mask.unsqueeze(-1).to(x.dtype), mask

    def check_times(self, lengths: torch.Tensor, timestamps: torch.Tensor, now: torch.Tensor) -> None:
        """Every time 0 <= t < 2^62, so that no gap overflows, and one timestamp per timed id."""
        _require(((timestamps >= 0) & (timestamps < TIME_LIMIT)).all() & ((now >= 0) & (now < TIME_LIMIT)).all(),
                 "timestamps and now must be 0 <= t < 2^62")
        _require(torch.stack([lengths[s].sum() for s, _ in self.timed]).sum() == timestamps.shape[0],
                 "timestamps must hold one value per id of each sequence with timestamps")

    def check_requests(self, holders: torch.Tensor, request: torch.Tensor, rows: int) -> None:
        """holders [R] rows of the batch, request [B] in 0..R-1, each holder its own request's."""
        _require(((holders >= 0) & (holders < rows)).all(), "holders must be rows of the batch")
        _require(((request >= 0) & (request < holders.shape[0])).all(), "request must be in 0..R-1, R the holders")
        _require((request.index_select(0, holders) == torch.arange(holders.shape[0], device=holders.device)).all(),
                 "each holder must be a row of its own request: request[holders[r]] == r")

    def keep_behaviours(self, ids: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor | None,
                        now: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(ids, lengths, timestamps) of only the behaviours the reader keeps: each hard search's
        matches, those whose searched field's raw id equals the row's query id (none where the
        query is null; trainer/data/side_fields.py `HardSearch`), and none after its row's request
        time (trainer/data/timestamps.py); a side field's values go with its sequence's ids."""
        n, rows = ids.shape[0], lengths.shape[1]
        flat, per_feature = lengths.flatten(), lengths.sum(dim=1)

        def per_id(values: list[int]) -> torch.Tensor:  # one constant per feature -> one per id
            return torch.repeat_interleave(torch.tensor(values, device=ids.device), per_feature, output_size=n)

        starts = torch.cumsum(per_feature, 0) - per_feature  # each feature's first id
        # an id's place in its feature
        within = torch.arange(n, device=ids.device) - torch.repeat_interleave(starts, per_feature, output_size=n)
        keep = torch.ones(n, dtype=torch.bool, device=ids.device)
        padded = torch.cat([ids, ids.new_zeros(1)])  # index n: read where an id is not searched
        if self.searched:
            each_row = torch.arange(rows, device=ids.device)
            row = torch.repeat_interleave(each_row.unsqueeze(0).expand_as(lengths).flatten(), flat, output_size=n)
            bag_starts = torch.cumsum(flat, 0) - flat
            for members, field, query in self.searched:
                member = per_id([int(s in members) for s in range(len(self.sparse))]) == 1
                value = padded[torch.where(member, starts[field] + within, n)]  # the searched field's, aligned
                present = lengths[query] > 0  # an id feature: one id a row, or none
                asked = padded[torch.where(present, bag_starts[query * rows + each_row], n)]
                keep = keep & (~member | ((value == asked[row]) & present[row]))
        kept_stamps = None
        if timestamps is not None:
            # Ids and timestamps come in the same order (feature after feature, row after row), and a
            # side field's values as its sequence's ids: an id's timestamp is at its place in its
            # feature plus where its block starts.
            block = per_id(self.stamp_block)
            counts = torch.stack([per_feature[s] for s, _ in self.timed])
            block_start = torch.cat([torch.cumsum(counts, 0) - counts, counts.new_zeros(1)])  # [T + 1]
            timed = block >= 0
            positions = torch.where(timed, block_start[torch.where(timed, block, len(self.timed))] + within,
                                    timestamps.shape[0])
            stamp = torch.cat([timestamps, timestamps.new_zeros(1)])[positions]
            keep = keep & (~timed | (stamp <= torch.repeat_interleave(torch.cat([now] * len(self.sparse)), flat,
                                                                       output_size=n)))
            own = per_id([int(s in {t for t, _ in self.timed}) for s in range(len(self.sparse))]) == 1
            kept_stamps = stamp[keep & own]
        kept = torch.cat([flat.new_zeros(1), torch.cumsum(keep.long(), 0)])
        ends = torch.cumsum(flat, 0)
        return ids[keep], (kept[ends] - kept[ends - flat]).view_as(lengths), kept_stamps

    def gaps(self, timestamps: torch.Tensor, now: torch.Tensor, lengths: torch.Tensor,
             cut: torch.Tensor, holders: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each timed sequence's gap buckets [B, L] (0 past a row's end): its timestamps (none after
        the request time: `keep_behaviours`) cut to the last max_len as its ids are, the gap to `now`
        bucketed; a shared sequence's of the rows `holders` alone, where given ([R, L])."""
        counts = [lengths[s] for s, _ in self.timed]
        out = {}
        block = torch.zeros((), dtype=torch.int64, device=timestamps.device)
        extended = torch.cat([timestamps, timestamps.new_zeros(1)])
        for (s, f), count in zip(self.timed, counts):
            ends, kept, at = block + torch.cumsum(count, 0), cut[s], now
            if holders is not None and s in self.shared:
                ends, kept, at = (t.index_select(0, holders) for t in (ends, kept, now))
            steps = torch.arange(f.max_len, device=timestamps.device)
            mask = steps < kept.unsqueeze(1)
            positions = torch.where(mask, (ends - kept).unsqueeze(1) + steps, timestamps.shape[0])
            gap = at.unsqueeze(1) - extended[positions]
            out[f.name] = torch.where(mask, gap_buckets_torch(gap, self.time_buckets), 0)
            block = block + count.sum()
        return out

    def hash_ids(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ids [N], lengths [S, B] -> table rows, lengths: ids checked (hashing 'none'),
        reduced modulo the table as unsigned 64-bit numbers, or looked up in a managed table's
        id map; each bag cut to its last max_len ids."""
        _require((lengths >= 0).all(), "lengths must not be negative")
        per_feature = lengths.sum(dim=1)
        n = ids.shape[0]
        _require(per_feature.sum() == n, "lengths must add up to the number of ids")

        def per_id(values: list[int]) -> torch.Tensor:  # one value per feature -> one per id
            return torch.repeat_interleave(torch.tensor(values, device=ids.device), per_feature, output_size=n)

        rows = self._table_rows(ids, per_id)
        limits = [f.max_len or _NO_LIMIT for f in self.sparse]
        if any(f.max_len for f in self.sparse):
            flat = lengths.flatten()
            bag_end = torch.repeat_interleave(torch.cumsum(flat, 0), flat, output_size=n)
            keep = bag_end - torch.arange(n, device=ids.device) <= per_id(limits)  # the last max_len of each bag
            rows = rows[keep]
            lengths = torch.minimum(lengths, torch.tensor(limits, device=ids.device).unsqueeze(1))
        return rows, lengths

    def _table_rows(self, ids: torch.Tensor, per_id) -> torch.Tensor:
        """Each id hashed by its feature's mode (`HASHINGS`): every mode runs over every id and
        `torch.where` keeps each feature's own, so there is no data-dependent split to trace."""
        sizes = per_id([f.num_embeddings for f in self.sparse])
        checked = [(i, f) for i, f in enumerate(self.sparse) if HASHINGS[f.hashing].in_range]
        if checked:
            feature = per_id(list(range(len(self.sparse))))
            outside = (ids < 0) | (ids >= sizes)  # as unsigned numbers: an id below 0 is 2^63 or more
            for i, f in checked:
                _require(~(outside & (feature == i)).any(), f"sparse feature {f.name!r}: an id is out of "
                         f"range for its {f.num_embeddings} rows (hashing {f.hashing!r})")
        rows = ids  # what the in-range modes keep
        for mode in sorted({f.hashing for f in self.sparse if not HASHINGS[f.hashing].in_range}):
            hashed = HASHINGS[mode].torch(ids, sizes)
            if mode == "managed":  # spread ids -> rows, by each managed table's fixed map
                for table, id_map in self.id_maps.items():
                    in_table = per_id([int(f.table == table) for f in self.sparse]) == 1
                    rows = torch.where(in_table, id_map(hashed), rows)
            else:
                rows = torch.where(per_id([int(f.hashing == mode) for f in self.sparse]) == 1, hashed, rows)
        return rows

    def transform_numeric(self, numeric: torch.Tensor) -> torch.Tensor:
        """[B, F] float64 raw -> [B, F] float32: nulls filled, transforms applied in order."""
        columns = []
        for i, f in enumerate(self.numeric):
            x = numeric[:, i]
            if f.fill_null is not None:
                x = torch.where(torch.isnan(x), f.fill_null, x)
            _require(torch.isfinite(x).all(), f"numeric feature {f.name!r}: a null or non-finite value")
            for op in f.transform:
                transform = TRANSFORMS[op]
                if transform.valid is not None:
                    _require(transform.valid(x).all(), f"numeric feature {f.name!r}: {op} needs {transform.needs}")
                x = transform.torch(x, f)
            columns.append(x)
        if not columns:
            return numeric.new_zeros(numeric.shape[0], 0, dtype=torch.float32)
        return torch.stack(columns, dim=1).to(torch.float32)


class TimedServingModel(ServingModel):
    """A ServingModel whose attended sequences have timestamps: (ids, lengths, numeric, timestamps,
    now) -> probabilities [B, K]; see the module docstring."""

    INPUTS = ("ids", "lengths", "numeric", "timestamps", "now")

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, numeric: torch.Tensor, timestamps: torch.Tensor,
                now: torch.Tensor) -> torch.Tensor:
        return self.predict(ids, lengths, numeric, timestamps, now)


class RequestServingModel(ServingModel):
    """A ServingModel trained with data.request_column: (ids, lengths, numeric, holders, request) ->
    probabilities [B, K]; a request's shared sequences are read at its holder row, once."""

    INPUTS = ("ids", "lengths", "numeric", "holders", "request")

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, numeric: torch.Tensor, holders: torch.Tensor,
                request: torch.Tensor) -> torch.Tensor:
        return self.predict(ids, lengths, numeric, None, None, holders, request)


class TimedRequestServingModel(ServingModel):
    """`TimedServingModel`'s inputs, then `RequestServingModel`'s holders and request."""

    INPUTS = ("ids", "lengths", "numeric", "timestamps", "now", "holders", "request")

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, numeric: torch.Tensor, timestamps: torch.Tensor,
                now: torch.Tensor, holders: torch.Tensor, request: torch.Tensor) -> torch.Tensor:
        return self.predict(ids, lengths, numeric, timestamps, now, holders, request)


def serving_class(timed: bool, requests: bool) -> type[ServingModel]:
    """The ServingModel whose forward takes timestamps (`timed`) and requests' holders (`requests`)."""
    return {(False, False): ServingModel, (True, False): TimedServingModel, (False, True): RequestServingModel,
            (True, True): TimedRequestServingModel}[timed, requests]


class ManagedRows(nn.Module):
    """Spread ids [N] int64 -> rows [N] of one managed table, as TorchRec's MCH maps them in
    evaluation on the ranks that trained it: the id spread as the reader spreads it
    (`HASHINGS['managed']`, trainer/data/feature_ops.py), then its row in the map, or else the miss row of the
    rank whose range holds it. The map (embeddings/managed.py `served_tables`) is fixed: serving admits
    and evicts nothing.

    keys [M] ascending spread ids, rows [M] their rows, miss_rows [W] one per training rank.
    """

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor, miss_rows: torch.Tensor):
        super().__init__()
        # A last key above every spread id, so that a search never runs past the end (MCH's own
        # sorted ids end with such a free slot).
        self.register_buffer("keys", torch.cat([keys, torch.tensor([torch.iinfo(torch.int64).max])]))
        self.register_buffer("rows", torch.cat([rows, miss_rows[-1:]]))
        self.register_buffer("miss_rows", miss_rows.clone())
        self.range_per_rank = -(-MANAGED_ID_RANGE // len(miss_rows))  # TorchRec's row-wise bucket size

    def forward(self, spread: torch.Tensor) -> torch.Tensor:
        """Spread ids [N] (`HASHINGS['managed']`) -> rows [N]."""
        at = torch.searchsorted(self.keys, spread)
        return torch.where(self.keys[at] == spread, self.rows[at], self.miss_rows[spread // self.range_per_rank])
