"""RankMixer tower speed as a ratio: forward+backward FLOP/s divided by the same process's
plain 2048^3 matrix-multiply FLOP/s, measured in the same run (absolute times drift on a
shared machine; the ratio does not).

    .venv/bin/python bench/tower.py [--shapes T,D,L,k,B ...] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dense.rankmixer import RankMixerTower
from dense.tokenizer import SliceTokenizer


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def matmul_flops_per_sec(repeats: int, n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timed(lambda: a @ b, repeats)


def tower_flops_per_sec(t: int, d: int, layers: int, k: int, batch: int, repeats: int) -> tuple[float, int]:
    tower = RankMixerTower(SliceTokenizer(t * d, t, d, d), layers, d, k)
    e_input = torch.randn(batch, t * d, requires_grad=True)

    def step():
        tower(e_input).sum().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    return flops / timed(step, repeats), flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16,256,2,4,512", "32,512,2,4,512"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for shape in args.shapes:
        t, d, layers, k, batch = map(int, shape.split(","))
        peak = matmul_flops_per_sec(args.repeats)
        rate, flops = tower_flops_per_sec(t, d, layers, k, batch, args.repeats)
        print(f"T={t} D={d} L={layers} k={k} B={batch}: {flops / 1e9:.2f} GFLOP/step, "
              f"tower {rate / 1e9:.1f} GFLOP/s, matmul {peak / 1e9:.1f} GFLOP/s, ratio {rate / peak:.2f}")


if __name__ == "__main__":
    main()
