"""UniMixer's two-stage recipe (UniMixer §4.5, `model.unimixer.schedule = "two_stage"`), the
configs of its two trainings (trainer/run.py runs them): where data is too scarce for a linear
anneal, train hot (tau_start, held), then train again cold (tau_end, held) from the hot run's weights.

The hot stage runs in `<run_dir>/hot`, with its checkpoints on whatever the config says,
so that the cold stage can start from its weights: those of its best validation where the
run validates (model selection's `best` folder), else its final checkpoint. A finished hot
stage (its summary.json written) is not trained again, so a two-stage run interrupted in its
cold stage resumes there. The cold stage is the run: its folder, checkpoints and
summary.json; the summary line `rankmix train` prints adds the hot stage's as `hot/<key>`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from dense.tower_registry import TOWERS
from trainer.config import Config
from trainer.run_layout import COMPLETE, RunFolder


def two_stages(cfg: Config) -> bool:
    """Whether `cfg` asks for the two-stage recipe (its tower reads [model.unimixer])."""
    return "unimixer" in TOWERS.get(cfg.model.tower).tables and cfg.model.unimixer.schedule == "two_stage"


def hot_stage(cfg: Config) -> Config:
    """The first stage: at tau_start throughout, in <run_dir>/hot, saving its final step."""
    hot = copy.deepcopy(cfg)
    hot.train.run_dir = str(RunFolder(Path(cfg.train.run_dir)).hot.root)
    hot.model.unimixer.tau_anneal_steps = 0
    hot.checkpoint.enabled, hot.checkpoint.save_final = True, True
    hot.checkpoint.folder = ""  # RunFolder.hot: its checkpoints in its own folder, apart from the cold stage's
    return hot


def cold_stage(cfg: Config) -> Config:
    """The second stage: at tau_end throughout, in run_dir, from the hot stage's weights."""
    hot = RunFolder(Path(cfg.train.run_dir)).hot
    cold = copy.deepcopy(cfg)
    u = cold.model.unimixer
    u.tau_start, u.tau_anneal_steps = u.tau_end, 0
    cold.checkpoint.load_path = str(hot.best if (hot.best / COMPLETE).exists() else hot.root)
    cold.checkpoint.load_mode = "weights"
    return cold


def hot_summary(cfg: Config) -> dict | None:
    """The hot stage's summary.json, once it has finished."""
    path = RunFolder(Path(cfg.train.run_dir)).hot.summary
    return json.loads(path.read_text()) if path.exists() else None
