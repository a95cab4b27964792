"""Credentials in URIs: the one redaction used wherever config values are written or shown.

Data paths may carry object-store credentials in a URI's user-info
(`s3://KEY:SECRET@bucket/prefix?...`, pyarrow's only URI form for them). The config keeps
the value as given, so that the reader can open the store; everything that writes or
shows config values (config.toml, reprs, error messages, the sweep's files) goes through
`redact_uri` / `redact_config`, which turn it into `s3://***@bucket/prefix?...`.

A redacted value read back (a run's config.toml given to `--config`) is not usable: see
`is_redacted`, and `trainer.config_loader.load_config`, which asks for the credentials again.

Standard library only: importable from anywhere (reader, CLI, sweep) without cost.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

MARKER = "***"
"""What replaces a URI's user-info or a secret query parameter's value."""

ENV_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")
"""Where credentials should live instead (pyarrow's default AWS chain reads them)."""

SECRET_QUERY_PARAMETERS = ("access_key", "secret_key", "session_token", "account_key", "sas_token",
                           "client_secret", "password", "token", "sig", "signature", "x-amz-signature",
                           "x-amz-credential", "x-amz-security-token")
"""Query parameters whose values are redacted too (pyarrow rejects most of them for S3, but
its "Unexpected query parameter" error quotes the whole URI)."""

# Environment variables that hold a secret by convention (AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
# HF_TOKEN, DB_PASSWORD, WANDB_API_KEY, AZURE_STORAGE_ACCOUNT_KEY), matched on whole `_` words so
# that TOKENIZERS_PARALLELISM is none; a name ending in _FILE / _PATH / _DIR says where a secret
# is (AWS_WEB_IDENTITY_TOKEN_FILE), which a job spec may show.
_SECRET_NAME = re.compile(r"(?:^|_)(?:SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|API_?KEY|PRIVATE_KEY|ACCOUNT_KEY)(?:_|$)")
_REFERENCE_NAME = re.compile(r"_(?:FILE|PATH|DIR)$")
# `scheme://` not preceded by a scheme character (`xs3://` is one scheme, not `s3://`).
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
# Schemes whose host is a bucket name, which never holds a ':' (so `KEY:123/...` is no port).
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs"})
# Characters that end a URI written in prose, a repr, a TOML or JSON string, a command line.
_END = frozenset(" \t\r\n\f\v'\"<>`")
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&;](?:%s)=)(?P<value>[^&;#\s'\"<>`,]*)" % "|".join(re.escape(p) for p in SECRET_QUERY_PARAMETERS),
    re.IGNORECASE)


class CredentialsError(ValueError):
    """URI credentials that cannot be used (redacted, or not parsable); the message quotes
    none, and may show placeholders (`s3://KEY:SECRET@...`) that must not be redacted again."""


def _userinfo_spans(text: str) -> Iterator[tuple[int, int, bool]]:
    """(start, end, malformed) of each URI user-info in `text`: text[start:end] is what
    lies between `scheme://` and the `@` before the host. `malformed`: pyarrow cannot parse
    it (an unencoded '/' or '@' in the secret) and would quote the URI in its error."""
    done = 0
    for m in _SCHEME.finditer(text):
        start = m.end()
        if m.start() < done:  # inside a user-info already found
            continue
        end = start
        while end < len(text) and text[end] not in "/?#" and text[end] not in _END:
            end += 1
        authority = text[start:end]
        at = authority.rfind("@")  # the last '@' of the authority: a raw '@' in the secret is redacted too
        if at >= 0:
            yield start, start + at, "@" in authority[:at]
            done = start + at
            continue
        # `KEY:SE/CRET@host`: an unencoded '/' (common in AWS secrets) ends the authority
        # early; `KEY:SE` cannot be host:port (not a number, or a bucket scheme), so the
        # user-info runs to the next '@'.
        _, colon, port = authority.partition(":")
        bucket = m[0][:-3].lower() in _BUCKET_SCHEMES
        if colon and (bucket or port and not port.isdigit()) and not authority.startswith("[") \
                and end < len(text) and text[end] == "/":
            stop = end
            while stop < len(text) and text[stop] not in "?#," and text[stop] not in _END:
                stop += 1
            at = text.rfind("@", end, stop)
            if at >= 0:
                yield start, at, True
                done = at


def redact_uri(text: str) -> str:
    """`text` with the user-info of every `scheme://user:pass@host` (or `scheme://user@host`)
    and every secret query parameter's value replaced by `***`; anything else unchanged.
    Works on any text: one URI, a comma-separated list, a message, a command line."""
    if "://" not in text and "=" not in text:
        return text
    out, pos = [], 0
    for start, end, _ in _userinfo_spans(text):
        out += [text[pos:start], MARKER]
        pos = end
    out.append(text[pos:])
    return _SECRET_QUERY.sub(lambda m: m["key"] + MARKER, "".join(out))


def redact_config(value: Any) -> Any:
    """A copy of a nested dict / list / tuple of config values with every string redacted."""
    if isinstance(value, str):
        return redact_uri(value)
    if isinstance(value, dict):
        return {k: redact_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_config(v) for v in value)
    return value


def has_credentials(text: str) -> bool:
    """Whether `text` holds URI credentials (not already redacted)."""
    return redact_uri(text) != text


def is_secret_name(name: str) -> bool:
    """Whether environment variable `name` holds a secret by convention (see `_SECRET_NAME`)."""
    name = name.upper()
    return bool(_SECRET_NAME.search(name)) and not _REFERENCE_NAME.search(name)


def to_environment(options: list[str]) -> tuple[list[str], dict[str, str]]:
    """`options` with the user-info of their s3:// URIs dropped, and the AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY that carry it instead: the reader gives a URI without user-info the
    AWS default chain, which reads them. A ValueError, quoting no secret, for credentials the
    two variables cannot carry: another scheme's user-info, a secret query parameter, or two
    different key pairs."""
    out, pairs = [], set()
    for option in options:
        kept, pos = [], 0
        for start, end, _ in _userinfo_spans(option):
            scheme = re.search(r"[A-Za-z0-9+.\-]*$", option[:start - 3])[0].lower()
            if scheme == "s3":
                key, _, secret = option[start:end].partition(":")
                pairs.add((unquote(key), unquote(secret)))
                kept.append(option[pos:start])
                pos = end + 1  # the '@' too
        kept.append(option[pos:])
        out.append("".join(kept))
        if has_credentials(out[-1]):
            raise ValueError(f"{redact_uri(option)} holds credentials that cannot reach a run through its "
                             "environment (only an s3:// URI's KEY:SECRET can, as AWS_ACCESS_KEY_ID / "
                             "AWS_SECRET_ACCESS_KEY), and its command line would show them; give them through "
                             "the environment or a credentials file")
        if len(pairs) > 1:
            raise ValueError(f"{redact_uri(option)} holds another key than an earlier s3:// URI, but a run has "
                             "one AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; use one key for all of them")
    if not pairs:
        return out, {}
    (key, secret), = pairs
    return out, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}


