"""A publish delta names its base by content (trainer/serving/publish.py, `tables_digest`):
`rankmix publish apply` refuses another run's publish of the same step, a delta of an older
rankmix that names its base by step only, and a delta whose rows do not fit; a file given
where a folder is expected is one line. Two tiny runs of configs/debug.toml publish every step."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from cli import rankmix
from trainer.serving.publish import tables_digest

pytestmark = pytest.mark.slow  # two training runs, made once
# The least a publishing run needs: TorchScript artifacts (quicker to write than pt2), few rows,
# one evaluation batch, no checkpoint.
CHEAP = ["--publish.format=torchscript", "--data.synth_rows=3000", "--metrics.eval_batches=1",
         "--checkpoint.enabled=false", "--metrics.progress=false", "--metrics.tensorboard=false"]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(made_once) -> Path:
    """Run A (2 steps: step-1, and step-2 with a delta against it) and run B (another seed, step-1)."""
    def make(folder: Path) -> None:
        for name, steps, seed in (("A", 2, 0), ("B", 1, 1)):
            ok(rankmix("train", "--config", "configs/debug.toml", f"--train.run_dir={folder / name}",
                       f"--data.cache_dir={folder / 'cache'}", f"--train.steps={steps}", f"--train.seed={seed}",
                       "--publish.every_steps=1", *CHEAP))
    return made_once("delta-base-runs", make)


def publish_info(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["publish"]


def refused(base: Path, delta: Path, out: Path) -> str:
    """The one `rankmix: error:` line of a refused apply (exit 2, no traceback, no output folder)."""
    proc = rankmix("publish", "apply", "--base", str(base), "--delta", str(delta), "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0].removeprefix("rankmix: error: ")


def test_another_runs_base_of_the_same_step_is_refused(runs, tmp_path):
    a1, a2, b1 = runs / "A/publish/step-1", runs / "A/publish/step-2", runs / "B/publish/step-1"
    wanted = publish_info(a2)["delta"]["base_digest"]
    assert wanted == publish_info(a1)["tables_digest"]  # recorded when the base was published and in the delta
    other = publish_info(b1)["tables_digest"]
    assert other != wanted
    assert refused(b1, a2, tmp_path / "out") == (
        f"--delta {a2} was made against tables of digest {wanted[:16]}, but --base {b1} holds tables of digest "
        f"{other[:16]}: another run's or another publish's tables, though of the same step; a delta applies to its "
        "own base only")


def test_a_delta_applies_to_its_base_and_the_result_is_the_next_deltas_base(runs, tmp_path):
    a1, a2 = runs / "A/publish/step-1", runs / "A/publish/step-2"
    out = tmp_path / "applied"
    ok(rankmix("publish", "apply", "--base", str(a1), "--delta", str(a2), "--out", str(out)))
    ours, theirs = (torch.load(f / "tables.pt", weights_only=True) for f in (out, a2))
    assert ours["tables"].keys() == theirs["tables"].keys()
    for table, weight in theirs["tables"].items():
        assert torch.equal(ours["tables"][table].view(torch.int32), weight.view(torch.int32)), table
    assert tables_digest(ours["tables"], ours["id_maps"]) == publish_info(a2)["tables_digest"]


def test_a_file_where_a_folder_is_expected_is_one_line(runs, tmp_path):
    a1, a2 = runs / "A/publish/step-1", runs / "A/publish/step-2"
    assert refused(a1, a1 / "tables.pt", tmp_path / "out") == (
        f"--delta {a1}/tables.pt is not a delta: give the published folder after the base, or its delta.pt")
    assert refused(a1 / "tables.pt", a2, tmp_path / "out") == (
        f"--base {a1}/tables.pt is a file: give a published artifact's folder (it holds tables.pt)")


def test_a_delta_without_a_base_digest_or_with_rows_outside_its_base_is_refused(runs, tmp_path):
    a1, a2 = runs / "A/publish/step-1", runs / "A/publish/step-2"
    delta = torch.load(a2 / "delta.pt", weights_only=True)
    old = tmp_path / "old.pt"
    torch.save({k: v for k, v in delta.items() if k != "base_digest"}, old)
    assert refused(a1, old, tmp_path / "out") == (
        f"--delta {old} names its base by step only (an older rankmix wrote it), so it cannot be checked against "
        f"--base {a1}: apply deltas of this version's publishes")
    table = sorted(delta["rows"])[0]
    width = delta["values"][table].shape[1]
    outside = tmp_path / "outside.pt"
    torch.save({**delta, "rows": {**delta["rows"], table: torch.tensor([1 << 40])},
                "values": {**delta["values"], table: torch.zeros(1, width)}}, outside)
    assert refused(a1, outside, tmp_path / "out") == (
        f"--delta {outside}: the changed rows of table {table} do not fit the base's tables")
