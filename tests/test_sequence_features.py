"""The schema's rules (embeddings/features.py) in-process, each error message whole: the sequence's
default candidate among several ids on its table, the features looked up unpooled and their
order, the fields a feature's kind does not read, and each check of a feature and of a table
shared, one step past each limit and at it."""

from __future__ import annotations

import dataclasses

import pytest

from embeddings.features import (
    ID_FIELDS,
    NUMERIC_FIELDS,
    SEQUENCE_FIELDS,
    FeatureSpec,
    attended_tables,
    default_candidate,
    managed_tables,
    unpooled_features,
    unused_feature_fields,
    validate_features,
)

f = FeatureSpec


def catalog(**hist) -> list[FeatureSpec]:
    """Two ids on the sequence's table (the first is the default candidate), a list and the history."""
    return [f(name="seller", num_embeddings=9, embedding_dim=8),
            f(name="item", table="catalog", num_embeddings=50, embedding_dim=8),
            f(name="shown", table="catalog", num_embeddings=50, embedding_dim=8),
            f(name="tags", kind="id_list", table="catalog", num_embeddings=50, embedding_dim=8, max_len=3),
            f(**{"name": "hist", "kind": "sequence", "table": "catalog", "num_embeddings": 50, "embedding_dim": 8,
                 "max_len": 6, "sequence_module": "target_attention"} | hist)]


def error(features: list[FeatureSpec]) -> str:
    with pytest.raises(ValueError) as e:
        validate_features(features)
    return str(e.value)


def test_the_default_candidate_is_the_first_id_on_the_sequences_table_in_schema_order():
    features = catalog()
    validate_features(features)
    assert default_candidate(features[4], features) == "item"
    swapped = [features[0], features[2], features[1], *features[3:]]
    assert default_candidate(swapped[4], swapped) == "shown"
    assert default_candidate(dataclasses.replace(features[4], candidate="shown"), features) == "shown"
    alone = [f(name="hist", kind="sequence", table="catalog", num_embeddings=50, embedding_dim=8, max_len=6,
               sequence_module="transformer")]
    assert error(alone) == ("features.hist: sequence_module='transformer' needs a candidate, and no id feature "
                            "shares table 'catalog'; set features.hist.candidate")


def test_the_features_on_an_attended_table_are_unpooled_unmanaged_first_each_in_schema_order():
    features = catalog()
    features[1:] = [dataclasses.replace(g, hashing="managed") if g.name in ("item", "hist") else g
                    for g in features[1:]]
    features.append(f(name="price", kind="numeric", table="catalog"))  # a numeric naming the table stays out
    assert [g.name for g in unpooled_features(features)] == ["shown", "tags", "item", "hist"]
    assert attended_tables(features + [f(name="b", kind="sequence", sequence_module="transformer")]) == ["b", "catalog"]
    assert managed_tables(features + [f(name="a", hashing="managed")]) == ["a", "catalog"]
    assert unpooled_features(catalog(sequence_module="pool")) == []
    assert f(name="p", kind="numeric").table == "" and f(name="p", kind="numeric").column == "p"
    assert f(name="i").table == "i" and f(name="i", column="c", table="t").column == "c"


def test_each_field_a_feature_does_not_read_is_named_with_the_reason():
    features = [f(name="p", kind="numeric"), f(name="u"), f(name="m", hashing="managed"),
                f(name="s", kind="sequence"), f(name="a", kind="sequence", sequence_module="transformer"),
                f(name="r", kind="sequence", side_of="a")]
    kind = {name: (f"features.{name}.kind", f"features.{name}.kind={k!r} does not read it")
            for name, k in [("p", "numeric"), ("u", "id"), ("m", "id")]}
    expected = {}
    expected |= {f"features.p.{x}": kind["p"] for x in (*ID_FIELDS, *SEQUENCE_FIELDS)}
    expected |= {"features.p.eviction_policy": kind["p"], "features.p.eviction_interval": kind["p"]}
    for name in ("u", "m"):
        expected |= {f"features.{name}.{x}": kind[name] for x in (*NUMERIC_FIELDS, *SEQUENCE_FIELDS)}
    unmanaged = ("features.u.hashing", "features.u.hashing='modulo' is not managed")
    expected |= {"features.u.eviction_policy": unmanaged, "features.u.eviction_interval": unmanaged}
    for name in ("s", "a", "r"):
        cause = (f"features.{name}.kind", f"features.{name}.kind='sequence' does not read it")
        expected |= {f"features.{name}.{x}": cause for x in NUMERIC_FIELDS}
        hashing = (f"features.{name}.hashing", f"features.{name}.hashing='modulo' is not managed")
        expected |= {f"features.{name}.eviction_policy": hashing, f"features.{name}.eviction_interval": hashing}
    pool = ("features.s.sequence_module", "features.s.sequence_module='pool' does not read it")
    expected |= {"features.s.candidate": pool, "features.s.sequence_tokens": pool,  # timestamps: the schema's column
                 "features.s.candidate_fields": pool, "features.s.search_k": pool}
    side = ("features.r.side_of", "features.r is a side field of features.a, whose settings it follows")
    expected |= {f"features.r.{x}": side for x in SEQUENCE_FIELDS if x != "side_of"}
    assert unused_feature_fields(features) == expected


