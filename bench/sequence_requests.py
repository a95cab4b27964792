"""A user's history encoded once per request (`data.request_column`) against once per row, as
before it: training and serving throughput of ranking requests of 100 candidates (--candidates)
that share one history of M = 200 and 1,000 behaviours, for pool, target_attention and the
transformer (its blocks reading the history alone: `transformer.candidate = "query"`, shared
a request; and today's default, the candidate inside the blocks, which cannot be shared).

Each (module, M) runs in a process of its own (its peak RSS holds both ways), on the CPU with
unsharded tables as bench/sequence.py: B = requests x candidates rows in one Parquet row group
in memory, read both ways, the two timed in turns (one of each per round) so that both see the same load. `encode
ms`: the reader's encoding and batch assembly (the request check and the holders included; in
the reader's thread during training). `step ms`: a training step (forward + BCE + backward).
`serve ms`: the serving module (trainer/serving/served_model.py, eager, no gradient) on the raw
rows, each request's history sent once or once a row. Medians over --steps rounds after two
warm-ups; the last lines, per module and M, the medians of the rounds' ratios of rows/s, once a
request over once a row, training and serving.

    .venv/bin/python bench/sequence_requests.py                   # 5 requests x 100, M 200,1000
    .venv/bin/python bench/sequence_requests.py --lengths 200 --modules pool,target_attention --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.sequence import ITEMS, base_config, training_step  # noqa: E402  (the path above)

# (name, sequence_module, transformer.candidate)
MODULES = {"pool": ("pool", "in_sequence"), "target_attention": ("target_attention", "in_sequence"),
           "transformer": ("transformer", "query"), "transformer_bst": ("transformer", "in_sequence")}


def build(module: str, length: int, requests: int, candidates: int, tower: str, once: bool):
    """(config, model, the row group, its encoder): `requests` requests of `candidates` rows, each
    request one user and one history of `length` behaviours with times; read once a request (`once`)."""
    import numpy as np
    import pyarrow as pa
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from dense.heads import build_dense
    from dense.sequence import build_sequences
    from embeddings.features import FeatureSpec
    from embeddings.tables import sequence_table_configs, table_configs
    from trainer.data.encode import RowEncoder
    from trainer.ranking_model import RankingModel, shared_bags

    cfg = base_config(tower)
    name, candidate = MODULES[module]
    cfg.data.request_column = "request" if once else ""
    cfg.model.sequence.transformer.candidate = candidate
    cfg.features.append(FeatureSpec(name="hist", kind="sequence", table="catalog", num_embeddings=ITEMS,
                                    embedding_dim=16, pooling="mean", max_len=length, sequence_module=name,
                                    timestamps="ts", group="behaviour"))
    layout, dense, heads = build_dense(cfg.model, cfg.features)
    unpooled = sequence_table_configs(cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, dense, heads,
                         sequence_tables=EmbeddingCollection(tables=unpooled) if unpooled else None,
                         sequences=build_sequences(cfg.features, cfg.model.sequence),
                         shared_bags=shared_bags(cfg.features))
    rng = np.random.default_rng(0)
    rows = requests * candidates
    of = np.repeat(np.arange(requests), candidates)  # each row's request
    offsets = pa.array(np.arange(rows + 1) * length, pa.int32())

    def lists(values) -> pa.ListArray:  # a request's list in each of its rows
        return pa.ListArray.from_arrays(offsets, pa.array(values[of].ravel()))
    table = pa.table({"request": of, "user": rng.integers(0, 1000, requests)[of], "item": rng.integers(0, ITEMS, rows),
                      "hist": lists(rng.integers(0, ITEMS, (requests, length))),
                      "ts": lists(np.sort(10**7 - rng.integers(0, 10**7, (requests, length)), axis=1)),
                      "now": np.full(rows, 10**7), "click": rng.integers(0, 2, rows)})
    encoder = RowEncoder(cfg.features, cfg.model.tasks, "", "now", cfg.model.sequence.time_buckets,
                         cfg.data.request_column)
    return cfg, model, table, encoder


def in_turns(calls: list, steps: int) -> list[list[float]]:
    """Seconds of each of `calls` in each of `steps` rounds, one call of each per round, after two warm-ups."""
    for call in calls:
        call(), call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(steps):
        for call, each in zip(calls, times):
            start = time.perf_counter()
            call()
            each.append(time.perf_counter() - start)
    return times


def child(module: str, length: int, requests: int, candidates: int, steps: int, tower: str, modes: list[bool]) -> dict:
    import resource

    import torch

    from trainer.serving.export import serving_model
    from trainer.serving.predict import raw_inputs

    built = [build(module, length, requests, candidates, tower, once) for once in modes]
    encode = in_turns([lambda e=e, t=t: e.encode(t, "bench").to_batch() for _, _, t, e in built], steps)
    step = in_turns([training_step(m, e.encode(t, "bench").to_batch()) for _, m, t, e in built], steps)
    serving = []
    for cfg, model, table, _ in built:
        served = serving_model(cfg, model.state_dict(), step=0)
        inputs = raw_inputs(table, cfg.features, "bench", "now", cfg.data.request_column)
        serving.append(lambda served=served, inputs=inputs: served(*inputs))
    with torch.no_grad():
        serve = in_turns(serving, steps)
    rows = requests * candidates
    out = {"modes": [{"once": once, "encode_ms": statistics.median(e) * 1e3, "step_ms": statistics.median(s) * 1e3,
                      "serve_ms": statistics.median(v) * 1e3, "train_rows_s": rows / statistics.median(s),
                      "serve_rows_s": rows / statistics.median(v)}
                     for once, e, s, v in zip(modes, encode, step, serve)],
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if len(modes) == 2:  # rows/s once a request over once a row: each round's step time each way over once
        out["train_ratio"] = statistics.median(a / b for a, b in zip(step[0], step[1]))
        out["serve_ratio"] = statistics.median(a / b for a, b in zip(serve[0], serve[1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--lengths", default="200,1000")
    parser.add_argument("--modules", default=",".join(MODULES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tower", default="rankmixer")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        module, length = args.child
        # the candidate is inside today's transformer's blocks: nothing to share
        modes = [False] if module == "transformer_bst" else [False, True]
        print(json.dumps(child(module, int(length), args.requests, args.candidates, args.steps, args.tower, modes)))
        return
    print(f"{args.requests} requests x {args.candidates} candidates a batch, tower {args.tower}")
    print(f"{'module':<17} {'M':>5} {'history':>8} {'encode ms':>10} {'step ms':>9} {'train rows/s':>13} "
          f"{'serve ms':>9} {'serve rows/s':>13} {'peak RSS MB':>12}")
    ratios = []
    for length in args.lengths.split(","):
        for module in args.modules.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", module, length, "--requests",
                                   str(args.requests), "--candidates", str(args.candidates), "--steps",
                                   str(args.steps), "--tower", args.tower], capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            got = json.loads(proc.stdout.splitlines()[-1])
            for r in got["modes"]:
                history = "a request" if r["once"] else "a row"
                print(f"{module:<17} {length:>5} {history:>8} {r['encode_ms']:>10.1f} {r['step_ms']:>9.1f} "
                      f"{r['train_rows_s']:>13.0f} {r['serve_ms']:>9.1f} {r['serve_rows_s']:>13.0f} "
                      f"{got['peak_rss_mb']:>12.0f}", flush=True)
            if "train_ratio" in got:
                ratios.append((module, length, got["train_ratio"], got["serve_ratio"]))
    for module, length, train, serve in ratios:
        print(f"{module} at M={length}: once a request over once a row: training {train:.2f}x, serving {serve:.2f}x")


if __name__ == "__main__":
    main()
