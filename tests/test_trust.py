"""Loading a checkpoint, a best-weights folder or a pt2 artifact never runs code from it
(trainer/checkpoint/safe_load.py), and one run holds a run folder at a time (trainer/checkpoint/run_folder.py).

Each planted file carries a pickle whose loading runs `touch MARKER`: the test checks that
the command refuses it in one line naming the file, and that the marker was never made."""

import io
import json
import os
import pickle
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from cli import rankmix
from trainer.checkpoint import manager
from trainer.checkpoint.links import swap_folder
from trainer.checkpoint.run_folder import LOCK_FILE, RunLock
from trainer.checkpoint.safe_load import UnsafeFileError
from trainer.checkpoint.state import decode_state, encode_state
from trainer.files import write_atomic

TRAIN = ["--config", "configs/debug.toml", "--metrics.progress=false", "--metrics.tensorboard=false",
         "--train.steps=4", "--checkpoint.interval=2"]


class Payload:
    """Runs `touch marker` when unpickled, as a crafted file would run anything."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def refused(proc: subprocess.CompletedProcess, file: Path, marker: Path) -> str:
    """The one-line error of a command that refused `file`; nothing ran."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rankmix: error:")]
    assert len(lines) == 1 and str(file) in lines[0] and "refused" in lines[0], proc.stderr[-2000:]
    assert not marker.exists(), "the planted payload ran"
    return lines[0]


@pytest.fixture(scope="module")
def run(made_once) -> Path:
    """A short debug run with checkpoints at steps 2 and 4, made once."""
    def make(folder: Path) -> None:
        proc = rankmix("train", *TRAIN, f"--train.run_dir={folder}/run", f"--data.cache_dir={folder}/data")
        assert proc.returncode == 0, proc.stderr[-2000:]
    return made_once("trust-run", make) / "run"


def copy_run(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run, dest, symlinks=True)
    return dest


def test_planted_metadata_is_refused_by_every_command(run, tmp_path):
    """The review's reproduction (`export --format weights` on a step whose .metadata runs a
    command), then auto-resume and `score --checkpoint` on the same folder."""
    copied, marker = copy_run(run, tmp_path), tmp_path / "ran"
    planted = copied / "checkpoints" / "step-4" / ".metadata"
    planted.write_bytes(pickle.dumps(Payload(marker)))
    line = refused(rankmix("export", "--checkpoint", str(copied), "--out", str(tmp_path / "w.pt"),
                           "--format", "weights"), planted, marker)
    assert line == (f"rankmix: error: {planted}: refused to load: it names posix.system, which a DCP checkpoint's "
                    "metadata never holds (a crafted file would run it). Load checkpoints only from sources you "
                    "trust; see README, Trust")
    data = next((run.parent / "data").iterdir())
    refused(rankmix("train", *TRAIN, f"--train.run_dir={copied}", f"--data.cache_dir={run.parent / 'data'}"),
            planted, marker)
    refused(rankmix("score", "--checkpoint", str(copied), "--data", str(data / "valid"),
                    "--out", str(tmp_path / "scores")), planted, marker)


