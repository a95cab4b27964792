"""The typed configuration tree: defaults < TOML file < `--section.key=value` overrides.

Every field carries a one-line docstring (the string literal after it); `rankmix train
--help` prints them. Unknown keys and wrong types are `ValueError`s naming the key.

Credentials in URIs (`s3://KEY:SECRET@bucket/...`) stay in the loaded config, where the
reader needs them, but never leave it: `to_dict`, `dump_toml`, the reprs and every error
of `load_config` show them redacted (`s3://***@bucket/...`, trainer/credentials.py), and a
redacted value read back is an error that asks for the credentials again.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from trainer.credentials import (ENV_VARIABLES, CredentialsError, is_redacted, malformed_userinfo, redact_config,
                                 redact_uri, with_placeholders, without_credentials)

FEATURE_KINDS = ("id", "id_list", "sequence", "numeric")
NUMERIC_TRANSFORMS = ("log1p", "clip", "standardize")
SPARSE_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")


@dataclass
class FeatureSpec:
    """One input feature: where it comes from, how it is embedded, which group it feeds."""

    name: str = ""
    """Feature name: the key in the KeyedJaggedTensor, in logs and in CLI overrides."""
    column: str = ""
    """Source column in the Parquet files (defaults to `name`)."""
    kind: str = "id"
    """id (one id per row) | id_list (multi-hot) | sequence (behaviour ids, most recent last) | numeric."""
    table: str = ""
    """Embedding table (defaults to `name`); features naming one table share it."""
    num_embeddings: int = 0
    """Rows of the embedding table."""
    embedding_dim: int = 16
    """Width of the embedding table."""
    hashing: str = "modulo"
    """modulo: id % num_embeddings | none: an id >= num_embeddings is an error."""
    pooling: str = "sum"
    """How an id list is pooled into one vector: sum | mean."""
    group: str = "default"
    """Semantic group (user, item, context, sequence, cross...) the feature's token slice belongs to."""
    max_len: int = 0
    """id_list / sequence: keep only the last max_len ids (0 keeps all)."""
    transform: list[str] = field(default_factory=list)
    """numeric: transforms applied in order, from log1p | clip | standardize."""
    clip_min: float = -math.inf
    """numeric `clip`: lower bound."""
    clip_max: float = math.inf
    """numeric `clip`: upper bound."""
    mean: float = 0.0
    """numeric `standardize`: subtracted mean."""
    std: float = 1.0
    """numeric `standardize`: divisor."""
    fill_null: float | None = None
    """numeric: value that replaces nulls (unset: a null is an error)."""

    def __post_init__(self) -> None:
        self.column = self.column or self.name
        if self.kind != "numeric":
            self.table = self.table or self.name


@dataclass
class TaskSpec:
    """One prediction task: a binary label column and its loss weight."""

    name: str = "click"
    """Task name used in logs and metrics."""
    label: str = ""
    """Label column (0/1; defaults to `name`)."""
    weight: float = 1.0
    """Weight of this task's binary cross-entropy in the total loss."""

    def __post_init__(self) -> None:
        self.label = self.label or self.name


@dataclass
class DataConfig:
    """Where training and evaluation rows come from and how they are batched."""

    dataset: str = "synth"
    """Registered dataset: synth (generated) | movielens (converted from source_dir) | parquet (paths)."""
    train_path: str = ""
    """Training Parquet files: a file, directory or glob, local or a pyarrow filesystem URI."""
    eval_path: str = ""
    """Held-out Parquet files, same forms as train_path."""
    batch_size: int = 512
    """Rows per step on each rank; the global batch is batch_size x world size."""
    global_batch_size: int = 0
    """If set, rows per step over all ranks (overrides batch_size; must divide by the world size)."""
    shuffle: bool = True
    """Shuffle row groups per epoch and rows through the shuffle buffer."""
    eval_batch_size: int = 4096
    """Rows per evaluation step on each rank."""
    shuffle_buffer: int = 65_536
    """Rows held in memory and shuffled together (0: rows keep their order within a row group)."""
    user_column: str = "user_id"
    """Column that identifies the user for UAUC ('' disables UAUC)."""
    synth_rows: int = 200_000
    """synth dataset: rows generated (train plus 10% held out)."""
    source_dir: str = ""
    """Raw data of datasets converted on first use (movielens: the ml-100k folder)."""
    cache_dir: str = ".cache/data"
    """Where generated or converted Parquet files are kept and reused."""
    retry_seconds: float = 300.0
    """How long a failing object-store read is retried (with backoff) before the run stops with exit code 4."""
    retry_attempts: int = 3
    """Attempts per request inside pyarrow's S3 client (its AWS standard retry strategy)."""


