r"""`rankmix`: train, and convert or generate data.

    rankmix train [--config F.toml] [--section.key=value ...]
    rankmix launch [--nproc-per-node N] [--nnodes N|MIN:MAX --node-rank I --master-addr H] [--max-restarts N] \
        [--config F.toml] [--section.key=value ...]
    rankmix export --checkpoint RUN_OR_STEP_DIR --out DIR [--format pt2|torchscript|weights] \
        [--tables fp32|fp16|int8|int4] [--moe sparse|dense] [--section.key=value ...]
    rankmix score (--checkpoint RUN_OR_STEP_DIR | --model EXPORT_DIR) --data FILES --out DIR [--config F.toml] \
        [--batch-size N] [--keep COLS|*] [--section.key=value ...]
    rankmix publish apply --base PUBLISHED_DIR --delta PUBLISHED_DIR_OR_DELTA_PT --out DIR
    rankmix sweep --config F.toml --out DIR --tower NAME [--tower NAME ...] --grid section.key=v1,v2 ... \
        [--tower-grid TOWER:section.key=v1,v2] [--seeds N] [--set section.key=value] [--baseline-tower logreg]
    rankmix study [--config F.toml] --out DIR --tower NAME [--tower NAME ...] [--tower-set TOWER:section.key=value] \
        [--tower-grid TOWER:section.key=v1,v2] [--seeds 3] [--baseline TOWER] [--reference TOWER]
    rankmix plan --config F.toml --world-size N [--device cuda|cpu] [--hbm-gb G] [--ddr-gb G] \
        [--local-world-size N] [--section.key=value ...]
    rankmix doctor
    rankmix data synth --out DIR [--rows N] [--files N] [--seed N] [--teacher default|capacity|sequence|recency] \
        [--days N --drift D]
    rankmix data movielens --src ML100K_DIR --out DIR
    rankmix data criteo --src DAY_FILES... --out DIR [--workers N] [--strict] [--rows-per-file N] \
        [--row-group-size N]
    rankmix data csv --src FILES... --out DIR --label COL [--categorical COLS] [--numeric COLS] \
        [--drop COLS] [--delimiter C] [--workers N] [--strict] [--rows-per-file N] [--row-group-size N]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, get_args

from trainer.config import SynthTeacherName
from trainer.config_loader import describe, load_config
from trainer.credentials import redact_uri
from trainer.errors import BAD_INPUT, RankmixError
from trainer.run_layout import CONFIG, find_config

# Commands import the rest on use: `rankmix --help` answers in under 0.1 s, where torch and
# TorchRec take seconds to import and numpy or pyarrow a tenth of one, and the `rankmix data`
# converters need no torch.

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}; see `rankmix --help`")
        return COMMANDS[command](rest)
    except (ValueError, RankmixError) as e:  # one clear line, no traceback; exit codes: trainer/errors.py
        if os.environ.get("RANKMIX_TRACEBACK"):
            raise
        kind = "error" if isinstance(e, ValueError) else "stopped"
        print(f"rankmix: {kind}: {redact_uri(str(e))}", file=sys.stderr)  # a safety net: raisers redact too
        return BAD_INPUT if isinstance(e, ValueError) else e.exit_code


def recorded(command):
    """`command` under torch elastic's `record`: under torchrun or torchx, a rank's failure
    (handled or not) goes to the error file the agent reads, so its report shows the real
    message instead of `error_file: <N/A>`. Imported on use: it pulls in torch."""
    def run(argv: list[str]) -> int:
        if "-h" in argv or "--help" in argv:  # help needs no torch: it answers at once
            return command(argv)
        from torch.distributed.elastic.multiprocessing.errors import record  # on use: torch
        return record(command)(argv)
    return run


OVERRIDES_ENV = "RANKMIX_OVERRIDES"


def config_args(argv: list[str], environment: bool = True) -> tuple[str | None, list[str]]:
    """(--config file, ['--section.key=value', ...]) from train-style arguments, followed by
    those in $RANKMIX_OVERRIDES, which come last and so win: a way to change every run a
    script or a README block starts (the README test shortens them all with it)."""
    config_path, overrides = None, []
    it = iter([*argv, *shlex.split(os.environ.get(OVERRIDES_ENV, "") if environment else "")])
    for arg in it:
        if arg == "--config":
            config_path = next(it, None)
            if config_path is None:
                raise ValueError("--config needs a file")
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif arg.startswith("--") and "=" not in arg:
            value = next(it, None)
            if value is None:
                raise ValueError(f"option {arg} needs a value")
            overrides.append(f"{arg}={value}")
        else:
            overrides.append(arg)
    return config_path, overrides


def train(argv: list[str]) -> int:
    """Parse --config and overrides, train, print the summary as the last line (rank 0)."""
    if "-h" in argv or "--help" in argv:
        print("rankmix train [--config F.toml] [--section.key=value ...]\n\n"
              f"${OVERRIDES_ENV}: more --section.key=value options, applied after these.\n\nOptions:")
        print("\n".join(describe()))
        return 0
    cfg = load_config(*config_args(argv))
    from trainer.run import train as train_run  # on use: torch and TorchRec

    summary = train_run(cfg)
    if summary is not None:
        print(json.dumps(summary), flush=True)
    return 0


def launch(argv: list[str]) -> int:
    """`rankmix train` on several processes of this node (or of several nodes) via torchrun."""
    parser = argparse.ArgumentParser(prog="rankmix launch", description="the rest goes to `rankmix train`")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--nnodes", default="1", help="hosts, or an elastic range MIN:MAX (c10d rendezvous at "
                        "--master-addr:--master-port; needs --max-restarts)")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--max-restarts", type=int, default=0)
    args, train_args = parser.parse_known_args(argv)
    options = torchrun_args(args)
    # on use: torch
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun  # on use: torch

    try:
        torchrun([*options, "-m", "launch.cli", "train", *train_args])
    except ChildFailedError as e:  # the ranks' error files, summarised; the first rank's code passed on
        rank, failure = _first_failure(e.failures)
        print(f"{e}\nrankmix: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as e:  # torchrun passed the signal on to the ranks, which saved and stopped
        print(f"rankmix: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


def _first_failure(failures: dict) -> tuple[int, Any]:
    """The rank whose failure came first, of those that failed by themselves: a rank that torchrun
    stopped (a negative exit code, its signal) after another failed carries no error of its own,
    and the clock torchrun stamps it with may read earlier than the failed rank's error file."""
    own = {rank: failure for rank, failure in failures.items() if failure.exitcode > 0} or failures
    rank = min(own, key=lambda r: (own[r].timestamp, r))
    return rank, own[rank]


