"""The feature schema ([[features]]): where each input comes from, its embedding table and
how ids reach a row (hashing, managed collisions and their eviction), or its numeric
transforms, and the semantic group its token slice belongs to.

The lowest floor of the code base holds it, because every floor reads it: the tables and
their sharding (here), the dense side's input layout (dense/layout.py), the reader's
encoding and the serving artifact (trainer/). Standard library only (torch on use, for one
check): `rankmix --help` loads it without torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

FeatureKind = Literal["id", "id_list", "sequence", "numeric"]
Hashing = Literal["modulo", "none", "managed", "log2"]
EvictionPolicy = Literal["lfu", "lru"]
Pooling = Literal["sum", "mean"]
NumericTransform = Literal["log1p", "clip", "standardize"]

MANAGED_ID_RANGE = 2 ** 62
"""Managed tables take ids in [0, MANAGED_ID_RANGE): TorchRec's MCH routes an id to the rank
that owns its part of that range, and marks an empty slot with INT64_MAX."""


@dataclass
class FeatureSpec:
    """One input feature: where it comes from, how it is embedded, which group it feeds."""

    name: str = ""
    """Feature name: the key in the KeyedJaggedTensor, in logs and in CLI overrides."""
    column: str = ""
    """Source column in the Parquet files (defaults to `name`)."""
    kind: FeatureKind = "id"
    """id (one id per row) | id_list (multi-hot) | sequence (behaviour ids, most recent last) | numeric."""
    table: str = ""
    """Embedding table (defaults to `name`); features naming one table share it."""
    num_embeddings: int = 0
    """Rows of the embedding table."""
    embedding_dim: int = 16
    """Width of the embedding table."""
    hashing: Hashing = "modulo"
    ("""modulo: id % num_embeddings | none: an id >= num_embeddings is an error | managed: every live id its own """
     """row (TorchRec MCH), stale ones evicted | log2: a count or a duration v >= 0, its power-of-two bucket """
     """min(bit_length(v), num_embeddings - 1): 0, 1, 2-3, 4-7, ... (a dwell time as a side field).""")
    eviction_policy: EvictionPolicy = "lfu"
    """managed: rows freed at an eviction: lfu (least frequently used, decayed by age) | lru (least recently used)."""
    eviction_interval: int = 100
    ("""managed: training steps between evictions; a new id gets a row at the next one (until then the shard's """
     """miss row).""")
    pooling: Pooling = "sum"
    """How an id list is pooled into one vector: sum | mean."""
    group: str = "default"
    """Semantic group (user, item, context, sequence, cross...) the feature's token slice belongs to."""
    max_len: int = 0
    """id_list / sequence: keep only the last max_len ids (0 keeps all)."""
    transform: list[NumericTransform] = field(default_factory=list)
    """numeric: transforms applied in order, from log1p | clip | standardize."""
    clip_min: float = -math.inf
    """numeric `clip`: lower bound."""
    clip_max: float = math.inf
    """numeric `clip`: upper bound."""
    mean: float = 0.0
    """numeric `standardize`: subtracted mean."""
    std: float = 1.0
    """numeric `standardize`: divisor."""
    fill_null: float | None = None
    """numeric: value that replaces nulls (unset: a null is an error)."""
    sequence_module: str = "pool"
    ("""sequence: pool (a pooled bag, as id_list) | target_attention (behaviours weighted by the candidate) | """
     """transformer (self-attention, then target attention); dense/sequence.py.""")
    candidate: str = ""
    """sequence, not pool: the id feature whose vector attends (default: the id feature sharing this table)."""
    sequence_tokens: int = 1
    ("""sequence, not pool: vectors the module outputs, each its own group and so its own token under the group """
     """tokenizer.""")
    timestamps: str = ""
    ("""sequence, not pool: list column of the behaviours' times (seconds, aligned with the ids); the gap to """
     """data.time_column is embedded.""")
    side_of: str = ""
    ("""sequence: makes this list a side field of that sequence, one value per behaviour aligned with its ids """
     """(a past rating's stars, its genre); its vector is added to the behaviour's.""")
    search_field: str = ""
    ("""sequence: SIM's hard search: keep only the behaviours whose value of this side field equals the """
     """candidate's search_query, then the newest max_len of them.""")
    search_query: str = ""
    """sequence, search_field set: the candidate's id feature whose raw value a behaviour's search_field must equal."""
    search_k: int = 0
    ("""sequence, not pool: SIM's soft search: of the max_len kept, the module reads only the search_k whose vectors """
     """are most similar to the query's (inner product; 0 reads all).""")
    candidate_fields: list[str] = field(default_factory=list)
    ("""sequence, not pool: more id features of the candidate added to its vector into the query (its genre, """
     """on the table of the behaviours' genre side field).""")

    def __post_init__(self) -> None:
        self.column = self.column or self.name
        if self.kind != "numeric":
            self.table = self.table or self.name


