"""What one training step does, counted: ATen ops, host syncs and Python calls per step.

Timings of a small step on a shared machine swing by more than a change of a few percent;
counts do not. The script builds the Trainer of a config, trains --warmup steps, then counts
--steps more whole steps (Trainer.train_step, as bench/e2e.py --towers times them):

    aten ops     operators dispatched (a TorchDispatchMode), of which host syncs: a value read
                 back (`item`, `tolist`) or an output sized by values (nonzero, unique, ...)
    Python calls function calls on the main thread (cProfile), by where the function lives:
                 rankmix (this repository), torch, torchrec + fbgemm, numpy, builtins
    CPU ms       the main thread's CPU time per step (thread_time, untraced; timing, so noisy)

It reads only `load_config`, `build_trainer`, `Trainer.batches` and `Trainer.train_step`, so it also
counts an older checkout: run it there, with that checkout first on the path.

    .venv/bin/python bench/step_counts.py                        # MovieLens, RankMixer
    .venv/bin/python bench/step_counts.py --top 15               # plus rankmix's most called functions
    .venv/bin/python bench/step_counts.py --config configs/debug.toml --set data.synth_rows=4000
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
            aten.repeat_interleave.Tensor}
# read back without an op the dispatcher sees
READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.numpy}
FORCED_SET = ("checkpoint.enabled=false", "metrics.progress=false", "metrics.tensorboard=false")


class ReadCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in READS
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def area(filename: str, repo: Path) -> str:
    """Where a profiled function lives (cProfile names builtins '~')."""
    if filename == "~":
        return "builtins"
    for name, parts in (("torchrec + fbgemm", ("/torchrec/", "/fbgemm_gpu/")), ("torch", ("/torch/",)),
                        ("numpy", ("/numpy/",))):
        if any(p in filename for p in parts):
            return name
    return "rankmix" if Path(filename).resolve().is_relative_to(repo) else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/movielens.toml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override, repeatable")
    parser.add_argument("--steps", type=int, default=20, help="steps counted (each count is per step)")
    parser.add_argument("--warmup", type=int, default=10, help="steps trained first, uncounted")
    parser.add_argument("--top", type=int, default=0, metavar="K", help="also list rankmix's K most called functions")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    from trainer.config_loader import load_config  # the checkout first on the path: this one or an older one
    try:
        from trainer.assembly import build_trainer
    except ImportError:  # a checkout before trainer/assembly.py, whose Trainer built itself
        from trainer.train import Trainer as build_trainer

    import trainer
    repo = Path(trainer.__file__).resolve().parents[1]
    overrides = [f"--{s}"
                 for s in (*args.set, *FORCED_SET, f"train.run_dir={tempfile.mkdtemp(prefix='rankmix-counts-')}")]
    with contextlib.redirect_stdout(io.StringIO()):
        t = build_trainer(load_config(args.config, overrides))
    batches = t.batches()
    for _ in range(args.warmup):
        t.train_step(batches)
    n = args.steps

    with ReadCounter() as reads, OpCounter() as counter:
        for _ in range(n):
            t.train_step(batches)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        t.train_step(batches)
    profile.disable()
    cpu = time.thread_time()
    for _ in range(n):
        t.train_step(batches)
    cpu = (time.thread_time() - cpu) / n

    calls: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for (filename, line, name), (_, ncalls, *_) in pstats.Stats(profile).stats.items():
        where = area(filename, repo)
        calls[where] += ncalls
        if where == "rankmix":
            own[f"{Path(filename).resolve().relative_to(repo)}:{line}({name})"] += ncalls
    ops = sum(counter.ops.values())
    synced = {str(op): c / n for op, c in counter.ops.items() if op in SYNC_OPS}
    if reads.reads:
        synced["read back (tolist, item, ...)"] = reads.reads / n
    syncs = sum(synced.values())
    areas = ", ".join(f"{k} {v / n:,.0f}" for k, v in calls.most_common())
    print(f"{args.config} {' '.join(args.set)}; {t.cfg.model.tower}, batch {t.batch_size}, {n} steps, "
          f"{torch.get_num_threads()} threads; {repo}")
    print(f"per step: aten ops {ops / n:.1f}, host syncs {syncs:.1f}, Python calls {sum(calls.values()) / n:,.0f} "
          f"({areas}); main-thread CPU {1e3 * cpu:.2f} ms")
    if synced:
        print("host syncs per step: " + ", ".join(f"{k} {v:.1f}" for k, v in synced.items()))
    for name, c in own.most_common(args.top):
        print(f"  {c / n:7.1f}  {name}")
    from trainer.dist import shutdown
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