def nodes_range(nnodes: str, restarts: int, option: str = "--nnodes", restarts_option: str = "--max-restarts") \
        -> tuple[int, int]:
    """(min, max) hosts of `nnodes`, N or an elastic range MIN:MAX; ValueError naming `option`
    where it is neither, or a range has no `restarts` (torchrun restarts the ranks on the hosts
    left, and the run resumes from its newest checkpoint at the new world size)."""
    low, sep, high = str(nnodes).partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ValueError(f"{option} {nnodes}: give a number of hosts N, or an elastic range MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{option} {nnodes}: hosts must be at least 1, and MIN at most MAX")
    if lo < hi and restarts < 1:
        raise ValueError(f"{option} {nnodes} is elastic: give {restarts_option} N (at least 1), the times torchrun "
                         "restarts the ranks when hosts leave or join")
    return lo, hi


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """torchrun's options for `rankmix launch`: standalone on one host, a static rendezvous at
    --master-addr for a fixed number of hosts, c10d's there for an elastic range."""
    if args.nproc_per_node < 1:
        raise ValueError("--nproc-per-node must be at least 1")
    low, high = nodes_range(args.nnodes, args.max_restarts)
    endpoint = [f"{args.master_addr}:{args.master_port}"]
    rendezvous = (["--standalone"] if high == 1 else
                  ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                   "--master-port", str(args.master_port)] if low == high else
                  ["--rdzv-backend", "c10d", "--rdzv-endpoint", *endpoint, "--rdzv-id", "rankmix"])
    return ["--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node),
            "--max-restarts", str(args.max_restarts), *rendezvous]