@dataclass
class EmbeddingsConfig:
    """Sparse side: TorchRec tables, sharding and the fused optimizer."""

    optimizer: str = "adagrad"
    """Fused sparse optimizer: adagrad | rowwise_adagrad."""
    lr: float = 0.1
    """Sparse learning rate."""
    eps: float = 1e-8
    """Adagrad epsilon."""
    plan: str = "auto"
    """Registered sharding plan builder (auto: TorchRec's planner)."""
    sharding_types: list[str] = field(default_factory=lambda: list(SPARSE_SHARDING_TYPES))
    """Sharding types the planner may choose; data_parallel would train tables densely, outside Adagrad."""
    table_sharding: dict[str, str] = field(default_factory=dict)
    """Per-table sharding type overriding the plan, e.g. {item = "row_wise"}."""


@dataclass
class ModelConfig:
    """Tokenizer, dense tower and task heads."""

    tower: str = "rankmixer"
    """Registered dense tower: rankmixer | rankmixer_moe | unimixer | unimixer_lite | logreg | mlp | dcnv2 | no_token_mixing | shared_ffn | self_attention."""
    tokenizer: str = "slice"
    """slice: concatenate groups, cut into num_tokens slices | group: one token per semantic group."""
    num_tokens: int = 8
    """T, tokens for the slice tokenizer (the group tokenizer uses the number of groups)."""
    token_dim: int = 0
    """d, width of one slice of e_input (0: ceil(len(e_input) / T), the tail zero-padded)."""
    hidden_dim: int = 64
    """D, token width."""
    num_layers: int = 2
    """L, RankMixer blocks."""
    ffn_ratio: int = 4
    """k, per-token FFN hidden width is k x D."""
    block_size: int = 0
    """UniMixer block size over the flattened T x D tokens (0: D, one block per token)."""
    tau_start: float = 1.0
    """UniMixer temperature at step 0 (eq. 21)."""
    tau_end: float = 0.05
    """UniMixer temperature after tau_anneal_steps (eq. 21)."""
    tau_anneal_steps: int = 0
    """J, steps of the linear temperature anneal (0: hold tau_start for the whole run)."""
    sinkhorn_iters: int = 50
    """Sinkhorn-Knopp iterations (row and column normalisation each) for the UniMixer weights."""
    num_basis: int = 4
    """b, shared basis matrices of the local weights (unimixer_lite)."""
    global_rank: int = 8
    """r, rank of the global weight A_G B_G (unimixer_lite)."""
    num_experts: int = 4
    """E, experts per token (rankmixer_moe)."""
    expert_hidden: int = 0
    """Hidden width of each expert (0: k D / E, the dense per-token FFN split over the experts)."""
    moe_budget: float = 0.5
    """Target mean fraction of active experts; the L1 coefficient adapts to track it."""
    moe_l1_init: float = 0.001
    """Initial L1 coefficient lambda on the inference router's gates (also the smallest step scale)."""
    moe_l1_rate: float = 0.1
    """Adaptation speed: lambda += rate * (active - budget) / budget * max(|lambda|, moe_l1_init) per step."""
    moe_consistency: float = 1.0
    """Weight of the loss that teaches the inference router to reproduce the dense training output."""
    moe_inference: str = "sparse"
    """MoE at evaluation and scoring: sparse (inference router, only experts with a non-zero gate) | dense (training router, every expert)."""
    mlp_hidden: list[int] = field(default_factory=lambda: [256, 128])
    """Hidden widths of the ReLU MLP (mlp, and dcnv2's deep part); the last is the tower's output."""
    cross_layers: int = 3
    """dcnv2: cross layers x_{l+1} = x_0 * (W x_l + b) + x_l."""
    cross_rank: int = 0
    """dcnv2: rank r of W = U V^T (0: full E x E matrices)."""
    num_heads: int = 0
    """self_attention: attention heads H (0: one per token, H = T); D must divide by H."""
    head_hidden: int = 0
    """Hidden width of each task head's MLP (0: one linear layer)."""
    tasks: list[TaskSpec] = field(default_factory=lambda: [TaskSpec()])
    """Prediction tasks, one head each."""