@pytest.mark.parametrize("change,message", [
    ({"name": ""}, "features: every feature needs a name"),
    ({"name": "item"}, "features.item: duplicate feature name"),
    ({"max_len": -1}, "features.seller.max_len must be >= 0, got -1"),
    ({"num_embeddings": 0}, "features.seller: num_embeddings and embedding_dim must be positive"),
    ({"embedding_dim": 0}, "features.seller: num_embeddings and embedding_dim must be positive"),
    ({"hashing": "managed", "eviction_interval": 0}, "features.seller.eviction_interval must be at least 1, got 0"),
    ({"table": "items"}, "features.seller.table: 'items' is a name TorchRec cannot give a table (it keeps tables in "
                         "a torch ModuleDict, which has an attribute of that name); rename it"),
    ({"table": "catalog"}, "features.item: shares table 'catalog' with features.seller but their num_embeddings / "
                           "embedding_dim differ"),
])
def test_each_check_of_a_feature_names_it(change, message):
    features = catalog()
    features[0] = dataclasses.replace(features[0], **change)
    assert error(features) == message


def test_the_checks_pass_at_each_limit_and_numeric_features_skip_the_id_checks():
    features = catalog()
    features[0] = dataclasses.replace(features[0], num_embeddings=1, embedding_dim=1, max_len=0,
                                      hashing="managed", eviction_interval=1)
    features[3] = dataclasses.replace(features[3], max_len=1)
    features[4] = dataclasses.replace(features[4], max_len=1)
    validate_features(features)
    validate_features([f(name="u", num_embeddings=5, eviction_interval=0)])  # unmanaged: the interval is not read
    numeric = [f(name="p", kind="numeric", std=1e-9), f(name="u", num_embeddings=0)]
    assert error(numeric) == "features.u: num_embeddings and embedding_dim must be positive"
    assert error([f(name="p", kind="numeric", std=0.0)]) == "features.p.std must be positive, got 0.0"
    assert error([f(name="p", kind="numeric", fill_null=float("nan"))]) == \
        "features.p.fill_null must be a finite number, got nan"
    validate_features([f(name="p", kind="numeric", fill_null=-1e300)])


def test_a_shared_table_is_managed_alike_or_not_at_all():
    def pair(a: dict, b: dict) -> list[FeatureSpec]:
        return [f(name="a", table="t", num_embeddings=5, **a), f(name="b", table="t", num_embeddings=5, **b)]

    validate_features(pair({"eviction_policy": "lru"}, {"eviction_interval": 7}))  # unmanaged: neither is read
    managed = {"hashing": "managed", "eviction_interval": 7}
    validate_features(pair(managed, managed))
    message = ("features.b: shares table 't' with features.a, so both must be managed with the same eviction_policy "
               "and eviction_interval, or neither")
    assert error(pair({"hashing": "managed"}, {})) == message
    assert error(pair({}, {"hashing": "managed"})) == message
    assert error(pair({"hashing": "managed"}, {"hashing": "managed", "eviction_policy": "lru"})) == message
    assert error(pair({"hashing": "managed"}, {"hashing": "managed", "eviction_interval": 7})) == message


@pytest.mark.parametrize("change,message", [
    ({"max_len": 0}, "features.hist.sequence_module='target_attention' needs max_len > 0 (the behaviours kept, most "
                     "recent last), got 0"),
    ({"sequence_tokens": 0}, "features.hist.sequence_tokens must be at least 1, got 0"),
    ({"candidate": "nope"}, "features.hist.candidate='nope' is not an id feature"),
    ({"candidate": "tags"}, "features.hist.candidate='tags' is not an id feature"),
])
def test_each_check_of_an_attended_sequence_names_it(change, message):
    assert error(catalog(**change)) == message


def test_every_list_on_an_attended_table_needs_a_length_and_attended_tables_one_width():
    features = catalog()
    for i, kind in [(3, "id_list"), (3, "sequence")]:  # a pooled sequence on the table too
        features_i = list(features)
        features_i[i] = dataclasses.replace(features[i], kind=kind, max_len=0)
        assert error(features_i) == ("features.tags.max_len must be > 0: its table 'catalog' holds an attended "
                                     "sequence, so it is looked up unpooled and padded (to max_len in a served model)")
    validate_features(features + [f(name="free", kind="id_list", num_embeddings=5, embedding_dim=8)])  # another table
    other = [f(name="user", num_embeddings=5, embedding_dim=4),
             f(name="visits", kind="sequence", table="user", num_embeddings=5, embedding_dim=4, max_len=2,
               sequence_module="transformer")]
    assert error(features + other) == ("features.visits.embedding_dim=4: every attended sequence's table needs the "
                                       "same width (TorchRec's EmbeddingCollection), another has 8")
    same = [dataclasses.replace(g, embedding_dim=8) for g in other]
    validate_features(features + same)
    validate_features(same + features)
