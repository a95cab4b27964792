"""RankMixer tower speed.

CPU (default): forward+backward FLOP/s divided by the same process's plain 2048^3
matrix-multiply FLOP/s, measured in the same run (absolute times drift on a shared
machine; the ratio does not).

CUDA (--device cuda): model FLOPs utilisation in bf16 autocast against the chip's peak
(--peak-tflops, or a known peak for the device name), plus the same matmul ratio.

    .venv/bin/python bench/tower.py [--shapes T,D,L,k,B ...] [--repeats N]
    .venv/bin/python bench/tower.py --device cuda --bf16 --shapes 16,768,2,4,4096 32,1536,2,4,4096
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dense.rankmixer import RankMixerTower
from dense.tokenizer import SliceTokenizer

# Dense bf16 tensor-core peaks (TFLOP/s) by device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn(), fn()
    times = []
    for _ in range(repeats):
        sync()
        tic = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def matmul_flops_per_sec(device: torch.device, dtype: torch.dtype, repeats: int, n: int = 2048) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, repeats, device)


def tower_flops_per_sec(shape: tuple[int, ...], device: torch.device, bf16: bool, repeats: int) -> tuple[float, int]:
    """(FLOP/s, FLOPs) of one forward+backward of the tower at shape (T, D, L, k, B)."""
    t, d, layers, k, batch = shape
    tower = RankMixerTower(SliceTokenizer(t * d, t, d, d), layers, d, k).to(device)
    e_input = torch.randn(batch, t * d, device=device, requires_grad=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step():
        with autocast:
            out = tower(e_input)
        out.float().sum().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    return flops / timed(step, repeats, device), flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16,256,2,4,512", "32,512,2,4,512"],
                        help="T,D,L,k,B per shape")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="autocast the tower to bfloat16")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak for MFU (default: by device name)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    peak = args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak or next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)
        print(f"{name}, torch {torch.__version__}, peak {peak / 1e12:.0f} TFLOP/s")
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for text in args.shapes:
        shape = tuple(map(int, text.split(",")))
        matmul = matmul_flops_per_sec(device, dtype, args.repeats)
        rate, flops = tower_flops_per_sec(shape, device, args.bf16, args.repeats)
        line = (f"T={shape[0]} D={shape[1]} L={shape[2]} k={shape[3]} B={shape[4]}: {flops / 1e9:.1f} GFLOP/step, "
                f"tower {rate / 1e12:.3f} TFLOP/s, matmul {matmul / 1e12:.3f} TFLOP/s, ratio {rate / matmul:.2f}")
        if peak:
            line += f", MFU {rate / peak:.1%}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
