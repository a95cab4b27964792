"""Where numbers go: TensorBoard scalars, metrics.jsonl, MLflow (metrics.mlflow_uri) and a progress
bar (rank 0 only)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from trainer.metrics.mlflow_run import MlflowRun
from trainer.run_layout import RunFolder

_CPU = torch.device("cpu")


class StepMeter:
    """Mean task losses and examples/s since the last flush, and examples/s over the run
    (step time only: evaluation and logging are not counted)."""

    def __init__(self, num_tasks: int, device: torch.device = _CPU):
        # Summed on the device: a copy to the host each step would wait for the GPU.
        self.loss_sum = torch.zeros(num_tasks, dtype=torch.float64, device=device)
        self.steps = self.examples = self.total_examples = 0
        self.seconds = self.total_seconds = 0.0

    def add(self, task_losses: torch.Tensor, examples: int, seconds: float) -> None:
        self.loss_sum += task_losses.double()
        self.steps += 1
        self.examples += examples
        self.seconds += seconds

    def flush(self) -> tuple[torch.Tensor, float]:
        """(mean task losses [K], examples/s) since the last flush; starts a new window."""
        out = self.loss_sum.cpu() / max(self.steps, 1), self.examples / max(self.seconds, 1e-9)
        self.total_examples += self.examples
        self.total_seconds += self.seconds
        self.loss_sum.zero_()
        self.steps, self.examples, self.seconds = 0, 0, 0.0
        return out

    @property
    def examples_per_sec(self) -> float:
        return (self.total_examples + self.examples) / max(self.total_seconds + self.seconds, 1e-9)


class MetricLogger:
    """Writes each record as one JSON line, as TensorBoard scalars under `prefix/key` and, with
    `mlflow` = (tracking URI, experiment, params), as MLflow metrics."""

    def __init__(self, run_dir: Path, total_steps: int, *, enabled: bool, tensorboard: bool, progress: bool,
                 mlflow: tuple[str, str, dict[str, str]] | None = None):
        self.enabled = enabled
        self.writer = None
        self.bar = None
        self.jsonl = None
        self.mlflow: MlflowRun | None = None
        if not enabled:
            return
        self.jsonl = open(RunFolder(run_dir).metrics, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only when used
            self.writer = SummaryWriter(log_dir=str(RunFolder(run_dir).tensorboard))
        if progress:
            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, mininterval=1.0)
        if mlflow is not None:
            uri, experiment, params = mlflow
            self.mlflow = MlflowRun(uri, experiment, str(Path(run_dir).resolve()), params, self.write)

    def log(self, step: int, prefix: str, values: dict[str, float]) -> None:
        """Record `values` at `step` (train/..., eval/...)."""
        if not self.enabled:
            return
        record = {"step": step, "kind": prefix, "time": time.time(), **values}
        self.jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{prefix}/{key}", value, step)
        if self.mlflow is not None:
            self.mlflow.log(step, prefix, values)

    def artifact(self, name: str, folder: str) -> None:
        """A published artifact's folder (MLflow's tag rankmix.artifact.<name>)."""
        if self.mlflow is not None:
            self.mlflow.artifact(name, folder)

    def summary(self, summary: dict) -> None:
        """The run's summary (MLflow's summary/* metrics; the run marked finished)."""
        if self.mlflow is not None:
            self.mlflow.finish(summary)

    def advance(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def postfix(self, **values: float) -> None:
        """Show the latest loss and examples/s beside the bar."""
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)

    def write(self, message: str) -> None:
        """A line for the user, printed without breaking the progress bar (rank 0 only)."""
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(message)

    def close(self) -> None:
        if self.mlflow is not None:
            self.mlflow.close()
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
