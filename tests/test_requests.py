"""A user's history encoded once per request (`data.request_column`): the rows of a request share
their sequences, side fields and time gaps; a batch looks them up at each request's first row
only, the dense side pads and encodes them once a request, and every candidate reads its
request's. Each against the same model on the same rows read one history per row: the
predictions and every gradient must not change, in training and in the artifact."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from dense.heads import build_dense
from dense.model_config import TaskSpec
from dense.sequence import build_sequences
from embeddings.features import FeatureSpec, attended, shared_sequences, validate_features
from embeddings.tables import sequence_table_configs, table_configs
from test_side_fields import side_features, side_table
from trainer.config_loader import load_config
from trainer.data.batch import Part, Rows, assemble
from trainer.data.encode import RowEncoder
from trainer.data.requests import grouped_permutation, holders
from trainer.ranking_model import RankingModel, shared_bags
from trainer.serving.export import FORMATS, example_inputs, serving_model, trace_model
from trainer.serving.predict import raw_inputs

SHARED = ("user", "history", "history_stars", "history_genre", "history_ts", "now")  # one per request


def request_table(seed: int = 0, sizes: tuple[int, ...] = (3, 1, 4, 2)) -> pa.Table:
    """test_side_fields' rows cut into requests of `sizes` rows in turn (a request id each, some of
    them strings' worth of ids: 1000 + its number): a request's rows take its first row's user,
    history, side fields, timestamps and request time; each keeps its own candidate and labels."""
    rows = side_table(seed)
    first, request, start, k = [], [], 0, 0
    while start < rows.num_rows:
        size = min(sizes[k % len(sizes)], rows.num_rows - start)
        first += [start] * size
        request += [1000 + k] * size
        start, k = start + size, k + 1
    held = rows.take(pa.array(first))
    for name in SHARED:
        rows = rows.set_column(rows.schema.get_field_index(name), name, held.column(name))
    return rows.append_column("request_id", pa.array(request, pa.int64()))


def reference(module: str, timestamps: bool, soft: int = 0, candidate: str = "in_sequence", search: bool = False):
    """test_side_fields' model (MLP tower) with `module` on the history (target attention's time bias
    on, where timed), the transformer's candidate as `candidate`, read with requests; with
    `search`, the history hard-searched by the candidate's genre, which no request shares, and a
    second one (the same column) pooled on its table, which its request shares."""
    cfg = load_config(None, ["--model.tower=mlp", "--model.mlp.hidden=[16, 8]", "--data.request_column=request_id",
                             f"--data.time_column={'now' if timestamps else ''}",
                             f"--model.sequence.transformer.candidate={candidate}",
                             "--model.sequence.target_attention.time_bias=true"])  # read where timed
    cfg.features = side_features(module, timestamps, search, soft)
    if search:
        cfg.features.append(FeatureSpec(name="bag", kind="sequence", column="history", table="item_rows",
                                        num_embeddings=30, embedding_dim=8, hashing="none", max_len=4, group="context"))
        validate_features(cfg.features)
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    torch.manual_seed(0)
    layout, tower, heads = build_dense(cfg.model, cfg.features)
    unpooled = any(attended(f) for f in cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, tower, heads,
                         sequence_tables=EmbeddingCollection(tables=sequence_table_configs(cfg.features))
                         if unpooled else None, sequences=build_sequences(cfg.features, cfg.model.sequence),
                         shared_bags=shared_bags(cfg.features))
    for name, weights in model.named_parameters():  # the time values and bias start at zero: here they count
        if "time_value" in name or "time_bias" in name:
            torch.nn.init.normal_(weights)
    return cfg, model


def encoder(cfg, requests: bool = True) -> RowEncoder:
    return RowEncoder(cfg.features, cfg.model.tasks, "", cfg.data.time_column, cfg.model.sequence.time_buckets,
                      cfg.data.request_column if requests else "")


MODULES = [("pool", True, 0, "in_sequence", False), ("target_attention", True, 0, "in_sequence", False),
           ("target_attention", False, 0, "in_sequence", False), ("transformer", True, 0, "in_sequence", False),
           ("transformer", True, 0, "query", False), ("transformer", False, 0, "query", False),
           ("target_attention", True, 2, "in_sequence", False), ("transformer", True, 2, "query", False),
           ("target_attention", True, 0, "in_sequence", True), ("pool", False, 0, "in_sequence", True)]


@pytest.mark.parametrize("module,timestamps,soft,candidate,search", MODULES)
def test_a_request_read_once_trains_as_each_row_reading_its_own_history(module, timestamps, soft, candidate, search):
    """The same rows read once a request and once a row: the same predictions, and the same
    gradient of every parameter, the tables' included (a request's lookups take its rows' sum)."""
    cfg, model = reference(module, timestamps, soft, candidate, search)
    rows = request_table()
    once, each = encoder(cfg).encode(rows, "test").to_batch(), encoder(cfg, False).encode(rows, "test").to_batch()
    grads = []
    for batch in (once, each):
        model.zero_grad()
        logits = model(batch)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        grads.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-5)
    assert grads[0][1].keys() == grads[1][1].keys()
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], rtol=1e-5, atol=1e-5, msg=name)
    # the lookups: the histories of the requests' first rows, none for their other rows
    first = np.unique(rows.column("request_id").to_numpy(), return_index=True)[1]
    ids = (once.sparse if module == "pool" else once.sequence_ids).to_dict()
    every = (each.sparse if module == "pool" else each.sequence_ids).to_dict()
    if search:  # a hard search's lists are each row's own
        assert torch.equal(ids["history"].lengths(), every["history"].lengths())
    for name in ("bag",) if search else ("history", "history_stars", "history_genre"):
        lengths = every[name].lengths().numpy()
        held = np.zeros_like(lengths)
        held[first] = lengths[first]
        assert ids[name].lengths().tolist() == held.tolist(), name
    assert once.request_holders.tolist() == sorted(first.tolist())
    assert once.request_index.tolist() == np.searchsorted(np.sort(first), first[np.unique(
        rows.column("request_id").to_numpy(), return_inverse=True)[1]]).tolist()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("module,timestamps,soft,candidate", [
    ("pool", True, 0, "in_sequence"), ("target_attention", True, 0, "in_sequence"), ("transformer", True, 0, "query"),
    ("transformer", False, 2, "in_sequence")])
