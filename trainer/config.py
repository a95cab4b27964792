"""The typed configuration tree: one dataclass per section, a one-line docstring per field.

The ground floor of the code base: every package (dense/, embeddings/, trainer/, launch/)
may import these classes, and this module imports nothing of rankmix but the redaction
of URI credentials. Loading, overriding, checking and writing a config live in
`trainer/config_loader.py`.

Credentials in URIs (`s3://KEY:SECRET@bucket/...`) stay in the loaded config, where the
reader needs them, but never leave it: the reprs here, and `to_dict`, `dump_toml` and
every error of `load_config`, show them redacted (`s3://***@bucket/...`,
trainer/credentials.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from trainer.credentials import redact_uri

# The choices of the config's fixed-choice fields. The loader checks a value against its
# field's Literal; the code that acts on a choice reads the allowed values from here
# (`typing.get_args`), never from a list of its own.
ShardingType = Literal["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"]
SPARSE_SHARDING_TYPES: tuple[str, ...] = get_args(ShardingType)
"""TorchRec sharding types the planner may choose from."""
FeatureKind = Literal["id", "id_list", "sequence", "numeric"]
Hashing = Literal["modulo", "none", "managed"]
EvictionPolicy = Literal["lfu", "lru"]
Pooling = Literal["sum", "mean"]
NumericTransform = Literal["log1p", "clip", "standardize"]
SynthTeacherName = Literal["default", "capacity"]
DataOrder = Literal["shuffled", "time"]
SparseOptimizer = Literal["adagrad", "rowwise_adagrad"]
TableDataType = Literal["fp32", "fp16"]
Tokenizer = Literal["slice", "group"]
TokenizerBias = Literal["uniform", "zero"]
Recipe = Literal["rankmix", "paper"]
Calibration = Literal["none", "bias", "platt"]
BlockNorm = Literal["post", "pre"]
TowerPooling = Literal["mean", "flatten"]
MoEInference = Literal["sparse", "dense"]
ArtifactFormat = Literal["pt2", "torchscript"]
ServedTables = Literal["fp32", "fp16", "int8", "int4"]
Device = Literal["auto", "cpu", "cuda"]
PipelineChoice = Literal["auto", "sparse_dist", "none"]
MixedPrecision = Literal["auto", "none", "bf16"]
SelectMetric = Literal["auc", "logloss"]
LoadMode = Literal["full", "weights"]
DataPosition = Literal["exact", "next_epoch"]
Backend = Literal["auto", "gloo", "nccl"]

MANAGED_ID_RANGE = 2 ** 62
"""Managed tables take ids in [0, MANAGED_ID_RANGE): TorchRec's MCH routes an id to the rank
that owns its part of that range, and marks an empty slot with INT64_MAX."""

MAX_BATCH_ROWS = 2 ** 31 - 1
"""The most rows a batch may hold, per rank or over all ranks: FBGEMM's embedding kernels take
a rank's batch size as a 32-bit integer, so no larger batch can run (2^31 rows are also hundreds
of GB of input a step). Below it, whether a batch fits in memory is `rankmix plan`'s answer."""


@dataclass
class FeatureSpec:
    """One input feature: where it comes from, how it is embedded, which group it feeds."""

    name: str = ""
    """Feature name: the key in the KeyedJaggedTensor, in logs and in CLI overrides."""
    column: str = ""
    """Source column in the Parquet files (defaults to `name`)."""
    kind: FeatureKind = "id"
    """id (one id per row) | id_list (multi-hot) | sequence (behaviour ids, most recent last) | numeric."""
    table: str = ""
    """Embedding table (defaults to `name`); features naming one table share it."""
    num_embeddings: int = 0
    """Rows of the embedding table."""
    embedding_dim: int = 16
    """Width of the embedding table."""
    hashing: Hashing = "modulo"
    """modulo: id % num_embeddings | none: an id >= num_embeddings is an error | managed: every live id its own row (TorchRec MCH), stale ones evicted."""
    eviction_policy: EvictionPolicy = "lfu"
    """managed: rows freed at an eviction: lfu (least frequently used, decayed by age) | lru (least recently used)."""
    eviction_interval: int = 100
    """managed: training steps between evictions; a new id gets a row at the next one (until then the shard's miss row)."""
    pooling: Pooling = "sum"
    """How an id list is pooled into one vector: sum | mean."""
    group: str = "default"
    """Semantic group (user, item, context, sequence, cross...) the feature's token slice belongs to."""
    max_len: int = 0
    """id_list / sequence: keep only the last max_len ids (0 keeps all)."""
    transform: list[NumericTransform] = field(default_factory=list)
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