def attended(f: FeatureSpec) -> bool:
    """Whether `f` is a sequence read position by position (a sequence module other than pool)."""
    return f.kind == "sequence" and not f.side_of and f.sequence_module != "pool"


def side_fields(f: FeatureSpec, features: list[FeatureSpec]) -> list[FeatureSpec]:
    """The side fields of sequence `f` (features whose side_of names it), in schema order."""
    return [g for g in features if g.kind == "sequence" and g.side_of == f.name]


def read_with_attended(features: list[FeatureSpec]) -> list[FeatureSpec]:
    """The features read position by position: attended sequences and their side fields."""
    names = {f.name for f in features if attended(f)}
    return [f for f in features if attended(f) or (f.kind == "sequence" and f.side_of in names)]


def shared_sequences(features: list[FeatureSpec]) -> list[FeatureSpec]:
    """The sequences a request's rows share (`data.request_column`): every sequence and side field but
    those of a hard search (`search_field`), whose behaviours depend on each row's candidate."""
    searched = {f.name for f in features if f.kind == "sequence" and f.search_field}
    return [f for f in features if f.kind == "sequence" and f.name not in searched and f.side_of not in searched]


def attended_tables(features: list[FeatureSpec]) -> list[str]:
    """The tables of attended sequences and of their side fields, sorted by name: looked up unpooled
    (an EmbeddingCollection), with every feature that names them."""
    return sorted({f.table for f in read_with_attended(features)})


def default_candidate(f: FeatureSpec, features: list[FeatureSpec]) -> str:
    """The candidate of sequence `f`: its `candidate`, or else the first id feature on its table."""
    if f.candidate:
        return f.candidate
    same = [g.name for g in features if g.kind == "id" and g.table == f.table]
    if not same:
        raise ValueError(f"features.{f.name}: sequence_module={f.sequence_module!r} needs a candidate, and no id "
                         f"feature shares table {f.table!r}; set features.{f.name}.candidate")
    return same[0]


def managed_tables(features: list[FeatureSpec]) -> list[str]:
    """The tables with managed collisions (hashing = "managed"), sorted by name."""
    return sorted({f.table for f in features if f.hashing == "managed"})


def unpooled_features(features: list[FeatureSpec]) -> list[FeatureSpec]:
    """The features on attended sequences' tables, looked up unpooled: those on unmanaged tables,
    then those on managed ones, each in schema order (`Batch.sequence_ids`, then
    `Batch.managed_sequence_ids`: TorchRec's pipeline sends each collection its own)."""
    unpooled = set(attended_tables(features))
    on = [f for f in features if f.kind != "numeric" and f.table in unpooled]
    return [f for f in on if f.hashing != "managed"] + [f for f in on if f.hashing == "managed"]


ID_FIELDS = ("table", "num_embeddings", "embedding_dim", "hashing", "pooling", "max_len")
"""FeatureSpec fields that only id, id_list and sequence features read."""
SEQUENCE_FIELDS = ("sequence_module", "candidate", "sequence_tokens", "timestamps", "side_of", "candidate_fields",
                   "search_field", "search_query", "search_k")
"""FeatureSpec fields that only sequence features read (all but sequence_module only when not pooled)."""
NUMERIC_FIELDS = ("transform", "clip_min", "clip_max", "mean", "std", "fill_null")
"""FeatureSpec fields that only numeric features read."""