def test_the_artifact_reads_a_requests_history_once_as_training_evaluates_it(module, timestamps, soft, candidate,
                                                                            fmt):
    cfg, model = reference(module, timestamps, soft, candidate)
    model.eval()
    rows = request_table()
    with torch.no_grad():
        expected = torch.sigmoid(model(encoder(cfg).encode(rows, "test").to_batch()))
        served = serving_model(cfg, model.state_dict(), step=7)
        assert served.INPUTS[-2:] == ("holders", "request")
        program = trace_model(served, example_inputs(served), fmt)
        artifact = program if fmt == "torchscript" else program.module()
        inputs = raw_inputs(rows, cfg.features, "test", cfg.data.time_column, "request_id")
        probs = artifact(*inputs)
        part = artifact(*raw_inputs(rows.slice(5, 6), cfg.features, "test", cfg.data.time_column, "request_id"))
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(part, expected[5:11], atol=1e-6, rtol=0)  # a request cut by the slice: two holders
    stars = [f.name for f in cfg.features if f.kind != "numeric"].index("history_stars")
    assert int((inputs[1][stars] > 0).sum()) <= len(inputs[-2])  # the history sent once a request


def test_the_artifact_refuses_requests_that_do_not_index_its_holders():
    cfg, model = reference("target_attention", False)
    served = serving_model(cfg, model.state_dict(), step=7)
    ids, lengths, numeric, holders_, request = raw_inputs(request_table(), cfg.features, "test", "", "request_id")
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="request must be in 0..R-1, R the holders"):
            served(ids, lengths, numeric, holders_, request + 1)
        with pytest.raises(RuntimeError, match=r"each holder must be a row of its own request: "
                                               r"request\[holders\[r\]\] == r"):
            served(ids, lengths, numeric, holders_.flip(0), request)
        with pytest.raises(RuntimeError, match="holders must be rows of the batch"):
            served(ids, lengths, numeric, holders_ + len(request), request)


