"""The run's config tree: the sections of trainer/ (data, optim, train, checkpoint, metrics,
launch, publish) declared here, composed with the sections each component declares next to its
code: [embeddings] and [[features]] (embeddings/sparse_config.py, embeddings/features.py), and
[model] with its towers' tables (dense/model_config.py). One dataclass per section, a one-line
docstring per field. Loading, overriding, checking and writing it live in
`trainer/config_loader.py`.

Credentials in URIs (`s3://KEY:SECRET@bucket/...`) stay in the loaded config, where the
reader needs them, but never leave it: the reprs here, and `to_dict`, `dump_toml` and
every error of `load_config`, show them redacted (`s3://***@bucket/...`,
trainer/credentials.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dense.model_config import ModelConfig
from embeddings.features import FeatureSpec
from embeddings.sparse_config import EmbeddingsConfig
from trainer.credentials import redact_uri, secret_kind

# The choices of the config's fixed-choice fields. The loader checks a value against its
# field's Literal; the code that acts on a choice reads the allowed values from here
# (`typing.get_args`), never from a list of its own.
SynthTeacherName = Literal["default", "capacity", "sequence", "recency"]
DataOrder = Literal["shuffled", "time"]
DataSplit = Literal["given", "time"]
Calibration = Literal["none", "bias", "platt"]
ArtifactFormat = Literal["pt2", "torchscript"]
ServedTables = Literal["fp32", "fp16", "int8", "int4"]
Device = Literal["auto", "cpu", "cuda"]
PipelineChoice = Literal["auto", "sparse_dist", "none"]
MixedPrecision = Literal["auto", "none", "bf16"]
SelectMetric = Literal["auc", "logloss"]
LoadMode = Literal["full", "weights"]
DataPosition = Literal["exact", "next_epoch"]
Backend = Literal["auto", "gloo", "nccl"]

MAX_BATCH_ROWS = 2 ** 31 - 1
"""The most rows a batch may hold, per rank or over all ranks: FBGEMM's embedding kernels take
a rank's batch size as a 32-bit integer, so no larger batch can run (2^31 rows are also hundreds
of GB of input a step). Below it, whether a batch fits in memory is `rankmix plan`'s answer."""


