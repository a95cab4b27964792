"""The dense towers' declarations, by `model.tower` name: e_input [B, E] -> [B, tower.out_dim].

Each module here declares the towers of one family: the config table of the family, what of
[model] each tower reads and its builder (`register_tower`, dense/tower_registry.py).
Importing the package imports every module in it, so that the registry, the `model.tower`
choices and ModelConfig's tables (dense/model_config.py) hold every tower declared here.
These modules need no torch, so that the config loads without it (`rankmix --help`); a
builder imports its tower's modules (dense/rankmixer.py, ...) on use, and those modules
import no declaration back. dense/heads.py `build_tower` builds the chosen one.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
