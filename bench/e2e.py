"""One training step's time, broken into its parts.

The model is the Trainer's own (TorchRec DMP, fused Adagrad, RMSProp, world size 1 on
gloo). Each part runs standalone on the real modules and batches:

    data        the reader's next batch, moved to the device (Trainer.fetch)
    embedding   sharded EBC lookup forward + backward of a dummy loss on the pooled
                output, which runs the fused Adagrad update inside backward
    tokenizer   e_input assembly + tokenizer, forward + backward
    tower       the tower after the tokenizer (blocks, pooling), forward + backward
    heads+loss  task heads and the weighted BCE, forward + backward
    grad check  the dense gradient norm the trainer checks for finiteness (and clips with)
    optimizer   CombinedOptimizer.step (RMSProp; the fused side only sets its LR) + zero_grad
    all-reduce  with more than one rank: the dense gradients' all-reduce, as the step's DDP
                runs it (trainer/dist.py: one all-reduce per gradient on gloo past 2 ranks)

and the whole step as fit() runs it (Trainer.train_step: the step and its bookkeeping). Parts and
the whole step alternate within every round and the medians over rounds are reported,
so drift on a shared machine hits both alike; process CPU time is reported beside wall
time, as it does not count waiting for a core. Target: end-to-end / sum of parts <= 1.25.

--towers compares whole training steps instead: one Trainer per tower on the same
config (the same batches: same data, same seed), each timed through Trainer.train_step
for --steps steps per round, the towers and a plain square matmul in turns, medians over
rounds. One line per tower:

    TOWER examples/s E ratio_to_rankmixer R flops_ratio F mfu M

flops_ratio is the tower's forward FLOPs per sample over the first tower's; mfu is the
trainer's figure (3 x FLOPs x examples/s over the matmul's FLOP/s, measured in the same
rounds). --tower-set TOWER:SECTION.KEY=VALUE sizes one tower only (e.g. a UniMixer FFN
ratio that brings its FLOPs near RankMixer's).

    .venv/bin/python bench/e2e.py                                  # synthetic, B 1024, T16 D256 L2 k4
    .venv/bin/python bench/e2e.py --set data.batch_size=512 --rounds 30
    .venv/bin/python bench/e2e.py --config configs/movielens.toml --set train.pipeline=sparse_dist
    .venv/bin/python bench/e2e.py --profile 10                     # plus the top ops of 10 whole steps
    .venv/bin/python -m torch.distributed.run --nproc-per-node 4 bench/e2e.py --rounds 5   # 4 gloo ranks

Under torchrun every rank runs the same parts in the same order (the lookup's all-to-all and the
all-reduce are collectives) and rank 0 prints its table; bench/scale.py runs it so.
    .venv/bin/python bench/e2e.py --config configs/movielens.toml \
        --towers rankmixer,rankmixer_moe,unimixer,unimixer_lite,mlp,dcnv2 --tower-set unimixer:model.ffn_ratio=2
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tower import matmul_step  # bench/tower.py (this script's folder): the same reference product

from dense.cost import mfu
from trainer.config import Config
from trainer.config_loader import load_config, unused_fields
from trainer.data.batch import Batch

# Without --config: configs/debug.toml's synthetic log and tasks at a realistic batch and a
# mid-sized RankMixer (the default bench/tower.py shape).
DEFAULT_CONFIG = "configs/debug.toml"
DEFAULT_SET = ("data.synth_rows=200000", "data.batch_size=1024", "model.tower=rankmixer",
               "model.num_tokens=16", "model.hidden_dim=256", "model.num_layers=2", "model.ffn_ratio=4")
# Whatever the config: no checkpoints (a resume would change what is timed), no progress bar.
FORCED_SET = ("checkpoint.enabled=false", "metrics.progress=false", "metrics.tensorboard=false")

PARTS = ("data", "embedding", "tokenizer", "tower", "heads+loss", "grad check", "optimizer", "all-reduce")


class _FixedTokens(nn.Module):
    """Stands in for a tower's tokenizer so that the tower's remaining forward runs on
    precomputed tokens: the rest of the tower is timed through its own forward()."""

    def __init__(self, tokens: torch.Tensor, num_tokens: int):
        super().__init__()
        self.tokens, self.num_tokens = tokens, num_tokens

    def forward(self, e_input: torch.Tensor) -> torch.Tensor:
        return self.tokens.transpose(0, 1)  # [T, B, D] stored -> [B, T, D]

    def forward_tm(self, e_input: torch.Tensor) -> torch.Tensor:
        return self.tokens


@contextlib.contextmanager
def tokenizer_replaced(tower: nn.Module, tokens: torch.Tensor):
    """tower.tokenizer temporarily returns `tokens` (token-major [T, B, D])."""
    real = tower.tokenizer
    tower.tokenizer = _FixedTokens(tokens, real.num_tokens)
    try:
        yield
    finally:
        tower.tokenizer = real


class Clock:
    """Wall seconds and process CPU seconds (every thread of this process) of a region.
    On a shared machine wall time includes waiting for a core; CPU time does not, so the
    two ratios together tell work the step adds from time it loses to neighbours."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    @property
    def times(self) -> tuple[float, float]:
        return self.wall, self.cpu


