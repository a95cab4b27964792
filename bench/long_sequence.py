"""Long behaviour sequences through SIM's hard search (`features.<name>.search_field`): rows of
M = 1,000 and 10,000 behaviours, each with a genre (one of 4) and a time, of which the reader
keeps those of the candidate's genre, then the newest K = max_len = 256, for target attention.
With --search soft, SIM's soft search (`search_k`): every behaviour is looked up (max_len = M)
and the module reads the K most similar to the query.

Each M runs in a process of its own (peak RSS is per process): B rows as one Parquet row group
in memory, the reader's encoding of it (the check of every time, the search, the cut: on the host,
in the reader's thread during training) and a training step (forward + backward, unsharded tables
on the CPU, as bench/sequence.py) on what it kept, and that step's lookup alone (forward, no
gradient: what any search inside the step must at least pay). Medians over --steps after two
warm-ups. The last line is the goal: the step plus the encoding at 10,000 over 1,000 (goal <= 2); memory grows
with M only in the row group and the reader's flat arrays (`input MB`: ids, genres, times).

    .venv/bin/python bench/long_sequence.py                     # B 512, M 1000,10000, K 256
    .venv/bin/python bench/long_sequence.py --search soft       # the model's top K of every behaviour
    .venv/bin/python bench/long_sequence.py --rows 128 --lengths 1000,10000 --steps 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.sequence import ITEMS, base_config, timed, training_step  # noqa: E402  (the path above)

GENRES = 4


def build(length: int, rows: int, k: int, tower: str, search: str):
    """(model, the row group, its encoder): B rows of `length` behaviours, searched to `k` by the
    reader (`hard`) or by the model (`soft`: every behaviour looked up, the k nearest attended)."""
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
    items = ITEMS
    f = FeatureSpec
    searched = {"search_field": "hist_genre", "search_query": "item_genre"} if search == "hard" else {"search_k": k}
    kept = k if search == "hard" else length  # max_len
    cfg.features += [f(name="item_genre", table="genre", num_embeddings=GENRES, embedding_dim=16, hashing="none",
                       group="item"),
                     f(name="hist", kind="sequence", table="catalog", num_embeddings=items, embedding_dim=16,
                       max_len=kept, sequence_module="target_attention", timestamps="ts", group="behaviour",
                       candidate_fields=["item_genre"], **searched),
                     f(name="hist_genre", kind="sequence", side_of="hist", table="genre", num_embeddings=GENRES,
                       embedding_dim=16, hashing="none", max_len=kept, group="behaviour")]
    layout, dense, heads = build_dense(cfg.model, cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, dense, heads,
                         sequence_tables=EmbeddingCollection(tables=sequence_table_configs(cfg.features)),
                         sequences=build_sequences(cfg.features, cfg.model.sequence))
    rng = np.random.default_rng(0)
    offsets = pa.array(np.arange(rows + 1) * length, pa.int32())

    def lists(values) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, pa.array(values.ravel()))
    table = pa.table({"user": rng.integers(0, 1000, rows), "item": rng.integers(0, items, rows),
                      "item_genre": rng.integers(0, GENRES, rows),
                      "hist": lists(rng.integers(0, items, (rows, length))),
                      "hist_genre": lists(rng.integers(0, GENRES, (rows, length))),
                      "ts": lists(np.sort(10**7 - rng.integers(0, 10**7, (rows, length)), axis=1)),
                      "now": np.full(rows, 10**7), "click": rng.integers(0, 2, rows)})
    encoder = RowEncoder(cfg.features, cfg.model.tasks, "", "now", cfg.model.sequence.time_buckets)
    return model, table, encoder


def child(length: int, rows: int, k: int, steps: int, tower: str, search: str) -> dict:
    import resource

    import torch

    model, table, encoder = build(length, rows, k, tower, search)
    encode_s = timed(lambda: encoder.encode(table, "bench"), steps)
    batch = encoder.encode(table, "bench").to_batch()
    step_s = timed(training_step(model, batch), steps)

    def lookup() -> None:  # every behaviour the model reads, forward alone: a floor under a search in the step
        with torch.no_grad():
            model.sequence_tables(batch.sequence_ids)
    lookup_s = timed(lookup, steps)
    kept = min(batch.sequence_ids["hist"].lengths().double().mean().item(), k)  # soft: what the module reads
    return {"M": length, "K": k, "kept": kept, "encode_ms": encode_s * 1e3, "step_ms": step_s * 1e3,
            "lookup_ms": lookup_s * 1e3,
            "input_mb": table.nbytes / 2**20, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--lengths", default="1000,10000")
    parser.add_argument("--k", type=int, default=256, help="behaviours kept after the search (max_len)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tower", default="rankmixer")
    parser.add_argument("--search", choices=("hard", "soft"), default="hard",
                        help="hard: by genre, in the reader; soft: the k nearest the query, in the model")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.k, args.steps, args.tower, args.search)))
        return
    results = []
    print(f"{'M':>6} {'K':>4} {'kept':>6} {'encode ms':>10} {'step ms':>8} {'lookup ms':>10} {'input MB':>9} "
          f"{'peak RSS MB':>12}")
    for length in (int(x) for x in args.lengths.split(",")):
        proc = subprocess.run([sys.executable, __file__, "--child", str(length), "--rows", str(args.rows), "--k",
                               str(args.k), "--steps", str(args.steps), "--tower", args.tower, "--search", args.search],
                              capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.splitlines()[-1])
        results.append(r)
        print(f"{r['M']:>6} {r['K']:>4} {r['kept']:>6.1f} {r['encode_ms']:>10.1f} {r['step_ms']:>8.1f} "
              f"{r['lookup_ms']:>10.2f} {r['input_mb']:>9.1f} {r['peak_rss_mb']:>12.0f}", flush=True)
    first, last = results[0], results[-1]
    ratio = (last["encode_ms"] + last["step_ms"]) / (first["encode_ms"] + first["step_ms"])
    print(f"{args.search} search: encode + step at M={last['M']} over M={first['M']}, K={args.k}: {ratio:.2f} "
          f"(step alone {last['step_ms'] / first['step_ms']:.2f}; goal <= 2)")


if __name__ == "__main__":
    main()
