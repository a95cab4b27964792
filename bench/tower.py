"""Dense tower speed: every registered tower, on stock PyTorch alone.

One training step of a tower is forward + backward of its output (and of the auxiliary
losses it asks the training loop for, e.g. the MoE's router terms), gradients written
as after optimizer.zero_grad(). Nothing on this path imports torchrec, fbgemm or the
data stack, only torch, dense/, embeddings/' TorchRec-free contracts (features, registry, hooks)
and trainer/dist.py (tests/test_bench.py checks it with the other packages made unimportable
and the repository not installed):
the GPU machine this project can reach has torch and nothing else.

CPU (default): FLOP/s divided by the same process's plain 2048^3 float32 matmul, the
two timed in turns (absolute times drift on a shared machine; the ratio does not).
glibc's malloc is told to keep freed memory (--no-malloc-tuning to leave it alone).

CUDA (--device cuda --bf16): bf16 autocast; MFU against the chip's dense bf16 peak
(989 TFLOP/s for H100/H200, or --peak-tflops) and against an 8192^3 bf16 matmul
measured in the same run. --compile wraps the tower in torch.compile; --cuda-graphs
captures the whole step in a CUDA graph (UniMixer's scaling runs a fixed number of Newton
steps and reads nothing back, so both take it as it is).

--moe-inference also times inference of the rankmixer_moe tower: the sparse router
(only the experts with a non-zero gate run) against the dense one, rows/s of each.

FLOPs are what torch's FlopCounterMode counts for one step (matmuls only).

    .venv/bin/python bench/tower.py [--towers rankmixer,mlp] [--shapes T,D,L,k,B ...] [--repeats N]
    python3 bench/tower.py --device cuda --bf16 --towers rankmixer,rankmixer_moe --shapes 32,1536,2,4,4096
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# The repository, for a machine where it is not installed (python3 bench/tower.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dense.heads import build_tower  # noqa: E402
from dense.layout import InputLayout  # noqa: E402
from dense.model_config import ModelConfig  # noqa: E402
from dense.tower_registry import TOWERS  # noqa: E402
from embeddings.features import FeatureSpec  # noqa: E402
from embeddings.hooks import TrainingHooks  # noqa: E402
from trainer.dist import tune_malloc  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s) by device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
DEFAULT_TOWERS = "rankmixer,rankmixer_moe,unimixer,unimixer_lite,mlp,dcnv2"


def timed(fns: list[Callable[[], object]], repeats: int, device: torch.device,
          clock: Callable[[], float] = time.perf_counter) -> list[float]:
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


def matmul_step(device: torch.device, dtype: torch.dtype):
    """(fn, FLOPs) of the plain square reference product: 8192^3 on a GPU, 2048^3 on the CPU."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return (lambda: a @ b), 2 * n**3


def model_config(tower: str, shape: tuple[int, ...], settings: list[str]) -> ModelConfig:
    """The tower at shape (T, D, L, k, B), with `settings` (key=value of model.*, tables
    dotted: moe.inference=dense) on top. Parsed here rather than by trainer.config_loader,
    which needs tomli-w: the GPU machine has torch alone."""
    t, d, layers, k, _ = shape
    cfg = ModelConfig(tower=tower, num_tokens=t, hidden_dim=d, num_layers=layers, ffn_ratio=k)
    for item in settings:
        dotted, _, value = item.partition("=")
        *tables, key = dotted.split(".")
        section = cfg
        for table in tables:
            section = getattr(section, table, None)
        if section is None or not hasattr(section, key):
            raise SystemExit(f"--set {item!r}: ModelConfig has no field {dotted!r}")
        current = getattr(section, key)
        if not isinstance(current, (int, float, str, list)) or key == "tasks":
            raise SystemExit(f"--set {item!r}: {dotted} cannot be set here")
        try:  # numbers, strings and lists of ints: the only types a tower's shape takes
            setattr(section, key, [int(v) for v in value.strip("[]").split(",")] if isinstance(current, list)
                    else type(current)(value))
        except ValueError:
            raise SystemExit(f"--set {item!r}: {value!r} is not a {type(current).__name__}") from None
    return cfg


def tower_input(shape: tuple[int, ...]) -> InputLayout:
    """e_input of T features of width D, one semantic group: the slice tokenizer's
    token t is then exactly feature t."""
    t, d = shape[:2]
    return InputLayout([FeatureSpec(name=f"f{i}", num_embeddings=1, embedding_dim=d) for i in range(t)])