class StepParts:
    """The Trainer's step cut into standalone pieces; each `time_*` returns (wall, CPU) seconds."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.model = trainer.model.module  # RankingModel under DMP (and DDP for the dense part)
        self.batches: Iterator[Batch] = trainer.batches()  # for whole steps
        # The parts read their own copy of the reader: a batch they take is not one a
        # whole step trains, so it must not move the trainer's data position.
        self.part_batches: Iterator[Batch] = trainer.side_batches()
        self.batch = self._next()
        self.has_tokenizer = hasattr(self.model.tower, "tokenizer")
        self.grads: list[torch.Tensor] = []

    def _next(self) -> Batch:
        return self.trainer.fetch(self.part_batches)

    # ---------------------------------------------------------------- the parts

    def time_data(self) -> tuple[float, float]:
        with Clock() as clock:
            self.batch = self._next()
        return clock.times

    def time_embedding(self) -> tuple[float, float]:
        """Lookup [B, sum of dims], backward of sum() (gradient of ones) incl. fused Adagrad."""
        with Clock() as clock:
            sum(v.sum() for v in self.model.pooled(self.batch).values()).backward()
        return clock.times

    def _inputs(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Pooled embeddings (leaves) and the dense features, as the tower's input sees them."""
        with torch.no_grad():
            pooled = self.model.pooled(self.batch)
        return {k: v.detach().requires_grad_() for k, v in pooled.items()}, self.batch.dense

    def time_tokenizer(self) -> tuple[float, float]:
        """layout.assemble + tokenizer: e_input [B, E] -> tokens [T, B, D], backward of a
        fixed random cotangent."""
        if not self.has_tokenizer:
            return 0.0, 0.0
        pooled, dense = self._inputs()
        tokenizer = self.model.tower.tokenizer
        grad = torch.randn(tokenizer.num_tokens, len(self.batch), self.model.tower.out_dim)
        with Clock() as clock:
            tokenizer.forward_tm(self.model.layout.assemble(pooled, dense)).backward(grad)
        return clock.times

    def time_tower(self) -> tuple[float, float]:
        """The tower after the tokenizer (the whole tower when it has none), [B, out_dim]."""
        tower = self.model.tower
        pooled, dense = self._inputs()
        if self.has_tokenizer:
            with torch.no_grad():
                tokens = tower.tokenizer.forward_tm(self.model.layout.assemble(pooled, dense))
            context, e_input = tokenizer_replaced(tower, tokens.requires_grad_()), None
        else:
            context, e_input = contextlib.nullcontext(), self.model.layout.assemble(pooled, dense).detach()
        grad = torch.randn(len(self.batch), tower.out_dim)
        with context, Clock() as clock:
            tower(e_input).backward(grad)
        return clock.times

    def time_heads_loss(self) -> tuple[float, float]:
        hidden = torch.randn(len(self.batch), self.model.tower.out_dim, requires_grad=True)
        with Clock() as clock:
            loss, _ = self.trainer.loss(self.model.heads(hidden), self.batch.labels)
            loss.backward()
        return clock.times

    def _set_grads(self) -> None:
        """Every dense parameter holds a gradient, as after a backward."""
        params = self.trainer.dense_parameters()
        if not self.grads:
            self.grads = [torch.randn_like(p) * 1e-3 for p in params]
        for p, g in zip(params, self.grads):
            p.grad = g.clone()

    def time_grad_check(self) -> tuple[float, float]:
        self._set_grads()
        with Clock() as clock:
            self.trainer.check_gradients()
        return clock.times

    def time_optimizer(self) -> tuple[float, float]:
        self._set_grads()
        with Clock() as clock:
            self.trainer.optimizer_step()
        return clock.times

    def time_all_reduce(self) -> tuple[float, float]:
        """Every dense gradient averaged over the ranks, one all-reduce each, as the step's DDP
        does on gloo past 2 ranks (trainer/dist.py `_reduce_each_gradient`); 0 on one rank."""
        if self.trainer.env.world_size == 1:
            return 0.0, 0.0
        self._set_grads()
        grads = [p.grad for p in self.trainer.dense_parameters()]
        with Clock() as clock:
            for work in [torch.distributed.all_reduce(g.div_(self.trainer.env.world_size), async_op=True)
                         for g in grads]:
                work.wait()
        return clock.times

    def time_step(self) -> tuple[float, float]:
        """fit()'s loop body up to the metering: Trainer.train_step, the whole step."""
        with Clock() as clock:
            self.trainer.train_step(self.batches)
        return clock.times

    def clear(self) -> None:
        """No stale gradient may leak from one part into the next."""
        for p in self.trainer.model.parameters():
            p.grad = None

    def round(self) -> dict[str, tuple[float, float]]:
        """Every part once, then one whole step; (wall, CPU) seconds by name."""
        timers: dict[str, Callable[[], tuple[float, float]]] = {
            "data": self.time_data, "embedding": self.time_embedding, "tokenizer": self.time_tokenizer,
            "tower": self.time_tower, "heads+loss": self.time_heads_loss, "grad check": self.time_grad_check,
            "optimizer": self.time_optimizer, "all-reduce": self.time_all_reduce}
        out = {}
        for name in PARTS:
            out[name] = timers[name]()
            self.clear()
        out["end-to-end"] = self.time_step()
        return out


