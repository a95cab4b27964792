"""The run folder's layout (docs/design.md §2.10): every path of a run, and the resolving of a
path a user gives (a run, a checkpoint folder, a step); the names on disk stand here only.

    <run_dir>/config.toml      the resolved config (rank 0 writes it once restored)
    <run_dir>/summary.json     the run's summary, written when it ends
    <run_dir>/metrics.jsonl    one JSON line per record; <run_dir>/tb/ its TensorBoard scalars
    <checkpoints>/step-N/      the checkpoints: checkpoint.folder, default <run_dir>/checkpoints
    <run_dir>/best/            model selection's best weights, with the run wherever its
                               checkpoints go: they are what the run chose (like summary.json),
                               not a state to resume from that retention prunes
    <publish>/                 the published models: publish.folder, default <run_dir>/publish
    <run_dir>/hot/             the two-stage recipe's hot stage, a run folder of its own

At the floor of trainer/: it imports nothing of the project, so that every module may ask it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.toml"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
CHECKPOINTS = "checkpoints"
BEST = "best"
PUBLISH = "publish"
HOT = "hot"
STEP_PREFIX = "step-"
COMPLETE = ".metadata"  # DCP writes it last: a step folder without it is incomplete


@dataclass(frozen=True)
class RunFolder:
    """The paths of the run in `root`; `checkpoint_folder` and `publish_folder` are the config's
    checkpoint.folder and publish.folder ("" for their defaults inside `root`)."""

    root: Path
    checkpoint_folder: str = ""
    publish_folder: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    def recorded(self, section: str, why: str) -> dict:
        """The [section] of the config.toml of the run started here ({} when none started);
        a ValueError that says `why` it was read when that file is not TOML."""
        if not self.config.is_file():
            return {}
        try:
            return tomllib.loads(self.config.read_text()).get(section, {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.config}: cannot read {why} of the run started there: {e}") from None

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def checkpoints(self) -> Path:
        return Path(self.checkpoint_folder) if self.checkpoint_folder else self.root / CHECKPOINTS

    @property
    def default_checkpoints(self) -> bool:
        """Whether the checkpoints are in their default folder inside the run."""
        return not self.checkpoint_folder

    def step(self, step: int) -> Path:
        """The checkpoint of `step`."""
        return self.checkpoints / f"{STEP_PREFIX}{step}"

    @property
    def best(self) -> Path:
        return self.root / BEST

    @property
    def publish(self) -> Path:
        return Path(self.publish_folder) if self.publish_folder else self.root / PUBLISH

    @property
    def hot(self) -> RunFolder:
        """The two-stage recipe's hot stage: a run of its own, its checkpoints inside it (the
        cold stage, which shares the config's checkpoint.folder, must not resume from them)."""
        return RunFolder(self.root / HOT)


def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    n = len(STEP_PREFIX)
    steps = [int(p.name[n:]) for p in folder.iterdir()
             if p.name.startswith(STEP_PREFIX) and p.name[n:].isdigit() and (p / COMPLETE).exists()]
    return sorted(steps)


def resolve_checkpoint(path: str, option: str = "checkpoint.load_path") -> Path:
    """A checkpoint folder (a `step-N`, a `best`), or a run / checkpoints folder whose latest
    complete one is taken; errors name `option`, where the path came from."""
    p = Path(path)
    if (p / COMPLETE).exists():
        return p
    for folder in (p, RunFolder(p).checkpoints):
        steps = complete_steps(folder)
        if steps:
            return folder / f"{STEP_PREFIX}{steps[-1]}"
    if p.name.startswith(STEP_PREFIX) and p.is_dir():
        raise ValueError(f"{option}={path}: incomplete checkpoint (no {COMPLETE}: "
                         "the save was interrupted)")
    raise ValueError(f"{option}={path}: no complete checkpoint there")


def find_config(path: str) -> Path:
    """The config.toml of the run that `path` (a run folder, its checkpoints or best folder, or
    one of its step folders) belongs to: in `path` or one of the two folders above it."""
    if not Path(path).is_dir():
        raise ValueError(f"--checkpoint {path}: no such folder")
    here = Path(path).resolve()
    for folder in (here, *here.parents[:2]):
        if RunFolder(folder).config.is_file():
            return RunFolder(folder).config
    raise ValueError(f"no {CONFIG} in {path} or the two folders above it; pass --config")