@pytest.mark.parametrize("column,change", [("history", lambda v: v[1:] + v[:1]), ("history_stars", lambda v: v[::-1]),
                                           ("history_stars", lambda v: v[:-1] + [(v[-1] + 1) % 6]),  # one value
                                           ("history_ts", lambda v: [t - 10**6 for t in v])])
def test_a_request_whose_rows_hold_different_histories_is_refused_naming_both_rows(column, change):
    """Training compares what the model reads (the time gaps' buckets, not the timestamps); the
    artifact's input, the raw lists: a timestamp moved by far more than a bucket fails both."""
    cfg, _ = reference("target_attention", True)
    rows = request_table()
    values, now = rows.column(column).to_pylist(), rows.column("now").to_pylist()
    stamps = rows.column("history_ts").to_pylist()
    row = next(r for r in range(1, rows.num_rows) if rows.column("request_id")[r] == rows.column("request_id")[r - 1]
               and len(values[r] or []) > 1 and len(set(values[r])) > 1 and max(stamps[r]) <= now[r])
    values[row] = change(values[row])
    bad = rows.set_column(rows.schema.get_field_index(column), column, pa.array(values, rows.schema.field(column).type))
    first = rows.column("request_id").to_pylist().index(rows.column("request_id")[row].as_py())
    message = (f"f.parquet, row group 0, column {column!r}: rows {first} and {row} are one request "
               f"({rows.column('request_id')[row].as_py()} in column 'request_id', data.request_column) but hold "
               "different lists: a request's rows must carry one history")
    for read in (lambda: encoder(cfg).encode(bad, "f.parquet, row group 0"),
                 lambda: raw_inputs(bad, cfg.features, "f.parquet, row group 0", "now", "request_id")):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == message


def test_a_null_request_id_is_refused():
    cfg, _ = reference("pool", False)
    rows = request_table()
    ids = rows.column("request_id").to_pylist()
    ids[7] = None
    bad = rows.set_column(rows.schema.get_field_index("request_id"), "request_id", pa.array(ids, pa.int64()))
    with pytest.raises(ValueError) as e:
        encoder(cfg).encode(bad, "f.parquet, row group 0")
    assert str(e.value) == "f.parquet, row group 0, column 'request_id': null request id at row 7 (data.request_column)"


@pytest.mark.parametrize("search,shared_names", [(False, {"history", "history_stars", "history_genre"}),
                                                 (True, {"bag"})])
def test_a_batch_gathers_each_shared_list_at_its_holder_row_alone_from_any_part(search, shared_names):
    """Parts picked by an index (a shuffled window) and in order (a slice), one request's rows in
    both: each shared list is its row's at the request's first row in the batch, empty elsewhere;
    a list no request shares (a hard-searched history and its side fields) is every row's."""
    cfg, _ = reference("target_attention", True, search=search)
    rows = request_table()
    encoded = encoder(cfg).encode(rows, "test")
    plain = encoder(cfg, False).encode(rows, "test").to_batch()
    order = grouped_permutation(np.random.default_rng(0), encoded.requests)
    batch = assemble([Part(encoded, order[:9]), Part(encoded.slice(0, 10))])
    picked = np.concatenate([order[:9], np.arange(10)])  # the batch's rows, as rows of `rows`
    is_holder = holders(encoded.requests[picked])[0]
    shared = {f.name for f in shared_sequences(cfg.features)}
    assert shared == shared_names
    for collection, every in ((batch.sparse, plain.sparse), (batch.sequence_ids, plain.sequence_ids)):
        got, lists = collection.to_dict(), every.to_dict()
        for name in got:
            expected = [lists[name].to_dense()[int(r)].tolist() for r in picked]
            if name in shared:
                expected = [x if held else [] for x, held in zip(expected, is_holder)]
            assert [x.tolist() for x in got[name].to_dense()] == expected, name