@dataclass
class DataConfig:
    """Where training and evaluation rows come from and how they are batched."""

    dataset: str = "synth"
    """Registered dataset: synth (generated) | movielens (converted from source_dir) | parquet (paths)."""
    train_path: str = ""
    ("""Training Parquet files: a file, directory or glob, local or a pyarrow filesystem URI; or a table: """
     """iceberg:<namespace>.<table> or delta:<path or URI>.""")
    eval_path: str = ""
    """Held-out (test) Parquet files, same forms as train_path: the final metrics."""
    valid_path: str = ""
    """Validation Parquet files that pick the best point and stop early ('' : none, or valid_fraction)."""
    valid_fraction: float = 0.0
    ("""Share of the training rows held out as the validation split when valid_path is unset (0: none): every """
     """row group's last rows, or with split=time the latest rows before the cut.""")
    split: DataSplit = "given"
    ("""given (train_path trains, eval_path tests) | time (their rows are one log, cut by time_column at """
     """split_at: the past trains, the future tests; trainer/data/time_split.py).""")
    split_at: float = 0.8
    ("""split=time: where the log is cut: a share of its rows in time order (0 < x < 1), or a time in the """
     """column's unit (>= 1; read as a float, so exact below 2^53).""")
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
    time_column: str = ""
    ("""Column of each row's request time (integer seconds): the time gaps of features.<name>.timestamps are """
     """measured from it.""")
    request_column: str = ""
    ("""Column naming each row's request (integers or strings; several joined by commas, e.g. a user's and a """
     """request time's, name it together; '' : none): the rows of one request share their sequences, looked up """
     """and encoded once a request in training and serving; shuffling keeps a request's rows together.""")
    synth_rows: int = 200_000
    """synth dataset: rows generated (train plus 10% held out)."""
    synth_teacher: SynthTeacherName = "default"
    ("""synth dataset: default (crosses of users, items, context) | capacity (high-order crosses of 16 Zipf """
     """fields and a sequence) | sequence (clicks from the recent behaviours that resemble the candidate) | """
     """recency (a click when the candidate's own behaviour is under a day old).""")
    source_dir: str = ""
    """Raw data of datasets converted on first use (movielens: the ml-100k folder)."""
    cache_dir: str = ".cache/data"
    """Where generated or converted Parquet files are kept and reused."""
    retry_seconds: float = 300.0
    """How long a failing object-store read is retried (with backoff) before the run stops with exit code 4."""
    retry_attempts: int = 3
    """Attempts per request inside pyarrow's S3 client (its AWS standard retry strategy)."""
    order: DataOrder = "shuffled"
    ("""shuffled (one file list, reshuffled every epoch) | time (train_path's KEY=VALUE partitions in key order, """
     """each once; docs/continuous.md).""")
    success_marker: str = "_SUCCESS"
    """The file that marks a KEY=VALUE partition folder complete, in either order ('' : every one is complete)."""
    follow: bool = False
    """data.order=time: once the complete partitions are trained, wait for new ones (until SIGTERM)."""
    poll_seconds: float = 30.0
    """data.follow: how often train_path is listed for new complete partitions."""
    catalog: dict[str, str] = field(default_factory=dict)
    ("""iceberg: paths: the catalog's name and pyiceberg properties (uri, warehouse, type, ...; a sqlite: uri """
     """is an embedded SQL catalog); secrets through PYICEBERG_CATALOG__<NAME>__* variables.""")
    snapshot: int = 0
    """iceberg: train_path: the snapshot id read (0: the current one when the run starts; a resume keeps its own)."""
    version: int = -1
    """delta: train_path: the table version read (-1: the newest when the run starts; a resume keeps its own)."""

    @property
    def row_group_holdout(self) -> float:
        """The share of every training row group that is the validation split: valid_fraction, unless
        split=time made the validation split its own files."""
        return self.valid_fraction if self.split == "given" else 0.0


RECIPES: dict[str, dict[str, object]] = {
    "auto": {},  # rankmix's; the width is chosen from the data when a run starts (trainer/auto_width.py)
    "rankmix": {},
    "paper": {"model.tokenizer_bias": "uniform", "optim.dense_warmup_steps": 0},
}
"""model.recipe -> the defaults it replaces (dotted key -> value); a key set in the file or
on the command line keeps its value. rankmix's are the dataclass defaults."""


def per_rank_batch_size(cfg: Config, world_size: int) -> int:
    """data.global_batch_size split over the ranks, or data.batch_size per rank."""
    if not cfg.data.global_batch_size:
        return cfg.data.batch_size
    if cfg.data.global_batch_size % world_size:
        raise ValueError(f"data.global_batch_size={cfg.data.global_batch_size} does not divide "
                         f"over {world_size} ranks")
    return cfg.data.global_batch_size // world_size


TABLE_SCHEMES = ("iceberg", "delta")
"""The prefixes of a table path in data.*_path (`iceberg:<namespace>.<table>`, `delta:<path or URI>`)."""

PIN_FIELDS = {"iceberg": "snapshot", "delta": "version"}
"""The [data] field that pins a table of each format to one snapshot (Iceberg's id, Delta's version)."""

DEFAULT_CATALOG = "default"
"""The name of [data.catalog]'s catalog without data.catalog.name (pyiceberg's own default): a SQL
catalog keeps its tables under it, and pyiceberg reads its PYICEBERG_CATALOG__<NAME>__* variables."""

_SECRET_PROPERTY_WORDS = ("credential", "token", "secret", "password", "key")


def table_format(path: str) -> str | None:
    """"iceberg" or "delta" for a table path (trainer/data/lakehouse.py), else None (files, folders, URIs)."""
    scheme, sep, _ = path.partition(":")
    return scheme if sep and scheme in TABLE_SCHEMES else None


