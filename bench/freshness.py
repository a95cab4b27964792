"""How fresh a published model is: a run that publishes every N steps (`publish.every_steps`),
timed from each publish's manifest (trainer/serving/publish.py).

    .venv/bin/python bench/freshness.py [--small] [--config F.toml] [--every N] [--publishes K] \
        [--ranks R] [--set section.key=value ...]

Prints one line of JSON, medians over the publishes that have a delta (all but the first):
`train_s`, the training between two publishes (N steps, with their logging); `publish_s`, from
the step's end to its published artifact, and its parts (`save`: the weights gathered and
saved, `artifact`: read back, traced and written, `delta`: the changed rows found and
written); `data_to_artifact_s`, their sum: how old the newest data is in the newest artifact;
and `delta_over_full`, delta.pt's bytes over the model file's. `--small` is a seconds-long
run for the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.run_layout import RunFolder

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/synth.toml")
    parser.add_argument("--every", type=int, default=50, help="steps between publishes")
    parser.add_argument("--publishes", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="2 publishes of 3 steps on 4000 rows")
    parser.add_argument("--set", action="append", default=[], help="a config override (section.key=value)")
    args = parser.parse_args()
    if args.small:
        args.every, args.publishes, args.set = 3, 2, ["data.synth_rows=4000", *args.set]
    if args.every < 1 or args.publishes < 2:
        parser.error("--every must be at least 1 and --publishes at least 2 (the first publish has no delta)")
    with tempfile.TemporaryDirectory(prefix="freshness-") as tmp:
        publish = train(args, Path(tmp))
        print(json.dumps(summary(publish, args.every)))


def train(args: argparse.Namespace, folder: Path) -> Path:
    """Run the training; returns its publish folder."""
    command = ["train"] if args.ranks == 1 else ["launch", "--nproc-per-node", str(args.ranks)]
    options = ["--config", args.config, f"--train.run_dir={folder}/run", f"--data.cache_dir={folder}/cache",
               f"--train.steps={args.every * args.publishes}", f"--publish.every_steps={args.every}",
               f"--metrics.log_every={args.every}", "--metrics.progress=false", "--metrics.tensorboard=false",
               "--checkpoint.enabled=false", *(f"--{o}" for o in args.set)]
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *command, *options], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stderr[-3000:]}")
    return RunFolder(folder / "run").publish


def summary(publish: Path, every: int) -> dict:
    """The medians of the publishes that have a delta (see the module docstring)."""
    infos = sorted((json.loads((p / "manifest.json").read_text())["publish"] for p in publish.glob("step-*")),
                   key=lambda info: info["step"])
    rows = []
    for before, info in zip(infos, infos[1:]):
        parts = info["seconds"]
        publish_s = sum(parts.values())
        train_s = info["published_at"] - before["published_at"] - publish_s
        rows.append({"train_s": train_s, "publish_s": publish_s, **{f"{k}_s": v for k, v in parts.items()},
                     "data_to_artifact_s": train_s + publish_s, "delta_over_full": info["delta_over_full"]})
    return {"steps_per_publish": every, "publishes": len(infos),
            **{key: statistics.median(r[key] for r in rows) for key in rows[0]}}


if __name__ == "__main__":
    main()