def managed_tables(features: list[FeatureSpec]) -> list[str]:
    """The tables with managed collisions (hashing = "managed"), sorted by name."""
    return sorted({f.table for f in features if f.hashing == "managed"})


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
    """Held-out (test) Parquet files, same forms as train_path: the final metrics."""
    valid_path: str = ""
    """Validation Parquet files that pick the best point and stop early ('' : none, or valid_fraction)."""
    valid_fraction: float = 0.0
    """Share of every training row group held out as the validation split when valid_path is unset (0: none)."""
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
    synth_teacher: SynthTeacherName = "default"
    """synth dataset: default (crosses of users, items, context) | capacity (high-order crosses of 16 Zipf fields and a sequence)."""
    source_dir: str = ""
    """Raw data of datasets converted on first use (movielens: the ml-100k folder)."""
    cache_dir: str = ".cache/data"
    """Where generated or converted Parquet files are kept and reused."""
    retry_seconds: float = 300.0
    """How long a failing object-store read is retried (with backoff) before the run stops with exit code 4."""
    retry_attempts: int = 3
    """Attempts per request inside pyarrow's S3 client (its AWS standard retry strategy)."""
    order: DataOrder = "shuffled"
    """shuffled (one file list, reshuffled every epoch) | time (train_path's KEY=VALUE partitions in key order, each once; docs/continuous.md)."""
    success_marker: str = "_SUCCESS"
    """data.order=time: the file that marks a partition complete ('' : every partition folder is complete)."""
    follow: bool = False
    """data.order=time: once the complete partitions are trained, wait for new ones (until SIGTERM)."""
    poll_seconds: float = 30.0
    """data.follow: how often train_path is listed for new complete partitions."""


@dataclass
class EmbeddingsConfig:
    """Sparse side: TorchRec tables, sharding and the fused optimizer."""

    optimizer: SparseOptimizer = "adagrad"
    """Fused sparse optimizer: adagrad | rowwise_adagrad."""
    lr: float = 0.1
    """Sparse learning rate."""
    eps: float = 1e-8
    """Adagrad epsilon."""
    data_type: TableDataType = "fp32"
    """Table weights: fp32 | fp16 (half the memory; the optimizer state stays fp32)."""
    plan: str = "auto"
    """Registered sharding plan builder (auto: TorchRec's planner)."""
    sharding_types: list[ShardingType] = field(default_factory=lambda: list(SPARSE_SHARDING_TYPES))
    """Sharding types the planner may choose; data_parallel would train tables densely, outside Adagrad."""
    table_sharding: dict[str, ShardingType] = field(default_factory=dict)
    """Per-table sharding type overriding the plan, e.g. {item = "row_wise"}."""


@dataclass
class RankMixerBlockConfig:
    """[model.rankmixer]: the RankMixer block (towers rankmixer and rankmixer_moe)."""

    norm: BlockNorm = "post"
    """post (the paper's LN(X + F(X))) | pre (X + F(LN(X)), one LN before the pooling)."""
    dropout: float = 0.0
    """Dropout on the per-token FFN's output before its residual add (0: none)."""
    pooling: TowerPooling = "mean"
    """Tower output: mean (over tokens, the paper's, [B, D]) | flatten (every token into the heads, [B, T*D])."""