def check_catalog(catalog: dict[str, str]) -> None:
    """Refuse a secret in [data.catalog]: the config is written into the run folder and shown, so
    secrets reach pyiceberg through its environment variables (or the object store's own chain)."""
    for key, value in catalog.items():
        words = key.lower().replace("_", "-").replace(".", "-").split("-")
        named = any(w in _SECRET_PROPERTY_WORDS for w in words[-2:]) and words[-1] not in ("id", "name", "type", "uri")
        # a connection string holds an account key; a REST catalog's header.* is sent as is (a bearer token)
        if named or "connection" in words or key.lower().startswith("header.") or secret_kind(str(value)):
            name = catalog.get("name", DEFAULT_CATALOG).upper()
            variable = f"PYICEBERG_CATALOG__{name}__" + key.upper().replace(".", "__").replace("-", "_")
            raise ValueError(f"data.catalog.{key} holds a secret, and the config is written into the run folder; "
                             f"give it as the environment variable {variable} (pyiceberg reads it there), or "
                             "through the object store's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")


TIME_ORDER_FIELDS = ("follow", "poll_seconds")
"""DataConfig fields that only data.order = "time" reads."""


def unused_run_fields(data: DataConfig) -> dict[str, tuple[str, str]]:
    """Each data, train, metrics and publish field that data.order leaves unread -> (the key that
    decides it, why)."""
    why = ("data.order", f"data.order={data.order!r} does not read it")
    if data.order == "time":  # a pass over the partitions; a validation split would read unfinished ones
        # a table in time order is read snapshot by snapshot, none of them pinned
        return dict.fromkeys(("train.epochs", "data.valid_fraction", "data.valid_path", "train.calibrate",
                              "data.snapshot", "data.version"), why)
    unused = dict.fromkeys((*(f"data.{name}" for name in TIME_ORDER_FIELDS), "publish.every_partition",
                            "metrics.eval_next_partition"), why)
    if data.split == "given":
        unused["data.split_at"] = ("data.split", "only data.split=time cuts the log")
    if not data.valid_fraction and not data.valid_path:
        unused["train.calibrate"] = ("data.valid_fraction", "it fits on the validation split, and there is none "
                                     "(data.valid_fraction or data.valid_path)")
    return unused


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
    """L2 penalty on the dense weights (the tokenizer's and the sequence modules' too, unless set apart below)."""
    tokenizer_weight_decay: float = -1.0
    """L2 penalty on a token tower's tokenizer (-1: optim.weight_decay)."""
    sequence_weight_decay: float = -1.0
    """L2 penalty on the sequence modules (-1: optim.weight_decay)."""
    warmup_steps: int = 0
    """Linear warm-up of both learning rates over this many steps."""
    dense_warmup_steps: int = 300
    """Linear warm-up of the dense learning rate only (RMSProp's first steps move ~10x lr: its average starts at 0)."""
    sequence_lr_mult: float = 1.0
    """The sequence modules' learning rate as a multiple of optim.lr."""
    sequence_warmup_steps: int = -1
    """Linear warm-up of the sequence modules' learning rate (-1: optim.dense_warmup_steps)."""
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
    device: Device = "auto"
    """auto (cuda when available) | cpu | cuda."""
    deterministic: bool = True
    """Use deterministic kernels (bitwise-reproducible runs on CPU)."""
    pipeline: PipelineChoice = "auto"
    ("""auto (sparse_dist on CUDA or past one rank, none on one CPU rank) | sparse_dist (TorchRec """
     """TrainPipelineSparseDist) | none.""")
    mixed_precision: MixedPrecision = "auto"
    ("""auto (bf16 on CUDA, none on CPU) | bf16: autocast the dense tower and heads to bfloat16 (fp32 master """
     """weights), TF32 matmuls elsewhere on CUDA | none: fp32 throughout.""")
    check_every: int = 20
    ("""Steps between reads of the finiteness checks, stop signal and timed-save vote (also read at every log, """
     """validation, evaluation and save); a non-finite step is found up to check_every - 1 steps late.""")
    select_metric: SelectMetric = "auc"
    """Validation metric that ranks the points of a run: auc (higher is better) | logloss (lower is better)."""
    early_stopping_patience: int = 0
    """Stop after this many validations without a better select_metric (0: train to the end)."""
    restore_best: bool = True
    """With a validation split: end on the weights of the best validation, the test metrics measured there."""
    calibrate: Calibration = "none"
    ("""With a validation split, after training: fit each task's logit map a z + b on it """
     """(trainer/components/calibration.py): none | bias (b) | platt (a and b); the test metrics before it become """
     """uncalibrated/*.""")


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
    load_mode: LoadMode = "full"
    """load_path: full (weights, optimizer, schedule, data position) | weights."""
    data_position: DataPosition = "exact"
    ("""On a world-size change mid-epoch: exact (the epoch's rows left, over the new ranks) | next_epoch (start """
     """the next).""")
    signal_grace_steps: int = 0
    """On SIGTERM/SIGINT: train on to a scheduled save due within this many steps, else save at once."""


