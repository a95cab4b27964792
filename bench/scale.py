"""Scale rehearsal: the largest run one 2-core, 24 GiB machine holds, as one table (not a test).

Every figure comes with a ratio to its limit, measured in the same run (docs/scale.md):

- data: a generated log (numpy in a pool of 2 processes, pyarrow's writer, many files) whose
  ids are Zipf ranks scattered over a space of 2^40 values, into `hashing = "modulo"` tables
  of dim 8 (`--table-rows` in all) with row-wise Adagrad, sharded row-wise. The config is a
  TOML written next to the data, so every stage runs the real `rankmix` commands.
- loader: one `ParquetReader` pass over the training files, unshuffled and shuffled, each
  in a fresh process with malloc tuned as training's (trainer/dist.py `tune_malloc`), against
  pyarrow's bare `iter_batches` of the same files and columns;
  peak RSS (VmHWM) at 10%, 50% and 100% of each pass.
- training: `rankmix launch` on 4 gloo ranks for `--steps` steps, an async save halfway
  and at the end; then 2 ranks resume it (DCP reshards; the epoch's rows left are split over
  the 2 ranks, trainer/data/elastic.py) for `--resume-steps` more and save synchronously.
  Each rank's peak RSS (VmHWM of the rank processes, sampled from /proc) against
  `rankmix plan --device cpu` for the same config.
- checkpoint: each save's GB/s (the step's log time to `.metadata`'s mtime, which DCP writes
  last) and a DCP load of the model (`trainer.checkpoint.manager.model_tensors`) against this disk's
  sequential write (fsync'd) and read of a file of the checkpoint's size. Before every timed
  read the files are fsync'd and dropped from the page cache (posix_fadvise DONTNEED: no
  root needed; pages another process maps stay).
- evaluation: 2 ranks with no step left evaluate the held-out files in full; their peak RSS
  against the resumed training's.
- export: `rankmix export --tables int8` of the trained model: size and time.
- RankMixer: the product's tower (T16 D256, 2 blocks) on the same log and tables, 4 ranks for
  `--rankmixer-steps`: rows/s beside the MLP's, MFU (3 x its forward FLOPs a row x rows/s
  against this machine's 2048^3 matmul on every core), rank 0's step split (bench/e2e.py's
  parts under torchrun: data, lookup with its fused update, tokenizer, tower, heads and loss,
  gradient check, optimizer, all-reduce) and each rank's peak RSS against the plan.

    python bench/scale.py [--small] [--rows N] [--table-rows N] [--steps N] [--resume-steps N] \
        [--loader-rows N] [--rankmixer-steps N] [--split-rounds N] [--tmp DIR] [--keep] [--data DIR]

The full rehearsal (the defaults) writes about 13 GB; the data is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer.run_layout import COMPLETE, RunFolder

ROOT = Path(__file__).resolve().parents[1]
GB = 2**30
ID_SPACE = 2**40
# (column, Zipf exponent, share of --table-rows): users and items dominate, as in a real log
ID_COLUMNS = (("user_id", 1.1, 0.5), ("item_id", 1.05, 0.4), ("query_id", 1.2, 0.08), ("page_id", 1.5, 0.02))
# float32 counters and rates, as a log carries many (Criteo: 13): with the ids, about 65 bytes a row of Parquet
NUMERIC_COLUMNS = tuple(f"dense_{i}" for i in range(8))
ROW_GROUP = 262_144  # larger than the reader's 65,536-row slice: the slicing runs
PRESETS = {
    "full": dict(rows=200_000_000, files=200, table_rows=100_000_000, steps=3000, resume_steps=500,
                 batch_size=2048, loader_rows=0, rankmixer_steps=60, split_rounds=3),
    "small": dict(rows=300_000, files=6, table_rows=400_000, steps=40, resume_steps=10, batch_size=256,
                  loader_rows=0, rankmixer_steps=6, split_rounds=1),
}
BUDGET_S = 45 * 60


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="the same stages in about a minute (the suite's test)")
    for name in ("rows", "files", "table_rows", "steps", "resume_steps", "batch_size", "loader_rows",
                 "rankmixer_steps", "split_rounds"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="default: the preset's")
    p.add_argument("--tmp", help="folder for the data and runs (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the data and runs")
    p.add_argument("--data", help="the data folder of an earlier --keep run (its train/ and eval/): not written again")
    return p


# ---------------------------------------------------------------------- data


def write_file(path: str, rows: int, seed: int) -> int:
    """One Parquet file of `rows` log rows; returns its bytes."""
    rng = np.random.default_rng(seed)
    columns = {}
    for i, (name, exponent, _) in enumerate(ID_COLUMNS):
        ranks = rng.zipf(exponent, rows).astype(np.uint64)
        # an odd multiplier is a bijection of the 2^40 space: popular ranks land anywhere in it
        with np.errstate(over="ignore"):
            columns[name] = ((ranks * np.uint64(0x9E3779B97F4A7C15 + 2 * i)) % np.uint64(ID_SPACE)).astype(np.int64)
    columns["hour"] = rng.integers(0, 24, rows, dtype=np.int64)
    for name in NUMERIC_COLUMNS:
        columns[name] = rng.lognormal(3.0, 1.0, rows).astype(np.float32)
    # the label leans on a few bits of the item and the user, so that the model has something to learn
    logit = ((columns["item_id"] >> 7) & 7) * 0.5 - ((columns["user_id"] >> 5) & 3) * 0.5 - 1.0
    columns["click"] = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    pq.write_table(pa.table(columns), path, row_group_size=ROW_GROUP, compression="snappy")
    return os.path.getsize(path)


def make_data(folder: Path, rows: int, files: int) -> dict:
    """The log in folder/train and folder/eval (its last tenth of files, at least one)."""
    eval_files = max(1, files // 10)
    per_file = -(-rows // files)
    paths = []
    for i in range(files):
        split = "eval" if i >= files - eval_files else "train"
        (folder / split).mkdir(parents=True, exist_ok=True)
        paths.append((str(folder / split / f"part-{i:05d}.parquet"), min(per_file, rows - i * per_file), i))
    t = time.perf_counter()
    with ProcessPoolExecutor(2) as pool:
        sizes = list(pool.map(write_file, *zip(*paths)))
    return {"rows": rows, "bytes": sum(sizes), "files": files, "seconds": time.perf_counter() - t,
            "eval_rows": sum(n for p, n, _ in paths if "/eval/" in p)}


RANKMIXER = {"tower": "rankmixer", "num_tokens": 16, "hidden_dim": 256, "num_layers": 2, "ffn_ratio": 4}
"""The product's tower at issue 43's shape, T16 D256 (2 blocks, FFN ratio 4), beside the MLP."""


def described(folder: Path) -> dict:
    """make_data's figures of a log it wrote earlier (from the Parquet footers; 0 seconds)."""
    paths = sorted(folder.glob("*/*.parquet"))
    rows = {p: pq.ParquetFile(p).metadata.num_rows for p in paths}
    return {"rows": sum(rows.values()), "bytes": sum(p.stat().st_size for p in paths), "files": len(paths),
            "seconds": 0.0, "eval_rows": sum(n for p, n in rows.items() if p.parent.name == "eval")}


