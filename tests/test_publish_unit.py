"""Publishing (trainer/serving/publish.py) in-process, on a tiny model: a publish is the artifact
of the weights it was given; its delta holds exactly the rows changed since the publish before;
`apply` of a base and the delta after it rebuilds the next publish bit for bit and is the next
delta's base; every refusal of `apply` is one exact line. The weights stand in for a
checkpoint's whole tensors (`checkpoint.model_tensors`): plain tables, a managed table with its
MCH buffers, the tower and the heads. (tests/test_publish.py publishes from real runs.)"""

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from torchrec import EmbeddingBagCollection

from dense.heads import build_dense
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features
from embeddings.tables import table_configs
from embeddings.torchrec_compat import FREE_SLOT, MC_WEIGHTS, MCH_BUFFERS, MCH_ROWS, MCH_SEGMENTS, MCH_SORTED_IDS
from trainer.config_loader import dump_toml, load_config
from trainer.data.feature_ops import spread
from trainer.serving import publish as publishing
from trainer.serving.export import load, serving_model
from trainer.serving.predict import raw_inputs
from trainer.serving.publish import DELTA_KEYS, Publisher, apply, tables_digest, tracked_rows

MANAGED = "managed_tables." + MC_WEIGHTS + "user.weight"
MCH = "managed_tables." + MCH_BUFFERS + "user."
# The managed table's 8 rows, trained on 2 ranks: rows 0-3 and 4-7, each range's last its miss row.
MISS_ROWS = [3, 7]


def config(*overrides: str):
    """A tiny UniMixer (its served form depends on the step: the temperature) on a managed and
    two plain tables; it reads an S3 URI with credentials, which the artifact's config.toml redacts."""
    cfg = load_config(None, ["--model.tower=unimixer", "--model.hidden_dim=8", "--model.num_tokens=2",
                             "--model.unimixer.tau_anneal_steps=10", "--publish.format=torchscript",
                             "--data.dataset=parquet", "--data.train_path=s3://key:secret@bucket/logs", *overrides])
    f = FeatureSpec
    cfg.features = [f(name="user", num_embeddings=8, embedding_dim=4, hashing="managed", group="user"),
                    f(name="item", num_embeddings=10, embedding_dim=4, group="item"),
                    f(name="cat", num_embeddings=5, embedding_dim=2, group="item"),
                    f(name="num", kind="numeric", group="item")]
    validate_features(cfg.features)
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    return cfg