def unused_feature_fields(features: list[FeatureSpec]) -> dict[str, tuple[str, str]]:
    """Each feature field that its feature's kind and hashing do not read -> (the key whose
    value makes it unused, why)."""
    unused: dict[str, tuple[str, str]] = {}
    for f in features:
        where = f"features.{f.name}"
        numeric = f.kind == "numeric"
        cause = (f"{where}.kind", f"{where}.kind={f.kind!r} does not read it")
        unused |= dict.fromkeys((f"{where}.{name}" for name in (NUMERIC_FIELDS if not numeric else ID_FIELDS)), cause)
        if f.kind != "sequence":
            unused |= dict.fromkeys((f"{where}.{name}" for name in SEQUENCE_FIELDS), cause)
        elif f.side_of:  # a side field is read as its sequence is: the sequence's settings hold
            unused |= dict.fromkeys((f"{where}.{name}" for name in SEQUENCE_FIELDS if name != "side_of"),
                                    (f"{where}.side_of", f"{where} is a side field of features.{f.side_of}, "
                                     "whose settings it follows"))
        elif not attended(f):  # timestamps stay: a schema names its columns whichever module reads them
            unused |= dict.fromkeys((f"{where}.{name}" for name in ("candidate", "sequence_tokens",
                                                                     "candidate_fields", "search_k")),
                                    (f"{where}.sequence_module", f"{where}.sequence_module='pool' does not read it"))
        if numeric or f.hashing != "managed":
            unused |= dict.fromkeys((f"{where}.eviction_policy", f"{where}.eviction_interval"), cause if numeric else
                                    (f"{where}.hashing", f"{where}.hashing={f.hashing!r} is not managed"))
    return unused


def validate_features(features: list[FeatureSpec]) -> None:
    """Check each feature and table sharing (the choices are checked by the loader's types;
    column and table defaults are FeatureSpec's own)."""
    seen: set[str] = set()
    tables: dict[str, FeatureSpec] = {}
    for f in features:
        where = f"features.{f.name or '<unnamed>'}"
        if not f.name:
            raise ValueError("features: every feature needs a name")
        if f.name in seen:
            raise ValueError(f"{where}: duplicate feature name")
        seen.add(f.name)
        if f.kind == "numeric":
            if f.std <= 0:
                raise ValueError(f"{where}.std must be positive, got {f.std}")
            if f.fill_null is not None and not math.isfinite(f.fill_null):
                raise ValueError(f"{where}.fill_null must be a finite number, got {f.fill_null}")
            continue
        if f.max_len < 0:
            raise ValueError(f"{where}.max_len must be >= 0, got {f.max_len}")
        if f.num_embeddings <= 0 or f.embedding_dim <= 0:
            raise ValueError(f"{where}: num_embeddings and embedding_dim must be positive")
        if f.hashing == "managed" and f.eviction_interval < 1:
            raise ValueError(f"{where}.eviction_interval must be at least 1, got {f.eviction_interval}")
        if f.table in _taken_table_names():
            raise ValueError(f"{where}.table: {f.table!r} is a name TorchRec cannot give a table (it keeps "
                             "tables in a torch ModuleDict, which has an attribute of that name); rename it")
        other = tables.setdefault(f.table, f)
        if (other.num_embeddings, other.embedding_dim) != (f.num_embeddings, f.embedding_dim):
            raise ValueError(
                f"{where}: shares table {f.table!r} with features.{other.name} but their "
                "num_embeddings / embedding_dim differ")
        managed = (f.hashing == "managed", f.eviction_policy, f.eviction_interval)
        if (other.hashing == "managed", other.eviction_policy, other.eviction_interval) != managed and \
                "managed" in (f.hashing, other.hashing):
            raise ValueError(f"{where}: shares table {f.table!r} with features.{other.name}, so both must be "
                             "managed with the same eviction_policy and eviction_interval, or neither")
    _validate_sides(features)
    by_name = {f.name: f for f in features}
    for f in features:
        _validate_search(f, by_name)
    _validate_sequences(features)