@dataclass
class OptimConfig:
    """Dense optimizer (RMSProp, as in the RankMixer paper) and schedule."""

    lr: float = 0.002
    """Dense learning rate (the paper's 0.01 is for its scale; 0.002 trains the default better)."""
    alpha: float = 0.99
    """RMSProp smoothing constant."""
    eps: float = 1e-8
    """RMSProp epsilon."""
    momentum: float = 0.0
    """RMSProp momentum."""
    weight_decay: float = 0.0
    """L2 penalty on dense weights."""
    warmup_steps: int = 0
    """Linear warm-up of both learning rates over this many steps."""
    grad_clip_norm: float = 0.0
    """Clip the dense gradient norm to this value (0 disables)."""


@dataclass
class TrainConfig:
    """Length, seeding and placement of a run."""

    steps: int = 0
    """Optimizer steps (0: `epochs` passes over the training data)."""
    epochs: int = 3
    """Passes over the training data when steps is 0."""
    seed: int = 0
    """Seed for initialisation, data order and shuffling."""
    run_dir: str = "runs/default"
    """Run folder: resolved config, metrics.jsonl, TensorBoard events."""
    device: str = "auto"
    """auto (cuda when available) | cpu | cuda."""
    deterministic: bool = True
    """Use deterministic kernels (bitwise-reproducible runs on CPU)."""
    pipeline: str = "auto"
    """auto (sparse_dist on CUDA, none on CPU) | sparse_dist (TorchRec TrainPipelineSparseDist) | none."""
    mixed_precision: str = "none"
    """none | bf16: autocast the dense tower to bfloat16 on CUDA (fp32 master weights)."""


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints, resume and retention."""

    enabled: bool = True
    """Write checkpoints (and resume from them)."""
    folder: str = ""
    """Where step-N folders go ('' : <run_dir>/checkpoints)."""
    interval: int = 0
    """Save every N steps (0: only by time and at the end)."""
    interval_minutes: float = 0.0
    """Save when this many minutes have passed since the last save (0: off)."""
    save_final: bool = True
    """Save after the last step."""
    keep: int = 3
    """Complete checkpoints kept, newest first (0 keeps all)."""
    async_save: bool = False
    """Write in a background thread while training goes on (tables are then DTensors)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `folder` when there is one."""
    load_path: str = ""
    """Initialise a new run from another run's checkpoint (a step-N folder or a run folder)."""
    load_mode: str = "full"
    """load_path: full (weights, optimizer, schedule, data position) | weights."""
    data_position: str = "exact"
    """On a world-size change mid-epoch: exact (refuse) | next_epoch (start the next epoch)."""
    signal_grace_steps: int = 0
    """On SIGTERM/SIGINT: train on to a scheduled save due within this many steps, else save at once."""


@dataclass
class MetricsConfig:
    """Evaluation and logging."""

    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    eval_batches: int = 0
    """Evaluation batches per rank (0: the whole held-out split)."""
    log_every: int = 20
    """Log training loss and throughput every N steps."""
    tensorboard: bool = True
    """Write TensorBoard scalars into the run folder."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for MFU (0: measure a plain matrix multiply at start)."""


@dataclass
class LaunchConfig:
    """Process-group set-up."""

    backend: str = "auto"
    """Collective backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl."""


