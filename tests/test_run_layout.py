"""The run folder's layout (trainer/run_layout.py): each path of a run, the checkpoints and the
publish folder wherever the config points them, and the resolving of a path a user gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.checkpoint.run_folder import run_folders
from trainer.config import CheckpointConfig
from trainer.run_layout import RunFolder, complete_steps, find_config, resolve_checkpoint


def _step(folder: Path, step: int, complete: bool = True) -> Path:
    """A step folder as DCP leaves it: `.metadata` written last, absent when the save was cut."""
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_bytes(b"")
    return path


def test_paths_of_a_run_with_its_defaults(tmp_path):
    run = RunFolder(tmp_path / "run")
    assert (run.config, run.summary, run.metrics, run.tensorboard) == (
        tmp_path / "run/config.toml", tmp_path / "run/summary.json", tmp_path / "run/metrics.jsonl",
        tmp_path / "run/tb")
    assert (run.checkpoints, run.step(12), run.best, run.publish) == (
        tmp_path / "run/checkpoints", tmp_path / "run/checkpoints/step-12", tmp_path / "run/best",
        tmp_path / "run/publish")
    assert run.default_checkpoints


def test_checkpoints_and_publish_where_the_config_points_best_stays_with_the_run(tmp_path):
    run = RunFolder(str(tmp_path / "run"), checkpoint_folder=str(tmp_path / "big"),
                    publish_folder=str(tmp_path / "served"))
    assert run.root == tmp_path / "run"  # a str from the config becomes a Path
    assert (run.checkpoints, run.step(3), run.publish) == (
        tmp_path / "big", tmp_path / "big/step-3", tmp_path / "served")
    assert run.best == tmp_path / "run/best" and not run.default_checkpoints


def test_the_hot_stage_is_a_run_of_its_own_with_its_checkpoints_inside(tmp_path):
    hot = RunFolder(tmp_path, checkpoint_folder=str(tmp_path / "big")).hot
    assert hot == RunFolder(tmp_path / "hot")
    assert (hot.checkpoints, hot.best, hot.summary) == (
        tmp_path / "hot/checkpoints", tmp_path / "hot/best", tmp_path / "hot/summary.json")


def test_run_folders_locks_the_checkpoints_wherever_they_are(tmp_path):
    assert run_folders(tmp_path, CheckpointConfig(enabled=True)) == {
        tmp_path: "--train.run_dir", tmp_path / "checkpoints": "--train.run_dir"}
    assert run_folders(tmp_path, CheckpointConfig(enabled=False)) == {tmp_path: "--train.run_dir"}
    assert run_folders(tmp_path, CheckpointConfig(folder=str(tmp_path / "big"))) == {
        tmp_path: "--train.run_dir", tmp_path / "big": "--checkpoint.folder"}


def test_complete_steps_are_the_numbered_folders_with_metadata_in_order(tmp_path):
    for step in (10, 2, 30):
        _step(tmp_path, step)
    _step(tmp_path, 40, complete=False)
    (tmp_path / "step-x").mkdir()
    (tmp_path / "saved5").mkdir()  # a digit after five characters and a .metadata, but no step- before it
    (tmp_path / "saved5" / ".metadata").write_bytes(b"")
    assert complete_steps(tmp_path) == [2, 10, 30]
    assert complete_steps(tmp_path / "missing") == []


@pytest.mark.parametrize("given", ["run", "run/checkpoints", "run/checkpoints/step-20"])
def test_resolve_a_run_its_checkpoints_or_a_step(tmp_path, given):
    checkpoints = RunFolder(tmp_path / "run").checkpoints
    for step in (5, 10, 20):  # three complete steps: the latest, not the second, is resumed
        _step(checkpoints, step)
    _step(checkpoints, 30, complete=False)
    assert resolve_checkpoint(str(tmp_path / given)) == checkpoints / "step-20"


def test_resolve_a_step_that_is_not_the_latest_and_a_best_folder(tmp_path):
    run = RunFolder(tmp_path)
    _step(run.checkpoints, 5)
    _step(run.checkpoints, 20)
    run.best.mkdir()
    (run.best / ".metadata").write_bytes(b"")
    assert resolve_checkpoint(str(run.step(5))) == run.step(5)
    assert resolve_checkpoint(str(run.best), "--checkpoint") == run.best


def test_resolve_refuses_an_incomplete_step_and_a_folder_without_checkpoints(tmp_path):
    step = _step(tmp_path / "checkpoints", 7, complete=False)
    with pytest.raises(ValueError) as cut:
        resolve_checkpoint(str(step), "--checkpoint")
    assert str(cut.value) == f"--checkpoint={step}: incomplete checkpoint (no .metadata: the save was interrupted)"
    with pytest.raises(ValueError) as empty:
        resolve_checkpoint(str(tmp_path))
    assert str(empty.value) == f"checkpoint.load_path={tmp_path}: no complete checkpoint there"
    with pytest.raises(ValueError) as missing:
        resolve_checkpoint(str(tmp_path / "nowhere"))
    assert str(missing.value) == f"checkpoint.load_path={tmp_path / 'nowhere'}: no complete checkpoint there"
    with pytest.raises(ValueError) as gone:  # a step's name alone is not an interrupted save
        resolve_checkpoint(str(tmp_path / "step-9"))
    assert str(gone.value) == f"checkpoint.load_path={tmp_path / 'step-9'}: no complete checkpoint there"


@pytest.mark.parametrize("given", ["run", "run/checkpoints", "run/checkpoints/step-20", "run/best"])
def test_find_config_of_a_run_from_its_folders(tmp_path, given):
    run = RunFolder(tmp_path / "run")
    _step(run.checkpoints, 20)
    run.best.mkdir()
    run.config.write_text("")
    assert find_config(str(tmp_path / given)) == run.config.resolve()


def test_find_config_refuses_a_missing_folder_and_one_three_below(tmp_path):
    with pytest.raises(ValueError) as missing:
        find_config(str(tmp_path / "nowhere"))
    assert str(missing.value) == f"--checkpoint {tmp_path / 'nowhere'}: no such folder"
    RunFolder(tmp_path).config.write_text("")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    assert find_config(str(deep.parent)) == tmp_path.resolve() / "config.toml"
    with pytest.raises(ValueError) as far:
        find_config(str(deep))
    assert str(far.value) == f"no config.toml in {deep} or the two folders above it; pass --config"


def test_a_section_of_the_config_the_run_recorded(tmp_path):
    folder = RunFolder(tmp_path)
    assert folder.recorded("model", "its width") == {}  # no run started here
    folder.config.write_text('[model]\nhidden_dim = 32\nrecipe = "auto"\n\n[data]\nsnapshot = 7\n')
    assert folder.recorded("model", "its width") == {"hidden_dim": 32, "recipe": "auto"}
    assert folder.recorded("data", "the pin") == {"snapshot": 7}
    assert folder.recorded("optim", "its rate") == {}
    folder.config.write_text("[model\n")
    with pytest.raises(ValueError) as e:
        folder.recorded("model", "the token width")
    assert str(e.value).startswith(f"{folder.config}: cannot read the token width of the run started there: ")
    folder.config.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="cannot read the pin of the run started there: "):
        folder.recorded("data", "the pin")
