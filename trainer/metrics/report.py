"""What a training run reports beyond its evaluations: the `train` record every
metrics.log_every steps, the `data` record at every epoch's end, and the run's summary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dense.cost import DenseCost, mfu
from embeddings.hooks import TrainingHooks
from trainer.data.assignment import EpochRows
from trainer.files import write_atomic
from trainer.metrics.logger import MetricLogger
from trainer.metrics.streaming import TrainingWindow
from trainer.run_layout import RunFolder


class TrainingReport:
    """The records of a run's training. `data_rows`: the last complete epoch's rows. MFU is
    relative to the peak the user gave (metrics.peak_tflops), or to a matrix multiply timed at
    start (`peak_flops`), which is no vendor peak (bench/tower.py's is)."""

    def __init__(self, logger: MetricLogger, window: TrainingWindow, hooks: TrainingHooks, task_names: list[str],
                 task_weights: torch.Tensor, cost: DenseCost, peak_flops: float, peak_given: bool, world_size: int):
        self.logger, self.window, self.hooks = logger, window, hooks
        self.task_names, self.task_weights = task_names, task_weights
        self.cost, self.peak_flops, self.world_size = cost, peak_flops, world_size
        self.mfu_name = "mfu_vs_peak" if peak_given else "mfu_vs_matmul"
        self.data_rows: dict[str, int] = {}

    def describe(self, run_dir: Path, plan, batch_size: int) -> None:
        """The sharding plan into the run folder; it, the batch and the dense cost onto the console."""
        write_atomic(run_dir / "plan.txt", f"{plan}\n")
        print(f"world size {self.world_size}, {batch_size} rows per rank, sharding plan:\n{plan}\n"
              f"{self.cost.describe()}; peak {self.peak_flops / 1e12:.3g} TFLOP/s per device for MFU", flush=True)

    def mfu(self, examples_per_sec: float) -> dict[str, float]:
        """Model FLOPs utilisation of the dense model on this rank's device."""
        return {self.mfu_name: mfu(examples_per_sec / self.world_size, self.cost.flops, self.peak_flops)}

    def train(self, step: int, task_losses: torch.Tensor, examples_per_sec: float, optimizer) -> None:
        """Weighted and per-task loss, throughput, both learning rates, the window's AUC, NE and
        calibration, and the tower's own values (collective: every rank logs)."""
        values = {"loss": float(task_losses @ self.task_weights.cpu().double()),
                  "examples_per_sec": examples_per_sec,
                  **{f"{n}/loss": float(v) for n, v in zip(self.task_names, task_losses)},
                  **{f"lr/{name}": opt.param_groups[0]["lr"] for name, opt in optimizer.optimizers},
                  **self.mfu(examples_per_sec)}
        values.update(self.window.compute())
        for hook in self.hooks.metrics:
            values.update(hook("train"))
        self.logger.log(step, "train", values)
        self.logger.postfix(loss=values["loss"], ex_per_s=examples_per_sec)

    def epoch(self, step: int, epoch: int, rows: EpochRows, partition: str) -> None:
        """At an epoch's last step, the rows its steps trained on all ranks against the rows of the
        split, so no data goes missing unseen (every training batch is full, so the rows trained
        are the epoch's steps x batch x ranks; fewer than ranks x batch rows of the split are left
        out, see trainer/data/reader.py). In time order an epoch is a partition."""
        self.data_rows = {"epoch": epoch, "rows": rows.rows, "rows_trained": rows.used, "rows_dropped": rows.dropped}
        self.logger.log(step, "data", {**self.data_rows, **({"partition": partition} if partition else {})})

    def summary(self, metrics: dict[str, float], examples_per_sec: float, trained: dict, run_dir: Path,
                is_main: bool) -> dict:
        """The run's summary: final metrics, throughput and `trained` (steps, epochs, the best point),
        also saved as summary.json on rank 0."""
        summary = {"auc": metrics["auc"], "uauc": metrics.get("uauc", float("nan")),
                   "logloss": metrics["logloss"], "ne": metrics["ne"], "calibration": metrics["calibration"],
                   "steps": trained.pop("steps"), "epochs": trained.pop("epochs"), "examples_per_sec": examples_per_sec,
                   "dense_params": self.cost.params, "flops_per_sample": self.cost.flops,
                   **self.mfu(examples_per_sec), "peak_tflops": self.peak_flops / 1e12, "run_dir": str(run_dir),
                   **{f"data/{k}": v for k, v in self.data_rows.items()}, **trained,
                   # per-task and top-level tower metrics, not per layer
                   **{k: v for k, v in metrics.items() if k.count("/") == 1}}
        self.logger.summary(summary)
        self.logger.close()
        if is_main:
            write_atomic(RunFolder(run_dir).summary, json.dumps(summary, indent=1))
        return summary