@dataclass
class Config:
    """The whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input data."""
    features: list[FeatureSpec] = field(default_factory=list)
    """Feature schema (TOML: [[features]]); empty means the dataset's built-in schema."""
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    """Sparse side."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Dense side."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Dense optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Run length and placement."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Evaluation and logging."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Distributed set-up."""


def _redacting_repr(cls: type) -> None:
    """Make the dataclass's generated repr show URIs with their credentials redacted."""
    generated = cls.__repr__

    def __repr__(self) -> str:
        return redact_uri(generated(self))

    __repr__.__qualname__ = f"{cls.__qualname__}.__repr__"
    cls.__repr__ = __repr__  # type: ignore[method-assign]


for _cls in (FeatureSpec, TaskSpec, DataConfig, EmbeddingsConfig, ModelConfig, OptimConfig, TrainConfig,
             CheckpointConfig, MetricsConfig, LaunchConfig, Config):
    _redacting_repr(_cls)


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                allow_redacted: bool = False) -> Config:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides.

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
        check_credentials(cfg, path, overrides, allow_redacted=allow_redacted)
        validate(cfg)
        return cfg
    except CredentialsError:
        raise
    except ValueError as e:
        message = redact_uri(str(e))
        if message != str(e):
            raise ValueError(message) from None  # no chained original: it holds the secret
        raise


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
                "'/' as %2F and '@' as %40 in the key and secret, or better put them in "
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
    for i, part in enumerate(parts[:-1]):
        if dataclasses.is_dataclass(obj) and part in _fields(type(obj)):
            hint = _hints(type(obj))[part]
        obj = _child(obj, part, ".".join(parts[: i + 1]))
    key = parts[-1]
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
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
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
    _check_positive(cfg, "data.batch_size", "data.eval_batch_size", "data.synth_rows", "model.hidden_dim",
                    "model.num_layers", "model.ffn_ratio", "model.num_tokens", "optim.lr", "embeddings.lr",
                    "model.tau_start", "model.tau_end", "model.sinkhorn_iters", "model.num_basis",
                    "model.global_rank", "model.num_experts", "model.moe_l1_init", "data.retry_attempts")  # lambda adapts multiplicatively
    _check_nonnegative(cfg, "data.global_batch_size", "data.shuffle_buffer", "train.steps", "train.epochs", "model.token_dim",
                       "model.head_hidden", "model.block_size", "model.expert_hidden", "model.moe_l1_rate",
                       "model.moe_consistency", "model.tau_anneal_steps", "optim.warmup_steps", "optim.grad_clip_norm",
                       "metrics.eval_every", "metrics.eval_batches", "metrics.log_every", "metrics.peak_tflops",
                       "checkpoint.interval", "checkpoint.interval_minutes", "checkpoint.keep", "data.retry_seconds",
                       "checkpoint.signal_grace_steps")
    _check_choice(cfg, "train.device", ("auto", "cpu", "cuda"))
    _check_choice(cfg, "launch.backend", ("auto", "gloo", "nccl"))
    _check_choice(cfg, "model.tokenizer", ("slice", "group"))
    _check_choice(cfg, "train.pipeline", ("auto", "sparse_dist", "none"))
    _check_choice(cfg, "checkpoint.load_mode", ("full", "weights"))
    _check_choice(cfg, "checkpoint.data_position", ("exact", "next_epoch"))
    _check_choice(cfg, "train.mixed_precision", ("none", "bf16"))
    _check_choice(cfg, "model.moe_inference", ("sparse", "dense"))
    if not 0 < cfg.model.moe_budget <= 1:
        raise ValueError(f"model.moe_budget={cfg.model.moe_budget} must be a fraction of the experts in (0, 1]")
    for table, kind in cfg.embeddings.table_sharding.items():
        if kind not in SPARSE_SHARDING_TYPES:
            raise ValueError(f"embeddings.table_sharding.{table}={kind!r}; choose from {SPARSE_SHARDING_TYPES}")
    _check_choice(cfg, "embeddings.optimizer", ("adagrad", "rowwise_adagrad"))
    bad = [t for t in cfg.embeddings.sharding_types if t not in SPARSE_SHARDING_TYPES]
    if bad or not cfg.embeddings.sharding_types:
        raise ValueError(f"embeddings.sharding_types: {bad or 'empty'}; choose from {SPARSE_SHARDING_TYPES}")
    if cfg.train.steps == 0 and cfg.train.epochs == 0:
        raise ValueError("train.steps and train.epochs are both 0: nothing to train")
    if cfg.model.tau_anneal_steps and cfg.model.tau_end > cfg.model.tau_start:
        raise ValueError(f"model.tau_end={cfg.model.tau_end} exceeds model.tau_start={cfg.model.tau_start}: "
                         "eq. 21 anneals the temperature downwards")
    if not cfg.model.tasks:
        raise ValueError("model.tasks is empty: at least one task is needed")
    for task in cfg.model.tasks:
        task.label = task.label or task.name
    names = [t.name for t in cfg.model.tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"model.tasks has duplicate names: {names}")
    validate_features(cfg.features)


