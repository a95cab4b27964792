"""What a sequence module is to the rest of the code (`features.<name>.sequence_module`): the
registry its declaration fills (dense/sequence_modules.py, its `[model.sequence.<key>]` table and
builder) and the token slots it outputs. Standard library only, like dense/tower_registry.py:
the modules themselves (dense/sequence.py) build from here and import no declaration back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from embeddings.registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from embeddings.features import FeatureSpec

Builder = Callable[..., "nn.Module"]
"""(SequenceConfig, FeatureSpec) -> the module that reads the feature's sequence."""
SEQUENCE_MODULES: Registry[Builder | None] = Registry("features.<name>.sequence_module")
"""Name -> builder of the module that reads a sequence position by position; None for `pool`,
which TorchRec's EmbeddingBagCollection pools before the dense side sees the sequence."""
SEQUENCE_TABLES: dict[str, type] = {}


def register_sequence(name: str, table: type | None = None) -> Callable[[Builder | None], Builder | None]:
    """Decorator: make `build` the sequence module `name`, reading [model.sequence.<table.key>]."""
    def wrap(build):
        if table is not None:
            assert SEQUENCE_TABLES.setdefault(table.key, table) is table
        SEQUENCE_MODULES.register(name)(build)
        return build
    return wrap


def token_slots(f: FeatureSpec) -> list[tuple[str, str]]:
    """(slot name, semantic group) of each vector an attended sequence outputs: one in its own
    group, or `sequence_tokens` = k in k groups of their own (<group>.0, ...)."""
    if f.sequence_tokens == 1:
        return [(f.name, f.group)]
    return [(f"{f.name}.{j}", f"{f.group}.{j}") for j in range(f.sequence_tokens)]
