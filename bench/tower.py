"""RankMixer tower speed.

CPU (default): forward+backward FLOP/s divided by the same process's plain 2048^3
matrix-multiply FLOP/s, measured in the same run (absolute times drift on a shared
machine; the ratio does not). Each is the best of --repeats calls, the two timed in turns.
glibc's malloc is told to keep freed memory (--no-malloc-tuning to leave it alone): by
default every tensor over 32 MiB is a fresh mmap, so each step page-faults its large
activations back in (about a tenth of the step at T=32, D=512). --clock cpu divides
process CPU seconds instead of wall seconds, which other processes on a busy machine
disturb far less (with several threads it also counts their spin-waits).

CUDA (--device cuda): model FLOPs utilisation in bf16 autocast against the chip's peak
(--peak-tflops, or a known peak for the device name), plus the same matmul ratio.

    .venv/bin/python bench/tower.py [--shapes T,D,L,k,B ...] [--repeats N]
    .venv/bin/python bench/tower.py --device cuda --bf16 --shapes 16,768,2,4,4096 32,1536,2,4,4096
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dense.rankmixer import RankMixerTower
from dense.tokenizer import SliceTokenizer
from trainer.dist import tune_malloc

# Dense bf16 tensor-core peaks (TFLOP/s) by device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def timed(fns, repeats: int, device: torch.device, clock=time.perf_counter) -> list[float]:
    """Best seconds of each of `fns`, after two warm-up calls each, timed in turns.

    The machine is shared: a slice taken by another process only ever adds time, so the
    fastest of several calls is the least disturbed one; alternating the functions puts
    the numerator and the denominator of the ratio under the same conditions.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        fn(), fn()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync()
            tic = clock()
            fn()
            sync()
            best[i] = min(best[i], clock() - tic)
    return best


def matmul_step(device: torch.device, dtype: torch.dtype, n: int = 2048):
    """(fn, FLOPs) of the plain n^3 reference product."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return (lambda: a @ b), 2 * n**3


def tower_step(shape: tuple[int, ...], device: torch.device, bf16: bool):
    """(fn, FLOPs) of one forward+backward of the tower at shape (T, D, L, k, B).

    FLOPs are the matrix products FlopCounterMode sees, checked against the tower's own
    analytic cost(): forward 2 T d D (tokenizer, d = D) + L 4 k T D^2 (the per-token FFNs)
    per sample, and backward twice that (input and weight gradients).
    """
    t, d, layers, k, batch = shape
    tower = RankMixerTower(SliceTokenizer(t * d, t, d, d), layers, d, k).to(device)
    e_input = torch.randn(batch, t * d, device=device, requires_grad=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    params = [e_input, *tower.parameters()]

    def step():
        for p in params:  # as after optimizer.zero_grad(): gradients are written, not accumulated
            p.grad = None
        with autocast:
            out = tower(e_input)
        out.float().sum().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    expected = 3 * batch * tower.cost()[1]
    if flops != expected:
        raise RuntimeError(f"counted {flops} FLOPs per step, expected 3 x forward = {expected}")
    return step, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16,256,2,4,512", "32,512,2,4,512"],
                        help="T,D,L,k,B per shape")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="autocast the tower to bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="CPU only: time by process CPU seconds")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc's defaults")
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
        if args.threads:
            torch.set_num_threads(args.threads)
        malloc = "malloc untouched" if args.no_malloc_tuning else tune_malloc()
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {malloc}, {args.clock} clock")
    clock = time.process_time if args.clock == "cpu" and device.type == "cpu" else time.perf_counter
    for text in args.shapes:
        shape = tuple(map(int, text.split(",")))
        mm_fn, mm_flops = matmul_step(device, dtype)
        tower_fn, flops = tower_step(shape, device, args.bf16)
        mm_time, tower_time = timed([mm_fn, tower_fn], args.repeats, device, clock)
        matmul, rate = mm_flops / mm_time, flops / tower_time
        line = (f"T={shape[0]} D={shape[1]} L={shape[2]} k={shape[3]} B={shape[4]}: {flops / 1e9:.1f} GFLOP/step, "
                f"tower {rate / 1e12:.3f} TFLOP/s, matmul {matmul / 1e12:.3f} TFLOP/s, ratio {rate / matmul:.2f}")
        if peak:
            line += f", MFU vs peak {rate / peak:.1%}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
