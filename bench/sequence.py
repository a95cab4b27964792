"""Sequence modules' cost: rows/s of a training step (forward + backward) and peak memory for
behaviour sequences of M = 50, 200 and 1,000 ids, for pool, target_attention and transformer at
the same tower, and each module's share of the step.

Each (module, M) runs in a process of its own (peak RSS is per process), on the CPU with
unsharded tables (an EmbeddingBagCollection, and for an attended sequence an
EmbeddingCollection of its table), B rows whose sequences all hold M ids (a batch already
padded: no copy), or with --ragged 1 to M (uniform), padded to the longest. Training's sharded
tables update their rows in a fused backward; here both sides pay a dense table gradient (the
bag's sorts its B M ids, the EmbeddingCollection's scatters them), as fair to pool as to
attention. Every child keeps freed memory as training does (`tune_malloc`). A step is the
model's forward, the BCE loss and backward; `share` is the sequence module's own forward +
backward (SequenceInputs.attend on the padded rows) over the step, both medians over --steps
timed steps after two warm-ups. The last line is the goal's ratio, target_attention's
step at M = 200 over pool's (goal <= 1.5), timed apart from the table: both models in one
process, one step of each in turns for --turns rounds, the median of the rounds' ratios (on a
loaded machine, steps timed in two processes minutes apart differ by more than the ratio).

    .venv/bin/python bench/sequence.py                          # B 512, M 50,200,1000, rankmixer
    .venv/bin/python bench/sequence.py --rows 256 --lengths 50,200 --steps 5 --tower mlp
    .venv/bin/python bench/sequence.py --lengths 200 --modules pool --steps 3 --turns 30   # the ratio
    .venv/bin/python bench/sequence.py --lengths 200 --modules pool --steps 3 --ragged
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODULES = ("pool", "target_attention", "transformer")


ITEMS = 10_000  # rows of the catalog table, the candidate's and the behaviours'


def base_config(tower: str):
    """The benches' config, the seed set and malloc tuned as training's: `tower` at its defaults,
    a user table and the candidate `item` on the `catalog` table; the caller adds the history."""
    import torch

    from embeddings.features import FeatureSpec
    from trainer.config_loader import load_config
    from trainer.dist import tune_malloc

    tune_malloc()  # as training does (docs/performance.md): no page faults per large activation
    torch.manual_seed(0)
    cfg = load_config(None, [f"--model.tower={tower}", "--data.time_column=now"])
    cfg.features = [FeatureSpec(name="user", num_embeddings=1000, embedding_dim=16, group="user"),
                    FeatureSpec(name="item", table="catalog", num_embeddings=ITEMS, embedding_dim=16, group="item")]
    return cfg


def build(module: str, length: int, rows: int, tower: str, ragged: bool = False):
    """(model, batch, sequences) of one (module, M): the same seed, tables and data for every module;
    each row holds M ids, or with `ragged` 1 to M (uniform), padded to the longest."""
    # on use: the parent process only starts children and prints
    import numpy as np
    import pyarrow as pa
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from dense.heads import build_dense
    from dense.sequence import build_sequences
    from embeddings.features import FeatureSpec
    from embeddings.tables import sequence_table_configs, table_configs
    from trainer.data.encode import RowEncoder
    from trainer.ranking_model import RankingModel

    cfg = base_config(tower)
    cfg.features.append(FeatureSpec(name="hist", kind="sequence", table="catalog", num_embeddings=ITEMS,
                                    embedding_dim=16, pooling="mean", max_len=length, sequence_module=module,
                                    timestamps="ts", group="behaviour"))
    items = ITEMS
    layout, dense, heads = build_dense(cfg.model, cfg.features)
    sequences = build_sequences(cfg.features, cfg.model.sequence)
    unpooled = sequence_table_configs(cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, dense, heads,
                         sequence_tables=EmbeddingCollection(tables=unpooled) if unpooled else None,
                         sequences=sequences)
    rng = np.random.default_rng(0)
    keep = rng.integers(1, length + 1, rows) if ragged else np.full(rows, length)

    def cut(ids):
        return [row[:n] for row, n in zip(ids, keep)]
    table = pa.table({"user": rng.integers(0, 1000, rows), "item": rng.integers(0, items, rows),
                      "hist": pa.array(cut(rng.integers(0, items, (rows, length))), pa.list_(pa.int64())),
                      # oldest first, as the reader requires of a history with times
                      "ts": pa.array(cut(np.sort(1_000_000 - rng.integers(0, 10**6, (rows, length)), axis=1)),
                                     pa.list_(pa.int64())),
                      "now": np.full(rows, 1_000_000), "click": rng.integers(0, 2, rows)})
    batch = RowEncoder(cfg.features, cfg.model.tasks, "", "now", cfg.model.sequence.time_buckets).encode(
        table, "bench").to_batch()
    return model, batch, sequences


def training_step(model, batch) -> Callable[[], None]:
    import torch

    def step() -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def timed(fn, steps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(module: str, length: int, rows: int, steps: int, tower: str, ragged: bool) -> dict:
    import resource

    from dense.sequence import pad

    model, batch, sequences = build(module, length, rows, tower, ragged)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def module_alone() -> None:
        looked = model.sequence_tables(batch.sequence_ids)
        rows = looked["hist"].values().detach().requires_grad_()
        padded, mask = pad(rows, looked["hist"].offsets(), batch.sequence_max[-1])
        gaps = pad(batch.sequence_gaps[0], looked["hist"].offsets(), batch.sequence_max[-1])[0]
        candidate = looked["item"].values().detach()
        out = sequences.attend({"item": candidate}, {}, {"hist": (padded, mask)}, {"hist": gaps})
        sum(v.sum() for v in out.values()).backward()

    step_s = timed(training_step(model, batch), steps)
    share = timed(module_alone, steps) / step_s if sequences is not None else float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"module": module, "M": length, "rows_per_s": rows / step_s, "step_ms": step_s * 1e3,
            "peak_rss_mb": peak / 1024, "step_rss_mb": (peak - base) / 1024, "share": share}


def in_turns(modules: list[str], length: int, rows: int, steps: int, tower: str, ragged: bool) -> dict:
    """Each module's step over the first's, timed in turns in one process (one step of each per
    round), so that both see the same load: the median of the rounds' ratios and their range."""
    steps_of = [training_step(*build(module, length, rows, tower, ragged)[:2]) for module in modules]
    for step in steps_of:
        step(), step()
    times = [[] for _ in modules]
    for _ in range(steps):
        for step, each in zip(steps_of, times):
            start = time.perf_counter()
            step()
            each.append(time.perf_counter() - start)
    out = {}
    for module, each in zip(modules[1:], times[1:]):
        ratios = [t / t0 for t, t0 in zip(each, times[0])]
        out[module] = [statistics.median(ratios), min(ratios), max(ratios)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--lengths", default="50,200,1000")
    parser.add_argument("--modules", default=",".join(MODULES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tower", default="rankmixer")
    parser.add_argument("--ragged", action="store_true", help="rows of 1 to M ids (uniform), not all M")
    parser.add_argument("--turns", type=int, default=30, help="rounds of the goal's ratio, timed in turns")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "turns":
            print(json.dumps(in_turns(["pool", "target_attention"], int(args.child[1]), args.rows, args.turns,
                                      args.tower, args.ragged)))
        else:
            print(json.dumps(child(args.child[0], int(args.child[1]), args.rows, args.steps, args.tower, args.ragged)))
        return

    def run_child(name: str, length: int) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", name, str(length), "--rows", str(args.rows),
                              "--steps", str(args.steps), "--turns", str(args.turns), "--tower", args.tower,
                              *(["--ragged"] if args.ragged else [])],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(f"{'module':<17} {'M':>5} {'rows/s':>9} {'step ms':>8} {'peak RSS MB':>12} {'step RSS MB':>12} {'share':>6}")
    for length in (int(x) for x in args.lengths.split(",")):
        for module in args.modules.split(","):
            r = run_child(module, length)
            print(f"{module:<17} {length:>5} {r['rows_per_s']:>9.0f} {r['step_ms']:>8.1f} {r['peak_rss_mb']:>12.0f} "
                  f"{r['step_rss_mb']:>12.0f} {r['share']:>6.2f}", flush=True)
    if args.turns:
        median, low, high = run_child("turns", 200)["target_attention"]
        print(f"target_attention / pool step at M=200, {args.turns} rounds in turns: {median:.2f} "
              f"(rounds {low:.2f}-{high:.2f}; goal <= 1.5)")


if __name__ == "__main__":
    main()
