"""Credentials in URIs: the one redaction used wherever config values are written or shown;
and what tells a secret in an environment variable, by its name or its value.

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

import math
import re
from collections import Counter
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
# HF_TOKEN, DB_PASSWORD, PGPASSWORD, WANDB_API_KEY, WANDB_KEY, MYSQL_PWD): SECRET, PASSWORD, PASSWD
# and PASSPHRASE anywhere; TOKEN, API_KEY, PRIVATE_KEY and ACCOUNT_KEY as whole `_` words (TOKEN
# at the end too), so that TOKENIZERS_PARALLELISM is none; KEY and PWD as the last word only
# (AWS_ACCESS_KEY_ID is an ID, NCCL_IB_PKEY a partition, PWD a folder). A name ending in _FILE /
# _PATH / _DIR says where a secret is (AWS_WEB_IDENTITY_TOKEN_FILE), which a job spec may show.
_SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|PASSPHRASE|(?:^|_)(?:TOKEN|API_?KEY|PRIVATE_KEY|ACCOUNT_KEY)(?:_|$)"
                          r"|TOKEN$|_KEY$|^KEY$|_PWD$")
_REFERENCE_NAME = re.compile(r"_(?:FILE|PATH|DIR)$")
# Credentials of a known format, wherever they are in a value.
_KEY_FORMATS = [(re.compile(pattern), what) for pattern, what in (
    (r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])", "an AWS access key ID"),
    (r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})", "a GitHub token"),
    (r"\bxox[abposr]-[A-Za-z0-9-]{10,}", "a Slack token"),
    (r"\bsk-[A-Za-z0-9_-]{20,}", "an API key (sk-...)"),
    (r"\bglpat-[A-Za-z0-9_-]{20,}", "a GitLab token"),
    (r"\bAIza[A-Za-z0-9_-]{35}", "a Google API key"),
    (r"\bhf_[A-Za-z0-9]{30,}", "a Hugging Face token"),
    (r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.", "a JSON Web Token"),
    (r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY", "a private key"))]
# A run of base64 / base64url characters long enough to be a key (a 192-bit one is 32).
_RANDOM_RUN = re.compile(r"[A-Za-z0-9+/=_-]{32,}")
# Runs that read as words or numbers: identifiers, paths and model names are mostly made of them.
_WORDS = re.compile(r"[a-z]{3,}|[A-Z]{4,}|[0-9]{4,}")
# `scheme://` not preceded by a scheme character (`xs3://` is one scheme, not `s3://`).
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
# Schemes whose host is a bucket name, which never holds a ':' (so `KEY:123/...` is no port).
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "s3n", "gs", "gcs"})
# Characters that end a URI written in prose, a repr, a TOML or JSON string, a command line;
# they end a user-info only where no '@' follows before the authority's end (see `_userinfo_spans`).
_END = frozenset(" \t\r\n\f\v'\"<>`")
# What a user-info may hold unencoded (RFC 3986: unreserved, sub-delims, ':', %XX). pyarrow's
# parser refuses anything else ('/', '@', '#', '?', a space), and its error quotes the URI.
_USERINFO = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*")
PLACEHOLDER = "KEY:SECRET"
"""The user-info messages show where credentials go (`with_placeholders`): no secret, never redacted."""
_SECRET_QUERY = re.compile(
    rf"(?P<key>[?&;](?:{'|'.join(re.escape(p) for p in SECRET_QUERY_PARAMETERS)})=)(?P<value>[^&;#\s'\"<>`,]*)",
    re.IGNORECASE)


class CredentialsError(ValueError):
    """URI credentials that cannot be used (redacted, or not parsable); the message quotes
    none, and may show placeholders (`s3://KEY:SECRET@...`) that must not be redacted again."""


def _userinfo_spans(text: str) -> Iterator[tuple[int, int, bool]]:
    """(start, end, malformed) of each URI user-info in `text`: text[start:end] is what
    lies between `scheme://` and the last `@` before the first '/' after it (or before the
    next `scheme://` or line break, where no '/' comes first). '?', '#', spaces and quotes do
    not end it: a secret may hold them, and a parser that stops there shows the rest of the
    secret. `malformed`: pyarrow cannot parse it (a character outside `_USERINFO`, as an
    unencoded '/', '@', '#' or '?' in the secret) and would quote the URI in its error."""
    done = 0
    schemes = list(_SCHEME.finditer(text))
    for i, m in enumerate(schemes):
        start = m.end()
        if m.start() < done:  # inside a user-info already found
            continue
        limit = schemes[i + 1].start() if i + 1 < len(schemes) else len(text)
        end = start
        while end < limit and text[end] not in "/\r\n":
            end += 1
        authority = text[start:end]
        at = authority.rfind("@")  # the last '@': a raw '@' in the secret is redacted too
        if at >= 0:
            if authority[:at] != PLACEHOLDER:
                yield start, start + at, not _USERINFO.fullmatch(authority[:at])
                done = start + at
            continue
        # `KEY:SE/CRET@host`: an unencoded '/' (common in AWS secrets) ends the authority
        # early; `KEY:SE` cannot be host:port (not a number, or a bucket scheme), so the
        # user-info runs to the next '@' before a ',' or the end of the URI in prose.
        authority = authority[:next((k for k, c in enumerate(authority) if c in _END), len(authority))]
        _, colon, port = authority.partition(":")
        bucket = m[0][:-3].lower() in _BUCKET_SCHEMES
        if colon and (bucket or port and not port.isdigit()) and not authority.startswith("[") \
                and start + len(authority) == end and end < limit and text[end] == "/":
            stop = end
            while stop < limit and text[stop] != "," and text[stop] not in _END:
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


def secret_kind(value: str) -> str | None:
    """What credential `value` looks like (for a message that cannot show it), or None.

    URI credentials; a key of a known format (`_KEY_FORMATS`); or a random-looking string: a
    run of 32+ base64 characters, not a path (starting with '/'), mixing capitals, small
    letters and digits, whose Shannon entropy is at least 0.8 x log2(min(length, 64)) bits per
    character, and less than 55% of it word-like runs (`_WORDS`). That catches about 98% of
    random keys of 32 to 64 characters (the rest read partly as words, or start with '/' as a
    path does) and leaves paths, URLs, hosts, numbers, CamelCase and model names alone; hex
    digests (git commits, sha256) are never taken for keys, nor is anything shorter than 32."""
    if has_credentials(value):
        return "credentials in a URI"
    for pattern, what in _KEY_FORMATS:
        if pattern.search(value):
            return what
    for run in _RANDOM_RUN.findall(value):
        if not run.startswith("/") and _random_looking(run):
            return "a random key (a long string of high entropy)"
    return None


def _random_looking(run: str) -> bool:
    if not (re.search("[A-Z]", run) and re.search("[a-z]", run) and re.search("[0-9]", run)):
        return False
    counts = Counter(run).values()
    entropy = -sum(c / len(run) * math.log2(c / len(run)) for c in counts)
    words = sum(len(w) for w in _WORDS.findall(run))
    return entropy >= 0.8 * math.log2(min(len(run), 64)) and words < 0.55 * len(run)


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
