"""model.recipe = "auto" (trainer/auto_width.py): the token width halved from the config's while
the dense side holds more than PARAMS_PER_ROW parameters per training row; a resumed run keeps
the width its folder recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli import rankmix
from dense.heads import build_dense
from launch.sweep import fixed_width
from trainer.auto_width import MIN_WIDTH, PARAMS_PER_ROW, choose_width, dense_params
from trainer.config_loader import dump_toml, load_config
from trainer.offline.synth import FIRST_SECOND

REPO = Path(__file__).resolve().parents[1]
MOVIELENS = REPO / "configs" / "movielens.toml"


def _params(cfg, width: int) -> int:
    """Counted parameters of real modules (not the formulas) at `width`."""
    cfg.model.hidden_dim = width
    _, tower, heads = build_dense(cfg.model, cfg.features)
    return sum(p.numel() for m in (tower, heads) for p in m.parameters())


def _reference_width(cfg, rows: int) -> int:
    """The widest of the config's width and its halves down to MIN_WIDTH (those the tower takes)
    that fits PARAMS_PER_ROW a row, else the narrowest of them."""
    ceiling, widths = cfg.model.hidden_dim, []
    while ceiling >= MIN_WIDTH and ceiling % cfg.model.num_tokens == 0:
        widths.append(ceiling)
        ceiling //= 2
    counts = {w: _params(cfg, w) for w in widths}
    return next((w for w in widths if counts[w] <= PARAMS_PER_ROW * rows), widths[-1])


@pytest.mark.parametrize("tower", ["rankmixer", "rankmixer_moe", "unimixer_lite"])
@pytest.mark.parametrize("rows", [5_000, 40_000, 80_000, 200_000, 10**9])
def test_the_width_is_the_widest_that_fits_the_rows(tmp_path, tower, rows):
    cfg = load_config(MOVIELENS, [f"--model.tower={tower}"])
    expected = _reference_width(load_config(MOVIELENS, [f"--model.tower={tower}"]), rows)
    line = choose_width(cfg, rows, tmp_path)
    assert cfg.model.hidden_dim == expected
    params = _params(load_config(MOVIELENS, [f"--model.tower={tower}"]), expected)
    assert dense_params(cfg, expected) == params
    assert line == (f"model.recipe=auto: model.hidden_dim={expected} (of at most 64): {params:,} dense parameters "
                    f"for {rows:,} training rows (at most {PARAMS_PER_ROW} a row, down to width {MIN_WIDTH})")


def test_the_rows_of_the_evidence_choose_the_widths_that_held():
    """docs/results.md: MovieLens' 72k training rows at 32 (64 trailed the MLP), the sequence
    teacher's 144k at its config's 64."""
    movielens = load_config(MOVIELENS)
    choose_width(movielens, 72_000, Path("/nonexistent"))
    sequence = load_config(REPO / "configs" / "sequence.toml")
    choose_width(sequence, 144_000, Path("/nonexistent"))
    assert (movielens.model.hidden_dim, sequence.model.hidden_dim) == (32, 64)


def test_the_narrowest_width_is_the_towers_own(tmp_path):
    """32 tokens: 16 is no multiple of them, so 32 is as narrow as RankMixer goes."""
    cfg = load_config(MOVIELENS, ["--model.num_tokens=32"])
    line = choose_width(cfg, 10, tmp_path)
    assert cfg.model.hidden_dim == 32
    assert line == (f"model.recipe=auto: model.hidden_dim=32 (of at most 64): {_params(cfg, 32):,} dense parameters "
                    f"for 10 training rows (at most {PARAMS_PER_ROW} a row, down to width {MIN_WIDTH})")
    cfg = load_config(MOVIELENS, ["--model.num_tokens=4", "--model.hidden_dim=128"])
    choose_width(cfg, 10, tmp_path)
    assert cfg.model.hidden_dim == MIN_WIDTH


def test_a_tower_that_fits_its_budget_exactly_keeps_its_width(tmp_path, monkeypatch):
    monkeypatch.setattr("trainer.auto_width.PARAMS_PER_ROW", 1)
    rows = _params(load_config(MOVIELENS), 64)
    cfg = load_config(MOVIELENS)
    choose_width(cfg, rows, tmp_path)
    assert cfg.model.hidden_dim == 64
    choose_width(cfg, rows - 1, tmp_path)
    assert cfg.model.hidden_dim == 32


def test_choosing_draws_nothing_from_the_runs_generator(tmp_path):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    choose_width(load_config(MOVIELENS), 1_000, tmp_path)
    assert torch.equal(torch.get_rng_state(), before)


def test_other_recipes_towers_without_tokens_and_unknown_rows_keep_the_width(tmp_path):
    cfg = load_config(MOVIELENS, ["--model.recipe=rankmix"])
    assert choose_width(cfg, 10, tmp_path) is None and cfg.model.hidden_dim == 64
    cfg = load_config(MOVIELENS, ["--model.tower=mlp"])
    assert choose_width(cfg, 10, tmp_path) == "model.recipe=auto: the mlp tower has no token width to choose"
    cfg = load_config(MOVIELENS)
    assert choose_width(cfg, None, tmp_path) == (
        "model.recipe=auto: model.hidden_dim=64, the config's: the training rows are not known before "
        "training (data.order=time)")
    assert cfg.model.hidden_dim == 64


def test_a_run_folder_keeps_the_width_it_recorded(tmp_path):
    started = load_config(MOVIELENS)
    choose_width(started, 1_000, tmp_path)
    assert started.model.hidden_dim == MIN_WIDTH
    dump_toml(started, tmp_path / "config.toml")
    cfg = load_config(MOVIELENS)
    assert choose_width(cfg, 10**9, tmp_path) == (
        f"model.recipe=auto: model.hidden_dim={MIN_WIDTH}, as the run in {tmp_path} chose it")
    assert cfg.model.hidden_dim == MIN_WIDTH
    dump_toml(load_config(MOVIELENS, ["--model.recipe=rankmix"]), tmp_path / "config.toml")
    choose_width(cfg := load_config(MOVIELENS), 1_000, tmp_path)
    assert cfg.model.hidden_dim == MIN_WIDTH  # the rankmix run's 64 was no choice to keep
    (tmp_path / "config.toml").write_text("[model\n")
    with pytest.raises(ValueError, match=r"config.toml: cannot read the token width of the run started there: "):
        choose_width(load_config(MOVIELENS), 10, tmp_path)


def test_a_run_trains_at_the_width_it_chose_records_it_and_resumes_at_it(tmp_path):
    """The default config on the default synthetic log cut in time (its request_time): the
    training split's rows choose the width."""
    run = tmp_path / "run"
    common = [f"--data.cache_dir={tmp_path / 'cache'}", f"--train.run_dir={run}", "--metrics.progress=false",
              "--metrics.tensorboard=false", "--data.synth_rows=3000", "--data.split=time",
              "--data.time_column=request_time", "--data.split_at=0.8", "--train.steps=0"]
    done = rankmix("train", *common, "--train.epochs=1")
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = load_config(run / "config.toml")
    rows = json.loads((run / "summary.json").read_text())["data/rows"]
    assert f"data.split=time: cut at request_time={FIRST_SECOND + rows}: {rows} training" in done.stdout
    expected = _reference_width(load_config(run / "config.toml", ["--model.hidden_dim=64"]), rows)
    assert cfg.model.hidden_dim == expected < 64
    assert (f"model.recipe=auto: model.hidden_dim={expected} (of at most 64): "
            f"{dense_params(cfg, expected):,} dense parameters for {rows:,} training rows") in done.stdout
    assert json.loads(done.stdout.strip().splitlines()[-1])["dense_params"] == dense_params(cfg, expected)
    done = rankmix("train", *common, "--train.epochs=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model.recipe=auto: model.hidden_dim={expected}, as the run in {run} chose it" in done.stdout
    assert "resumed from" in done.stdout + done.stderr


def test_a_sweep_runs_its_points_at_the_widths_it_names():
    """A sweep's point is its size: auto would narrow it (launch/sweep.py's fixed_width)."""
    assert fixed_width(None, []) == ["model.recipe=rankmix"]
    assert fixed_width(None, ["--model.recipe=paper"]) == fixed_width(None, ["model.recipe=rankmix"]) == []
    with pytest.raises(ValueError, match=r"^sweep: model.recipe must be one of "):
        fixed_width(None, ["model.recipe=wide"])