def export(argv: list[str]) -> int:
    """A checkpoint as a serving artifact that plain PyTorch loads (trainer/serving/), or as
    whole-tensor weights (--format weights: one torch.save file)."""
    parser = argparse.ArgumentParser(prog="rankmix export", epilog="other --section.key=value options override "
                                     "the run's config")
    parser.add_argument("--checkpoint", required=True, help="a step-N folder, or a run folder (newest)")
    parser.add_argument("--out", required=True, help="the artifact's folder (--format weights: a file)")
    parser.add_argument("--format", default="pt2", help="pt2 (torch.export) | torchscript | weights")
    parser.add_argument("--tables", help="fp32 (default) | fp16 | int8 | int4 (TorchRec quantized tables)")
    parser.add_argument("--moe", help="sparse: the inference router's experts only | dense: the training router, "
                        "every expert (default: the run's model.moe.inference)")
    args, rest = parser.parse_known_args(argv)
    from trainer.serving.export import FORMATS  # on use: torch and TorchRec

    if args.format not in (*FORMATS, "weights"):
        raise ValueError(f"--format must be one of {'|'.join(FORMATS)}|weights, got {args.format!r}")
    if args.format == "weights":
        ignored = [o for o, v in (("--tables", args.tables), ("--moe", args.moe)) if v] + rest
        if ignored:
            raise ValueError(f"--format weights writes the checkpoint's tensors as they are; it takes no {ignored}")
        from trainer.checkpoint.manager import export_weights  # on use: torch

        if Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a folder; --format weights writes one file")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"tensors": export_weights(args.checkpoint, args.out), "out": args.out}))
        return 0
    # on use: torch and TorchRec
    from trainer.serving.export import export as export_artifact

    config_path, overrides = config_args(rest)
    cfg = load_config(config_path or str(find_config(args.checkpoint)), overrides, allow_redacted=True)
    manifest = export_artifact(cfg, args.checkpoint, args.out, args.format, args.tables or "fp32", args.moe)
    print(json.dumps({**manifest, "out": args.out}))
    return 0


def publish(argv: list[str]) -> int:
    """`publish apply`: the next full artifact from a published base and a delta (trainer/serving/publish.py)."""
    parser = argparse.ArgumentParser(prog="rankmix publish")
    sub = parser.add_subparsers(dest="action", required=True)
    a = sub.add_parser("apply", help="the next full artifact from a published one and the delta after it")
    a.add_argument("--base", required=True, help="a published artifact's folder (with tables.pt)")
    a.add_argument("--delta", required=True, help="the next published folder, or its delta.pt")
    a.add_argument("--out", required=True, help="the new artifact's folder")
    args = parser.parse_args(argv)
    from trainer.serving.publish import apply  # on use: torch and TorchRec

    manifest = apply(args.base, args.delta, args.out)
    print(json.dumps({**manifest, "out": args.out}))
    return 0


