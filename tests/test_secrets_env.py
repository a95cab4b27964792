"""Secrets travel in environments, never on command lines or in job specs: a sweep's runs get
URI credentials as AWS_* variables (their command lines are world-readable in /proc and `ps`,
their environments only to their owner), checked on a real sweep against moto's S3 server
whose runs start through an interpreter that records its own /proc entries. The torchx
component's refusal of secrets in `env` is tested with the job specs in tests/test_launch.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

import cli
from trainer.config_loader import dump_toml, load_config
from trainer.credentials import is_secret_name

REPO = Path(__file__).resolve().parents[1]
KEY, SECRET = "AKIDSWEEP", "sw33p/SECRETvalue"  # a '/' as AWS secrets have, percent-encoded in URIs
USERINFO = f"{KEY}:{quote(SECRET, safe='')}"
NEEDLES = [KEY, SECRET, quote(SECRET, safe="")]


def test_secret_names():
    secret = ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "GITHUB_TOKEN", "DB_PASSWORD",
              "WANDB_API_KEY", "OPENAI_APIKEY", "AZURE_STORAGE_ACCOUNT_KEY", "client_secret", "SECRET"]
    other = ["AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_REGION", "TOKENIZERS_PARALLELISM", "AWS_WEB_IDENTITY_TOKEN_FILE",
             "AWS_SHARED_CREDENTIALS_FILE", "GOOGLE_APPLICATION_CREDENTIALS", "SECRETS_DIR", "LOGLEVEL"]
    assert [n for n in secret if not is_secret_name(n)] == []
    assert [n for n in other if is_secret_name(n)] == []


def bare_env(**extra: str) -> dict[str, str]:
    """A command's environment without this machine's AWS_* settings (and no EC2 metadata look-up)."""
    env = {k: v for k, v in cli.run_env().items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true", **extra}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(config with the synthetic schema, {split: URI with credentials}, {split: the URI without})."""
    pytest.importorskip("moto.server", reason="moto[server] not installed")
    from object_store import synthetic_bucket
    from trainer.data.datasets import synth_features

    local = tmp_path_factory.mktemp("synth")
    with synthetic_bucket(local, "sweep-test", USERINFO, rows=1_500, files=1, seed=2, num_users=100,
                          num_items=50) as (with_credentials, without):
        cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
        cfg.features = synth_features()
        dump_toml(cfg, local / "parquet.toml")
        yield local / "parquet.toml", with_credentials, without


def recording_python(folder: Path) -> Path:
    """An interpreter that keeps its /proc cmdline and environ in `folder`, then becomes Python
    (exec keeps the process, its command line and its environment)."""
    folder.mkdir()
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\ncat /proc/$$/cmdline > "{folder}/cmdline.$$"\n'
                       f'cat /proc/$$/environ > "{folder}/environ.$$"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.slow
def test_sweep_runs_get_uri_credentials_in_their_environment(tmp_path, store):
    config, with_credentials, bare = store
    record = tmp_path / "record"
    out = tmp_path / "sweep"
    proc = cli.rankmix("sweep", "--config", str(config), "--out", str(out), "--tower", "mlp", "--baseline-auc", "0.5",
                       "--python", str(recording_python(record)),
                       "--set", f"data.train_path={with_credentials['train']}",
                       "--set", f"data.eval_path={with_credentials['valid']}", "--set", "train.steps=3",
                       "--set", "data.batch_size=64", "--set", "metrics.progress=false",
                       "--set", "metrics.tensorboard=false", "--set", "checkpoint.enabled=false",
                       env=bare_env(AWS_SESSION_TOKEN="a-token-of-other-credentials"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "mlp" / "base" / "summary.json").read_text())
    assert summary["steps"] == 3 and 0 < summary["auc"] < 1  # it read the store with the credentials
    (cmdline,), (environ,) = sorted(record.glob("cmdline.*")), sorted(record.glob("environ.*"))
    argv = cmdline.read_bytes().decode().split("\0")
    assert f"--data.train_path={bare['train']}" in argv and f"--data.eval_path={bare['valid']}" in argv
    assert [a for a in argv if any(n in a for n in NEEDLES)] == []
    variables = dict(v.split("=", 1) for v in environ.read_bytes().decode().split("\0") if v)
    assert (variables["AWS_ACCESS_KEY_ID"], variables["AWS_SECRET_ACCESS_KEY"]) == (KEY, SECRET)
    assert "AWS_SESSION_TOKEN" not in variables  # it belongs to other credentials
    written = [p for p in out.rglob("*") if p.is_file() and any(n.encode() in p.read_bytes() for n in NEEDLES)]
    assert written == [] and not any(n in proc.stdout + proc.stderr for n in NEEDLES)
    assert "--data.train_path=s3://***@sweep-test/logs/train" in (out / "mlp" / "base" / "train.log").read_text()


OTHER_SCHEME = ("holds credentials that cannot reach a run through its environment (only an s3:// URI's "
                "KEY:SECRET can, as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), and its command line would show "
                "them; give them through the environment or a credentials file")


@pytest.mark.parametrize("uris,message", [
    ((f"s3://{USERINFO}@b/train", f"s3://OTHERKEY:{quote(SECRET, safe='')}@b/valid"),
     "--data.eval_path=s3://***@b/valid holds another key than an earlier s3:// URI, but a run has one "
     "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; use one key for all of them"),
    ((f"gs://{USERINFO}@b/train", "b/valid"), f"--data.train_path=gs://***@b/train {OTHER_SCHEME}"),
    ((f"s3://b/train?region=x&session_token={quote(SECRET, safe='')}", "b/valid"),
     f"--data.train_path=s3://b/train?region=x&session_token=*** {OTHER_SCHEME}"),
])
def test_sweep_refuses_credentials_it_cannot_keep_off_command_lines(tmp_path, uris, message):
    proc = cli.rankmix("sweep", "--config", str(REPO / "configs" / "debug.toml"), "--out", str(tmp_path / "sweep"),
                       "--tower", "mlp", "--baseline-auc", "0.5", "--dry-run",
                       "--set", f"data.train_path={uris[0]}", "--set", f"data.eval_path={uris[1]}", env=bare_env())
    assert proc.returncode == 2
    assert proc.stderr == f"rankmix: error: sweep point mlp [-]: {message}\n"  # one line, no traceback
    assert not any(n in proc.stdout + proc.stderr for n in NEEDLES)
