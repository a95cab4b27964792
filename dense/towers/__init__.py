"""Dense towers chosen by name (`model.tower`): e_input [B, E] -> [B, tower.out_dim].

Each module here declares the towers of one family: the config table of the family, what of
ModelConfig each tower reads and its builder (`register_tower`, dense/tower_registry.py).
Importing the package imports every module in it, so that the registry, the `model.tower`
choices and ModelConfig's tables (dense/model_config.py) hold every tower declared here.
These modules need no torch, so that the config loads without it (`rankmix --help`); a
builder imports its tower's modules (dense/rankmixer.py, ...) on use.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from dense.tower_registry import TOWERS

if TYPE_CHECKING:
    from torch import nn

    from dense.layout import InputLayout
    from dense.model_config import ModelConfig

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_tower(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    """The tower named by `model.tower`; it exposes `out_dim`."""
    return TOWERS.get(cfg.tower).build(cfg, layout)
