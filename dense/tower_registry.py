"""What a tower is to the rest of the code, declared by the tower's own module (dense/tower_configs/):

Standard library only: the config (dense/model_config.py) loads the towers' declarations
without torch, and a builder imports its tower's modules on use.

- `register_tower` puts its builder in `TOWERS` under its `model.tower` name, with what it reads
  of ModelConfig: the `[model.<key>]` tables of its family (dataclasses with a `key`), whether it
  tokenizes (the tokenizer and token fields of [model]), and the fields of its tables it skips.
  dense/model_config.py derives the `model.tower` choices and ModelConfig's tables from it, and
  the loader the fields a choice leaves unread.
- A builder sees `TokenFields` and its own tables, not ModelConfig: ModelConfig is assembled from
  the declarations, so a declaration that named it would import its own assembly back.
- `ServingForm`: a tower whose evaluation forward does not trace into a serving artifact as it
  is gives a module that does (trainer/serving/export.py takes `serving_form(tower)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from embeddings.registry import Registry

if TYPE_CHECKING:
    from torch import nn


class TokenFields(Protocol):
    """The [model] fields a token tower reads (declared in dense/model_config.py ModelFields)."""

    tokenizer: str
    num_tokens: int
    tokenizer_bias: str
    token_dim: int
    hidden_dim: int
    num_layers: int
    ffn_ratio: int


Builder = Callable[..., "nn.Module"]
"""(TokenFields, InputLayout, *its tables in the order of `tables`) -> the tower module."""


@dataclass(frozen=True)
class TowerSpec:
    """A registered tower: its builder, and what of ModelConfig it reads."""

    build: Builder
    """(TokenFields, InputLayout, *its tables) -> the tower module; it exposes `out_dim`."""
    tables: tuple[str, ...] = ()
    """Keys of the [model.<key>] tables the tower reads."""
    tokens: bool = True
    """The tower tokenizes: it reads the token fields of [model] (`TokenFields`)."""
    skip: tuple[str, ...] = ()
    """Fields of its tables that it does not read."""
    defaults: tuple[tuple[str, object], ...] = ()
    """(dotted key, value): run defaults this tower trains best with, over model.recipe's; a key given explicitly
    wins."""


TOWERS: Registry[TowerSpec] = Registry("model.tower")
TABLES: dict[str, type] = {}
"""[model.<key>] table -> its dataclass, as the registered towers declare them."""


def register_tower(name: str, *, tables: tuple[type, ...] = (), tokens: bool = True,
                   skip: tuple[str, ...] = (),
                   defaults: dict[str, object] | None = None) -> Callable[[Builder], Builder]:
    """Decorator: make the builder the tower `model.tower = name`, reading `tables` (dataclasses
    whose class attribute `key` names their [model.<key>] table; the builder gets them in this
    order after the layout) except the fields in `skip`, and training by `defaults` (dotted
    key -> value) unless a file or the command line says otherwise."""
    def wrap(build: Builder) -> Builder:
        for table in tables:
            assert TABLES.setdefault(table.key, table) is table, f"two tables declare [model.{table.key}]"
        assert set(skip) <= {f.name for table in tables for f in fields(table)}, f"{name} skips a field it has not"
        TOWERS.register(name)(TowerSpec(build, tuple(t.key for t in tables), tokens, skip,
                                        tuple((defaults or {}).items())))
        return build
    return wrap


def readers(key: str, name: str | None = None) -> list[str]:
    """The towers that read table `key` (its field `name`, when given), by name."""
    return [t for t in TOWERS.names() if key in TOWERS.get(t).tables and name not in TOWERS.get(t).skip]


def check_ranges(table: Any, positive: tuple[str, ...] = (), nonnegative: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field of `table` out of its range, as the loader's own checks say it."""
    for names, ok, what in ((positive, lambda v: v > 0, "must be positive"), (nonnegative, lambda v: v >= 0,
                                                                              "must be >= 0")):
        for name in names:
            value = getattr(table, name)
            if not ok(value):
                raise ValueError(f"model.{table.key}.{name} {what}, got {value}")


class ServingForm:
    """Mixin for towers whose evaluation forward does not trace into a serving artifact
    as it is (torch.export, torch.fx): `serving_form` gives a module (a new one, or the tower
    itself set up for serving) that computes the same in evaluation mode and traces."""

    def serving_form(self) -> nn.Module:
        raise NotImplementedError


def serving_form(tower: nn.Module) -> nn.Module:
    """`tower` as it is served: its `ServingForm`, or itself, in evaluation mode."""
    tower.eval()
    return tower.serving_form().eval() if isinstance(tower, ServingForm) else tower