def is_redacted(text: str) -> bool:
    """Whether `text` holds credentials that `redact_uri` replaced (no longer usable)."""
    return any(text[s:e] == MARKER for s, e, _ in _userinfo_spans(text)) or \
        any(m["value"] == MARKER for m in _SECRET_QUERY.finditer(text))


def malformed_userinfo(text: str) -> bool:
    """Whether a URI in `text` has user-info that pyarrow cannot parse (an unencoded '/' or
    '@' in the key or secret): its error would quote the URI, secret included."""
    return any(bad for _, _, bad in _userinfo_spans(text))


def with_placeholders(text: str) -> str:
    """A redacted value with KEY:SECRET / SECRET where the credentials were (for messages)."""
    out, pos = [], 0
    for start, end, _ in _userinfo_spans(text):
        if text[start:end] == MARKER:
            out += [text[pos:start], "KEY:SECRET"]
            pos = end
    out.append(text[pos:])
    return _SECRET_QUERY.sub(lambda m: m["key"] + ("SECRET" if m["value"] == MARKER else m["value"]), "".join(out))


def without_credentials(text: str) -> str:
    """A redacted value with the redacted parts dropped: the form that takes credentials from
    the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE)."""
    out, pos = [], 0
    for start, end, _ in _userinfo_spans(text):
        if text[start:end] == MARKER:
            out.append(text[pos:start])
            pos = end + 1  # the '@' too
    out.append(text[pos:])
    text = _SECRET_QUERY.sub(lambda m: m[0] if m["value"] != MARKER else "?" if m[0][0] == "?" else "",
                             "".join(out))
    return re.sub(r"\?&", "?", re.sub(r"\?(?=[#\s,'\"]|$)", "", text))