def bench(cfg: Config, rounds: int, warmup: int) -> tuple[dict[str, tuple[float, float]], StepParts]:
    """Median (wall, CPU) seconds of each part and of the whole step over `rounds` rounds."""
    from trainer.assembly import build_trainer

    with contextlib.redirect_stdout(io.StringIO()):  # the sharding plan: not what is measured
        parts = StepParts(build_trainer(cfg))
    for _ in range(warmup):
        parts.round()
    samples = [parts.round() for _ in range(rounds)]
    return {name: tuple(statistics.median(s[name][i] for s in samples) for i in range(2))
            for name in samples[0]}, parts


def profile(step: Callable[[], object], steps: int, rows: int) -> str:
    """Top CPU ops of `steps` calls of `step`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)


def table(times: dict[str, tuple[float, float]], batch: int) -> str:
    """Wall and CPU milliseconds per part, their sums, the whole step and both ratios."""
    parts = {k: v for k, v in times.items() if k != "end-to-end"}
    total = tuple(sum(v[i] for v in parts.values()) for i in range(2))
    e2e = times["end-to-end"]

    def row(name: str, t: tuple[float, float]) -> str:
        return (f"{name:<14}{1e3 * t[0]:>10.2f}{100 * t[0] / total[0]:>7.1f}%"
                f"{1e3 * t[1]:>10.2f}{100 * t[1] / total[1]:>7.1f}%")

    lines = [f"{'part':<14}{'wall ms':>10}{'%':>8}{'CPU ms':>10}{'%':>8}"]
    lines += [row(name, t) for name, t in parts.items()]
    lines += [row("sum of parts", total), row("end-to-end", e2e),
              f"ratio end-to-end / sum of parts: wall {e2e[0] / total[0]:.3f}, CPU {e2e[1] / total[1]:.3f} "
              f"(target <= 1.25); {batch / e2e[0]:,.0f} examples/s"]
    return "\n".join(lines)


# ---------------------------------------------------------------- --towers: whole steps per tower


def build_trainers(config: str, towers: list[str], overrides: list[str], tower_sets: dict[str, list[str]],
                   run_dir: str) -> dict:
    """One Trainer per tower, each with its own run folder and the same data and seed; the
    shared overrides reach the towers that read them (the token sizes skip mlp and dcnv2)."""
    from trainer.assembly import build_trainer

    trainers = {}
    for tower in towers:
        unread = unused_fields(load_config(config, [f"--model.tower={tower}"]))
        shared = [o for o in overrides if o[2:].split("=", 1)[0] not in unread]
        extra = [f"--model.tower={tower}", *(f"--{s}" for s in tower_sets.get(tower, [])),
                 f"--train.run_dir={run_dir}/{tower}"]
        with contextlib.redirect_stdout(io.StringIO()):
            trainers[tower] = build_trainer(load_config(config, [*shared, *extra]))
    return trainers


def compare_towers(trainers: dict, rounds: int, warmup: int, steps: int) -> list[dict]:
    """Median seconds per whole training step of every trainer and FLOP/s of a square
    matmul, all timed in turns within each round; one result row per tower."""
    first = next(iter(trainers.values()))
    device = first.env.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # the towers' matmul dtype, as the trainer's peak
    matmul_fn, matmul_flops = matmul_step(device, first.model.module.autocast_dtype or torch.float32)
    batches = {name: t.batches() for name, t in trainers.items()}

    def timed(fn: Callable[[], object], repeat: int) -> float:
        sync()
        tic = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        return (time.perf_counter() - tic) / repeat

    def step(name: str) -> Callable[[], object]:
        return lambda: trainers[name].train_step(batches[name])

    for _ in range(warmup):
        for name in trainers:
            timed(step(name), steps)
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    matmul: list[float] = []
    for _ in range(rounds):
        matmul.append(min(timed(matmul_fn, 1) for _ in range(2)))
        for name in trainers:
            seconds[name].append(timed(step(name), steps))
    peak = matmul_flops / statistics.median(matmul)
    rows = []
    for name, trainer in trainers.items():
        examples = trainer.batch_size / statistics.median(seconds[name])
        rows.append({"tower": name, "examples_per_sec": examples, "flops": trainer.report.cost.flops,
                     "mfu": mfu(examples, trainer.report.cost.flops, peak)})
    for row in rows:
        row["ratio"] = row["examples_per_sec"] / rows[0]["examples_per_sec"]
        row["flops_ratio"] = row["flops"] / first.report.cost.flops
    return rows


def tower_lines(rows: list[dict]) -> str:
    return "\n".join(f"{r['tower']:<14} examples/s {r['examples_per_sec']:>9,.0f} ratio_to_{rows[0]['tower']} "
                     f"{r['ratio']:.2f} flops_ratio {r['flops_ratio']:.2f} mfu {r['mfu']:.2f}" for r in rows)


def parse_tower_sets(items: list[str], towers: list[str]) -> dict[str, list[str]]:
    """['unimixer:model.ffn_ratio=2', ...] -> {'unimixer': ['model.ffn_ratio=2']}."""
    sets: dict[str, list[str]] = {}
    for item in items:
        tower, sep, setting = item.partition(":")
        if not sep or "=" not in setting:
            raise SystemExit(f"--tower-set {item!r}: expected TOWER:SECTION.KEY=VALUE")
        if tower not in towers:
            raise SystemExit(f"--tower-set {item!r}: {tower!r} is not in --towers {','.join(towers)}")
        sets.setdefault(tower, []).append(setting)
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"TOML config (default: {DEFAULT_CONFIG} with {' '.join(DEFAULT_SET)})")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override, repeatable")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (medians are reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also profile this many whole steps and print the top ops")
    parser.add_argument("--towers", metavar="A,B,...",
                        help="compare whole training steps of these towers (the first is the reference)")
    parser.add_argument("--tower-set", action="append", default=[], metavar="TOWER:SECTION.KEY=VALUE",
                        help="with --towers: an override for one tower only, repeatable")
    parser.add_argument("--steps", type=int, default=5, help="with --towers: whole steps per tower per round")
    parser.add_argument("--json", action="store_true",
                        help="also print the parts' (wall, CPU) ms and the forward FLOPs a row as a JSON line")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # TorchRec's ShardedTensor deprecation
    base = () if args.config else DEFAULT_SET
    run_dir = tempfile.mkdtemp(prefix="rankmix-e2e-")
    # the parts call the lookups outside a pipelined step, which TorchRec's pipeline forbids; so
    # under torchrun the whole step is the plain loop's too (training pipelines past one rank)
    forced = (*FORCED_SET, *(("train.pipeline=none",) if os.environ.get("WORLD_SIZE", "1") != "1" else ()))
    overrides = [f"--{s}" for s in (*base, *args.set, *forced, f"train.run_dir={run_dir}")]
    cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
    m = cfg.model
    print_ = print if os.environ.get("RANK", "0") == "0" else (lambda *a, **k: None)  # torchrun: rank 0 speaks
    print_(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.config or DEFAULT_CONFIG} "
          f"{' '.join(overrides[:len(base) + len(args.set)])}; tower {m.tower} T{m.num_tokens} D{m.hidden_dim} "
          f"L{m.num_layers} k{m.ffn_ratio}, batch {cfg.data.batch_size}, {args.rounds} rounds", flush=True)
    from trainer.dist import shutdown

    try:
        if args.towers:
            towers = args.towers.split(",")
            trainers = build_trainers(args.config or DEFAULT_CONFIG, towers, overrides,
                                      parse_tower_sets(args.tower_set, towers), run_dir)
            print(tower_lines(compare_towers(trainers, args.rounds, args.warmup, args.steps)))
            for name, trainer in trainers.items() if args.profile else ():
                batches = trainer.batches()

                def step(trainer=trainer, batches=batches):
                    return trainer.train_step(batches)

                print(f"\n{name}:\n{profile(step, args.profile, rows=25)}")
            return
        times, parts = bench(cfg, args.rounds, args.warmup)
        env = parts.trainer.env
        if env.rank == 0:  # every rank ran the same parts; rank 0's are printed
            pipeline = type(parts.trainer.pipeline).__name__ if parts.trainer.pipeline else "none (plain loop)"
            print(f"pipeline: {pipeline}"
                  f"; {env.world_size} rank(s); forward FLOPs per sample {parts.trainer.report.cost.flops:,.0f}")
            print(table(times, parts.trainer.batch_size * env.world_size))
            if args.json:
                print(json.dumps({"flops": parts.trainer.report.cost.flops,
                                  "ms": {name: [1e3 * t for t in wall_cpu] for name, wall_cpu in times.items()}}))
        if args.profile:
            text = profile(parts.time_step, args.profile, rows=30)
            print(text if env.rank == 0 else "", end="")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