def score(argv: list[str]) -> int:
    """Predictions of a trained checkpoint, or of a serving artifact, for Parquet files, one
    output file per input."""
    parser = argparse.ArgumentParser(prog="rankmix score", epilog="other --section.key=value options override "
                                     "the run's config (e.g. --model.moe.inference=dense)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a step-N folder, or a run folder (newest)")
    source.add_argument("--model", help="a serving artifact's folder (rankmix export)")
    parser.add_argument("--data", required=True, help="Parquet files, folders, globs or URIs (comma-separated)")
    parser.add_argument("--out", required=True, help="folder for the scored files")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--keep", default="", help="comma-separated input columns to copy (*: all); "
                        "labels and the user column are kept when present")
    args, rest = parser.parse_known_args(argv)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    # on use: torch and TorchRec
    from trainer.dist import shutdown
    from trainer.score import CheckpointModel, Scorer

    config_path, overrides = artifact_config(args.model, rest) if args.model else config_args(rest)
    # scoring reads --data, never the run's data paths: their redacted credentials may stay so
    cfg = load_config(config_path or str(find_config(args.checkpoint)), overrides, allow_redacted=True)
    keep = [c.strip() for c in args.keep.split(",") if c.strip()]
    try:
        if args.model:
            from trainer.serving.predict import ArtifactModel  # on use: torch and TorchRec
            model = ArtifactModel(args.model, cfg.features, cfg.data.time_column, cfg.data.request_column)
        else:
            model = CheckpointModel(cfg, args.checkpoint)
        summary = Scorer(cfg, model).score(args.data, args.out, args.batch_size, keep)
    finally:
        shutdown()
    print(json.dumps(summary), flush=True)
    return 0


SCORING_OPTIONS = ("--data.", "--metrics.")  # what `score --model` may change: reading, not the model


def artifact_config(folder: str, argv: list[str]) -> tuple[str, list[str]]:
    """(config file, overrides) of `score --model folder`: the artifact's own config.toml, its
    input contract, with only SCORING_OPTIONS changed (those of $RANKMIX_OVERRIDES, which is
    for every command, are dropped; those given here are refused)."""
    given_path, given = config_args(argv, environment=False)
    changed = [f"--config {given_path}"] if given_path else []
    changed += [o for o in given if not o.startswith(SCORING_OPTIONS)]
    if changed:
        raise ValueError(f"--model {folder} carries its own features, tasks and model; only "
                         f"{'/'.join(p + '*' for p in SCORING_OPTIONS)} options apply to it, not {changed}")
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ValueError(f"--model {folder}: no {CONFIG} there (not a `rankmix export` folder)")
    return str(path), [o for o in config_args(argv)[1] if o.startswith(SCORING_OPTIONS)]


def data(argv: list[str]) -> int:
    """Dataset generators and converters."""
    parser = argparse.ArgumentParser(prog="rankmix data")
    sub = parser.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("synth", help="synthetic logs with a hidden teacher")
    s.add_argument("--out", required=True)
    s.add_argument("--rows", type=int, default=200_000)
    s.add_argument("--files", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--teacher", choices=get_args(SynthTeacherName), default="default",
                   help="capacity: high-order crosses over 16 Zipf fields and a behaviour sequence "
                        "(trainer/offline/capacity.py), streamed in bounded memory; sequence: clicks from the recent "
                        "behaviours that resemble the candidate, with timestamps (trainer/offline/sequence_log.py)")
    s.add_argument("--days", type=int, default=0, help="write N day partitions date=YYYY-MM-DD/ of --rows rows "
                   "each, from a drifting teacher (default teacher only; docs/continuous.md)")
    s.add_argument("--drift", type=float, default=0.0, help="with --days: share of the teacher's users' and "
                   "items' weights and item popularity ranks that move each day")
    m = sub.add_parser("movielens", help="MovieLens-100K (RecBole layout) to Parquet")
    m.add_argument("--src", required=True)
    m.add_argument("--out", required=True)
    for name, doc in (("criteo", "Criteo 1TB day_N TSV (.gz too) to Parquet"),
                      ("csv", "CSV logs with a header (e.g. Avazu) to Parquet")):
        c = sub.add_parser(name, help=doc)
        c.add_argument("--src", required=True, nargs="+", help="input files")
        c.add_argument("--out", required=True)
        c.add_argument("--workers", type=int, default=1, help="processes, one input file each")
        c.add_argument("--strict", action="store_true", help="fail on the first malformed row")
        c.add_argument("--rows-per-file", type=int, default=0, help="split outputs (0: one part per input)")
        c.add_argument("--row-group-size", type=int, default=65_536)
        if name == "csv":
            c.add_argument("--label", required=True)
            c.add_argument("--categorical", default="", help="comma-separated (default: all other columns)")
            c.add_argument("--numeric", default="", help="comma-separated")
            c.add_argument("--drop", default="", help="comma-separated")
            c.add_argument("--delimiter", default=",")
    args = parser.parse_args(argv)
    if args.kind in ("criteo", "csv"):
        common = dict(workers=args.workers, strict=args.strict, rows_per_file=args.rows_per_file,
                      row_group_size=args.row_group_size)
        if args.kind == "criteo":
            from trainer.offline.criteo import convert_criteo  # on use: pyarrow
            summary = convert_criteo(args.src, args.out, **common)
        else:
            from trainer.offline.csvlog import convert_csv  # on use: pyarrow

            def cols(text: str) -> list[str]:
                return [c.strip() for c in text.split(",") if c.strip()]
            summary = convert_csv(args.src, args.out, label=args.label, categorical=cols(args.categorical),
                                  numeric=cols(args.numeric), drop=cols(args.drop), delimiter=args.delimiter,
                                  **common)
    elif args.kind == "synth":
        from trainer.data.datasets import SYNTH_TEACHERS  # on use: torch (datasets' process group)
        from trainer.offline.synth import write_days as synth_days  # on use: pyarrow
        if args.days and args.teacher != "default":
            raise ValueError(f"--days: only the default teacher drifts, not --teacher {args.teacher}")
        if args.drift and not args.days:
            raise ValueError("--drift needs --days: a single log does not drift")
        summary = (synth_days(args.out, days=args.days, drift=args.drift, rows=args.rows, files=args.files,
                              seed=args.seed) if args.days else
                   SYNTH_TEACHERS[args.teacher].write(args.out, rows=args.rows, files=args.files, seed=args.seed))
    else:
        from trainer.offline.movielens import convert_movielens  # on use: pyarrow
        summary = convert_movielens(args.src, args.out)
    print(json.dumps(summary, default=str))
    return 0