def test_a_planted_value_is_refused(run, tmp_path):
    """A well-formed .metadata whose `ranks` value (per-rank state) is a pickle that runs code."""
    copied, marker = copy_run(run, tmp_path), tmp_path / "ran"
    step = copied / "checkpoints" / "step-4"
    metadata = pickle.loads((step / ".metadata").read_bytes())  # the test's own file: trusted
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    (step / "planted.distcp").write_bytes(buffer.getvalue())
    metadata.storage_data[MetadataIndex("ranks")] = _StorageInfo("planted.distcp", 0, len(buffer.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    line = refused(rankmix("train", *TRAIN, f"--train.run_dir={copied}", f"--data.cache_dir={run.parent / 'data'}"),
                   step, marker)
    assert "checkpoint value 'ranks' refused: it is not plain data" in line


def test_storage_outside_the_checkpoint_is_refused(run, tmp_path):
    copied = copy_run(run, tmp_path)
    step = copied / "checkpoints" / "step-4"
    metadata = pickle.loads((step / ".metadata").read_bytes())
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = _StorageInfo("../../../../etc/passwd", 0, 10)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeFileError, match=r"\.metadata: refused: it names '\.\./\.\./\.\./\.\./etc/passwd', "
                                              r"which is not a file inside"):
        manager.model_tensors(step)


def test_planted_best_weights_are_refused(run, tmp_path):
    """The best-weights folder goes through the same reader as resume (ModelSelection.restore)."""
    marker, best = tmp_path / "ran", tmp_path / "best.step-2"
    shutil.copytree(run / "checkpoints" / "step-2", best)
    (best / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    swap_folder(tmp_path / "best", best)
    with pytest.raises(UnsafeFileError, match=r"refused to load: it names posix.system"):
        manager.load(tmp_path / "best", {"model": {}})
    assert not marker.exists()


@pytest.fixture(scope="module")
def artifact(run, made_once) -> Path:
    def make(folder: Path) -> None:
        proc = rankmix("export", "--checkpoint", str(run), "--out", str(folder / "export"))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return made_once("trust-export", make) / "export"


def test_manifest_paths_stay_inside_the_artifact(run, artifact, tmp_path):
    data = next((run.parent / "data").iterdir()) / "valid"
    for name in ("../export/model.pt2", str(artifact / "model.pt2")):
        copied = tmp_path / f"copy-{len(name)}"
        shutil.copytree(artifact, copied)
        manifest = json.loads((copied / "manifest.json").read_text())
        (copied / "manifest.json").write_text(json.dumps({**manifest, "file": name}))
        proc = rankmix("score", "--model", str(copied), "--data", str(data), "--out", str(tmp_path / "s"))
        refused(proc, copied / "manifest.json", tmp_path / "never")
        assert f"it names {name!r}, which is not a file inside {copied}" in proc.stderr


def test_a_pickled_payload_in_a_pt2_artifact_is_refused(run, artifact, tmp_path):
    """torch.export.load unpickles the sample inputs (weights-only): their pickle is scanned first."""
    marker, copied = tmp_path / "ran", tmp_path / "copy"
    shutil.copytree(artifact, copied)
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    source, target = artifact / "model.pt2", copied / "model.pt2"
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            planted = item.filename.endswith("data/sample_inputs/model.pt")
            new.writestr(item, buffer.getvalue() if planted else old.read(item))
    data = next((run.parent / "data").iterdir()) / "valid"
    proc = rankmix("score", "--model", str(copied), "--data", str(data), "--out", str(tmp_path / "s"))
    line = refused(proc, target, marker)
    assert "refused: sample inputs whose pickle holds GLOBAL posix system at byte 2" in line


def test_score_refuses_an_opaque_object_planted_in_upper_case(run, artifact, tmp_path):
    """The review's finding 1, as it ran: `rankmix score --model` on an export with an upper-case
    OPAQUE_OBJ_0 pickle named as an opaque object in model_constants_config.json (more of these
    in tests/test_trust_pt2.py)."""
    marker, copied = tmp_path / "ran", tmp_path / "copy"
    shutil.copytree(artifact, copied)
    source, target = artifact / "model.pt2", copied / "model.pt2"
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            data = old.read(item)
            if item.filename.endswith("data/constants/model_constants_config.json"):
                config = json.loads(data)
                config["config"]["planted"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                                               "tensor_meta": None}
                data = json.dumps(config).encode()
            new.writestr(item, data)
        top = item.filename.split("/")[0]
        new.writestr(f"{top}/data/constants/OPAQUE_OBJ_0", pickle.dumps(Payload(marker)))
    data = next((run.parent / "data").iterdir()) / "valid"
    proc = rankmix("score", "--model", str(copied), "--data", str(data), "--out", str(tmp_path / "s"))
    line = refused(proc, target, marker)
    assert line == (f"rankmix: error: {target}: refused: an entry '{top}/data/constants/OPAQUE_OBJ_0', which no "
                    "rankmix export holds (loading it could run code or touch files); see README, Trust")
    assert not (tmp_path / "s").exists()


def test_per_rank_state_round_trips_as_json():
    """Python's, NumPy's and torch's RNG states and nested containers come back equal, types
    included (random.setstate needs tuples); nothing else is accepted."""
    import random

    import numpy as np
    state = [{"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
              "reader": {"epoch": 1, "step": 7, "shuffle": True, "lr": [0.5, float("inf")]}}]
    back = decode_state(encode_state(state), "x")
    random.setstate(back[0]["rng"]["python"])
    np.random.set_state(back[0]["rng"]["numpy"])
    assert back[0]["rng"]["python"] == state[0]["rng"]["python"]
    assert torch.equal(back[0]["rng"]["torch"], state[0]["rng"]["torch"])
    assert np.array_equal(back[0]["rng"]["numpy"][1], state[0]["rng"]["numpy"][1])
    assert back[0]["reader"] == state[0]["reader"]
    with pytest.raises(ValueError,
                       match=r"^x is not rankmix's per-rank state \(ValueError: an array of dtype object\)"):
        decode_state('{"list": [{"numpy": {"dtype": "|O", "shape": [1], "data": ""}}]}', "x")


# ----------------------------------------------------------------------------- one run per folder


def test_a_second_run_in_a_held_folder_stops_naming_the_holder(run, tmp_path):
    copied = copy_run(run, tmp_path)
    holder = RunLock(copied)
    holder.acquire()
    try:
        config_before = (copied / "config.toml").read_text()
        proc = rankmix("train", *TRAIN, f"--train.run_dir={copied}", f"--data.cache_dir={run.parent / 'data'}",
                       "--data.batch_size=128")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"rankmix: error: {copied} is in use by another run (host {holder.holder['host']}, pid {os.getpid()}, "
            f"started {holder.holder['started']}): give this run a folder of its own (--train.run_dir).")
        assert (copied / "config.toml").read_text() == config_before
    finally:
        holder.release()
    assert not (copied / LOCK_FILE).exists()


def test_a_dead_holder_on_this_host_is_taken_over(run, tmp_path):
    """A lock left by a killed run; a failed resume then leaves config.toml as it was."""
    copied = copy_run(run, tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = RunLock(copied)
    (copied / LOCK_FILE).write_text(json.dumps({**lock.holder, "pid": dead.pid}))
    config_before = (copied / "config.toml").read_text()
    proc = rankmix("train", *TRAIN, f"--train.run_dir={copied}", f"--data.cache_dir={run.parent / 'data'}",
                   "--data.batch_size=128")
    assert f"rankmix: warning: taking over {copied / LOCK_FILE}: its holder, pid {dead.pid} on this host, is gone" \
        in proc.stderr
    assert proc.returncode == 2, proc.stderr[-2000:]  # the batch size differs from the checkpoint's
    assert "data reader state was saved with batch_size=256 but this run has batch_size=128" in proc.stderr
    assert (copied / "config.toml").read_text() == config_before
    assert not (copied / LOCK_FILE).exists()  # released by the failed run


def test_a_lock_from_another_host_holds_until_it_goes_stale(tmp_path):
    lock = RunLock(tmp_path)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
    with pytest.raises(ValueError, match=r"in use by another run \(host elsewhere, pid 1, started then\).*"
                                         r"taken over once it has not been refreshed for 10 minutes"):
        lock.acquire()
    old = os.stat(tmp_path / LOCK_FILE).st_mtime - 3600
    os.utime(tmp_path / LOCK_FILE, (old, old))
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == lock.holder
    lock.release()


def test_best_is_swapped_by_a_rename(tmp_path):
    """`best` always names a whole folder: the new one is complete before the link moves."""
    for step in (3, 5):
        folder = tmp_path / f"best.step-{step}"
        folder.mkdir()
        write_atomic(folder / "weights", str(step))
        swap_folder(tmp_path / "best", folder)
        assert (tmp_path / "best" / "weights").read_text() == str(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "best.step-5"]


@pytest.mark.parametrize("fmt, says", [("pt2", "A pt2 file of `rankmix export` is data"),
                                       ("torchscript", "A TorchScript file is a program: `torch.jit.load` runs")])
def test_the_artifact_readme_says_what_loading_trusts(tmp_path, fmt, says):
    from trainer.config_loader import load_config
    from trainer.serving.readme import write_readme

    manifest = {"tower": "rankmixer", "step": 4, "checkpoint": "runs/x", "format": fmt, "tables": "fp32",
                "moe": "sparse", "needs_fbgemm": False, "file": "model.pt2" if fmt == "pt2" else "model.pt"}
    write_readme(tmp_path / "README.md", load_config("configs/debug.toml", []), manifest)
    assert says in (tmp_path / "README.md").read_text()