@dataclass
class MoEConfig:
    """[model.moe]: the per-token sparse mixture of experts (tower rankmixer_moe)."""

    num_experts: int = 4
    """E, experts per token."""
    expert_hidden: int = 0
    """Hidden width of each expert (0: k D / E, the dense per-token FFN split over the experts)."""
    budget: float = 0.5
    """Target mean fraction of active experts; the L1 coefficient adapts to track it."""
    l1_init: float = 0.001
    """Initial L1 coefficient lambda on the inference router's gates (also the smallest step scale)."""
    l1_rate: float = 0.1
    """Adaptation speed: lambda += rate * (active - budget) / budget * max(|lambda|, l1_init) per step."""
    consistency: float = 1.0
    """Weight of the loss that teaches the inference router to reproduce the dense training output."""
    inference: MoEInference = "sparse"
    """At evaluation and scoring: sparse (inference router, only experts with a non-zero gate) | dense (training router, every expert)."""


@dataclass
class UniMixerConfig:
    """[model.unimixer]: UniMixer's mixing (towers unimixer and unimixer_lite)."""

    block_size: int = 0
    """Block size over the flattened T x D tokens (0: D, one block per token)."""
    tau_start: float = 1.0
    """Temperature at step 0 (eq. 21)."""
    tau_end: float = 0.05
    """Temperature after tau_anneal_steps (eq. 21)."""
    tau_anneal_steps: int = 0
    """J, steps of the linear temperature anneal (0: hold tau_start for the whole run)."""
    sinkhorn_iters: int = 50
    """Most Sinkhorn-Knopp iterations (row and column normalisation each) for the mixing weights."""
    sinkhorn_tol: float = 1e-5
    """Sinkhorn stops early once every row's log-sum is within this of 0 (0: always sinkhorn_iters)."""
    num_basis: int = 4
    """unimixer_lite: b, shared basis matrices of the local weights."""
    global_rank: int = 8
    """unimixer_lite: r, rank of the global weight A_G B_G."""


@dataclass
class MLPConfig:
    """[model.mlp]: the ReLU MLP (tower mlp, and dcnv2's deep part)."""

    hidden: list[int] = field(default_factory=lambda: [256, 128])
    """Hidden widths; the last is the tower's output."""


@dataclass
class DCNv2Config:
    """[model.dcnv2]: the cross network (tower dcnv2)."""

    cross_layers: int = 3
    """Cross layers x_{l+1} = x_0 * (W x_l + b) + x_l."""
    cross_rank: int = 0
    """Rank r of W = U V^T (0: full E x E matrices)."""


@dataclass
class AttentionConfig:
    """[model.attention]: token mixing by self-attention (tower self_attention)."""

    num_heads: int = 0
    """Attention heads H (0: one per token, H = T); D must divide by H."""


@dataclass(frozen=True)
class TowerFields:
    """What of ModelConfig a tower reads: `tables` of its own, and whether it tokenizes
    (the tokenizer and token fields of [model]); `skip` lists fields of its tables it ignores."""

    tables: tuple[str, ...] = ()
    """ModelConfig tables the tower reads."""
    tokens: bool = True
    """The tower tokenizes: it reads TOKEN_FIELDS."""
    skip: tuple[str, ...] = ()
    """Fields of its tables that it does not read."""


Tower = Literal["rankmixer", "rankmixer_moe", "unimixer", "unimixer_lite", "no_token_mixing", "shared_ffn",
                "self_attention", "logreg", "mlp", "dcnv2"]
TOWER_FIELDS: dict[str, TowerFields] = {
    "rankmixer": TowerFields(("rankmixer",)),
    "rankmixer_moe": TowerFields(("rankmixer", "moe")),
    "unimixer": TowerFields(("unimixer",), skip=("num_basis", "global_rank")),
    "unimixer_lite": TowerFields(("unimixer",)),
    "no_token_mixing": TowerFields(),
    "shared_ffn": TowerFields(),
    "self_attention": TowerFields(("attention",)),
    "logreg": TowerFields(tokens=False),
    "mlp": TowerFields(("mlp",), tokens=False),
    "dcnv2": TowerFields(("mlp", "dcnv2"), tokens=False),
}
"""Each registered tower (dense/towers/__init__.py registers exactly these names) -> the fields it reads."""
assert set(TOWER_FIELDS) == set(get_args(Tower))
TOKEN_FIELDS = ("tokenizer", "num_tokens", "tokenizer_bias", "token_dim", "hidden_dim", "num_layers", "ffn_ratio")
"""The [model] fields that only token towers (TowerFields.tokens) read."""