def _validate_sides(features: list[FeatureSpec]) -> None:
    """Side fields: each of a sequence that is not one itself, as wide (its vector is added to the
    behaviour's) and as long (the same newest behaviours kept) as it; pooled as a pooled sequence."""
    by_name = {f.name: f for f in features}
    for f in features:
        if not f.side_of:
            continue
        where = f"features.{f.name}"
        seq = by_name.get(f.side_of)
        if f.kind != "sequence":
            raise ValueError(f"{where}.side_of needs kind='sequence' (a list per row, one value per behaviour), "
                             f"got kind={f.kind!r}")
        if seq is None or seq.kind != "sequence" or seq.side_of:
            raise ValueError(f"{where}.side_of={f.side_of!r} is not a sequence feature (a side field's own "
                             "side_of must name the sequence itself)")
        for name in ("embedding_dim", "max_len"):
            if getattr(f, name) != getattr(seq, name):
                raise ValueError(f"{where}.{name}={getattr(f, name)} differs from features.{seq.name}.{name}="
                                 f"{getattr(seq, name)}: a side field is aligned with its sequence, its vector "
                                 "added to each behaviour's")
        if not attended(seq) and f.pooling != seq.pooling:
            raise ValueError(f"{where}.pooling={f.pooling!r} differs from features.{seq.name}.pooling="
                             f"{seq.pooling!r}: a pooled sequence's side field is pooled as it is")


def _validate_sequences(features: list[FeatureSpec]) -> None:
    """Attended sequences: a bounded length, a candidate that is an id feature of the same width,
    tables of one width (TorchRec's EmbeddingCollection holds tables of one width)."""
    by_name = {f.name: f for f in features}
    width = None
    for f in features:
        if not attended(f):
            continue
        where = f"features.{f.name}"
        if f.max_len <= 0:
            raise ValueError(f"{where}.sequence_module={f.sequence_module!r} needs max_len > 0 (the behaviours kept, "
                             "most recent last), got 0")
        if f.sequence_tokens < 1:
            raise ValueError(f"{where}.sequence_tokens must be at least 1, got {f.sequence_tokens}")
        if f.search_k < 0:
            raise ValueError(f"{where}.search_k must be >= 0 (0 reads every behaviour kept), got {f.search_k}")
        name = default_candidate(f, features)
        cand = by_name.get(name)
        if cand is None or cand.kind != "id":
            raise ValueError(f"{where}.candidate={name!r} is not an id feature")
        if cand.embedding_dim != f.embedding_dim:
            raise ValueError(f"{where}.candidate={name!r} has embedding_dim {cand.embedding_dim}, the sequence "
                             f"{f.embedding_dim}: they must match")
        for extra in f.candidate_fields:
            other = by_name.get(extra)
            if other is None or other.kind not in ("id", "id_list"):
                raise ValueError(f"{where}.candidate_fields: {extra!r} is not an id or id_list feature")
            if other.embedding_dim != f.embedding_dim:
                raise ValueError(f"{where}.candidate_fields: {extra!r} has embedding_dim {other.embedding_dim}, the "
                                 f"sequence {f.embedding_dim}: they must match (its vector is added to the query)")
        if width is not None and width != f.embedding_dim:
            raise ValueError(f"{where}.embedding_dim={f.embedding_dim}: every attended sequence's table needs the same "
                             f"width (TorchRec's EmbeddingCollection), another has {width}")
        width = f.embedding_dim
    unpooled = set(attended_tables(features))
    for f in features:
        if f.kind in ("id_list", "sequence") and f.table in unpooled and f.max_len <= 0:
            raise ValueError(f"features.{f.name}.max_len must be > 0: its table {f.table!r} holds an attended "
                             "sequence, so it is looked up unpooled and padded (to max_len in a served model)")


def _validate_search(f: FeatureSpec, by_name: dict[str, FeatureSpec]) -> None:
    """A hard search names one of the sequence's side fields and an id feature of the candidate."""
    where = f"features.{f.name}"
    if bool(f.search_field) != bool(f.search_query):
        raise ValueError(f"{where}: search_field and search_query go together (the behaviours' field and the "
                         f"candidate's id it must equal), got search_field={f.search_field!r}, "
                         f"search_query={f.search_query!r}")
    if not f.search_field:
        return
    field_spec, query = by_name.get(f.search_field), by_name.get(f.search_query)
    if field_spec is None or field_spec.side_of != f.name:
        raise ValueError(f"{where}.search_field={f.search_field!r} is not a side field of features.{f.name}")
    if query is None or query.kind != "id":
        raise ValueError(f"{where}.search_query={f.search_query!r} is not an id feature")


@functools.cache
def _taken_table_names() -> frozenset[str]:
    from torch import nn  # on use: the config loads without torch (`rankmix --help`, `rankmix data`)

    return frozenset(dir(nn.ModuleDict))
