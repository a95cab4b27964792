"""Side fields per behaviour (`features.<name>.side_of`) and a query of several candidate features
(`candidate_fields`): the reader keeps a side field aligned with its sequence (the same drops after
the request time, the same newest max_len), every module reads the behaviour as its id's vector
plus its side fields' and the query as the candidate's plus its fields', and the artifact does the
same from raw rows. Each against an independent reference: per-row Python for the reader, the
tables' weights summed by hand for the modules."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from dense.heads import build_dense
from dense.model_config import TaskSpec
from dense.sequence import build_sequences, pad, soft_search
from embeddings.features import FeatureSpec, validate_features
from embeddings.tables import sequence_table_configs, table_configs
from test_sequence_serving import timed_table
from test_serving_model import ROWS, features
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.ranking_model import RankingModel
from trainer.serving.export import FORMATS, example_inputs, serving_model, trace_model
from trainer.serving.predict import raw_inputs

RATINGS = 6  # the stars' table: ids 0-5
REPO = Path(__file__).resolve().parents[1]


def side_features(module: str, timestamps: bool, search: bool = False, soft: int = 0) -> list[FeatureSpec]:
    """test_serving_model's schema, its history with two side fields (the stars, hashing none, on a
    table of their own; the genre, hashed, on the table of the candidate's genre) and the
    candidate's genre in the query; with `search`, only the behaviours of the candidate's genre."""
    attended = module != "pool"
    search_keys = {"search_field": "history_genre", "search_query": "item_genre"} if search else {}  # any module
    search_keys |= {"search_k": soft} if soft else {}
    spec = [dataclasses.replace(f, sequence_module=module, sequence_tokens=2 if attended else 1,
                                timestamps="history_ts" if timestamps else "",
                                candidate_fields=["item_genre"] if attended else [], **search_keys)
            if f.name == "history" else f for f in features()]
    side = {"kind": "sequence", "side_of": "history", "embedding_dim": 8, "max_len": 4, "group": "context"}
    spec += [FeatureSpec(name="item_genre", table="genre", num_embeddings=7, embedding_dim=8, group="item"),
             FeatureSpec(name="history_stars", num_embeddings=RATINGS, hashing="none", **side),
             FeatureSpec(name="history_genre", table="genre", num_embeddings=7, **side)]
    validate_features(spec)
    return spec


def side_table(seed: int = 0) -> pa.Table:
    """test_sequence_serving's timed rows with the history's stars and genres, one per behaviour
    (a null list where the history is null or empty), and the candidate's genre (null in a few
    rows), genres drawn from 4 so that a quarter of the behaviours match the candidate's."""
    rows = timed_table(seed)
    rng = np.random.default_rng(seed + 2)
    lengths = [len(h or []) for h in rows.column("history").to_pylist()]
    stars = [list(rng.integers(0, RATINGS, n)) if n else None for n in lengths]
    genres = [list(rng.integers(0, 4, n)) for n in lengths]
    return rows.append_column("history_stars", pa.array(stars, pa.list_(pa.int64()))) \
        .append_column("history_genre", pa.array(genres, pa.list_(pa.int64()))) \
        .append_column("item_genre", pa.array(rng.integers(0, 4, ROWS), mask=np.arange(ROWS) % 13 == 6))


def reference(module: str, tower: str, timestamps: bool, search: bool = False, soft: int = 0):
    sizes = (["--model.hidden_dim=16", "--model.num_tokens=4"] if tower == "rankmixer"
             else ["--model.mlp.hidden=[16, 8]"])
    cfg = load_config(None, [f"--model.tower={tower}", *sizes, f"--data.time_column={'now' if timestamps else ''}"])
    cfg.features = side_features(module, timestamps, search, soft)
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    torch.manual_seed(0)
    layout, tower_module, heads = build_dense(cfg.model, cfg.features)
    attended = module != "pool"
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, tower_module, heads,
                         sequence_tables=EmbeddingCollection(tables=sequence_table_configs(cfg.features))
                         if attended else None,
                         sequences=build_sequences(cfg.features, cfg.model.sequence))
    for name, weights in model.named_parameters():  # the time values start at zero: here they count
        if "time_value" in name:
            torch.nn.init.normal_(weights)
    return cfg, model.eval()