@dataclass
class ModelConfig:
    """Tokenizer, dense tower and task heads; each tower family's own fields in its table."""

    tower: Tower = "rankmixer"
    """Registered dense tower: rankmixer | rankmixer_moe | unimixer | unimixer_lite | logreg | mlp | dcnv2 | no_token_mixing | shared_ffn | self_attention."""
    recipe: Recipe = "rankmix"
    """rankmix: this project's defaults (zero tokenizer biases, a dense warm-up; docs/results.md) | paper: the RankMixer paper's (RECIPES); keys given explicitly win."""
    tokenizer: Tokenizer = "slice"
    """slice: concatenate groups, cut into num_tokens slices | group: one token per semantic group."""
    num_tokens: int = 8
    """T, tokens for the slice tokenizer (the group tokenizer makes one per group)."""
    tokenizer_bias: TokenizerBias = "zero"
    """Initial tokenizer biases: zero (tokens start from the embeddings alone) | uniform (nn.Linear's +-1/sqrt(fan-in), the paper's)."""
    token_dim: int = 0
    """slice tokenizer: d, width of one slice of e_input (0: ceil(len(e_input) / T), the tail zero-padded)."""
    hidden_dim: int = 64
    """D, token width."""
    num_layers: int = 2
    """L, blocks of the token tower."""
    ffn_ratio: int = 4
    """k, per-token FFN hidden width is k x D."""
    head_hidden: int = 0
    """Hidden width of each task head's MLP (0: one linear layer)."""
    tasks: list[TaskSpec] = field(default_factory=lambda: [TaskSpec()])
    """Prediction tasks, one head each."""
    rankmixer: RankMixerBlockConfig = field(default_factory=RankMixerBlockConfig)
    """RankMixer block (rankmixer, rankmixer_moe)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Sparse mixture of experts (rankmixer_moe)."""
    unimixer: UniMixerConfig = field(default_factory=UniMixerConfig)
    """UniMixer mixing (unimixer, unimixer_lite)."""
    mlp: MLPConfig = field(default_factory=MLPConfig)
    """ReLU MLP (mlp, dcnv2)."""
    dcnv2: DCNv2Config = field(default_factory=DCNv2Config)
    """Cross network (dcnv2)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """Self-attention token mixing (self_attention)."""


TOWER_TABLES = tuple(dict.fromkeys(table for uses in TOWER_FIELDS.values() for table in uses.tables))
"""ModelConfig's per-tower tables."""


def unused_model_fields(model: ModelConfig) -> dict[str, tuple[str, str]]:
    """Each model field that the chosen tower and tokenizer do not read -> (the key whose
    value makes it unused, why)."""
    uses = TOWER_FIELDS[model.tower]
    unused: dict[str, tuple[str, str]] = {}
    if not uses.tokens:
        unused |= dict.fromkeys((f"model.{name}" for name in TOKEN_FIELDS),
                                ("model.tower", f"tower {model.tower!r} has no tokens"))
    elif model.tokenizer == "group":
        unused |= dict.fromkeys(("model.num_tokens", "model.token_dim"),
                                ("model.tokenizer", "model.tokenizer='group' makes one token per group"))
    for table in TOWER_TABLES:
        for f in fields(getattr(model, table)):
            if table not in uses.tables or f.name in uses.skip:
                readers = [t for t, u in TOWER_FIELDS.items() if table in u.tables and f.name not in u.skip]
                unused[f"model.{table}.{f.name}"] = (
                    "model.tower", f"tower {model.tower!r} does not read it (read by {', '.join(readers)})")
    return unused


RECIPES: dict[str, dict[str, object]] = {
    "rankmix": {},
    "paper": {"model.tokenizer_bias": "uniform", "optim.dense_warmup_steps": 0},
}
"""model.recipe -> the defaults it replaces (dotted key -> value); a key set in the file or
on the command line keeps its value. rankmix's are the dataclass defaults."""


TIME_ORDER_FIELDS = ("success_marker", "follow", "poll_seconds")
"""DataConfig fields that only data.order = "time" reads."""