def weights(cfg, seed: int, users: dict[int, int]) -> dict[str, torch.Tensor]:
    """A checkpoint's whole tensors: seeded weights, and the managed table holding the raw ids
    `users` at their rows."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=table_configs(cfg.features))
    _, tower, heads = build_dense(cfg.model, cfg.features)
    state = {f"ebc.{k}": v for k, v in ebc.state_dict().items() if ".user." not in k}
    state |= {f"tower.{k}": v for k, v in tower.state_dict().items()}
    state |= {f"heads.{k}": v for k, v in heads.state_dict().items()}
    ids = torch.full((8,), FREE_SLOT)
    for raw, row in users.items():
        ids[row] = int(spread(np.array([raw]))[0])
    state |= {MANAGED: torch.randn(8, 4), MCH + MCH_SORTED_IDS: ids, MCH + MCH_ROWS: torch.arange(8),
              MCH + MCH_SEGMENTS: torch.tensor([0, 4, 8, -1])}
    return state


USERS = {11: 0, 12: 1, 13: 5, 14: 6}  # raw id -> row


def rows() -> pa.Table:
    """Raw rows: users held, and not (a miss row); every item and category."""
    users = [11, 12, 13, 14, 99, 1000, 11, 13, 12, 14]
    return pa.table({"user": pa.array(users, pa.int64()), "item": pa.array(range(10), pa.int64()),
                     "cat": pa.array([i % 5 for i in range(10)], pa.int64()),
                     "num": pa.array(np.linspace(-1, 2, 10))})


def expected(cfg, tensors: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """The probabilities of the served model of `tensors` at `step`, built here, untraced."""
    model = serving_model(cfg, {k: v.clone() for k, v in tensors.items()}, step)
    with torch.no_grad():
        return model(*raw_inputs(rows(), cfg.features, "test"))


def scores(folder: Path) -> torch.Tensor:
    model, _ = load(folder)
    features = load_config(str(folder / "config.toml"), [], allow_redacted=True).features
    with torch.no_grad():
        return model(*raw_inputs(rows(), features, "test"))


def publish(publisher: Publisher, name: str, step: int, tensors: dict, gathered: list[dict],
            partition: str | None = None) -> Path:
    """What `Publisher.publish` does on rank 0 once the ranks' tracked rows are gathered."""
    digest = publisher._write(name, step, partition, tensors, gathered, 0.5)
    publisher.previous = (name, step, digest)
    return publisher.folder / name


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def loaded(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def same(a: dict, b: dict) -> bool:
    """Equal nested dicts of tensors, bit for bit (-0.0 is not 0.0)."""
    if a.keys() != b.keys():
        return False
    return all(same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(bits(a[k]), bits(b[k])) for k in a)


@pytest.fixture
def two(tmp_path):
    """(config, publisher, step-1, step-2, the tensors of each step). Between them: item rows 0,
    3 and 9 changed and looked up, 7 looked up only (each by one rank or both); user row 5
    changed and row 1 from 0.0 to -0.0, user 12 evicted and 15 admitted; the tower and heads
    changed; cat untouched."""
    cfg = config()
    first = weights(cfg, 0, USERS)
    first[MANAGED][1] = 0.0
    second = weights(cfg, 1, {11: 0, 15: 1, 13: 5, 14: 6})
    for table in ("ebc.embedding_bags.item.weight", "ebc.embedding_bags.cat.weight", MANAGED):
        second[table] = first[table].clone()
    second["ebc.embedding_bags.item.weight"][[0, 3, 9]] += 1.0
    second[MANAGED][5] += 1.0
    second[MANAGED][1] = -0.0
    publisher = Publisher(cfg, None, tmp_path / "run")
    one = publish(publisher, "step-1", 1, first, [{}])
    two = publish(publisher, "step-2", 2, second, [{"item": torch.tensor([7, 3, 0])}, {"item": torch.tensor([3, 9])}])
    return cfg, publisher, one, two, first, second


# ----------------------------------------------------------------------------- a publish

def test_a_publish_is_the_artifact_of_the_weights_it_was_given(tmp_path):
    cfg = config()
    tensors = weights(cfg, 0, USERS)
    run = tmp_path / "run"
    run.mkdir()
    records = [{"kind": "train", "step": 1}, {"kind": "eval", "step": 1}, {"kind": "train", "step": 2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    publisher = Publisher(cfg, None, run)
    before = time.time()
    folder = publish(publisher, "date=1/hour=2", 2, tensors, [{}], partition="date=1/hour=2")
    after = time.time()
    assert folder == run / "publish" / "date=1" / "hour=2"
    torch.testing.assert_close(scores(folder), expected(cfg, tensors, 2), atol=1e-6, rtol=0)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.toml", "example_inputs.pt",
                                                        "example_outputs.pt", "manifest.json", "model.pt", "tables.pt"]
    spread_ids = {row: int(spread(np.array([raw]))[0]) for raw, row in USERS.items()}
    order = sorted(spread_ids, key=spread_ids.get)
    tables = loaded(folder / "tables.pt")
    assert same(tables, {"tables": {"item": tensors["ebc.embedding_bags.item.weight"],
                                    "cat": tensors["ebc.embedding_bags.cat.weight"], "user": tensors[MANAGED]},
                         "id_maps": {"user": {"keys": torch.tensor([spread_ids[r] for r in order]),
                                              "rows": torch.tensor(order), "miss_rows": torch.tensor(MISS_ROWS)}}})
    info = manifest(folder)
    assert (info["step"], info["checkpoint"], info["format"]) == (2, str(run), "torchscript")
    entry = info["publish"]
    seconds, published_at = entry.pop("seconds"), entry.pop("published_at")
    assert entry == {"name": "date=1/hour=2", "partition": "date=1/hour=2", "step": 2,
                     "metrics": {"train": records[2], "eval": records[1]}, "table_bytes": info["table_bytes"],
                     "tables_digest": tables_digest(tables["tables"], tables["id_maps"]),
                     "full_bytes": (folder / "model.pt").stat().st_size, "delta_bytes": None,
                     "delta_over_full": None, "delta": None}
    assert seconds["save"] == 0.5 and 0 < seconds["artifact"] and 0 < seconds["delta"]
    assert seconds["artifact"] + seconds["delta"] <= after - before
    assert before <= published_at <= after


def test_a_publish_goes_to_the_configured_folder_and_without_metrics_has_none(tmp_path):
    cfg = config(f"--publish.folder={tmp_path / 'served'}")
    publisher = Publisher(cfg, None, tmp_path / "run")
    folder = publish(publisher, "step-3", 3, weights(cfg, 0, USERS), [{}])
    assert folder == tmp_path / "served" / "step-3"
    assert manifest(folder)["publish"]["metrics"] == {}


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_run_and_step(tmp_path):
    cfg = config()
    tensors = {k: v for k, v in weights(cfg, 0, USERS).items() if not k.startswith("heads.")}
    with pytest.raises(ValueError) as error:
        Publisher(cfg, None, tmp_path / "run")._write("step-3", 3, None, tensors, [{}], 0.5)
    heads = list(build_dense(cfg.model, cfg.features)[2].state_dict())
    assert str(error.value) == (f"{tmp_path / 'run'} at step 3 does not fit this config's heads: missing "
                                f"{heads[:3]}, unexpected []")


def test_the_next_publish_names_a_previous_publish_that_is_gone(tmp_path):
    cfg = config()
    publisher = Publisher(cfg, None, tmp_path / "run")
    one = publish(publisher, "step-1", 1, weights(cfg, 0, USERS), [{}])
    (one / "tables.pt").unlink()
    with pytest.raises(ValueError) as error:
        publish(publisher, "step-2", 2, weights(cfg, 1, USERS), [{}])
    assert str(error.value) == f"the previous publish: no tables.pt at {one}"


def test_the_delta_holds_the_rows_changed_since_the_publish_before(two):
    cfg, _, one, second_folder, first, second = two
    delta = loaded(second_folder / "delta.pt")
    full = loaded(second_folder / "tables.pt")
    assert delta.keys() == {"base_step", "base_digest", "manifest", "dense", "id_maps", "rows", "values"}
    assert delta["base_step"] == 1 and delta["base_digest"] == manifest(one)["publish"]["tables_digest"]
    # Plain tables: the rows any rank looked up, once, ascending; the managed one: the rows whose bits changed.
    changed = {"cat": torch.zeros(0, dtype=torch.int64), "item": torch.tensor([0, 3, 7, 9]),
               "user": torch.tensor([1, 5])}
    assert list(delta["rows"]) == ["cat", "item", "user"] and same(delta["rows"], changed)
    assert same(delta["values"], {t: full["tables"][t][r] for t, r in changed.items()})
    assert same(delta["dense"], {k: v for k, v in second.items() if k.startswith(("tower.", "heads."))})
    assert same(delta["id_maps"], full["id_maps"])
    info = manifest(second_folder)
    assert json.loads(delta["manifest"]) == {k: v for k, v in info.items() if k != "publish"}
    entry = info["publish"]
    assert entry["delta"] == {"base": "step-1", "base_step": 1, "base_digest": delta["base_digest"],
                              "file": "delta.pt", "rows": {"cat": 0, "item": 4, "user": 2}}
    assert entry["delta_bytes"] == (second_folder / "delta.pt").stat().st_size
    assert entry["delta_over_full"] == entry["delta_bytes"] / entry["full_bytes"]
    assert entry["tables_digest"] == tables_digest(full["tables"], full["id_maps"]) != delta["base_digest"]


def test_a_delta_applied_to_its_base_is_the_next_publish_and_the_next_deltas_base(two, tmp_path):
    """The changed rows include both ends of a table; the result's tables have the digest the
    next delta names as its base."""
    cfg, _, one, second_folder, _, second = two
    full = scores(second_folder)
    torch.testing.assert_close(full, expected(cfg, second, 2), atol=1e-6, rtol=0)
    out = tmp_path / "applied"
    applied = apply(str(one), str(second_folder), str(out))
    assert applied == json.loads(loaded(second_folder / "delta.pt")["manifest"]) == manifest(out)
    assert (out / "config.toml").read_text() == (one / "config.toml").read_text()
    tables = loaded(out / "tables.pt")
    assert same(tables, loaded(second_folder / "tables.pt"))
    assert tables_digest(tables["tables"], tables["id_maps"]) == manifest(second_folder)["publish"]["tables_digest"]
    assert torch.equal(scores(out), full)


# ----------------------------------------------------------------------------- refusals

def handmade(tmp_path: Path, step: int = 1, seed: int = 0) -> tuple[Path, Path, dict]:
    """(a base folder, a delta file made against it, the delta): what `apply` reads before it
    builds the model, and the config.toml it builds it from."""
    torch.manual_seed(seed)
    tables = {"item": torch.randn(10, 4), "cat": torch.randn(5, 2), "user": torch.randn(8, 4)}
    maps = {"user": {"keys": torch.tensor([4, 9]), "rows": torch.tensor([0, 5]), "miss_rows": torch.tensor(MISS_ROWS)}}
    base = tmp_path / f"base-{step}-{seed}"
    base.mkdir(parents=True)
    torch.save({"tables": tables, "id_maps": maps}, base / "tables.pt")
    (base / "manifest.json").write_text(json.dumps({"step": step}))
    dump_toml(config(), base / "config.toml")
    delta = {"base_step": step, "base_digest": tables_digest(tables, maps), "dense": {}, "id_maps": maps,
             "manifest": json.dumps({"step": step + 1, "format": "torchscript", "tables": "fp32"}),
             "rows": {"item": torch.tensor([3])}, "values": {"item": torch.zeros(1, 4)}}
    torch.save(delta, tmp_path / "delta.pt")
    return base, tmp_path / "delta.pt", delta


def refused(base, delta, out: Path) -> str:
    with pytest.raises(ValueError) as error:
        apply(str(base), str(delta), str(out))
    assert not out.exists()
    return str(error.value)


def test_a_base_of_another_step_or_of_other_tables_is_refused(tmp_path):
    base, delta, content = handmade(tmp_path)
    out = tmp_path / "out"
    later, _, _ = handmade(tmp_path / "later", step=2)
    assert refused(later, delta, out) == (
        f"--delta {delta} applies to the publish of step 1, but --base {later} is of step 2")
    stranger, _, _ = handmade(tmp_path / "stranger", seed=1)  # another run's step 1
    theirs = loaded(stranger / "tables.pt")
    assert refused(stranger, delta, out) == (
        f"--delta {delta} was made against tables of digest {content['base_digest'][:16]}, but --base {stranger} "
        f"holds tables of digest {tables_digest(theirs['tables'], theirs['id_maps'])[:16]}: another run's or another "
        "publish's tables, though of the same step; a delta applies to its own base only")
    old = tmp_path / "old.pt"
    for stale in ({k: v for k, v in content.items() if k != "base_digest"}, {**content, "base_digest": None}):
        torch.save(stale, old)
        assert refused(base, old, out) == (
            f"--delta {old} names its base by step only (an older rankmix wrote it), so it cannot be checked against "
            f"--base {base}: apply deltas of this version's publishes")


def test_a_delta_whose_weights_do_not_fit_the_bases_config_is_refused_naming_it(tmp_path):
    base, delta, _ = handmade(tmp_path)  # its dense part is empty
    message = refused(base, delta, tmp_path / "out")
    assert message.startswith(f"{delta} does not fit this config's tower: missing ['tokenizer."), message


BAD_ROWS = {
    "past the end": ("item", torch.tensor([10]), torch.zeros(1, 4)),
    "negative": ("item", torch.tensor([-1]), torch.zeros(1, 4)),
    "int32 rows": ("item", torch.tensor([1], dtype=torch.int32), torch.zeros(1, 4)),
    "2-D rows": ("item", torch.tensor([[1]]), torch.zeros(1, 4)),
    "float64 values": ("item", torch.tensor([1]), torch.zeros(1, 4, dtype=torch.float64)),
    "other width": ("item", torch.tensor([1]), torch.zeros(1, 3)),
    "more values": ("item", torch.tensor([1]), torch.zeros(2, 4)),
    "no such table": ("nope", torch.tensor([1]), torch.zeros(1, 4)),
    "no values": ("item", torch.tensor([1]), None),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_changed_rows_that_do_not_fit_the_base_are_refused(tmp_path, case):
    base, _, delta = handmade(tmp_path)
    table, rows, values = BAD_ROWS[case]
    delta["rows"][table] = rows
    if values is None:
        del delta["values"][table]
    else:
        delta["values"][table] = values
    bad = tmp_path / "bad.pt"
    torch.save(delta, bad)
    assert refused(base, bad, tmp_path / "out") == (
        f"--delta {bad}: the changed rows of table {table} do not fit the base's tables")


def cannot_read(path: Path) -> str:
    """torch's own first line on loading `path` as weights."""
    with pytest.raises(Exception) as error:
        torch.load(path, weights_only=True)
    return f"cannot read {path} ({error.type.__name__}: {str(error.value).strip().splitlines()[0]})"


def test_a_base_that_is_not_a_published_folder_is_refused(tmp_path):
    base, delta, _ = handmade(tmp_path)
    out = tmp_path / "out"
    assert refused(base / "tables.pt", delta, out) == (
        f"--base {base}/tables.pt is a file: give a published artifact's folder (it holds tables.pt)")
    assert refused(tmp_path / "missing", delta, out) == f"--base {tmp_path}/missing: no tables.pt at {tmp_path}/missing"
    tables = loaded(base / "tables.pt")
    (base / "tables.pt").write_bytes(b"not a zip")
    assert refused(base, delta, out) == f"--base {base}: {cannot_read(base / 'tables.pt')}"
    user = tables["id_maps"]["user"]
    for content in ([1, 2], {"tables": tables["tables"]}, {"id_maps": tables["id_maps"]},
                    {**tables, "tables": {"item": [1.0]}}, {**tables, "tables": [tables["tables"]["item"]]},
                    {**tables, "id_maps": {"user": {"keys": user["keys"], "rows": user["rows"]}}},
                    {**tables, "id_maps": {"user": [user["keys"]]}}, {**tables, "tables": {1: user["keys"]}},
                    {**tables, "id_maps": [user]}):
        torch.save(content, base / "tables.pt")
        assert refused(base, delta, out) == f"--base {base}: {base}/tables.pt is not a published tables file"
    torch.save(tables, base / "tables.pt")
    for text in ("{", json.dumps({"format": "torchscript"}), json.dumps({"step": "two"}), "[2]", None):
        if text is None:
            (base / "manifest.json").unlink()
        else:
            (base / "manifest.json").write_text(text)
        assert refused(base, delta, out) == (
            f"--base {base}: no readable manifest.json there (not a published artifact)")


def test_a_delta_that_is_not_one_is_refused(tmp_path):
    base, _, delta = handmade(tmp_path)
    out = tmp_path / "out"
    assert refused(base, base, out) == f"--delta {base}: no delta.pt at {base}"
    assert refused(base, base / "tables.pt", out) == (
        f"--delta {base}/tables.pt is not a delta: give the published folder after the base, or its delta.pt")
    info = json.loads(delta["manifest"])
    broken = [
        [1], *({k: v for k, v in delta.items() if k != key} for key in sorted(DELTA_KEYS)),
        {**delta, "rows": {"item": [3]}}, {**delta, "values": {"item": 1.0}}, {**delta, "dense": [1]},
        {**delta, "id_maps": {"user": {"keys": torch.zeros(1)}}}, {**delta, "manifest": "{"},
        {**delta, "manifest": info}, {**delta, "manifest": "[1]"},
        *({**delta, "manifest": json.dumps({**info, key: value})} for key, value in (
            ("step", "2"), ("step", True), ("step", 2.0), ("format", "onnx"), ("tables", "int3"))),
        *({**delta, "manifest": json.dumps({k: v for k, v in info.items() if k != key})}
          for key in ("step", "format", "tables")),
    ]
    bad = tmp_path / "bad.pt"
    for content in broken:
        torch.save(content, bad)
        assert refused(base, bad, out) == (
            f"--delta {bad} is not a delta: give the published folder after the base, or its delta.pt"), content
    bad.write_bytes(b"not a zip")
    assert refused(base, bad, out) == f"--delta {bad}: {cannot_read(bad)}"


class Payload:
    """A pickle that runs a command when it is loaded as a program rather than as data."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_delta_or_base_that_would_run_code_is_refused_unrun(tmp_path, monkeypatch):
    """Even where the environment turns torch.load's own default off."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    base, _, delta = handmade(tmp_path)
    ran = tmp_path / "ran"
    bad = tmp_path / "bad.pt"
    torch.save({**delta, "manifest": Payload(ran)}, bad)
    assert refused(base, bad, tmp_path / "out").startswith(
        f"--delta {bad}: cannot read {bad} (UnpicklingError: Weights only load failed")
    good = tmp_path / "good.pt"
    torch.save(delta, good)
    torch.save({**loaded(base / "tables.pt"), "id_maps": Payload(ran)}, base / "tables.pt")
    assert refused(base, good, tmp_path / "out").startswith(
        f"--base {base}: cannot read {base}/tables.pt (UnpicklingError: Weights only load failed")
    assert not ran.exists()


# ----------------------------------------------------------------------------- the digest

def test_the_tables_digest_is_of_names_kinds_shapes_and_bytes_in_name_order():
    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(4, dtype=torch.int64)}
    maps = {"m": {"keys": torch.tensor([1, 5]), "rows": torch.tensor([0, 1]), "miss_rows": torch.tensor([3])}}
    digest = tables_digest(t, maps)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert tables_digest({"b": t["b"], "a": t["a"]}, maps) == digest
    assert tables_digest({"a": t["a"].t().contiguous().t(), "b": t["b"]}, maps) == digest  # a strided copy
    others = [
        ({**t, "a": t["a"] + 1}, maps),
        ({**t, "a": -t["a"]}, maps),  # -0.0 is not 0.0
        ({**t, "a": t["a"].reshape(3, 2)}, maps),
        ({**t, "b": torch.zeros(4, dtype=torch.float64)}, maps),  # the same shape and bytes
        ({"c": t["a"], "b": t["b"]}, maps),
        ({"a": t["a"]}, maps),
        (t, {}),
        (t, {"n": maps["m"]}),
        (t, {"m": {**maps["m"], "keys": maps["m"]["rows"], "rows": maps["m"]["keys"]}}),
        (t, {"m": {**maps["m"], "miss_rows": torch.tensor([4])}}),
    ]
    digests = [tables_digest(*o) for o in others]
    assert digest not in digests and len(set(digests)) == len(digests)


# ----------------------------------------------------------------------------- the trainer's side

def test_publishing_is_due_every_n_steps_and_tracks_lookups_only_when_on(monkeypatch, tmp_path):
    tracked = []
    monkeypatch.setattr(publishing, "track_lookups", lambda model: tracked.append(model) or "tracker")
    off = Publisher(config(), "model", tmp_path)
    assert not any(off.due(step) for step in range(1, 30)) and tracked == []
    assert off.folder == tmp_path / "publish" and off.previous is None
    every = Publisher(config("--publish.every_steps=7"), "model", tmp_path)
    assert [step for step in range(1, 30) if every.due(step)] == [7, 14, 21, 28]
    assert every.tracker == "tracker" and tracked == ["model"]
    by_partition = Publisher(config("--data.order=time", "--publish.every_partition=true"), "model", tmp_path)
    assert not any(by_partition.due(step) for step in range(1, 30)) and by_partition.tracker == "tracker"
    assert tracked == ["model", "model"]
    once = Publisher(config("--publish.every_steps=1"), "model", tmp_path)
    assert all(once.due(step) for step in range(1, 5)) and len(tracked) == 3


def test_table_widths_the_published_tables_cannot_hold_are_refused_when_publishing_is_on(tmp_path):
    Publisher(config("--publish.tables=int4"), None, tmp_path)  # off: nothing to check
    for on in (["--publish.every_steps=5"], ["--data.order=time", "--publish.every_partition=true"]):
        with pytest.raises(ValueError) as error:
            Publisher(config("--publish.tables=int4", *on), None, tmp_path)
        assert str(error.value) == ("--tables int4 needs every table's embedding_dim divisible by 4: "
                                    "features.cat.embedding_dim=2")


def shard(rank: int, first: int) -> SimpleNamespace:
    return SimpleNamespace(placement=SimpleNamespace(rank=lambda: rank), shard_offsets=[first, 0])


def test_tracked_rows_are_rows_of_the_whole_table():
    """Row-wise shards count their rows from their first; a table held whole counts from 0."""
    plan = SimpleNamespace(plan={
        "ebc": {"item": SimpleNamespace(sharding_spec=SimpleNamespace(shards=[shard(0, 0), shard(1, 6)])),
                "cat": SimpleNamespace(sharding_spec=SimpleNamespace(shards=[shard(1, 0)]))},
        "other": {"user": SimpleNamespace(sharding_spec=SimpleNamespace(shards=[shard(0, 0)]))}})
    lookups = {"ebc.embedding_bags.item": torch.tensor([0, 2], dtype=torch.int32),
               "ebc.embedding_bags.cat": torch.tensor([4])}
    tracker = SimpleNamespace(table_to_fqn={"item": "ebc.embedding_bags.item", "cat": "ebc.embedding_bags.cat"},
                              get_unique_ids=lambda: lookups)
    rows = tracked_rows(tracker, plan, 1)
    assert rows.keys() == {"item", "cat"} and all(r.dtype == torch.int64 for r in rows.values())
    assert rows["item"].tolist() == [6, 8] and rows["cat"].tolist() == [4]
    assert tracked_rows(tracker, plan, 0)["item"].tolist() == [0, 2]


def test_a_rank_holding_two_row_ranges_of_a_table_is_an_internal_error():
    """TorchRec's row-wise plans give a rank one range of a table; the rows could not be placed otherwise."""
    plan = SimpleNamespace(plan={"ebc": {"item": SimpleNamespace(
        sharding_spec=SimpleNamespace(shards=[shard(1, 0), shard(1, 6)]))}})
    tracker = SimpleNamespace(table_to_fqn={}, get_unique_ids=dict)
    with pytest.raises(AssertionError, match="^table item has shards of several row ranges on rank 1$"):
        tracked_rows(tracker, plan, 1)
