"""Credentials in URIs never reach disk or logs (trainer/credentials.py): the redaction
itself, the config round trip (a redacted config.toml asks for them again), the sweep's
files, and a real `rankmix train` against moto's S3 server whose run folder and output are
searched byte by byte for the secret."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from cli import run_env
from trainer.config import Config, DataConfig
from trainer.config_loader import dump_toml, load_config, to_dict
from trainer.credentials import (
    has_credentials,
    is_redacted,
    malformed_userinfo,
    redact_config,
    redact_uri,
    with_placeholders,
    without_credentials,
)

REPO = Path(__file__).resolve().parents[1]
KEY, SECRET = "AKIDTEST", "s3cr3tSECRETvalue"
QUERY = "?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1"


# ----------------------------------------------------------------------------- redact_uri


@pytest.mark.parametrize("text, redacted", [
    (f"s3://{KEY}:{SECRET}@bucket/prefix{QUERY}", f"s3://***@bucket/prefix{QUERY}"),
    (f"s3://{KEY}:{SECRET}@bucket", "s3://***@bucket"),
    (f"s3://{KEY}@bucket/prefix", "s3://***@bucket/prefix"),                     # user only
    (f"s3://{KEY}:@bucket/p", "s3://***@bucket/p"),                              # empty password
    ("s3://AK:se%2Fc%40r%3Aet@bucket/p", "s3://***@bucket/p"),                   # percent-encoded secret
    ("s3://AK:se/cr/et@bucket/p?region=x", "s3://***@bucket/p?region=x"),         # raw '/' (AWS secrets have them)
    ("s3://AK:se@cret@bucket/p", "s3://***@bucket/p"),                           # raw '@' in the secret
    ("gs://user:pw@bucket/a,gs://user:pw@bucket/b", "gs://***@bucket/a,gs://***@bucket/b"),  # data path lists
    (f"s3://bucket/a,s3://{KEY}:{SECRET}@bucket/b", "s3://bucket/a,s3://***@bucket/b"),
    ("hdfs://alice@namenode:8020/logs", "hdfs://***@namenode:8020/logs"),
    ("abfs://account:key@container.dfs.core.windows.net/d", "abfs://***@container.dfs.core.windows.net/d"),
    ("s3://bucket/path@v2/part.parquet", "s3://bucket/path@v2/part.parquet"),    # '@' after the host
    ("s3://AK:123/abc@bucket/p", "s3://***@bucket/p"),                           # a bucket has no port
    ("http://minio:9000/bucket/a@b", "http://minio:9000/bucket/a@b"),            # host:port, '@' in the path
    ("http://K:se/cret@host/a", "http://***@host/a"),                            # not a port: user-info
    ("http://[::1]:9000/a@b", "http://[::1]:9000/a@b"),
    ("file:///tmp/a@b.parquet", "file:///tmp/a@b.parquet"),
    ("/data/logs@2024/train", "/data/logs@2024/train"),
    ("alice@example.com", "alice@example.com"),
    ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
    ("runs/default", "runs/default"),
    ("", ""),
    ("s3://***@bucket/p", "s3://***@bucket/p"),                                  # idempotent
    ("s3://bucket/p?region=x&secret_key=abc&scheme=http", "s3://bucket/p?region=x&secret_key=***&scheme=http"),
    ("https://h/f?X-Amz-Signature=abc123&X-Amz-Credential=AK/2024",
     "https://h/f?X-Amz-Signature=***&X-Amz-Credential=***"),
    (f"error: cannot open 's3://{KEY}:{SECRET}@bucket/p' (and gs://u:p@b/q).",
     "error: cannot open 's3://***@bucket/p' (and gs://***@b/q)."),
    (f'train_path = "s3://{KEY}:{SECRET}@bucket/p"\n', 'train_path = "s3://***@bucket/p"\n'),
    (f"python -m launch.cli train --data.train_path=s3://{KEY}:{SECRET}@b/p{QUERY} --train.steps=3",
     f"python -m launch.cli train --data.train_path=s3://***@b/p{QUERY} --train.steps=3"),
])
def test_redact_uri(text, redacted):
    assert redact_uri(text) == redacted
    assert KEY not in redact_uri(text) and SECRET not in redact_uri(text)
    assert has_credentials(text) == (text != redacted)
    assert is_redacted(redacted) == ("***" in redacted)


def test_malformed_userinfo_is_told_apart():
    assert malformed_userinfo("s3://AK:se/cret@bucket/p") and malformed_userinfo("s3://AK:se@cret@bucket/p")
    assert not malformed_userinfo("s3://AK:se%2Fcret@bucket/p") and not malformed_userinfo("s3://bucket/a@b")


def test_placeholder_and_environment_forms():
    red = f"s3://***@bucket/prefix{QUERY}"
    assert with_placeholders(red) == f"s3://KEY:SECRET@bucket/prefix{QUERY}"
    assert without_credentials(red) == f"s3://bucket/prefix{QUERY}"
    assert without_credentials("s3://***@b/x,s3://***@b/y") == "s3://b/x,s3://b/y"
    assert without_credentials("s3://b/p?secret_key=***&region=x") == "s3://b/p?region=x"
    assert without_credentials("s3://b/p?region=x&secret_key=***") == "s3://b/p?region=x"


def test_redact_config_walks_nested_values():
    raw = {"data": {"train_path": f"s3://{KEY}:{SECRET}@b/t", "eval_path": "local/eval", "batch_size": 3},
           "features": [{"name": "a", "column": f"x://{KEY}@y"}], "tags": (f"s3://{KEY}@b", 1.5, None)}
    out = redact_config(raw)
    assert out == {"data": {"train_path": "s3://***@b/t", "eval_path": "local/eval", "batch_size": 3},
                   "features": [{"name": "a", "column": "x://***@y"}], "tags": ("s3://***@b", 1.5, None)}
    assert raw["data"]["train_path"] == f"s3://{KEY}:{SECRET}@b/t"  # a copy: the input is untouched


# ---------------------------------------------------------------------- config round trip


TRAIN = f"s3://{KEY}:{SECRET}@bucket/train{QUERY}"
EVAL = f"s3://{KEY}:{SECRET}@bucket/eval{QUERY}"


def expected_error(path, key: str, folder: str) -> str:
    return (f"{key} in {path} has redacted credentials (s3://***@bucket/{folder}{QUERY}): give the URI with "
            f"credentials again on the command line (--{key}='s3://KEY:SECRET@bucket/{folder}{QUERY}') or put them "
            "in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE and drop the user-info "
            f"(--{key}='s3://bucket/{folder}{QUERY}')")


def test_config_keeps_credentials_in_memory_but_never_shows_them(tmp_path):
    cfg = load_config(None, ["--data.dataset=parquet", f"--data.train_path={TRAIN}", f"--data.eval_path={EVAL}"])
    assert cfg.data.train_path == TRAIN  # the reader needs them
    for shown in (repr(cfg), repr(cfg.data), str(cfg), json.dumps(to_dict(cfg))):
        assert SECRET not in shown and KEY not in shown and "s3://***@bucket/train" in shown
    assert to_dict(cfg, reveal=True)["data"]["train_path"] == TRAIN
    dump_toml(cfg, tmp_path / "config.toml")
    text = (tmp_path / "config.toml").read_bytes()
    assert SECRET.encode() not in text and KEY.encode() not in text
    assert f'train_path = "s3://***@bucket/train{QUERY}"'.encode() in text


def test_redacted_config_asks_for_the_credentials_and_an_override_restores_them(tmp_path):
    cfg = load_config(None, ["--data.dataset=parquet", f"--data.train_path={TRAIN}", f"--data.eval_path={EVAL}"])
    path = tmp_path / "config.toml"
    dump_toml(cfg, path)
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert str(e.value) == "; ".join([expected_error(path, "data.train_path", "train"),
                                      expected_error(path, "data.eval_path", "eval")])
    # one given again: the other is still asked for
    with pytest.raises(ValueError) as e:
        load_config(path, [f"--data.train_path={TRAIN}"])
    assert str(e.value) == expected_error(path, "data.eval_path", "eval")
    # both given again: exactly the original run
    again = load_config(path, [f"--data.train_path={TRAIN}", f"--data.eval_path={EVAL}"])
    assert again == cfg and again.data.train_path == TRAIN and again.data.eval_path == EVAL
    # or no user-info at all: credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE
    bare = load_config(path, [f"--data.train_path=s3://bucket/train{QUERY}",
                              f"--data.eval_path=s3://bucket/eval{QUERY}"])
    assert bare.data.train_path == f"s3://bucket/train{QUERY}"
    # commands that never open the data paths (scoring) may read the redacted file
    kept = load_config(path, allow_redacted=True)
    assert kept.data.train_path == f"s3://***@bucket/train{QUERY}" and kept.model == cfg.model


def test_redacted_uri_on_the_command_line_is_named_as_such():
    with pytest.raises(ValueError, match=re.escape("data.train_path on the command line has redacted credentials "
                                                   "(s3://***@bucket/t)")):
        load_config(None, ["--data.train_path=s3://***@bucket/t"])


def test_unparsable_user_info_is_an_error_that_quotes_no_secret():
    with pytest.raises(ValueError) as e:
        load_config(None, ["--data.train_path=s3://AK:se/cret@bucket/t"])
    assert str(e.value) == ("data.train_path: the user-info of s3://***@bucket/t is not valid URI syntax: "
                            "percent-encode '/', '@', '#' and '?' as %2F, %40, %23 and %3F in the key and secret, "
                            "or better put them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE and drop "
                            "the user-info")
    assert e.value.__cause__ is None and e.value.__context__ is None


def test_load_config_errors_never_quote_credentials(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(f'[data]\ntrain_path = "{TRAIN}"\nbatch_size = "s3://{KEY}:{SECRET}@b/x"\n')
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert str(e.value) == "config key data.batch_size must be int, got 's3://***@b/x'"
    with pytest.raises(ValueError) as e:
        load_config(None, [f"--train.device=s3://{KEY}:{SECRET}@b"])
    assert SECRET not in str(e.value) and "s3://***@b" in str(e.value)


def test_data_config_repr_is_redacted():
    assert repr(DataConfig(train_path=TRAIN)).count("s3://***@bucket/train") == 1
    assert SECRET not in repr(Config(data=DataConfig(train_path=TRAIN, eval_path=EVAL)))


# ---------------------------------------------------------------------------------- sweep


def test_sweep_shows_and_writes_no_credentials(tmp_path):
    from launch.sweep import Point, build_points, fingerprint, point_name, reusable, rows_of, run_point

    args = argparse.Namespace(out=str(tmp_path / "sweep"), set=[f"data.train_path={TRAIN}"], tower_set=[],
                              tower=["rankmixer"], grid=[f"data.eval_path={EVAL},local/eval"], tower_grid=[],
                              seeds=1, baseline_auc=0.5, baseline_tower="logreg")
    points, _ = build_points(args)
    assert f"--data.train_path={TRAIN}" in points[0].overrides  # the run itself gets them
    assert SECRET not in points[0].label and "s3://***@bucket/eval" in points[0].label
    assert SECRET not in str(points[0].run_dir) and KEY not in str(points[0].run_dir)
    assert point_name({"data.eval_path": EVAL}) == point_name({"data.eval_path": EVAL.replace(SECRET, "other")})
    assert SECRET not in json.dumps(fingerprint(None, points[0]))
    # a record written before redaction (raw overrides) still matches
    p = points[0]
    p.run_dir.mkdir(parents=True)
    (p.run_dir / "summary.json").write_text(json.dumps({"auc": 0.6, "dense_params": 1, "flops_per_sample": 2}))
    (p.run_dir / "sweep_point.json").write_text(json.dumps({"config": None, "overrides": p.overrides}))
    assert reusable(None, p)
    rows = rows_of([p], 0.5)
    assert SECRET not in json.dumps(rows) and "s3://***@bucket/eval" in rows[0]["overrides"]
    # train.log's command line, and the failure message quoting the log's tail
    failing = Point("rankmixer", {}, None, tmp_path / "fail", [f"--data.train_path={TRAIN}", "--no.such=1"])
    with pytest.raises(RuntimeError) as e:
        run_point(None, failing, sys.executable)
    log = (tmp_path / "fail" / "train.log").read_text()
    assert "--data.train_path=s3://***@bucket/train" in log.splitlines()[0]
    assert SECRET not in log and SECRET not in str(e.value)


# ------------------------------------------------------------------------- end to end (S3)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """({split: URI with credentials in the user-info}, {split: the same URI without})."""
    pytest.importorskip("moto.server", reason="moto[server] not installed")
    from object_store import synthetic_bucket

    with synthetic_bucket(tmp_path_factory.mktemp("synth"), "secret-test", f"{KEY}:{SECRET}", rows=3_000, files=2,
                          row_group_size=250, seed=5, num_users=200, num_items=100) as uris:
        yield uris


def rankmix(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in run_env(AWS_EC2_METADATA_DISABLED="true").items() if not k.startswith("AWS_")
            or k == "AWS_EC2_METADATA_DISABLED"}
    return cli.rankmix(*args, env={**base, **(env or {})})


def leaks(folder: Path, *texts: str) -> list[str]:
    """Files under `folder` (recursively, hidden ones too) and output texts holding the key or secret."""
    needles = [KEY.encode(), SECRET.encode()]
    found = [str(p) for p in sorted(folder.rglob("*")) if p.is_file() and any(n in p.read_bytes() for n in needles)]
    return found + [f"output {i}" for i, t in enumerate(texts) if KEY in t or SECRET in t]


@pytest.mark.slow
def test_training_from_s3_with_uri_credentials_leaves_no_secret(tmp_path, store):
    with_credentials, bare = store
    base = load_config("configs/debug.toml", ["--data.dataset=parquet"])
    from trainer.data.datasets import synth_features

    base.features = synth_features()
    config = tmp_path / "parquet.toml"
    dump_toml(base, config)
    run = tmp_path / "run"
    common = ["--train.steps=20", f"--train.run_dir={run}", "--metrics.log_every=10",
              "--metrics.progress=false", "--metrics.tensorboard=true", "--checkpoint.enabled=true"]
    first = rankmix("train", "--config", str(config), f"--data.train_path={with_credentials['train']}",
                    f"--data.eval_path={with_credentials['valid']}", *common)
    assert first.returncode == 0, redact_uri(first.stderr[-3000:])
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 20 and 0 < summary["auc"] < 1
    names = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert {"config.toml", "metrics.jsonl", "summary.json", "plan.txt", "checkpoints/step-20/.metadata"} <= names
    assert any(n.startswith("tb/events.out.tfevents") for n in names)
    assert leaks(run, first.stdout, first.stderr) == []
    assert "s3://***@secret-test/logs/train" in (run / "config.toml").read_text()

    # The run's config.toml given back: a clear error naming the keys, nothing trained.
    again = rankmix("train", "--config", str(run / "config.toml"), "--train.steps=30")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith(
        f"rankmix: error: data.train_path in {run / 'config.toml'} has redacted credentials (s3://***@secret-test/")
    assert "drop the user-info (--data.eval_path='s3://secret-test/logs/valid?" in again.stderr

    # Resumed with the credentials in the environment and no user-info: finds its data and checkpoint.
    resumed = rankmix("train", "--config", str(run / "config.toml"), f"--data.train_path={bare['train']}",
                      f"--data.eval_path={bare['valid']}", "--train.steps=30", f"--train.run_dir={run}",
                      "--metrics.progress=false", env={"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET})
    assert resumed.returncode == 0, redact_uri(resumed.stderr[-3000:])
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 30
    assert leaks(run, first.stdout, first.stderr, again.stdout, again.stderr, resumed.stdout, resumed.stderr) == []