def write_config(path: Path, data: Path, table_rows: int, batch_size: int, tower: str = "mlp") -> None:
    """The rehearsal's config: the log's schema, row-wise tables of dim 8, a small MLP (or RANKMIXER)."""
    features = [f'[[features]]\nname = "{name}"\nnum_embeddings = {max(int(table_rows * share), 4)}\n'
                f'embedding_dim = 8\nhashing = "modulo"\ngroup = "{"user" if name == "user_id" else "item"}"\n'
                for name, _, share in ID_COLUMNS]
    features += ['[[features]]\nname = "hour"\nnum_embeddings = 24\nembedding_dim = 8\ngroup = "context"\n']
    features += [f'[[features]]\nname = "{name}"\nkind = "numeric"\ntransform = ["log1p"]\ngroup = "item"\n'
                 for name in NUMERIC_COLUMNS]
    path.write_text(f"""[data]
dataset = "parquet"
train_path = "{data / 'train'}"
eval_path = "{data / 'eval'}"
batch_size = {batch_size}
eval_batch_size = 8192
shuffle_buffer = 65536
user_column = "user_id"

[embeddings]
optimizer = "rowwise_adagrad"
plan = "row_wise"

{_model_section(tower)}
[train]
device = "cpu"
epochs = 1

[checkpoint]
keep = 2

[metrics]
log_every = 10
tensorboard = false
progress = false

""" + "\n".join(features))