def unused_run_fields(data: DataConfig) -> dict[str, tuple[str, str]]:
    """Each data, train, metrics and publish field that data.order leaves unread -> (the key that
    decides it, why)."""
    why = ("data.order", f"data.order={data.order!r} does not read it")
    if data.order == "time":  # a pass over the partitions; a validation split would read unfinished ones
        return dict.fromkeys(("train.epochs", "data.valid_fraction", "data.valid_path", "train.calibrate"), why)
    unused = dict.fromkeys((*(f"data.{name}" for name in TIME_ORDER_FIELDS), "publish.every_partition",
                            "metrics.eval_next_partition"), why)
    if not data.valid_fraction and not data.valid_path:
        unused["train.calibrate"] = ("data.valid_fraction", "it fits on the validation split, and there is none "
                                     "(data.valid_fraction or data.valid_path)")
    return unused


ID_FIELDS = ("table", "num_embeddings", "embedding_dim", "hashing", "pooling", "max_len")
"""FeatureSpec fields that only id, id_list and sequence features read."""
NUMERIC_FIELDS = ("transform", "clip_min", "clip_max", "mean", "std", "fill_null")
"""FeatureSpec fields that only numeric features read."""


def unused_feature_fields(features: list[FeatureSpec]) -> dict[str, tuple[str, str]]:
    """Each feature field that its feature's kind and hashing do not read -> (the key whose
    value makes it unused, why)."""
    unused: dict[str, tuple[str, str]] = {}
    for f in features:
        where = f"features.{f.name}"
        numeric = f.kind == "numeric"
        cause = (f"{where}.kind", f"{where}.kind={f.kind!r} does not read it")
        unused |= dict.fromkeys((f"{where}.{name}" for name in (NUMERIC_FIELDS if not numeric else ID_FIELDS)), cause)
        if numeric or f.hashing != "managed":
            unused |= dict.fromkeys((f"{where}.eviction_policy", f"{where}.eviction_interval"), cause if numeric else
                                    (f"{where}.hashing", f"{where}.hashing={f.hashing!r} is not managed"))
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
    """L2 penalty on dense weights."""
    warmup_steps: int = 0
    """Linear warm-up of both learning rates over this many steps."""
    dense_warmup_steps: int = 300
    """Linear warm-up of the dense learning rate only (RMSProp's first steps move ~10x lr: its average starts at 0)."""
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
    """auto (sparse_dist on CUDA, none on CPU) | sparse_dist (TorchRec TrainPipelineSparseDist) | none."""
    mixed_precision: MixedPrecision = "auto"
    """auto (bf16 on CUDA, none on CPU) | bf16: autocast the dense tower and heads to bfloat16 (fp32 master weights), TF32 matmuls elsewhere on CUDA | none: fp32 throughout."""
    check_every: int = 20
    """Steps between reads of the finiteness checks, stop signal and timed-save vote (also read at every log, validation, evaluation and save); a non-finite step is found up to check_every - 1 steps late."""
    select_metric: SelectMetric = "auc"
    """Validation metric that ranks the points of a run: auc (higher is better) | logloss (lower is better)."""
    early_stopping_patience: int = 0
    """Stop after this many validations without a better select_metric (0: train to the end)."""
    restore_best: bool = True
    """With a validation split: end on the weights of the best validation, the test metrics measured there."""
    calibrate: Calibration = "none"
    """With a validation split, after training: fit each task's logit map a z + b on it (trainer/calibration.py): none | bias (b) | platt (a and b); the test metrics before it become uncalibrated/*."""


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
    """On a world-size change mid-epoch: exact (refuse) | next_epoch (start the next epoch)."""
    signal_grace_steps: int = 0
    """On SIGTERM/SIGINT: train on to a scheduled save due within this many steps, else save at once."""


@dataclass
class MetricsConfig:
    """Evaluation and logging."""

    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    valid_every: int = 0
    """With a validation split: validate every N steps (0: at the end of every epoch)."""
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


for _cls in (FeatureSpec, TaskSpec, DataConfig, EmbeddingsConfig, ModelConfig, OptimConfig, TrainConfig,
             RankMixerBlockConfig, MoEConfig, UniMixerConfig, MLPConfig, DCNv2Config, AttentionConfig,
             CheckpointConfig, MetricsConfig, LaunchConfig, PublishConfig, Config):
    _redacting_repr(_cls)
