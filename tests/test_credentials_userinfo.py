"""A URI's user-info is everything between `scheme://` and the last '@' before the first '/'
(issue 55, findings 3 and 4): a secret holding '#', '?', '@', a space or a quote is found by
the one parser (trainer/credentials.py) that redaction, `has_credentials`, the torchx
component's check and every error message use. Before, the parser ended the authority at
'?' or '#', so `s3://minio:hunter2#x@bucket/train` was printed in clear on stderr and went
into the job spec."""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cli import rankmix
from launch.component import train
from trainer.credentials import (
    has_credentials,
    is_redacted,
    malformed_userinfo,
    redact_uri,
    secret_kind,
    to_environment,
    with_placeholders,
)
from trainer.data.store import resolve_files

URI = "s3://minio:hunter2#x@bucket/train"
PLACEHOLDER = "KEY:SECRET"  # what messages show where credentials go: no secret
NOT_URI_SYNTAX = ("the user-info of {} is not valid URI syntax: percent-encode '/', '@', '#' and '?' as %2F, %40, "
                  "%23 and %3F in the key and secret, or better put them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                  "/ AWS_PROFILE and drop the user-info")
EXPECTED_S3 = ("expected s3://bucket/key or s3://KEY:SECRET@bucket/key (percent-encode '/', '@', '#' and '?' in the "
               "key and secret as %2F, %40, %23 and %3F)")
IN_JOB_SPEC = ": credentials in a URI would be written into the job spec; give them to the job as AWS_* environment " \
              "variables or a secret"


@pytest.mark.parametrize("text, redacted, malformed", [
    (URI, "s3://***@bucket/train", True),                                        # the URI
    ("s3://minio:pa?ss@bucket/train", "s3://***@bucket/train", True),             # '?' in the secret
    ("s3://minio:a?b#c@bucket/t?region=x#f", "s3://***@bucket/t?region=x#f", True),  # both, and a real query
    ("s3://minio:#@bucket/t", "s3://***@bucket/t", True),                        # the whole secret is '#'
    ("s3://mi#nio:pw@bucket/t", "s3://***@bucket/t", True),                      # '#' in the key
    ("s3://minio:a@b#c@bucket/t", "s3://***@bucket/t", True),                    # '@' and '#'
    ("s3://u:a@b@c@bucket/t", "s3://***@bucket/t", True),                        # several '@': the last one
    ("s3://u:a b'c\"d@bucket/t", "s3://***@bucket/t", True),                      # space and quotes
    ("s3://u:p#w@bucket", "s3://***@bucket", True),                              # no '/' after the authority
    ("s3://u:p?w@bucket?region=x", "s3://***@bucket?region=x", True),            # ... and a query
    ("s3://u:pw@bucket?endpoint_override=127.0.0.1:9000", "s3://***@bucket?endpoint_override=127.0.0.1:9000",
     False),
    ("s3://K:se/cr#et@b/p", "s3://***@b/p", True),                               # '/' and '#' (the '/' fallback)
    ("s3://u:p#1@b,gs://v:q?2@c/x", "s3://***@b,gs://***@c/x", True),            # a list without '/'
    ("s3://bucket,s3://u:p#w@b/x", "s3://bucket,s3://***@b/x", True),            # a bare URI before one
    (f"error: cannot open '{URI}' (and gs://u:p?w@b/q).", "error: cannot open 's3://***@bucket/train' "
     "(and gs://***@b/q).", True),
    ("s3://u:p%23w%3F@bucket/t", "s3://***@bucket/t", False),                    # percent-encoded: valid
    ("s3://bucket/t?a=1#frag@x", "s3://bucket/t?a=1#frag@x", False),             # '#', '@' after the '/'
    ("s3://bucket/t", "s3://bucket/t", False),
    (f"s3://{PLACEHOLDER}@bucket/key", f"s3://{PLACEHOLDER}@bucket/key", False),  # the placeholder is no secret
])
def test_user_info_runs_to_the_last_at_before_the_first_slash(text, redacted, malformed):
    assert redact_uri(text) == redacted
    assert has_credentials(text) == (text != redacted)
    assert malformed_userinfo(text) == malformed
    assert is_redacted(redacted) == ("***" in redacted) and not has_credentials(redacted)
    assert secret_kind(text) == ("credentials in a URI" if text != redacted else None)


PRINTABLE = st.text(st.sampled_from([c for c in string.printable[:95] if c != "/"]), max_size=24)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(user=PRINTABLE, secret=PRINTABLE.filter(bool))
def test_any_printable_secret_is_redacted(user, secret):
    """Secrets over printable ASCII but '/' (which the fallback for an unencoded '/' covers)."""
    assume(f"{user}:{secret}" != PLACEHOLDER)
    uri = f"s3://{user}:{secret}@bucket/key"
    assert redact_uri(uri) == "s3://***@bucket/key"  # no character of the secret left
    assert has_credentials(uri)
    assert redact_uri(f"cannot open {uri}: denied") == "cannot open s3://***@bucket/key: denied"
    assert redact_uri(f"--data.train_path={uri}?region=x") == "--data.train_path=s3://***@bucket/key?region=x"


def test_cli_error_line_names_no_secret_and_shows_the_placeholder():
    proc = rankmix("train", "--config", "configs/criteo_1tb.toml", f"--data.train_path={URI}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "rankmix: error: data.train_path: " + NOT_URI_SYNTAX.format("s3://***@bucket/train")
    assert "hunter2" not in proc.stdout + proc.stderr
    # a host:port where the bucket goes: the placeholder survives the CLI's redaction safety net
    proc = rankmix("train", "--config", "configs/criteo_1tb.toml", "--data.train_path=s3://minio:9000/bucket/train")
    assert proc.stderr.strip().splitlines()[-1] == f"rankmix: error: s3://minio:9000/bucket/train: {EXPECTED_S3}"


def test_store_error_for_a_secret_cut_short_by_hash_names_no_secret():
    """What reaches the store without the config's check (`rankmix score --data`)."""
    for uri in (URI, "s3://minio:hunter2?x@bucket/train"):
        with pytest.raises(ValueError) as e:
            resolve_files(uri)
        assert str(e.value) == f"s3://***@bucket/train: {EXPECTED_S3}"


def test_placeholders_are_not_redacted_again():
    shown = with_placeholders("s3://***@bucket/train")
    assert shown == "s3://KEY:SECRET@bucket/train" and redact_uri(shown) == shown


@pytest.mark.parametrize("overrides, shown", [
    ([f"--data.train_path={URI}"], "--data.train_path=s3://***@bucket/train"),
    (["--data.train_path=s3://minio:pa?ss@bucket/train"], "--data.train_path=s3://***@bucket/train"),
    (["--train.steps=3", "--data.eval_path", "s3://u:a@b#c@bucket/v"], "--data.eval_path=s3://***@bucket/v"),
    (["--data.train_path=s3://u:p w@bucket"], "--data.train_path=s3://***@bucket"),
])
def test_component_refuses_a_uri_secret_wherever_hash_and_question_mark_stand(overrides, shown):
    with pytest.raises(ValueError) as e:
        train(*overrides, config="configs/criteo_1tb.toml")
    assert str(e.value) == shown + IN_JOB_SPEC


def test_component_refuses_a_uri_secret_in_config():
    with pytest.raises(ValueError) as e:
        train(config=f"{URI}.toml")
    assert str(e.value) == "s3://***@bucket/train.toml" + IN_JOB_SPEC


def test_component_refuses_a_key_in_an_override_by_its_kind():
    token = "ghp_" + "a1B2c3D4e5" * 4
    with pytest.raises(ValueError) as e:
        train(f"--train.run_dir=runs/{token}", config="configs/criteo_1tb.toml")
    assert str(e.value) == ("--train.run_dir: its value looks like a GitHub token, and the job spec would show it; "
                            "give it to the job through the scheduler's secret mechanisms instead: a Kubernetes "
                            "Secret, a Slurm environment file (exported in the shell that submits), or an instance "
                            "role")
    assert token not in str(e.value)


def test_component_takes_ordinary_overrides():
    overrides = ["--data.train_path=s3://bucket/logs/part-00000-3f2a1b4c-5d6e-7f80-9a1b-2c3d4e5f6a7b.parquet",
                 "--data.eval_path=s3://bucket/valid?endpoint_override=127.0.0.1:9000&scheme=http#v@2",
                 "--train.run_dir=/shared/runs/RankMixer_Criteo1TB_D512_L8_T16_lr3e-4_bs65536_seed42",
                 "--model.token_dim=64", "--data.cache_dir=/home/JohnSmith/Projects/RankMix2024/cache"]
    args = train(*overrides, config="configs/criteo_1tb.toml").roles[0].args[1]
    assert all(o in args for o in overrides[2:]) and "s3://bucket/valid?" in args


def test_sweep_moves_a_hash_secret_into_the_environment():
    """`rankmix sweep` gives each run its s3:// key as AWS_* variables: a '#' secret too."""
    assert to_environment([f"--data.train_path={URI}", "--train.steps=3"]) == (
        ["--data.train_path=s3://bucket/train", "--train.steps=3"],
        {"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY": "hunter2#x"})
