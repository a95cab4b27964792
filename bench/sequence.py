"""Sequence modules' cost: rows/s of a training step (forward + backward) and peak memory for
behaviour sequences of M = 50, 200 and 1,000 ids, for pool, target_attention and transformer at
the same tower, and each module's share of the step.

Each (module, M) runs in a process of its own (peak RSS is per process), on the CPU with
unsharded tables (an EmbeddingBagCollection, and for an attended sequence an
EmbeddingCollection of its table), B rows whose sequences all hold M ids, a batch padded to M.
A step is the model's forward, the BCE loss and backward; `share` is the sequence module's own
forward + backward (SequenceInputs.attend on the padded rows) over the step, both medians over
--steps timed steps after two warm-ups. The last line is the goal's ratio:
target_attention's step at M = 200 over pool's (goal <= 1.5).

    .venv/bin/python bench/sequence.py                          # B 512, M 50,200,1000, rankmixer
    .venv/bin/python bench/sequence.py --rows 256 --lengths 50,200 --steps 5 --tower mlp
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODULES = ("pool", "target_attention", "transformer")


def child(module: str, length: int, rows: int, steps: int, tower: str) -> dict:
    # on use: the parent process only starts children and prints
    import numpy as np
    import pyarrow as pa
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from dense.heads import build_dense
    from dense.sequence import build_sequences, pad
    from embeddings.features import FeatureSpec
    from embeddings.tables import sequence_table_configs, table_configs
    from trainer.config_loader import load_config
    from trainer.data.encode import RowEncoder
    from trainer.ranking_model import RankingModel

    torch.manual_seed(0)
    items = 10_000
    cfg = load_config(None, [f"--model.tower={tower}", "--data.time_column=now"])
    f = FeatureSpec
    cfg.features = [f(name="user", num_embeddings=1000, embedding_dim=16, group="user"),
                    f(name="item", table="catalog", num_embeddings=items, embedding_dim=16, group="item"),
                    f(name="hist", kind="sequence", table="catalog", num_embeddings=items, embedding_dim=16,
                      pooling="mean", max_len=length, sequence_module=module, timestamps="ts", group="behaviour")]
    layout, dense, heads = build_dense(cfg.model, cfg.features)
    sequences = build_sequences(cfg.features, cfg.model.sequence)
    unpooled = sequence_table_configs(cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, dense, heads,
                         sequence_tables=EmbeddingCollection(tables=unpooled) if unpooled else None,
                         sequences=sequences)
    rng = np.random.default_rng(0)
    table = pa.table({"user": rng.integers(0, 1000, rows), "item": rng.integers(0, items, rows),
                      "hist": pa.array(list(rng.integers(0, items, (rows, length))), pa.list_(pa.int64())),
                      "ts": pa.array(list(1_000_000 - rng.integers(0, 10**6, (rows, length))), pa.list_(pa.int64())),
                      "now": np.full(rows, 1_000_000), "click": rng.integers(0, 2, rows)})
    batch = RowEncoder(cfg.features, cfg.model.tasks, "", "now", cfg.model.sequence.time_buckets).encode(
        table, "bench").to_batch()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def step() -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def module_alone() -> None:
        looked = model.sequence_tables(batch.sequence_ids)
        rows = looked["hist"].values().detach().requires_grad_()
        padded, mask = pad(rows, looked["hist"].offsets(), batch.sequence_max[-1])
        gaps = pad(batch.sequence_gaps[0], looked["hist"].offsets(), batch.sequence_max[-1])[0]
        candidate = looked["item"].values().detach()
        out = sequences.attend({"item": candidate}, {}, {"hist": (padded, mask)}, {"hist": gaps})
        sum(v.sum() for v in out.values()).backward()

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    step_s = timed(step)
    share = timed(module_alone) / step_s if sequences is not None else float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"module": module, "M": length, "rows_per_s": rows / step_s, "step_ms": step_s * 1e3,
            "peak_rss_mb": peak / 1024, "step_rss_mb": (peak - base) / 1024, "share": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--lengths", default="50,200,1000")
    parser.add_argument("--modules", default=",".join(MODULES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tower", default="rankmixer")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.rows, args.steps, args.tower)))
        return
    results = {}
    print(f"{'module':<17} {'M':>5} {'rows/s':>9} {'step ms':>8} {'peak RSS MB':>12} {'step RSS MB':>12} {'share':>6}")
    for length in (int(x) for x in args.lengths.split(",")):
        for module in args.modules.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", module, str(length), "--rows", str(args.rows),
                                  "--steps", str(args.steps), "--tower", args.tower],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[module, length] = r
            print(f"{module:<17} {length:>5} {r['rows_per_s']:>9.0f} {r['step_ms']:>8.1f} {r['peak_rss_mb']:>12.0f} "
                  f"{r['step_rss_mb']:>12.0f} {r['share']:>6.2f}", flush=True)
    if ("pool", 200) in results and ("target_attention", 200) in results:
        ratio = results["target_attention", 200]["step_ms"] / results["pool", 200]["step_ms"]
        print(f"target_attention / pool step at M=200: {ratio:.2f} (goal <= 1.5)")


if __name__ == "__main__":
    main()
