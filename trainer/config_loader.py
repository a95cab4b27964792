"""Loading, overriding, checking and writing the config tree of `trainer/config.py`:
defaults < model.recipe's defaults < TOML file < `--section.key=value` overrides.

Every field carries a one-line docstring (the string literal after it); `rankmix train
--help` prints them (`describe`). Unknown keys and wrong types are `ValueError`s naming
the key. A redacted credential read back (a run's config.toml given to `--config`) is an
error that asks for the credentials again.
"""


from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import tomli_w

from dense.model_config import TaskSpec, unused_model_fields, validate_model
from dense.sequence_registry import SEQUENCE_MODULES
from dense.tower_registry import TOWERS
from embeddings.features import FeatureSpec, managed_tables, unused_feature_fields, validate_features
from embeddings.sparse_config import SPARSE_SHARDING_TYPES
from trainer.config import MAX_BATCH_ROWS, RECIPES, Config, DataConfig, check_catalog, table_format, unused_run_fields
from trainer.credentials import (
    ENV_VARIABLES,
    CredentialsError,
    is_redacted,
    malformed_userinfo,
    redact_config,
    redact_uri,
    with_placeholders,
    without_credentials,
)
from trainer.files import write_atomic

# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                allow_redacted: bool = False) -> Config:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides; the
    recipe's defaults fill the keys neither gives (`apply_recipe`).

    A value whose URI credentials were redacted (a run's config.toml) is a ValueError that
    says which key to give again, unless an override replaces it; `allow_redacted` keeps
    such values, for commands that never open them (scoring reads only the model's keys).
    Error messages never quote credentials."""
    try:
        raw: dict[str, Any] = {}
        if path is not None:
            try:
                raw = tomllib.loads(Path(path).read_text())
            except FileNotFoundError:
                raise ValueError(f"config file not found: {path}") from None
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        cfg = _build(Config, raw, "")
        for item in overrides:
            apply_override(cfg, item)
        in_file, on_command_line = set(_given_keys(raw, "")), {item[2:].split("=", 1)[0] for item in overrides}
        apply_recipe(cfg, in_file | on_command_line)
        check_credentials(cfg, path, overrides, allow_redacted=allow_redacted)
        check_unused(cfg, in_file, on_command_line)
        validate(cfg)
        return cfg
    except CredentialsError:
        raise
    except ValueError as e:
        message = redact_uri(str(e))
        if message != str(e):
            raise ValueError(message) from None  # no chained original: it holds the secret
        raise


def apply_recipe(cfg: Config, given: set[str]) -> None:
    """Set the defaults model.recipe and then the chosen tower replace (`TowerSpec.defaults`),
    except the keys `given` in the file or on the command line: defaults < recipe < tower < TOML < CLI."""
    for dotted, value in [*RECIPES[cfg.model.recipe].items(), *TOWERS.get(cfg.model.tower).defaults]:
        if dotted not in given:
            section, key = dotted.split(".")
            setattr(getattr(cfg, section), key, value)


def check_unused(cfg: Config, in_file: set[str], on_command_line: set[str]) -> None:
    """ValueError for a field given that the chosen tower, tokenizer or feature kind does not
    read. A field from the file is let through when the command line changed the key that
    makes it unused (`--model.tower=mlp` over a RankMixer file), since it belongs to the
    file's own choice; `dump_toml` then leaves it out."""
    unused = unused_fields(cfg)
    for key in sorted(in_file | on_command_line):
        if key in unused:
            cause, why = unused[key]
            if key in on_command_line or cause not in on_command_line:
                raise ValueError(f"{key} is set, but {why}; remove it")


def unused_fields(cfg: Config) -> dict[str, tuple[str, str]]:
    """Every field of `cfg` that its choices leave unread -> (the key that decides it, why)."""
    return unused_model_fields(cfg.model) | unused_feature_fields(cfg.features) | unused_run_fields(cfg.data)


FREE_TABLES = ("embeddings.table_sharding", "data.catalog")
"""Config tables of free keys (dict fields): a key given in them is the table's, not a field."""


def _given_keys(raw: Any, where: str) -> typing.Iterator[str]:
    """The dotted keys a TOML table sets, list entries by name (`features.item_id.column`)."""
    for key, value in raw.items():
        dotted = _join(where, str(key))
        if isinstance(value, dict) and not dotted.startswith(FREE_TABLES):
            yield from _given_keys(value, dotted)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, entry in enumerate(value):
                yield from _given_keys(entry, _entry(dotted, i, entry))
        else:
            yield dotted


def check_credentials(cfg: Config, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                      *, allow_redacted: bool = False) -> None:
    """CredentialsError (a ValueError) for URI credentials pyarrow cannot parse (its error
    would quote them) and, unless `allow_redacted`, for redacted ones (naming the key and
    where the value came from)."""
    given = {item[2:].split("=", 1)[0] for item in overrides}
    problems = []
    for key, value in dict.fromkeys(_strings(cfg, "")):
        if malformed_userinfo(value):
            raise CredentialsError(
                f"{key}: the user-info of {redact_uri(value)} is not valid URI syntax: percent-encode "
                "'/', '@', '#' and '?' as %2F, %40, %23 and %3F in the key and secret, or better put them in "
                f"{' / '.join(ENV_VARIABLES)} and drop the user-info")
        if is_redacted(value) and not allow_redacted:
            where = "on the command line" if key in given or path is None else f"in {path}"
            drop = "the user-info" if "://***@" in value else "them from the URI"
            problems.append(
                f"{key} {where} has redacted credentials ({value}): give the URI with credentials again on the "
                f"command line (--{key}='{with_placeholders(value)}') or put them in "
                f"{' / '.join(ENV_VARIABLES)} and drop {drop} (--{key}='{without_credentials(value)}')")
    if problems:
        raise CredentialsError("; ".join(problems))


def _strings(obj: Any, key: str) -> typing.Iterator[tuple[str, str]]:
    """(override key, value) of every string in the config; list entries by name, as
    `apply_override` addresses them (`features.item_id.column`)."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _strings(getattr(obj, f.name), _join(key, f.name))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, _join(key, str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, _join(key, getattr(v, "name", "") or str(i)) if dataclasses.is_dataclass(v)
                                else key)
    elif isinstance(obj, str):
        yield key, obj


def apply_override(cfg: Config, item: str) -> None:
    """Apply one `--a.b=value` (list entries by name: `--features.item_id.num_embeddings=10`)."""
    if not item.startswith("--") or "=" not in item:
        raise ValueError(f"override {item!r} must look like --section.key=value")
    dotted, text = item[2:].split("=", 1)
    parts = dotted.split(".")
    obj: Any = cfg
    hint: Any = Config
    i = 0
    while i < len(parts) - 1 and not isinstance(obj, dict):
        if dataclasses.is_dataclass(obj) and parts[i] in _fields(type(obj)):
            hint = _hints(type(obj))[parts[i]]
        obj = _child(obj, parts[i], ".".join(parts[: i + 1]))
        i += 1
    key = ".".join(parts[i:])  # a free table's key may hold dots: `--data.catalog.s3.endpoint=...`
    if isinstance(obj, dict):  # a table of free keys: `--embeddings.table_sharding.item=row_wise`
        item = typing.get_args(hint)[1]
        obj[key] = _coerce(_parse_scalar(text, item), item, dotted)
        return
    if not dataclasses.is_dataclass(obj) or key not in _fields(type(obj)):
        raise ValueError(f"unknown config key: {dotted}")
    hint = _hints(type(obj))[key]
    setattr(obj, key, _coerce(_parse_scalar(text, hint), hint, dotted))


def _child(obj: Any, part: str, where: str) -> Any:
    if isinstance(obj, list):
        for entry in obj:
            if getattr(entry, "name", None) == part:
                return entry
        raise ValueError(f"unknown config key: {where} (no entry named {part!r})")
    if dataclasses.is_dataclass(obj) and part in _fields(type(obj)):
        return getattr(obj, part)
    raise ValueError(f"unknown config key: {where}")


def _parse_scalar(text: str, hint: Any) -> Any:
    if hint is str:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if typing.get_origin(hint) is list:  # `a,b` for `["a", "b"]`, `64,32` for `[64, 32]`
            (item,) = typing.get_args(hint)
            return [_parse_scalar(t.strip(), item) for t in text.split(",") if t.strip()]
        return text


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"config key {where or '<root>'} must be a table, got {type(raw).__name__}")
    hints, known = _hints(cls), _fields(cls)
    for key in raw:
        if key not in known:
            raise ValueError(f"unknown config key: {_join(where, key)}")
    return cls(**{k: _coerce(v, hints[k], _join(where, k)) for k, v in raw.items()})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check `value` against the field's type; ints widen to float, nothing else converts."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ValueError(f"config key {where} must be a table, got {value!r}")
        return {str(k): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ValueError(f"config key {where} must be a list, got {value!r}")
        return [_coerce(v, item, _entry(where, i, v)) for i, v in enumerate(value)]
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if isinstance(value, str) and value in choices:
            return value
        raise ValueError(f"{where} must be one of {choices}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, where)
            except ValueError:
                pass
        raise ValueError(f"config key {where} has the wrong type: {value!r}")
    if hint is type(None):
        if value is None:
            return None
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (str, bool) and isinstance(value, hint):
        return value
    raise ValueError(f"config key {where} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def _entry(where: str, index: int, value: Any) -> str:
    """A list entry's key: by its name when it has one (`features.item_id`), else its index."""
    name = value.get("name") if isinstance(value, dict) else None
    return f"{where}.{name}" if isinstance(name, str) and name else f"{where}[{index}]"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# ---------------------------------------------------------------------------- checking


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express; raises ValueError naming the key."""
    _check_positive(cfg, "data.batch_size", "data.eval_batch_size", "data.synth_rows", "data.retry_attempts",
                    "model.hidden_dim", "model.num_layers", "model.ffn_ratio", "model.num_tokens", "optim.lr",
                    "embeddings.lr", "optim.sequence_lr_mult", "launch.pg_timeout_minutes", "train.check_every",
                    "data.poll_seconds")
    _check_nonnegative(cfg, "data.global_batch_size", "data.shuffle_buffer", "data.retry_seconds", "train.steps",
                       "train.epochs", "train.early_stopping_patience", "model.token_dim", "model.head_hidden",
                       "optim.warmup_steps",
                       "optim.dense_warmup_steps", "optim.grad_clip_norm", "metrics.eval_every", "metrics.valid_every",
                       "metrics.eval_batches", "metrics.log_every", "metrics.peak_tflops", "metrics.window_batches",
                       "checkpoint.interval", "checkpoint.interval_minutes", "checkpoint.keep",
                       "checkpoint.signal_grace_steps", "publish.every_steps")
    for key in ("data.batch_size", "data.global_batch_size", "data.eval_batch_size"):
        if _get(cfg, key) > MAX_BATCH_ROWS:
            raise ValueError(f"{key}={_get(cfg, key)} is more rows than a batch can hold: at most {MAX_BATCH_ROWS} "
                             "(FBGEMM's embedding kernels count them in 32 bits); `rankmix plan` shows what fits")
    if not math.isfinite(cfg.data.retry_seconds):  # inf (or nan) would retry an outage forever
        raise ValueError(f"data.retry_seconds must be a finite number of seconds, got {cfg.data.retry_seconds}")
    if not 0 <= cfg.data.valid_fraction < 1:
        raise ValueError(f"data.valid_fraction={cfg.data.valid_fraction} must be a share of the rows in [0, 1)")
    if cfg.data.valid_fraction and cfg.data.valid_path:
        raise ValueError("data.valid_path and data.valid_fraction are both set: give the validation split one way")
    if cfg.train.early_stopping_patience and not (cfg.data.valid_path or cfg.data.valid_fraction):
        raise ValueError("train.early_stopping_patience needs a validation split: set data.valid_path or "
                         "data.valid_fraction")
    if not (math.isfinite(cfg.metrics.valid_every_epochs) and cfg.metrics.valid_every_epochs >= 0):
        raise ValueError(f"metrics.valid_every_epochs={cfg.metrics.valid_every_epochs} must be a share of an "
                         "epoch >= 0")
    if cfg.metrics.valid_every_epochs and cfg.metrics.valid_every:
        raise ValueError("metrics.valid_every and metrics.valid_every_epochs are both set: give the schedule one way")
    _validate_split(cfg.data)
    if not cfg.optim.weight_decay >= 0:
        raise ValueError(f"optim.weight_decay={cfg.optim.weight_decay:g} must be >= 0")
    for key in ("tokenizer_weight_decay", "sequence_weight_decay"):
        if not (getattr(cfg.optim, key) >= 0 or getattr(cfg.optim, key) == -1):
            raise ValueError(f"optim.{key}={getattr(cfg.optim, key):g} must be >= 0 (or -1: optim.weight_decay)")
    if cfg.optim.sequence_warmup_steps < -1:
        raise ValueError(f"optim.sequence_warmup_steps={cfg.optim.sequence_warmup_steps} must be >= 0 (or -1: "
                         "optim.dense_warmup_steps)")
    if not cfg.embeddings.weight_decay >= 0:
        raise ValueError(f"embeddings.weight_decay={cfg.embeddings.weight_decay:g} must be >= 0")
    _validate_tables(cfg.data)
    if not cfg.embeddings.sharding_types:
        raise ValueError(f"embeddings.sharding_types is empty; choose from {SPARSE_SHARDING_TYPES}")
    if cfg.publish.every_steps and cfg.publish.every_partition:
        raise ValueError("publish.every_steps and publish.every_partition are both set: publish one way")
    if cfg.train.steps == 0 and cfg.train.epochs == 0:
        raise ValueError("train.steps and train.epochs are both 0: nothing to train")
    validate_model(cfg.model)  # each tower table's own ranges
    if not cfg.model.tasks:
        raise ValueError("model.tasks is empty: at least one task is needed")
    names = [t.name for t in cfg.model.tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"model.tasks has duplicate names: {names}")
    for f in cfg.features:
        if f.kind == "sequence" and f.sequence_module not in SEQUENCE_MODULES.names():
            raise ValueError(f"features.{f.name}.sequence_module={f.sequence_module!r} is not one of "
                             f"{SEQUENCE_MODULES.names()}")
    validate_features(cfg.features)
    timed = [f.name for f in cfg.features if f.kind == "sequence" and f.sequence_module != "pool" and f.timestamps]
    if timed and not cfg.data.time_column:
        raise ValueError(f"features.{timed[0]}.timestamps needs data.time_column, "
                         "the column of each row's request time")
    bad = sorted({f.eviction_interval for f in cfg.features
                  if f.hashing == "managed" and cfg.checkpoint.interval % f.eviction_interval})
    if bad:
        raise ValueError(f"checkpoint.interval={cfg.checkpoint.interval} must be a multiple of every managed table's "
                         f"eviction_interval (not of {bad}): only a checkpoint taken right after an eviction "
                         "resumes exactly, since the ids seen since the last one are not saved")
    managed = [t for t in managed_tables(cfg.features) if t in cfg.embeddings.table_sharding]
    if managed:
        raise ValueError(f"embeddings.table_sharding names managed tables {managed}: those are always row-wise "
                         "(TorchRec shards managed-collision tables no other way)")


def _validate_split(data: DataConfig) -> None:
    """data.split=time: a column to cut by, a cut that is a share or a time, and a split that owns validation."""
    if data.split == "given":
        return
    if not data.time_column:
        raise ValueError("data.split=time cuts the log by data.time_column, which is empty: name the column of "
                         "each row's time (integer seconds)")
    if not (math.isfinite(data.split_at) and data.split_at > 0 and (data.split_at < 1 or data.split_at.is_integer())):
        raise ValueError(f"data.split_at={data.split_at:g} must be a share of the rows (0 < x < 1) or a whole "
                         "time in the column's unit (>= 1)")
    if data.valid_path:
        raise ValueError("data.split=time makes the validation split from the log (data.valid_fraction): "
                         "data.valid_path must be empty")
    if data.order == "time":
        raise ValueError("data.split=time judges a model on the future of its log; data.order=time trains on "
                         "the log as it arrives and evaluates on each next partition (metrics.eval_next_partition): "
                         "choose one")


def _validate_tables(data: DataConfig) -> None:
    """A snapshot pin names the table it pins; [data.catalog] holds no secret (trainer/data/lakehouse.py)."""
    kind = table_format(data.train_path)
    if data.snapshot and kind != "iceberg":
        raise ValueError(f"data.snapshot={data.snapshot} pins an Iceberg snapshot, but data.train_path "
                         f"{redact_uri(data.train_path)!r} is no iceberg: table")
    if data.version != -1 and kind != "delta":
        raise ValueError(f"data.version={data.version} pins a Delta version, but data.train_path "
                         f"{redact_uri(data.train_path)!r} is no delta: table")
    if data.version < -1:
        raise ValueError(f"data.version must be a Delta version (>= 0) or -1 for the newest, got {data.version}")
    check_catalog(data.catalog)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _check_positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) <= 0:
            raise ValueError(f"{key} must be positive, got {_get(cfg, key)}")


def _check_nonnegative(cfg: Config, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) < 0:
            raise ValueError(f"{key} must be >= 0, got {_get(cfg, key)}")


# ---------------------------------------------------------------------------- writing


def to_dict(cfg: Any, *, reveal: bool = False) -> dict[str, Any]:
    """The config as plain TOML values, URI credentials redacted (`reveal`: as given, for
    code that opens the stores, never for writing or showing); unset (None) fields are left
    out, as TOML has no null, and so are the unread fields of a Config or FeatureSpec
    (`unused_fields`), so that what is written loads again."""
    values = _drop_none(dataclasses.asdict(cfg))
    if isinstance(cfg, Config):
        for key in unused_fields(cfg):
            _pop(values, key)
    elif isinstance(cfg, FeatureSpec):  # a schema entry, as a [[features]] table
        for key in unused_feature_fields([cfg]):
            values.pop(key.rpartition(".")[2], None)
    return values if reveal else redact_config(values)


def _pop(values: dict[str, Any], dotted: str) -> None:
    """Remove `dotted` from asdict's tree (list entries by name)."""
    *path, last = dotted.split(".")
    nodes: list[Any] = [values]
    for part in path:
        node = nodes[-1]
        nodes.append(next(e for e in node if e.get("name") == part) if isinstance(node, list) else node[part])
    nodes[-1].pop(last, None)
    if not nodes[-1] and isinstance(nodes[-2], dict):  # a tower table left empty
        nodes[-2].pop(path[-1])


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_toml(cfg: Config, path: str | Path) -> None:
    """Write the resolved config so that `--config path` reproduces the run. URI credentials
    are redacted: such a run is resumed with them given again (on the command line, or by
    the environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE)."""
    write_atomic(Path(path), tomli_w.dumps(to_dict(cfg)))


def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line docstring, read from the source of the class and of the dataclasses
    it extends; a field made without source (ModelConfig's derived ones) carries it as metadata."""
    docs = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):  # a builtin, or a class made by make_dataclass
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                    and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()  # type: ignore[union-attr]
    return docs | {f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata}


def describe(cls: type = Config, prefix: str = "") -> list[str]:
    """`--section.key=default  doc` lines for every field under a `[section]  doc` line per
    table, for --help; the model's tower tables name the towers that read them."""
    lines = []
    docs, hints = field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            lines += ["", f"[{prefix}{f.name}]  {docs.get(f.name, '')}"] + describe(hint, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if typing.get_origin(hint) is list and typing.get_args(hint)[0] in (FeatureSpec, TaskSpec):
            lines.append(f"  [[{prefix}{f.name}]]  {docs.get(f.name, '')}")
            continue
        lines.append(f"  --{prefix}{f.name}={default!r}  {docs.get(f.name, '')}")
    return lines