@dataclass
class MetricsConfig:
    """Evaluation and logging."""

    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    valid_every: int = 0
    """With a validation split: validate every N steps (0: at the end of every epoch)."""
    valid_every_epochs: float = 0.0
    ("""With a validation split: validate every this share of an epoch's steps, e.g. 0.25 (0: metrics.valid_every; """
     """both set is an error).""")
    eval_batches: int = 0
    """Evaluation batches per rank (0: the whole held-out split)."""
    log_every: int = 20
    """Log training loss and throughput every N steps."""
    window_batches: int = 100
    """Training AUC, NE and calibration logged over the last N training batches of every rank (0: off)."""
    tensorboard: bool = True
    """Write TensorBoard scalars into the run folder."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one device for MFU (0: measure a plain matrix multiply at start)."""
    eval_next_partition: bool = False
    """data.order = "time": before a partition's first step, evaluate the model on it (kind next_partition)."""
    mlflow_uri: str = ""
    """MLflow tracking URI (file:<folder> or http(s)://server): params, metrics, summary, artifacts ('' : off)."""
    mlflow_experiment: str = "rankmix"
    """metrics.mlflow_uri: the MLflow experiment the run is logged under."""


@dataclass
class PublishConfig:
    """Serving artifacts published while training, each full and as a delta (trainer/serving/publish.py)."""

    every_steps: int = 0
    """Publish after every N steps (0: not by steps)."""
    every_partition: bool = False
    """Publish after each data partition is trained (data.order = "time")."""
    folder: str = ""
    """Where the published <name>/ folders go ('' : <run_dir>/publish)."""
    format: ArtifactFormat = "pt2"
    """The artifact's format, as `rankmix export --format`."""
    tables: ServedTables = "fp32"
    """The artifact's tables, as `rankmix export --tables`."""


@dataclass
class LaunchConfig:
    """Process-group set-up."""

    backend: Backend = "auto"
    """Collective backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl."""
    pg_timeout_minutes: float = 30.0
    """Minutes a collective may wait before the process groups give up (a save to a slow shared filesystem)."""


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
    publish: PublishConfig = field(default_factory=PublishConfig)
    """Publishing serving artifacts while training."""


def _redacting_repr(cls: type) -> None:
    """Make the dataclass's generated repr show URIs with their credentials redacted."""
    generated = cls.__repr__

    def __repr__(self) -> str:
        return redact_uri(generated(self))

    __repr__.__qualname__ = f"{cls.__qualname__}.__repr__"
    cls.__repr__ = __repr__  # type: ignore[method-assign]


for _cls in (DataConfig, OptimConfig, TrainConfig, CheckpointConfig, MetricsConfig, LaunchConfig, PublishConfig,
             Config):  # the sections that hold paths; the others' reprs show up inside Config's
    _redacting_repr(_cls)