def _model_section(tower: str) -> str:
    if tower == "mlp":
        return '[model]\ntower = "mlp"\n\n[model.mlp]\nhidden = [64, 32]\n'
    # the product's tower at its plan's width: model.recipe=auto would narrow it for the small preset's rows
    return '[model]\nrecipe = "rankmix"\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in RANKMIXER.items())


# ---------------------------------------------------------------------- memory


def _status_kb(pid: int, field: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else 0


def _rank_of(pid: int) -> int | None:
    """The RANK torchrun gave process `pid`, if it is a rank of `rankmix train`."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if b"train" not in cmdline:
        return None
    rank = [v[5:] for v in environ if v.startswith(b"RANK=")]
    return int(rank[0]) if rank else None


class RankPeaks:
    """Each rank's peak RSS (VmHWM, MB) among the descendants of `root`, sampled from /proc
    until `stop`: VmHWM only grows, so a sample shortly before a rank exits holds its peak."""

    def __init__(self, root: int):
        self.root, self.peaks, self.done = root, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _descendants(self) -> list[int]:
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        found, frontier = [], [self.root]
        while frontier:
            children = [p for p, parent in parents.items() if parent in frontier]
            found += children
            frontier = children
        return found

    def _run(self) -> None:
        while not self.done.wait(0.2):
            for pid in self._descendants():
                rank = _rank_of(pid)
                if rank is not None:
                    self.peaks[rank] = max(self.peaks.get(rank, 0), _status_kb(pid, "VmHWM") / 1024)

    def stop(self) -> dict[int, float]:
        self.done.set()
        self.thread.join()
        return dict(sorted(self.peaks.items()))


# ---------------------------------------------------------------------- commands


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def rankmix(*args: str, ranks: int = 0) -> tuple[str, float, dict[int, float]]:
    """`rankmix ARGS` (under `launch --nproc-per-node ranks` when ranks): stdout, seconds and
    each rank's peak RSS in MB. A failure stops the rehearsal with the command's output."""
    command = [sys.executable, "-m", "launch.cli",
               *(["launch", "--nproc-per-node", str(ranks), "--master-port", str(_free_port())] if ranks else []),
               *args]
    t = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = RankPeaks(proc.pid)
    out, err = proc.communicate()
    seconds = time.perf_counter() - t
    rss = peaks.stop()
    if proc.returncode:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    return out, seconds, rss


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_host_gb(config: Path, ranks: int, async_save: bool) -> list[float]:
    """`rankmix plan --device cpu`'s host GB of each rank for the config on one node."""
    out, _, _ = rankmix("plan", "--config", str(config), "--world-size", str(ranks), "--local-world-size",
                        str(ranks), "--device", "cpu", "--ddr-gb", str(24 / ranks),
                        f"--checkpoint.async_save={str(async_save).lower()}")
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank  resident GB")) + 1
    return [float(line.split()[-1]) for line in lines[start:start + ranks]]


LOADER = """
import json, re, sys, time
from pathlib import Path
import pyarrow.parquet as pq
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader
from trainer.dist import tune_malloc

tune_malloc()  # as in every process that reads for training (init_distributed)

def hwm():
    return int(re.search(r"^VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024

cfg = load_config({config!r})
encoder = RowEncoder(cfg.features, cfg.model.tasks, cfg.data.user_column)
files, mode = {files!r}, {mode!r}
t = time.perf_counter()
if mode == "raw":
    rows = sum(b.num_rows for f in files for b in
               pq.ParquetFile(f).iter_batches(batch_size=cfg.data.batch_size, columns=encoder.columns))
    print(json.dumps({{"rows": rows, "seconds": time.perf_counter() - t}}))
    sys.exit()
options = ReaderOptions(batch_size=cfg.data.batch_size, shuffle=mode == "shuffled",
                        shuffle_buffer=cfg.data.shuffle_buffer, num_epochs=1)
reader = ParquetReader(",".join(files), encoder, options)
marks, rows, rss = (0.1, 0.5), 0, []
for batch in reader:
    rows += len(batch)
    while marks and rows >= marks[0] * reader.num_rows:
        rss.append(hwm())
        marks = marks[1:]
rss.append(hwm())
print(json.dumps({{"rows": rows, "seconds": time.perf_counter() - t, "rss": rss}}))
"""


def loader_pass(config: Path, files: list[str], mode: str) -> dict:
    code = LOADER.format(config=str(config), files=files, mode=mode)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- disk


def uncached(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (fsync'd first: dirty pages stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_speed(folder: Path, size: int) -> tuple[float, float]:
    """(write, read) GB/s of one file of `size` bytes: written in 64 MiB chunks and fsync'd,
    then read back after dropping it from the page cache."""
    chunk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    path, n = folder / "disk-speed.bin", max(1, -(-size // len(chunk)))
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = n * len(chunk) / GB / (time.perf_counter() - t)
    uncached([path])
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(len(chunk)):
            pass
    read = n * len(chunk) / GB / (time.perf_counter() - t)
    path.unlink()
    return write, read


def save_speed(run: Path, step: int) -> tuple[float, float]:
    """(GB, GB/s) of the save of `step`: from the step's train log record (written just before
    the save starts) to the mtime of the checkpoint's `.metadata` (written last)."""
    folder = RunFolder(run).step(step)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    logged = [json.loads(line) for line in RunFolder(run).metrics.read_text().splitlines()]
    start = max(r["time"] for r in logged if r["step"] == step and r["kind"] == "train")
    return size / GB, size / GB / max((folder / COMPLETE).stat().st_mtime - start, 1e-6)


LOAD = """
import json, time
from pathlib import Path
from trainer.checkpoint.manager import model_tensors
t = time.perf_counter()
tensors = model_tensors(Path({path!r}))
print(json.dumps({{"bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                  "seconds": time.perf_counter() - t}}))
"""


def load_speed(folder: Path) -> dict:
    uncached([p for p in folder.rglob("*") if p.is_file()])
    out = subprocess.run([sys.executable, "-c", LOAD.format(path=str(folder))], cwd=ROOT, env=env(), check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the rehearsal


class Table:
    """The printed table: figure | value | reference | ratio."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, float]] = []

    def add(self, figure: str, value: str, reference: str, ratio: float) -> None:
        self.rows.append((figure, value, reference, ratio))
        print(f"| {figure} | {value} | {reference} | {ratio:.2f} |", file=sys.stderr, flush=True)

    def text(self) -> str:
        lines = ["| figure | value | reference | ratio |", "|---|---|---|---:|"]
        return "\n".join(lines + [f"| {f} | {v} | {r} | {x:.2f} |" for f, v, r, x in self.rows])


def rehearse(args: argparse.Namespace, tmp: Path, table: Table) -> None:
    started = time.perf_counter()
    data, config, run = tmp / "data", tmp / "scale.toml", tmp / "run"
    if args.data:  # a log an earlier run kept (--keep): the same rows, not written again
        data = Path(args.data).resolve()
        made = described(data)
    else:
        made = make_data(data, args.rows, args.files)
    write_config(config, data, args.table_rows, args.batch_size)
    free = shutil.disk_usage(tmp).free + made["bytes"]
    table.add("data: rows (train + eval)", f"{made['rows']:,} in {made['files']} files, ids Zipf over 2^40",
              f"target {PRESETS['full']['rows']:,}", made["rows"] / PRESETS["full"]["rows"])
    written = f"in {made['seconds']:.0f} s" if not args.data else "from an earlier run (--data)"
    table.add("data: Parquet", f"{made['bytes'] / GB:.2f} GB {written}",
              f"free disk {free / GB:.1f} GB", made["bytes"] / free)
    tables = sum(max(int(args.table_rows * share), 4) for _, _, share in ID_COLUMNS) + 24
    table.add("data: table rows (dim 8)", f"{tables:,}", f"target {PRESETS['full']['table_rows']:,}",
              tables / PRESETS["full"]["table_rows"])

    train_files = sorted(str(p) for p in (data / "train").glob("*.parquet"))
    if args.loader_rows:
        per_file = pq.ParquetFile(train_files[0]).metadata.num_rows
        train_files = train_files[:max(1, -(-args.loader_rows // per_file))]
    raw = loader_pass(config, train_files, "raw")
    raw_rate = raw["rows"] / raw["seconds"]
    what = "all training rows" if not args.loader_rows else f"a subset of {len(train_files)} files"
    rates = {}
    for mode in ("unshuffled", "shuffled"):
        res = loader_pass(config, train_files, mode)
        rate = rates[mode] = res["rows"] / res["seconds"]
        table.add(f"loader {mode}: rows/s", f"{rate:,.0f} over {res['rows']:,} rows ({what})",
                  f"raw pyarrow {raw_rate:,.0f}", rate / raw_rate)
        a, b, c = res["rss"]
        table.add(f"loader {mode}: peak RSS at 10/50/100%", f"{a:,.0f} / {b:,.0f} / {c:,.0f} MB",
                  f"at 10%: {a:,.0f} MB", c / a)

    steps, total = args.steps, args.steps + args.resume_steps
    half = max(10, steps // 2 // 10 * 10)  # a log step: the save's start time is in metrics.jsonl
    common = ["--config", str(config), f"--train.run_dir={run}", "--metrics.eval_batches=2",
              "--metrics.log_every=10"]
    plan4, plan2 = plan_host_gb(config, 4, True), plan_host_gb(config, 2, False)
    out, seconds, rss4 = rankmix(*common, f"--train.steps={steps}", "--checkpoint.async_save=true",
                                 f"--checkpoint.interval={half}", ranks=4)
    trained = json.loads(out.strip().splitlines()[-1])["examples_per_sec"]
    table.add("training, 4 ranks: rows/s", f"{trained:,.0f}: {steps} steps x {4 * args.batch_size} rows, "
              f"{seconds:.0f} s in all", f"loader shuffled {rates['shuffled']:,.0f}", trained / rates["shuffled"])
    for rank, mb in rss4.items():
        table.add(f"training, 4 ranks: rank {rank} peak RSS", f"{mb:,.0f} MB", f"plan {plan4[rank]:.2f} GB",
                  mb / 1024 / plan4[rank])
    write_gbs, read_gbs = disk_speed(tmp, int(save_speed(run, steps)[0] * GB))
    for step in (half, steps):
        size, gbs = save_speed(run, step)
        table.add(f"async save at step {step} (4 ranks)", f"{size:.2f} GB at {gbs:.2f} GB/s",
                  f"disk write {write_gbs:.2f} GB/s", gbs / write_gbs)

    out, seconds, rss2 = rankmix(*common, f"--train.steps={total}", ranks=2)
    reread = json.loads(out.strip().splitlines()[-1])["data/rows_reread"]
    table.add("resumed on 2 ranks (resharded)", f"{args.resume_steps} more steps of the same epoch, "
              f"{reread:,} rows read again, {seconds:.0f} s", f"{steps} steps before", args.resume_steps / steps)
    size, gbs = save_speed(run, total)
    table.add(f"sync save at step {total} (2 ranks)", f"{size:.2f} GB at {gbs:.2f} GB/s",
              f"disk write {write_gbs:.2f} GB/s", gbs / write_gbs)
    loaded = load_speed(RunFolder(run).step(total))
    load_gbs = loaded["bytes"] / GB / loaded["seconds"]
    table.add("load of the model (DCP, one process)", f"{loaded['bytes'] / GB:.2f} GB at {load_gbs:.2f} GB/s",
              f"disk read {read_gbs:.2f} GB/s", load_gbs / read_gbs)
    for rank, mb in rss2.items():
        table.add(f"training, 2 ranks: rank {rank} peak RSS", f"{mb:,.0f} MB", f"plan {plan2[rank]:.2f} GB",
                  mb / 1024 / plan2[rank])

    out, seconds, rss_eval = rankmix(*common, f"--train.steps={total}", "--metrics.eval_batches=0", ranks=2)
    summary = json.loads(out.strip().splitlines()[-1])
    table.add("evaluation, 2 ranks: rows/s", f"{made['eval_rows']:,} rows in {seconds:.0f} s (start-up included), "
              f"AUC {summary['auc']:.4f}", f"loader unshuffled {rates['unshuffled']:,.0f}",
              made["eval_rows"] / seconds / rates["unshuffled"])
    for rank, mb in rss_eval.items():
        table.add(f"evaluation, 2 ranks: rank {rank} peak RSS", f"{mb:,.0f} MB",
                  f"training {rss2[rank]:,.0f} MB", mb / rss2[rank])

    out, seconds, _ = rankmix("export", "--checkpoint", str(run), "--out", str(tmp / "export"), "--tables", "int8")
    exported = sum(p.stat().st_size for p in (tmp / "export").rglob("*") if p.is_file())
    table.add("export, int8 tables", f"{exported / GB:.2f} GB in {seconds:.0f} s",
              f"fp32 tables {tables * 8 * 4 / GB:.2f} GB", exported / (tables * 8 * 4))
    rankmixer_stage(args, tmp, data, table, trained)
    elapsed = time.perf_counter() - started
    table.add("whole rehearsal", f"{elapsed / 60:.1f} min", "budget 45 min", elapsed / BUDGET_S)


def step_split(config: Path, rounds: int) -> tuple[dict[str, tuple[float, float]], int]:
    """bench/e2e.py's parts of rank 0's step under torchrun at 4 ranks (the plain loop: the parts
    cannot run inside TorchRec's pipeline): {part: (wall ms, CPU ms)} with "end-to-end", and the
    tower's forward FLOPs per sample."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
               str(_free_port()), "bench/e2e.py", "--config", str(config), "--rounds", str(rounds), "--warmup", "1",
               "--json"]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    split = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: tuple(ms) for name, ms in split["ms"].items()}, split["flops"]


def rankmixer_stage(args: argparse.Namespace, tmp: Path, data: Path, table: Table, mlp_rate: float) -> None:
    """The product's tower (RANKMIXER) on the same log and tables at 4 ranks: rows/s beside the
    MLP's, MFU against this machine's matmul, rank 0's step split, and each rank's peak RSS
    against the plan. No checkpoint: the MLP's stages measure those."""
    config = tmp / "scale_rankmixer.toml"
    shape = "RankMixer T{num_tokens} D{hidden_dim} L{num_layers} k{ffn_ratio}".format(**RANKMIXER)
    write_config(config, data, args.table_rows, args.batch_size, tower="rankmixer")
    plan = plan_host_gb(config, 4, False)
    out, seconds, rss = rankmix("--config", str(config), f"--train.run_dir={tmp / 'run_rankmixer'}",
                                f"--train.steps={args.rankmixer_steps}", "--checkpoint.enabled=false",
                                "--metrics.eval_batches=2", ranks=4)
    rate = json.loads(out.strip().splitlines()[-1])["examples_per_sec"]
    table.add(f"{shape}, 4 ranks: rows/s", f"{rate:,.0f}: {args.rankmixer_steps} steps x {4 * args.batch_size} "
              f"rows, {seconds:.0f} s in all", f"MLP {mlp_rate:,.0f}", rate / mlp_rate)
    parts, flops = step_split(config, args.split_rounds)
    import torch

    from dense.cost import peak_flops

    torch.set_num_threads(os.cpu_count() or 1)
    peak = peak_flops(torch.device("cpu"))  # fp32 products of up to 2048^3 on every core, MFU's reference
    achieved = 3 * flops * rate  # forward and backward: 3x the forward's FLOPs
    table.add(f"{shape}, 4 ranks: MFU", f"{achieved / 1e9:,.1f} GFLOP/s (3 x {flops / 1e6:.1f} MFLOP a row)",
              f"matmul {peak / 1e9:,.1f} GFLOP/s, {os.cpu_count()} cores", achieved / peak)
    total = sum(wall for name, (wall, _) in parts.items() if name != "end-to-end")
    for name, (wall, cpu) in parts.items():
        what = "lookup + fused update" if name == "embedding" else name
        table.add(f"{shape}, step split (rank 0): {what}", f"{wall:,.1f} ms wall, {cpu:,.1f} ms CPU",
                  f"sum of parts {total:,.1f} ms", wall / total)
    for rank, mb in rss.items():
        table.add(f"{shape}, 4 ranks: rank {rank} peak RSS", f"{mb:,.0f} MB", f"plan {plan[rank]:.2f} GB",
                  mb / 1024 / plan[rank])


def main() -> None:
    args = parser().parse_args()
    for key, value in PRESETS["small" if args.small else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    tmp = Path(tempfile.mkdtemp(prefix="rankmix-scale-", dir=args.tmp))
    table = Table()
    try:
        rehearse(args, tmp, table)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    command = " ".join(["python bench/scale.py", *sys.argv[1:]])
    print(f"{command}\n\n{table.text()}")
    if not all(math.isfinite(r[3]) for r in table.rows):
        sys.exit("a ratio is not a finite number")


if __name__ == "__main__":
    main()