def validate_features(features: list[FeatureSpec]) -> None:
    """Fill defaults (column, table) and check each feature and table sharing."""
    seen: set[str] = set()
    tables: dict[str, FeatureSpec] = {}
    for f in features:
        where = f"features.{f.name or '<unnamed>'}"
        if not f.name:
            raise ValueError("features: every feature needs a name")
        if f.name in seen:
            raise ValueError(f"{where}: duplicate feature name")
        seen.add(f.name)
        f.column = f.column or f.name
        if f.kind not in FEATURE_KINDS:
            raise ValueError(f"{where}.kind must be one of {FEATURE_KINDS}, got {f.kind!r}")
        if f.kind == "numeric":
            bad = [t for t in f.transform if t not in NUMERIC_TRANSFORMS]
            if bad:
                raise ValueError(f"{where}.transform: unknown {bad}; choose from {NUMERIC_TRANSFORMS}")
            if f.std <= 0:
                raise ValueError(f"{where}.std must be positive, got {f.std}")
            continue
        f.table = f.table or f.name
        if f.max_len < 0:
            raise ValueError(f"{where}.max_len must be >= 0, got {f.max_len}")
        if f.num_embeddings <= 0 or f.embedding_dim <= 0:
            raise ValueError(f"{where}: num_embeddings and embedding_dim must be positive")
        if f.hashing not in ("modulo", "none"):
            raise ValueError(f"{where}.hashing must be modulo or none, got {f.hashing!r}")
        if f.pooling not in ("sum", "mean"):
            raise ValueError(f"{where}.pooling must be sum or mean, got {f.pooling!r}")
        other = tables.setdefault(f.table, f)
        if (other.num_embeddings, other.embedding_dim) != (f.num_embeddings, f.embedding_dim):
            raise ValueError(
                f"{where}: shares table {f.table!r} with features.{other.name} but their "
                "num_embeddings / embedding_dim differ")


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


def _check_choice(cfg: Config, key: str, choices: tuple[str, ...]) -> None:
    if _get(cfg, key) not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {_get(cfg, key)!r}")


# ---------------------------------------------------------------------------- writing


def to_dict(cfg: Any, *, reveal: bool = False) -> dict[str, Any]:
    """The config as plain TOML values, URI credentials redacted (`reveal`: as given, for
    code that opens the stores, never for writing or showing); unset (None) fields are left
    out, as TOML has no null."""
    values = _drop_none(dataclasses.asdict(cfg))
    return values if reveal else redact_config(values)


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
    Path(path).write_text(tomli_w.dumps(to_dict(cfg)))


def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line docstring, read from the class source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()  # type: ignore[union-attr]
    return docs


def describe(cls: type = Config, prefix: str = "") -> list[str]:
    """`--section.key  (type, default)  doc` lines for every field, for --help."""
    lines = []
    docs, hints = field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            lines += describe(hint, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if typing.get_origin(hint) is list and typing.get_args(hint)[0] in (FeatureSpec, TaskSpec):
            lines.append(f"  [[{prefix}{f.name}]]  {docs.get(f.name, '')}")
            continue
        lines.append(f"  --{prefix}{f.name}={default!r}  {docs.get(f.name, '')}")
    return lines