def plan(argv: list[str]) -> int:
    """Whether a config fits a cluster: sharding plan, per-rank memory, all-to-all bytes."""
    parser = argparse.ArgumentParser(prog="rankmix plan", epilog="other --section.key=value options override "
                                     "the config; nothing is allocated")
    parser.add_argument("--config", help="TOML config to plan (default: the embedded default)")
    parser.add_argument("--world-size", type=int, required=True, help="devices (ranks) in all")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--hbm-gb", type=float, default=0.0, help="memory per GPU")
    parser.add_argument("--ddr-gb", type=float, default=512.0, help="host memory per rank")
    parser.add_argument("--local-world-size", type=int, default=0, help="ranks per host (default: 8, or fewer)")
    args, rest = parser.parse_known_args(argv)
    from launch.plan import plan_cluster  # on use: torch and TorchRec

    config = ["--config", args.config] if args.config else []
    cfg = load_config(*config_args([*config, *rest]), allow_redacted=True)  # plans read no data
    local = args.local_world_size or min(args.world_size, 8)
    result = plan_cluster(cfg, args.world_size, args.device, args.hbm_gb, args.ddr_gb, local)
    print(result.text)
    return 0 if result.fits else 1


def doctor(argv: list[str]) -> int:
    """Whether this machine's torch, CUDA, NCCL, FBGEMM and TorchRec train (launch/doctor.py)."""
    from launch.doctor import doctor as run_doctor  # on use: torch
    return run_doctor(argv)


def sweep(argv: list[str]) -> int:
    """Scaling curves (launch/sweep.py)."""
    from launch.sweep import sweep as run_sweep  # on use: numpy (torch once it checks the grid)
    return run_sweep(argv)


def study(argv: list[str]) -> int:
    """Towers compared under the early-stopping protocol, paired over seeds (launch/study.py)."""
    from launch.study import study as run_study  # on use: numpy (torch once it checks the runs)
    return run_study(argv)


COMMANDS = {"train": recorded(train), "launch": launch, "export": export, "score": score, "sweep": sweep,
            "study": study, "data": data, "plan": plan, "doctor": doctor, "publish": publish}

if __name__ == "__main__":
    sys.exit(main())