def encoder(cfg) -> RowEncoder:
    return RowEncoder(cfg.features, cfg.model.tasks, "", cfg.data.time_column, cfg.model.sequence.time_buckets)


def kept(rows: pa.Table, column: str, timestamps: bool, search: bool = False) -> list[list[int]]:
    """Per row, `column`'s values at the behaviours the reader keeps: those of the candidate's
    genre (with `search`; none where it is null), not after the request time (with timestamps),
    then the last 4 (max_len)."""
    values = [v or [] for v in rows.column(column).to_pylist()]
    genres = [g or [] for g in rows.column("history_genre").to_pylist()]
    wanted = rows.column("item_genre").to_pylist()
    stamps = rows.column("history_ts").to_pylist()
    now = rows.column("now").to_pylist()
    return [[v for v, g, t in zip(vs, gs, ts) if (not timestamps or t <= n) and (not search or g == w)][-4:]
            for vs, gs, w, ts, n in zip(values, genres, wanted, stamps, now)]


@pytest.mark.parametrize("timestamps,search", [(True, False), (False, False), (True, True), (False, True)])
def test_the_reader_keeps_each_side_value_with_its_behaviour(timestamps, search):
    cfg, _ = reference("target_attention", "mlp", timestamps, search)
    rows = side_table()
    batch = encoder(cfg).encode(rows, "test").to_batch()
    looked = batch.sequence_ids.to_dict()
    genre_rows = [[g % 7 for g in gs] for gs in kept(rows, "history_genre", timestamps, search)]
    for name, expected in (("history", kept(rows, "history", timestamps, search)),
                           ("history_stars", kept(rows, "history_stars", timestamps, search)),
                           ("history_genre", genre_rows)):
        assert [v.tolist() for v in looked[name].to_dense()] == expected, name
    if timestamps:  # the drops are the sequence's: some rows lost behaviours to them
        assert sum(map(len, kept(rows, "history", True, search))) < sum(map(len, kept(rows, "history", False, search)))
        gaps = batch.sequence_gaps[0].tolist()  # the kept behaviours' own gaps, in order
        now, stamps = rows.column("now").to_pylist(), kept(rows, "history_ts", True, search)
        assert gaps == [min(1 + int(n - t + 1).bit_length() - 1, cfg.model.sequence.time_buckets - 1)
                        for n, ts in zip(now, stamps) for t in ts]
    if search:  # the search kept fewer than max_len cuts to: it ran before the cut
        assert sum(map(len, kept(rows, "history", timestamps, True))) < sum(map(len, kept(rows, "history", timestamps)))


def test_a_pooled_sequence_pools_only_what_its_hard_search_keeps():
    cfg, _ = reference("pool", "mlp", True, search=True)
    rows = side_table()
    unread = rows.drop_columns(["history_ts"])  # a pooled sequence's timestamps are not read, searched or not
    bags = encoder(cfg).encode(unread, "test").to_batch().sparse.to_dict()
    for name in ("history", "history_stars"):  # pooled sequences keep every behaviour not after the request
        assert [v.tolist() for v in bags[name].to_dense()] == kept(rows, name, False, True), name


def test_each_module_reads_the_behaviour_and_the_query_as_sums_of_their_fields():
    """SequenceInputs against the module called by hand on the tables' rows summed."""
    cfg, model = reference("target_attention", "mlp", True)
    batch = encoder(cfg).encode(side_table(), "test").to_batch()
    weights = {name: t.weight for name, t in model.sequence_tables.embeddings.items()}
    looked = batch.sequence_ids.to_dict()
    with torch.no_grad():
        out = model.sequences({}, model.sequence_tables(batch.sequence_ids), batch.sequence_max, batch.sequence_gaps)
        x, mask = pad(weights["item_rows"][looked["history"].values()], looked["history"].offsets(), 4)
        for name, table in (("history_stars", "history_stars"), ("history_genre", "genre")):
            x = x + pad(weights[table][looked[name].values()], looked[name].offsets(), 4)[0]
        genre = looked["item_genre"]  # null in a few rows: an empty bag, a zero vector
        query = weights["item_rows"][looked["item"].values()] + \
            pad(weights["genre"][genre.values()], genre.offsets(), 1)[0].squeeze(1)
        gaps = pad(batch.sequence_gaps[0], looked["history"].offsets(), 4)[0]
        expected = model.sequences.attention["history"](x, mask, query, gaps)
    torch.testing.assert_close(torch.stack([out["history.0"], out["history.1"]], 1), expected, rtol=0, atol=1e-6)


