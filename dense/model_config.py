"""[model]: the dense side's config. The tokenizer, token and head fields are declared here;
the `model.tower` choices and the towers' [model.<key>] tables are derived from the towers'
own modules (dense/tower_configs/), so that a tower is declared once, next to its builder.

trainer/config.py puts this section into the run's config tree; its loader checks the values
against the types here and `unused_model_fields` names what the chosen tower leaves unread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Literal

import dense.tower_configs  # noqa: F401  (importing the package registers every tower)
from dense.sequence_modules import SequenceConfig
from dense.tower_registry import TABLES, TOWERS, TokenFields, readers

Tokenizer = Literal["slice", "group"]
TokenizerBias = Literal["uniform", "zero"]
Recipe = Literal["auto", "rankmix", "paper"]


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
class ModelFields:
    """The [model] fields of every tower: its name, the recipe, the tokenizer and token fields,
    and the task heads. `ModelConfig` adds the towers' own tables."""

    tower: str = "rankmixer"
    """Registered dense tower (dense/tower_configs/); ModelConfig's field holds the choices."""
    recipe: Recipe = "auto"
    ("""auto: rankmix's, and hidden_dim the widest a run may use, halved for few training rows """
     """(trainer/auto_width.py) | rankmix: this project's defaults (zero tokenizer biases, a dense warm-up; """
     """docs/results.md) | paper: the RankMixer paper's (RECIPES); keys given explicitly win.""")
    tokenizer: Tokenizer = "slice"
    """slice: concatenate groups, cut into num_tokens slices | group: one token per semantic group."""
    num_tokens: int = 8
    """T, tokens for the slice tokenizer (the group tokenizer makes one per group)."""
    tokenizer_bias: TokenizerBias = "zero"
    ("""Initial tokenizer biases: zero (tokens start from the embeddings alone) | uniform (nn.Linear's """
     """+-1/sqrt(fan-in), the paper's).""")
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
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    """Sequence modules (features.<name>.sequence_module): the time gap's buckets and each module's options."""


TOKEN_FIELDS = tuple(TokenFields.__annotations__)
"""The [model] fields that only token towers (TowerSpec.tokens) read."""

Tower = Literal[tuple(TOWERS.names())]  # type: ignore[valid-type]


def _table_doc(key: str) -> str:
    """A tower table's --help line: its class's summary and the towers that read it."""
    return f"{TABLES[key].__doc__.strip().rstrip('.')} ({', '.join(readers(key))})."


_TOWER_DOC = f"Registered dense tower: {' | '.join(TOWERS.names())}."
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [("tower", Tower, field(default="rankmixer", metadata={"doc": _TOWER_DOC})),
     *((key, table, field(default_factory=table, metadata={"doc": _table_doc(key)})) for key, table in TABLES.items())],
    bases=(ModelFields,),
    namespace={"__module__": __name__,
               "__doc__": "Tokenizer, dense tower and task heads; each tower family's own fields in its table."})
"""[model]: ModelFields and a [model.<key>] table per tower family."""


def unused_model_fields(model: ModelConfig) -> dict[str, tuple[str, str]]:
    """Each model field that the chosen tower and tokenizer do not read -> (the key whose
    value makes it unused, why)."""
    uses = TOWERS.get(model.tower)
    unused: dict[str, tuple[str, str]] = {}
    if not uses.tokens:
        unused |= dict.fromkeys((f"model.{name}" for name in TOKEN_FIELDS),
                                ("model.tower", f"tower {model.tower!r} has no tokens"))
    elif model.tokenizer == "group":
        unused |= dict.fromkeys(("model.num_tokens", "model.token_dim"),
                                ("model.tokenizer", "model.tokenizer='group' makes one token per group"))
    for key in TABLES:
        for f in fields(getattr(model, key)):
            if key not in uses.tables or f.name in uses.skip:
                read_by = ", ".join(readers(key, f.name))
                unused[f"model.{key}.{f.name}"] = ("model.tower",
                                                   f"tower {model.tower!r} does not read it (read by {read_by})")
    return unused


def validate_model(model: ModelConfig) -> None:
    """Each tower table's own checks (its `validate`, where it has one) and the sequence modules';
    ValueError naming the key."""
    model.sequence.validate()
    for key in TABLES:
        check = getattr(getattr(model, key), "validate", None)
        if check is not None:
            check()
