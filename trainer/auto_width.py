"""`model.recipe = "auto"`: the token width for the size of the training data.

A token tower of the config's width can hold many more parameters than its training rows can
pin down: on MovieLens-100K cut in time (72k training rows) RankMixer at D = 64 (537k dense
parameters, 7.5 a row) trails the MLP by 0.0067 +- 0.0048 AUC while D = 32 (137k, 1.9 a row) is
level; on the sequence teachers (144k and 1.44M rows) D = 64 (137k, 0.95 and 0.1 a row) is ahead
(docs/results.md, "RankMixer against the MLP on splits in time"). So auto takes `model.hidden_dim`
as the widest the run may use and halves it while the dense tower and heads hold more than
PARAMS_PER_ROW parameters per training row, down to MIN_WIDTH or the narrowest width the tower
accepts. It never widens: at billions of rows the config's width stands.

The choice is made once per run folder: a resumed run keeps the width its folder's config.toml
recorded, though its input may have grown since (its checkpoint has that width's shapes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dense.heads import build_dense
from dense.tower_registry import TOWERS
from trainer.config import Config
from trainer.run_layout import RunFolder

PARAMS_PER_ROW = 4
"""The most dense parameters per training row that auto leaves a token tower (between the 2 a row
that held and the 8 that trailed)."""
MIN_WIDTH = 16
"""The narrowest token width auto chooses."""


def dense_params(cfg: Config, width: int) -> int:
    """Parameters of `cfg`'s tower and heads at token width `width`, by their formulas (built on
    the meta device: no memory, no draw from the run's generators); the tower's ValueError for a
    width it refuses."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        _, tower, heads = build_dense(dataclasses.replace(cfg.model, hidden_dim=width), cfg.features)
    return tower.cost()[0] + heads.cost()[0]


def choose_width(cfg: Config, training_rows: int | None, run_dir: Path) -> str | None:
    """Set `cfg.model.hidden_dim` for `model.recipe = "auto"` from `training_rows` (None: not
    known before training, as in time order) and return the line that says what it chose;
    None when the recipe is another."""
    model = cfg.model
    if model.recipe != "auto":
        return None
    if not TOWERS.get(model.tower).tokens:
        return f"model.recipe=auto: the {model.tower} tower has no token width to choose"
    recorded = RunFolder(run_dir).recorded("model", "the token width")
    if recorded.get("recipe") == "auto" and isinstance(recorded.get("hidden_dim"), int):
        model.hidden_dim = recorded["hidden_dim"]
        return f"model.recipe=auto: model.hidden_dim={model.hidden_dim}, as the run in {run_dir} chose it"
    if training_rows is None:
        return (f"model.recipe=auto: model.hidden_dim={model.hidden_dim}, the config's: the training rows "
                "are not known before training (data.order=time)")
    ceiling, budget = model.hidden_dim, PARAMS_PER_ROW * training_rows
    params = dense_params(cfg, ceiling)
    while params > budget and model.hidden_dim // 2 >= MIN_WIDTH:
        try:
            narrower = dense_params(cfg, model.hidden_dim // 2)
        except ValueError:  # the tower's narrowest width (RankMixer's: a multiple of its tokens)
            break
        model.hidden_dim, params = model.hidden_dim // 2, narrower
    return (f"model.recipe=auto: model.hidden_dim={model.hidden_dim} (of at most {ceiling}): {params:,} dense "
            f"parameters for {training_rows:,} training rows (at most {PARAMS_PER_ROW} a row, "
            f"down to width {MIN_WIDTH})")