def test_the_soft_search_keeps_the_k_behaviours_nearest_the_query_in_time_order_and_their_gradient():
    torch.manual_seed(3)
    x = torch.randn(6, 9, 4, requires_grad=True)
    lengths = torch.tensor([9, 5, 2, 0, 3, 7])
    mask = torch.arange(9) < lengths.unsqueeze(1)
    query, gaps = torch.randn(6, 4), torch.randint(1, 30, (6, 9))
    picked, kept_mask, kept_gaps = soft_search(x, mask, query, gaps, 3)
    for r in range(6):
        real = range(int(lengths[r]))
        nearest = sorted(sorted(real, key=lambda i: -float(x[r, i] @ query[r]))[:3])
        n = len(nearest)
        assert kept_mask[r].tolist() == [True] * n + [False] * (3 - n)  # a short row: its real ones first
        torch.testing.assert_close(picked[r, :n], x[r, nearest], rtol=0, atol=0)
        assert kept_gaps[r, :n].tolist() == gaps[r, nearest].tolist()
    (picked * kept_mask.unsqueeze(-1)).sum().backward()
    chosen = (x.grad != 0).any(-1)
    assert chosen.sum(1).tolist() == [min(3, int(n)) for n in lengths]
    untimed = soft_search(x.detach(), mask, query, None, 3)  # a sequence without timestamps
    assert untimed[2] is None and torch.equal(untimed[0], picked.detach())


def test_a_batch_shorter_than_the_soft_searchs_k_is_read_whole():
    """The soft search reads k of the batch's padded length, not of max_len: a batch of histories
    of at most 2 under k = 3 < max_len = 4 reads them all, as without the search."""
    cfg, model = reference("target_attention", "mlp", True, soft=3)
    rows = side_table()
    short = rows.filter(pa.array([len(h or []) <= 2 for h in rows.column("history").to_pylist()]))
    batch = encoder(cfg).encode(short, "test").to_batch()
    assert batch.sequence_max[-1] == 2
    with torch.no_grad():
        looked = model.sequence_tables(batch.sequence_ids)
        searched = model.sequences({}, looked, batch.sequence_max, batch.sequence_gaps)
        whole = build_sequences([dataclasses.replace(f, search_k=0) for f in cfg.features], cfg.model.sequence)
        whole.load_state_dict(model.sequences.state_dict())
        expected = whole({}, looked, batch.sequence_max, batch.sequence_gaps)
    torch.testing.assert_close(searched["history.0"], expected["history.0"], rtol=0, atol=0)


def test_a_soft_searched_sequence_attends_to_its_k_nearest_behaviours():
    cfg, model = reference("target_attention", "mlp", True, soft=2)
    batch = encoder(cfg).encode(side_table(), "test").to_batch()
    with torch.no_grad():
        looked = model.sequence_tables(batch.sequence_ids)
        out = model.sequences({}, looked, batch.sequence_max, batch.sequence_gaps)
        full = dataclasses.replace(cfg.model.sequence)  # the same module reading every behaviour
        inputs = build_sequences([dataclasses.replace(f, search_k=0) for f in cfg.features], full)
        inputs.load_state_dict(model.sequences.state_dict())
        x, mask = pad(looked["history"].values(), looked["history"].offsets(), batch.sequence_max[-1])
        assert (mask.sum(1) > 2).any()  # some rows hold more than the search keeps
        seen = inputs({}, looked, batch.sequence_max, batch.sequence_gaps)
    differ = (out["history.0"] != seen["history.0"]).any(1)
    assert differ.tolist() == (mask.sum(1) > 2).tolist()  # only rows of more than k behaviours read fewer