class TowerStep:
    """One training step of a tower on a fixed random batch e_input [B, T*D]."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, bf16: bool, compile_: bool,
                 graphed: bool = False):
        layout = tower_input((cfg.num_tokens, cfg.hidden_dim))
        self.tower = build_tower(cfg, layout).to(device)
        self.hooks = TrainingHooks.of(self.tower)
        self.model = torch.compile(self.tower) if compile_ else self.tower
        self.e_input = torch.randn(batch, layout.width, device=device, requires_grad=True)
        self.params = [self.e_input, *self.tower.parameters()]
        # A captured graph must not reuse autocast's weight casts from before the capture.
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not graphed) if bf16
                         else contextlib.nullcontext())

    def __call__(self) -> None:
        self._run(self.model)

    def _run(self, model: nn.Module) -> None:
        for p in self.params:  # as after optimizer.zero_grad(): gradients are written, not accumulated
            p.grad = None
        with self.autocast:
            loss = model(self.e_input).float().sum()
        for extra in self.hooks.extra_losses:
            loss = loss + extra()
        loss.backward()

    def flops(self) -> int:
        """Matmul FLOPs of one step by torch's counter, counted on the eager tower (the
        counter cannot see inside a compiled graph's kernels)."""
        with FlopCounterMode(display=False) as counter:
            self._run(self.tower)
        return counter.get_total_flops()


def cuda_graph(step: Callable[[], None]) -> Callable[[], None]:
    """`step` captured once in a CUDA graph; replaying it reruns every kernel on the same
    memory (the recipe of torch.cuda.graphs: warm up on a side stream, then capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def moe_inference(shape: tuple[int, ...], settings: list[str], device: torch.device, bf16: bool,
                  repeats: int) -> str:
    """Rows/s of the MoE tower's sparse inference against its dense inference, timed in turns."""
    towers = {}
    for mode in ("sparse", "dense"):
        torch.manual_seed(0)  # the same weights for both
        cfg = model_config("rankmixer_moe", shape, [*settings, f"moe.inference={mode}"])
        towers[mode] = build_tower(cfg, tower_input(shape)).to(device).eval()
    e_input = torch.randn(shape[4], shape[0] * shape[1], device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def infer(tower: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), autocast:
                tower(e_input)
        return run

    sparse, dense = timed([infer(towers["sparse"]), infer(towers["dense"])], repeats, device)
    active = float(towers["sparse"].log_values("eval")["moe/active_ratio"])
    return (f"rankmixer_moe inference T={shape[0]} D={shape[1]} B={shape[4]}: sparse {shape[4] / sparse:,.0f} rows/s, "
            f"dense {shape[4] / dense:,.0f} rows/s, sparse/dense {dense / sparse:.2f}x "
            f"at {active:.0%} of the gates active")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", default=DEFAULT_TOWERS, help=f"registered towers, comma-separated "
                        f"(default {DEFAULT_TOWERS})")
    parser.add_argument("--shapes", nargs="+", default=["16,256,2,4,512", "32,512,2,4,512"],
                        help="T,D,L,k,B per shape")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a model.* setting for every tower, e.g. cross_rank=256 (repeatable)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="autocast the tower to bfloat16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the tower")
    parser.add_argument("--cuda-graphs", action="store_true", help="CUDA only: replay each step from a CUDA graph")
    parser.add_argument("--moe-inference", action="store_true", help="also time the MoE's sparse and dense inference")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="CPU only: time by process CPU seconds")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc malloc's defaults")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak for MFU (default: by device name)")
    return parser


def main() -> None:
    args = parser().parse_args()
    device = torch.device(args.device)
    towers = args.towers.split(",")
    for name in towers:
        TOWERS.get(name)  # an unknown name fails now, listing the registered ones
    if args.cuda_graphs and device.type != "cuda":
        raise SystemExit("--cuda-graphs needs --device cuda")
    settings = list(args.set)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    peak = args.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak or next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)
        print(f"{name}, torch {torch.__version__}, peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        malloc = "malloc untouched" if args.no_malloc_tuning else tune_malloc()
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {malloc}, {args.clock} clock", flush=True)
    clock = time.process_time if args.clock == "cpu" and device.type == "cpu" else time.perf_counter
    mm_fn, mm_flops = matmul_step(device, dtype)
    for text in args.shapes:
        shape = tuple(map(int, text.split(",")))
        if len(shape) != 5:
            raise SystemExit(f"--shapes {text!r}: expected T,D,L,k,B")
        for tower in towers:
            step = TowerStep(model_config(tower, shape, settings), shape[4], device, args.bf16, args.compile,
                             graphed=args.cuda_graphs)
            flops = step.flops()
            run = cuda_graph(step) if args.cuda_graphs else step
            mm_time, step_time = timed([mm_fn, run], args.repeats, device, clock)
            matmul, rate = mm_flops / mm_time, flops / step_time
            line = (f"{tower} T={shape[0]} D={shape[1]} L={shape[2]} k={shape[3]} B={shape[4]}: "
                    f"{flops / 1e9:.1f} GFLOP/step, {rate / 1e12:.3f} TFLOP/s, {shape[4] / step_time:,.0f} rows/s, "
                    f"matmul {matmul / 1e12:.3f} TFLOP/s, ratio {rate / matmul:.2f}")
            if peak:
                line += f", MFU vs peak {rate / peak:.1%}"
            print(line, flush=True)
            del step, run
        if args.moe_inference:
            print(moe_inference(shape, args.set, device, args.bf16, args.repeats), flush=True)


if __name__ == "__main__":
    main()