def test_holders_and_the_grouped_shuffle_against_python():
    rng = np.random.default_rng(0)
    requests = rng.integers(0, 9, 40)
    is_holder, rows, index = holders(requests)
    seen: list[int] = []
    for r, q in enumerate(requests):
        if q not in seen:
            seen.append(int(q))
        assert index[r] == seen.index(q)
        assert is_holder[r] == (list(requests).index(q) == r)
    assert rows.tolist() == [list(requests).index(q) for q in seen]
    perm = grouped_permutation(np.random.default_rng(1), requests)
    assert sorted(perm.tolist()) == list(range(40))
    order = requests[perm]
    runs = [int(q) for i, q in enumerate(order) if i == 0 or order[i - 1] != q]
    assert sorted(runs) == sorted(set(requests.tolist()))  # each request one run of rows
    for q in set(requests.tolist()):  # in their order
        assert perm[order == q].tolist() == np.flatnonzero(requests == q).tolist()


def requests_log(folder, rows: int, per_request: int, seed: int) -> None:
    """The sequence teacher's rows (trainer/offline/sequence_log.py) as requests of `per_request`
    candidates: each request's rows take its first row's user, history and time."""
    from trainer.offline.sequence_log import write_sequence_log

    write_sequence_log(folder / "raw", rows=rows, files=1, row_group_size=rows, seed=seed)
    for split in ("train", "valid"):
        table = pq.read_table(folder / "raw" / split)
        request = np.arange(table.num_rows) // per_request
        held = table.take(pa.array(request * per_request))
        for name in ("user_id", "hist_items", "hist_ts", "request_time"):
            table = table.set_column(table.schema.get_field_index(name), name, held.column(name))
        (folder / split).mkdir()
        pq.write_table(table.append_column("request_id", pa.array(request)), folder / split / "part-0.parquet",
                       row_group_size=1000)