def test_a_pooled_sequence_adds_its_side_fields_pooled_vectors_to_its_own():
    cfg, model = reference("pool", "mlp", False)
    batch = encoder(cfg).encode(side_table(), "test").to_batch()
    with torch.no_grad():
        pooled = model.ebc(batch.sparse).to_dict()
        e_input = model.layout.assemble(pooled, batch.dense)
    slot = [s.name for s in model.layout.slots]
    assert "history_stars" not in slot and "history_genre" not in slot
    start = sum(s.width for s in model.layout.slots[:slot.index("history")])
    torch.testing.assert_close(e_input[:, start:start + 8],
                               pooled["history"] + pooled["history_stars"] + pooled["history_genre"], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("module,tower,timestamps,search,soft", [
    ("target_attention", "rankmixer", True, False, 0), ("transformer", "mlp", True, False, 0),
    ("transformer", "dcnv2", False, False, 0), ("pool", "rankmixer", False, False, 0),
    ("target_attention", "mlp", True, True, 0), ("transformer", "rankmixer", False, True, 0),
    ("pool", "dcnv2", True, True, 0), ("target_attention", "rankmixer", True, False, 2),
    ("transformer", "mlp", True, True, 2)])
def test_the_artifact_reads_side_fields_from_raw_rows_as_training_evaluates_them(module, tower, timestamps, search,
                                                                                 soft, fmt):
    cfg, model = reference(module, tower, timestamps, search, soft)
    rows = side_table()
    with torch.no_grad():
        expected = torch.sigmoid(model(encoder(cfg).encode(rows, "test").to_batch()))
        served = serving_model(cfg, model.state_dict(), step=7)
        program = trace_model(served, example_inputs(served), fmt)
        artifact = program if fmt == "torchscript" else program.module()
        probs = artifact(*raw_inputs(rows, cfg.features, "test", cfg.data.time_column))
        one_row = artifact(*raw_inputs(rows.slice(5, 1), cfg.features, "test", cfg.data.time_column))
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(one_row, expected[5:6], atol=1e-6, rtol=0)


def misaligned(rows: pa.Table) -> tuple[pa.Table, int]:
    """`rows` with one behaviour's genre missing in the first row that has a behaviour."""
    genres = rows.column("history_genre").to_pylist()
    row = next(i for i, g in enumerate(genres) if g)
    genres[row] = genres[row][1:]
    return rows.set_column(rows.schema.get_field_index("history_genre"), "history_genre",
                           pa.array(genres, pa.list_(pa.int64()))), row


def test_a_side_list_not_as_long_as_its_sequence_is_refused_by_the_reader_and_by_raw_inputs():
    cfg, _ = reference("target_attention", "mlp", True)
    rows, row = misaligned(side_table())
    n = len(rows.column("history").to_pylist()[row])
    message = (f"part-0.parquet, row group 0, column 'history_genre': row {row} has {n - 1} values for {n} ids in "
               "column 'history' (features.history_genre.side_of='history': one value per behaviour)")
    with pytest.raises(ValueError) as e:
        encoder(cfg).encode(rows, "part-0.parquet, row group 0")
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        raw_inputs(rows, cfg.features, "part-0.parquet, row group 0", cfg.data.time_column)
    assert str(e.value) == message


def test_the_artifact_refuses_a_side_field_not_aligned_with_its_sequence():
    cfg, model = reference("transformer", "mlp", False)
    ids, lengths, numeric = raw_inputs(side_table(), cfg.features, "test")
    stars = [f.name for f in cfg.features if f.kind != "numeric"].index("history_stars")
    lengths[stars, 0] += 1  # one more star than behaviours in row 0
    extra = int(lengths[:stars].sum() + lengths[stars, 0]) - 1
    ids = torch.cat([ids[:extra], torch.tensor([1]), ids[extra:]])
    served = serving_model(cfg, model.state_dict(), step=7)
    with torch.no_grad(), pytest.raises(RuntimeError, match="sparse feature 'history_stars' must hold one value per "
                                                           "id of sequence 'history' in each row \\(its side field\\)"):
        served(ids, lengths, numeric)


@pytest.mark.parametrize("search,soft", [(False, 0), (True, 0), (False, 2)])
def test_a_side_fields_export_is_within_the_pt2_allow_lists(search, soft):
    """The side fields' drops, the searches and padding add no op outside PT2_OPS (trainer/serving/safe_pt2.py)."""
    from test_trust_pt2 import check_export

    cfg, model = reference("target_attention", "rankmixer", True, search, soft)
    with torch.no_grad():
        check_export(cfg, serving_model(cfg, model.state_dict(), step=7), "fp32")


def spec(**kw) -> FeatureSpec:
    return FeatureSpec(**kw)


BASE = [spec(name="item", num_embeddings=10, embedding_dim=8),
        spec(name="genre", num_embeddings=5, embedding_dim=8),
        spec(name="wide", num_embeddings=5, embedding_dim=4),
        spec(name="hist", kind="sequence", table="item", num_embeddings=10, embedding_dim=8, max_len=5,
             sequence_module="target_attention"),
        spec(name="bag", kind="sequence", num_embeddings=10, embedding_dim=8, pooling="mean")]


@pytest.mark.parametrize("feature,message", [
    (spec(name="s", kind="id_list", side_of="hist", embedding_dim=8, num_embeddings=3, max_len=5),
     "features.s.side_of needs kind='sequence' (a list per row, one value per behaviour), got kind='id_list'"),
    (spec(name="s", kind="sequence", side_of="item", embedding_dim=8, num_embeddings=3, max_len=5),
     "features.s.side_of='item' is not a sequence feature (a side field's own side_of must name the sequence "
     "itself)"),
    (spec(name="s", kind="sequence", side_of="nothing", embedding_dim=8, num_embeddings=3, max_len=5),
     "features.s.side_of='nothing' is not a sequence feature (a side field's own side_of must name the sequence "
     "itself)"),
    (spec(name="s", kind="sequence", side_of="hist", embedding_dim=4, num_embeddings=3, max_len=5),
     "features.s.embedding_dim=4 differs from features.hist.embedding_dim=8: a side field is aligned with its "
     "sequence, its vector added to each behaviour's"),
    (spec(name="s", kind="sequence", side_of="hist", embedding_dim=8, num_embeddings=3, max_len=4),
     "features.s.max_len=4 differs from features.hist.max_len=5: a side field is aligned with its sequence, its "
     "vector added to each behaviour's"),
    (spec(name="s", kind="sequence", side_of="bag", embedding_dim=8, num_embeddings=3),
     "features.s.pooling='sum' differs from features.bag.pooling='mean': a pooled sequence's side field is pooled "
     "as it is"),
])
def test_a_side_field_is_refused_where_it_cannot_align(feature, message):
    with pytest.raises(ValueError) as e:
        validate_features([*BASE, feature])
    assert str(e.value) == message


def test_a_side_of_a_side_field_is_refused():
    first = spec(name="s", kind="sequence", side_of="hist", embedding_dim=8, num_embeddings=3, max_len=5)
    second = spec(name="t", kind="sequence", side_of="s", embedding_dim=8, num_embeddings=3, max_len=5)
    with pytest.raises(ValueError) as e:
        validate_features([*BASE, first, second])
    assert str(e.value) == ("features.t.side_of='s' is not a sequence feature (a side field's own side_of must name "
                            "the sequence itself)")


@pytest.mark.parametrize("change,message", [
    ({"search_field": "s"}, "features.hist: search_field and search_query go together (the behaviours' field and "
                            "the candidate's id it must equal), got search_field='s', search_query=''"),
    ({"search_query": "genre"}, "features.hist: search_field and search_query go together (the behaviours' field "
                                "and the candidate's id it must equal), got search_field='', search_query='genre'"),
    ({"search_field": "bag", "search_query": "genre"}, "features.hist.search_field='bag' is not a side field of "
                                                       "features.hist"),
    ({"search_field": "s", "search_query": "bag"}, "features.hist.search_query='bag' is not an id feature"),
])
def test_a_hard_search_is_refused_unless_on_a_side_field_and_an_id_of_the_candidate(change, message):
    side = spec(name="s", kind="sequence", side_of="hist", embedding_dim=8, num_embeddings=3, max_len=5)
    features = [dataclasses.replace(f, **change) if f.name == "hist" else f for f in BASE]
    with pytest.raises(ValueError) as e:
        validate_features([*features, side])
    assert str(e.value) == message


@pytest.mark.parametrize("fields,message", [
    (["bag"], "features.hist.candidate_fields: 'bag' is not an id or id_list feature"),
    (["nothing"], "features.hist.candidate_fields: 'nothing' is not an id or id_list feature"),
    (["genre", "wide"], "features.hist.candidate_fields: 'wide' has embedding_dim 4, the sequence 8: they must "
                        "match (its vector is added to the query)"),
])
def test_a_query_field_is_refused_unless_an_id_feature_as_wide_as_the_sequence(fields, message):
    ok = [dataclasses.replace(f, candidate_fields=["genre", "tags"]) if f.name == "hist" else f for f in BASE]
    validate_features([*ok, spec(name="tags", kind="id_list", num_embeddings=9, embedding_dim=8)])  # id and id_list
    features = [dataclasses.replace(f, candidate_fields=fields) if f.name == "hist" else f for f in BASE]
    with pytest.raises(ValueError) as e:
        validate_features(features)
    assert str(e.value) == message


ML_ARGS = ["--config", "configs/movielens.toml", "--train.steps=12", "--metrics.progress=false",
           "--metrics.tensorboard=false", "--checkpoint.keep=0", "--data.shuffle_buffer=1024",
           "--metrics.peak_tflops=1"]
MANAGED_GENRES = [f"--features.{f}.hashing=managed" for f in ("item_genre", "hist_genres")]
HARD_SEARCH = ["--features.hist_items.search_field=hist_genres", "--features.hist_items.search_query=item_genre"]
MOVIELENS = REPO.parent / "shared" / "data" / "movielens-100k"
HELD_OUT_ROWS = 2000


def movielens_data(made_once) -> Path:
    """MovieLens-100K as configs/movielens.toml converts it (movielens/), made once per session,
    and the first 2,000 of its 10,000 held-out rows in two row groups, one a rank (held_out/):
    the export parity reads its evaluation split three times (the run's evaluation, `score
    --model`, `score --checkpoint`) and holds on any rows."""
    import pyarrow.parquet as pq

    from trainer.offline.movielens import convert_movielens

    if not (MOVIELENS / "ml-100k.inter").is_file():
        pytest.skip("MovieLens-100K is not in ../shared/data")

    def make(folder: Path) -> None:
        convert_movielens(MOVIELENS, folder / "movielens")  # what data.dataset = "movielens" converts
        (folder / "held_out").mkdir()
        pq.write_table(pq.read_table(folder / "movielens" / "valid").slice(0, HELD_OUT_ROWS),
                       folder / "held_out" / "part-0.parquet", row_group_size=HELD_OUT_ROWS // 2)
    return made_once("movielens-side-fields", make)


def on_movielens(data: Path) -> list[str]:
    """A run's arguments for `movielens_data`: its training split, evaluated on the held-out 2,000."""
    return ["--data.dataset=parquet", f"--data.train_path={data / 'movielens' / 'train'}",
            f"--data.eval_path={data / 'held_out'}"]


def published_run(made_once) -> Path:
    """The hard search's 2-rank run of the test below, publishing (TorchScript) every 6 of its 12
    steps: the export parity and the publish test read it, trained once."""
    from cli import rankmix_ranks

    data = movielens_data(made_once)

    def make(folder: Path) -> None:
        proc = rankmix_ranks(2, *ML_ARGS, *on_movielens(data), f"--train.run_dir={folder / 'run'}",
                             "--features.hist_items.sequence_module=target_attention", *HARD_SEARCH,
                             "--publish.every_steps=6", "--publish.format=torchscript")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return made_once("movielens-side-fields-published", make) / "run"


@pytest.mark.slow
@pytest.mark.parametrize("module,args,fmt", [
    ("pool", [], "pt2"), ("target_attention", MANAGED_GENRES, "pt2"), ("target_attention", HARD_SEARCH, "torchscript"),
    ("transformer", ["--model.sequence.transformer.time_bias=true", "--features.hist_items.search_k=16"], "pt2")])
def test_movielens_with_side_fields_trains_on_two_ranks_and_its_artifact_scores_as_its_checkpoint(
        module, args, fmt, made_once, tmp_path):
    """configs/movielens.toml's past ratings with their stars and genres, queried by the item and
    its genre, with each search: on 2 ranks, exported, `score --model` as the run's evaluation and
    as `score --checkpoint`, row by row (managed tables load only on the ranks that trained them:
    the evaluation alone). The hard search's run also publishes, for the publish test below."""
    from cli import rankmix_ranks
    from test_managed import export_and_score

    data = movielens_data(made_once)
    if args == HARD_SEARCH:
        run = published_run(made_once)
    else:
        run = tmp_path / "run"
        proc = rankmix_ranks(2, *ML_ARGS, *on_movielens(data), f"--train.run_dir={run}",
                             f"--features.hist_items.sequence_module={module}", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    manifest, _ = export_and_score(run, data / "held_out", tmp_path, fmt, compare=args != MANAGED_GENRES)
    readme = (tmp_path / "model" / "README.md").read_text()  # the input contract names the side fields
    assert "| hist_ratings | hist_ratings | sequence | 6 | none | 50 | side of hist_items | - |" in readme
    if args == MANAGED_GENRES:
        assert manifest["managed"]["genre"]["ranks"] == 2


def test_a_negative_soft_search_is_refused():
    features = [dataclasses.replace(f, search_k=-1) if f.name == "hist" else f for f in BASE]
    with pytest.raises(ValueError) as e:
        validate_features(features)
    assert str(e.value) == "features.hist.search_k must be >= 0 (0 reads every behaviour kept), got -1"


@pytest.mark.slow
def test_movielens_with_side_fields_publishes_deltas_that_serve_as_their_full_artifact(made_once, tmp_path):
    """Continuous training's publishing carries the side fields' tables: step 12's delta applied
    to step 6's artifact predicts as step 12's full artifact, the side fields' rows among those
    it changed. The hard search's 2-rank run above, published as TorchScript: what a delta
    changes is the tables and dense weights of either format (test_publish.py applies PT2
    deltas, the export parity exports the side fields as PT2)."""
    import pyarrow.parquet as pq

    from cli import rankmix
    from trainer.serving.export import load

    run = published_run(made_once)
    full = run / "publish" / "step-12"
    rows = json.loads((full / "manifest.json").read_text())["publish"]["delta"]["rows"]
    assert rows["hist_ratings"] > 0 and rows["genre"] > 0
    applied = rankmix("publish", "apply", "--base", str(run / "publish" / "step-6"), "--delta", str(full),
                      "--out", str(tmp_path / "applied"))
    assert applied.returncode == 0, applied.stderr[-3000:]
    table = pq.read_table(movielens_data(made_once) / "held_out")  # the first 2,000 held-out rows
    features = load_config(str(full / "config.toml"), [], allow_redacted=True).features
    inputs = raw_inputs(table, features, "valid", "timestamp")
    with torch.no_grad():
        served = [load(folder)[0](*inputs) for folder in (full, tmp_path / "applied")]
    assert torch.equal(served[0], served[1])


@pytest.mark.parametrize("large", [False, True])
def test_the_hard_search_keeps_the_matching_behaviours_by_hand(large):
    """Four rows by hand: a uint64 genre past 2^63 matches itself and not its neighbour (equal as
    floats), a null query keeps nothing, the last row keeps nothing; the side fields and timestamps
    are cut alike; large lists stay large."""
    from trainer.data.side_fields import HardSearch

    big = 2**64 - 1
    lists = pa.large_list if large else pa.list_
    seq = spec(name="hist", kind="sequence", table="item", num_embeddings=10, embedding_dim=8, max_len=5,
               sequence_module="target_attention", timestamps="ts", search_field="g", search_query="genre")
    features = [BASE[0], dataclasses.replace(BASE[1], num_embeddings=2**10),
                seq, spec(name="g", kind="sequence", side_of="hist", embedding_dim=8, num_embeddings=5, max_len=5),
                spec(name="stars", kind="sequence", side_of="hist", embedding_dim=8, num_embeddings=6, max_len=5)]
    validate_features(features)
    table = pa.table({
        "genre": pa.array([2, big, None, 1], pa.uint64()),
        "hist": pa.array([[1, 2, 3], [4, 5], [6], [7, 8]], lists(pa.int64())),
        "g": pa.array([[2, 1, 2], [big, big - 1], [1], [2, 2]], lists(pa.uint64())),  # one float64 apart: none
        "stars": pa.array([[5, 4, 3], [2, 1], [0], [1, 1]], lists(pa.int64())),
        "ts": pa.array([[1, 2, 3], [4, 5], [6], [7, 8]], lists(pa.int64()))})
    out = HardSearch(features).apply(table, "t.parquet")
    assert sorted(out) == ["g", "hist", "hist@timestamps", "stars"]
    assert out["hist"].to_pylist() == [[1, 3], [4], [], []]
    assert out["g"].to_pylist() == [[2, 2], [big], [], []]
    assert out["stars"].to_pylist() == [[5, 3], [2], [], []]
    assert out["hist@timestamps"].to_pylist() == [[1, 3], [4], [], []]
    assert all(pa.types.is_large_list(a.type) == large for a in out.values())


def test_a_null_inside_a_searched_field_is_refused_with_its_row():
    cfg, _ = reference("target_attention", "mlp", True, search=True)
    rows = side_table()
    genres = rows.column("history_genre").to_pylist()
    row = [i for i, g in enumerate(genres) if g and len(g) > 1][1]
    genres[row][1] = None
    rows = rows.set_column(rows.schema.get_field_index("history_genre"), "history_genre",
                           pa.array(genres, pa.list_(pa.int64())))
    with pytest.raises(ValueError) as e:
        encoder(cfg).encode(rows, "part-3.parquet, row group 1")
    assert str(e.value) == f"part-3.parquet, row group 1, column 'history_genre': null id inside the list at row {row}"


def test_a_dwell_time_side_field_is_read_as_its_power_of_two_bucket_by_the_reader_and_the_artifact():
    """`hashing = "log2"`: each behaviour's dwell seconds -> min(bit_length, 23), kept with its
    behaviour through the drops and the cut; the artifact buckets the raw values alike."""
    cfg, _ = reference("target_attention", "mlp", True)
    cfg.features.append(FeatureSpec(name="history_dwell", kind="sequence", side_of="history", hashing="log2",
                                    num_embeddings=24, embedding_dim=8, max_len=4, group="context"))
    validate_features(cfg.features)
    torch.manual_seed(0)
    layout, tower, heads = build_dense(cfg.model, cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, tower, heads,
                         sequence_tables=EmbeddingCollection(tables=sequence_table_configs(cfg.features)),
                         sequences=build_sequences(cfg.features, cfg.model.sequence)).eval()
    rows = side_table()
    rng = np.random.default_rng(5)
    dwell = [None if h is None else [int(x) for x in rng.integers(0, 2 ** 30, len(h))]
             for h in rows.column("history").to_pylist()]
    rows = rows.append_column("history_dwell", pa.array(dwell, pa.list_(pa.int64())))
    batch = encoder(cfg).encode(rows, "test").to_batch()
    expected = [[min(v.bit_length(), 23) for v in vs] for vs in kept(rows, "history_dwell", True)]
    assert [v.tolist() for v in batch.sequence_ids.to_dict()["history_dwell"].to_dense()] == expected
    assert any(23 in vs for vs in expected) and any(0 < v < 23 for vs in expected for v in vs)
    with torch.no_grad():
        probs = torch.sigmoid(model(batch))
        served = serving_model(cfg, model.state_dict(), step=7)
        artifact = trace_model(served, example_inputs(served), "pt2").module()
        torch.testing.assert_close(artifact(*raw_inputs(rows, cfg.features, "test", "now")), probs, atol=1e-6, rtol=0)
        from test_trust_pt2 import check_export

        check_export(cfg, served, "fp32")  # the bucketing's ops are within the pt2 allow lists