@pytest.mark.slow
def test_a_request_log_trains_on_two_ranks_and_its_artifact_scores_as_its_checkpoint(tmp_path):
    """The sequence teacher as requests of 8 candidates, the transformer reading the history alone
    (its blocks once a request): 2 ranks, exported, `score --model` as the run's evaluation and as
    `score --checkpoint`, row by row."""
    from cli import rankmix_ranks
    from test_managed import export_and_score

    requests_log(tmp_path, 4000, 8, 0)
    run = tmp_path / "run"
    proc = rankmix_ranks(2, "--config", "configs/sequence.toml", "--data.dataset=parquet",
                         f"--data.train_path={tmp_path / 'train'}", f"--data.eval_path={tmp_path / 'valid'}",
                         "--data.request_column=request_id", "--data.batch_size=64", "--train.steps=10",
                         "--features.hist_items.sequence_module=transformer",
                         "--model.sequence.transformer.candidate=query", f"--train.run_dir={run}",
                         "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.keep=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest, _ = export_and_score(run, tmp_path / "valid", tmp_path, "pt2", compare=True)
    assert manifest["inputs"] == ["ids", "lengths", "numeric", "timestamps", "now", "holders", "request"]
    assert 'request_column = "request_id"' in (run / "config.toml").read_text()
    readme = (tmp_path / "model" / "README.md").read_text()  # the input contract
    assert "`model(ids, lengths, numeric, timestamps, now, holders, request)`" in readme


def test_a_user_and_a_request_time_name_a_request_where_the_log_has_no_request_id():
    """data.request_column = "user,now": the rows of one user at one time are one request, as the
    request ids group them; a row that differs is named with both columns' values."""
    cfg, _ = reference("target_attention", True)
    rows = request_table()
    users = rows.column("user").fill_null(7)  # a user id in every row: a null one is refused
    rows = rows.set_column(rows.schema.get_field_index("user"), "user", users)
    by_id = encoder(cfg).encode(rows, "test").to_batch()
    cfg.data.request_column = "user,now"
    by_pair = encoder(cfg).encode(rows.drop_columns(["request_id"]), "test").to_batch()
    assert torch.equal(by_pair.request_holders, by_id.request_holders)
    assert torch.equal(by_pair.request_index, by_id.request_index)
    assert torch.equal(by_pair.sequence_ids.lengths(), by_id.sequence_ids.lengths())
    stars = rows.column("history_stars").to_pylist()
    row = next(r for r in range(1, rows.num_rows) if rows.column("request_id")[r] == rows.column("request_id")[r - 1]
               and len(set(stars[r] or [])) > 1)
    stars[row] = stars[row][::-1]
    bad = rows.set_column(rows.schema.get_field_index("history_stars"), "history_stars",
                          pa.array(stars, pa.list_(pa.int64())))
    with pytest.raises(ValueError) as e:
        encoder(cfg).encode(bad, "f.parquet, row group 0")
    user, now = rows.column("user")[row].as_py(), rows.column("now")[row].as_py()
    first = rows.column("request_id").to_pylist().index(rows.column("request_id")[row].as_py())
    assert str(e.value) == (f"f.parquet, row group 0, column 'history_stars': rows {first} and "
                            f"{row} are one request ({user!r}, {now!r} in columns 'user', 'now', data.request_column) "
                            "but hold different lists: a request's rows must carry one history")


def test_requests_are_numbered_apart_in_each_row_group_and_a_split_one_is_two():
    """One encoder's row groups: each numbers its requests from where the last stopped, in order of
    first appearance, so a request cut by a row-group boundary is two requests of a batch."""
    cfg, _ = reference("target_attention", True)
    rows = request_table()  # requests of 3, 1, 4, 2, ... rows: rows 0-2, 3, 4-7, 8-9, ...
    reader = encoder(cfg)
    first, second = reader.encode(rows.slice(0, 6), "a"), reader.encode(rows.slice(6), "b")
    assert first.requests.tolist() == [0, 0, 0, 1, 2, 2]
    ids = rows.column("request_id").to_pylist()[6:]
    order = list(dict.fromkeys(ids))
    assert second.requests.tolist() == [3 + order.index(i) for i in ids]
    batch = Rows.concat([first, second]).to_batch()
    assert batch.request_holders.tolist()[:5] == [0, 3, 4, 6, 8]  # rows 6-7 hold the cut request's second part
    assert reader.encode(rows.slice(0, 0), "empty").requests.tolist() == []  # numbers nothing
    assert reader.encode(rows.slice(0, 2), "c").requests.tolist() == [3 + len(order)] * 2


def test_a_request_column_of_another_type_is_refused_by_the_schema_check():
    cfg, _ = reference("target_attention", True)
    rows = request_table()
    floats = rows.set_column(rows.schema.get_field_index("request_id"), "request_id",
                             rows.column("request_id").cast(pa.float64()))
    reader = encoder(cfg)
    reader.check_schema(rows.schema, "f.parquet")  # integers, as strings, pass
    reader.check_schema(rows.set_column(rows.schema.get_field_index("request_id"), "request_id",
                                        rows.column("request_id").cast(pa.string())).schema, "f.parquet")
    reader.check_schema(rows.set_column(rows.schema.get_field_index("request_id"), "request_id",
                                        rows.column("request_id").cast(pa.large_string())).schema, "f.parquet")
    with pytest.raises(ValueError) as e:
        reader.check_schema(floats.schema, "f.parquet")
    assert str(e.value) == ("f.parquet: column 'request_id' has type double, expected request ids, integers or "
                            "strings (data.request_column)")
    assert "request_id" in reader.columns


def test_a_pooled_sequence_on_a_managed_table_is_looked_up_once_a_request_too():
    """The managed bags' collection (Batch.managed_ids) keeps a shared sequence at its holders only."""
    cfg, _ = reference("pool", False)
    cfg.features = [dataclasses.replace(f, hashing="managed") if f.name == "history" else f for f in cfg.features]
    rows = request_table()
    once, each = encoder(cfg).encode(rows, "test").to_batch(), encoder(cfg, False).encode(rows, "test").to_batch()
    held = np.zeros(rows.num_rows, np.int64)
    first = once.request_holders.numpy()
    held[first] = each.managed_ids["history"].lengths().numpy()[first]
    assert once.managed_ids["history"].lengths().tolist() == held.tolist()
    every = each.managed_ids["history"].to_dense()
    assert [v.tolist() for v in once.managed_ids["history"].to_dense()] == [
        every[r].tolist() if r in first else [] for r in range(rows.num_rows)]
