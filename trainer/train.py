"""The training loop: fetch, forward, finiteness check, backward, step, log, validate, evaluate.

The Trainer holds the loop over a run's parts (`RunParts`, built by trainer/assembly.py); what a
run adds to it are components (trainer/components/), which the loop calls through hooks and
which see it through the narrow door of `trainer.components.base.Loop`.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from embeddings.hooks import TrainingHooks
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.run_folder import RunLocks
from trainer.checkpoint.state import (
    LRScheduleState,
    ModelState,
    OptimizerState,
    PerRankState,
    RNGState,
    TrainedPosition,
)
from trainer.components.base import LoopComponent
from trainer.config import Config
from trainer.config_loader import dump_toml
from trainer.data.batch import Batch
from trainer.data.encode import RowEncoder
from trainer.data.partitions import PartitionedReader
from trainer.data.reader import ParquetReader
from trainer.dist import DistEnv, memory_returned, on_own_arena, trim_heap
from trainer.errors import Interrupted
from trainer.lifecycle import GRADIENT, LOSS, StepChecks
from trainer.metrics.evaluation import Evaluator
from trainer.metrics.logger import MetricLogger, StepMeter
from trainer.metrics.report import TrainingReport
from trainer.metrics.streaming import TrainingWindow
from trainer.pipeline import build_pipeline
from trainer.run_layout import RunFolder

# TorchRec's own chatter (planner reservations, deprecations inside DMP) is not the user's to act on.
warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
logging.getLogger("torchrec").setLevel(logging.ERROR)
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@dataclass
class RunParts:
    """What the loop runs, built from the config (trainer/assembly.py `build_parts`)."""

    cfg: Config
    env: DistEnv
    run_dir: Path
    run_lock: RunLocks | None
    """The claim on the run's folders (None on the ranks other than 0)."""
    eval_path: str
    """The test split's files."""
    task_names: list[str]
    task_weights: torch.Tensor
    encoder: RowEncoder
    batch_size: int
    """Rows per rank per step."""
    train_reader: ParquetReader | PartitionedReader
    position: TrainedPosition
    total_steps: int
    """The planned steps (time order: 0 until continuous training counts its partitions)."""
    model: nn.Module
    hooks: TrainingHooks
    evaluator: Evaluator
    optimizer: torch.optim.Optimizer
    dense_optimizer: torch.optim.Optimizer
    dense_params: list[nn.Parameter]
    scheduler: torch.optim.lr_scheduler.LambdaLR
    logger: MetricLogger
    window: TrainingWindow
    report: TrainingReport
    checkpoints: CheckpointManager


class Trainer:
    """One run of `rankmix train`: the loop over its parts, then `fit()` (trainer/assembly.py
    `build_trainer` builds one from a config)."""

    def __init__(self, parts: RunParts, components: list[LoopComponent]):
        """The loop over `parts`, calling `components` in order; restores the run, then writes its config and plan."""
        p, cfg, env = parts, parts.cfg, parts.env
        self.cfg, self.env, self.run_dir, self.run_lock, self.eval_path = cfg, env, p.run_dir, p.run_lock, p.eval_path
        self.task_names, self.task_weights, self.batch_size = p.task_names, p.task_weights, p.batch_size
        self.train_reader, self.encoder, self.position, self.total_steps = (p.train_reader, p.encoder, p.position,
                                                                            p.total_steps)
        self.model, self.hooks, self.evaluator = p.model, p.hooks, p.evaluator
        self.optimizer, self.dense_optimizer, self.dense_params = p.optimizer, p.dense_optimizer, p.dense_params
        self.scheduler, self.checkpoints, self.components = p.scheduler, p.checkpoints, components
        self.logger, self.window, self.report = p.logger, p.window, p.report
        time_order = cfg.data.order == "time"
        self.pipeline = build_pipeline(cfg.train.pipeline, env.world_size, env.device, self.model, self.optimizer,
                                       self._pipeline_loss, self.check_finite, self.check_gradients, time_order)
        self.step, self.stop_requested = 0, False  # a component sets it to end the training after this step
        self.checks = StepChecks(env.device, env.world_size, env.is_main)
        self.checkpoint_parts = {
            "model": ModelState(self.model), "optim": OptimizerState(self.optimizer, self.dense_optimizer),
            "trainer": self, "ranks": PerRankState({"reader": self.position, "rng": RNGState(),
                                                    "scheduler": LRScheduleState(self.scheduler, self.optimizer)}),
            **{c.checkpoint_part: c for c in components if c.checkpoint_part}}
        self.restore()
        if not (cfg.train.steps or time_order):
            self._count_epoch_steps(cfg.train.epochs)
        for component in components:
            component.after_restore(self)
        if env.is_main:
            dump_toml(cfg, RunFolder(self.run_dir).config)
            self.report.describe(self.run_dir, self.model.plan, self.batch_size)

    def _count_epoch_steps(self, epochs: int) -> None:
        """train.epochs' steps from the restored position: a resume at another world size splits
        the rest of its epoch into another number of steps (trainer/data/elastic.py)."""
        position, reader = self.position, self.train_reader
        self.total_steps = self.step - position.step + sum(reader.steps_in_epoch(e)
                                                           for e in range(position.epoch, epochs))
        if self.logger.bar is not None:
            self.logger.bar.total = self.total_steps

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train for the configured steps, evaluating on schedule and at the end.
        Raises `Interrupted` after a SIGTERM/SIGINT, once the due checkpoint is saved."""
        batches = self.batches()
        try:
            with self.checks.signal:
                meter = self._train_loop(batches)
                while any(c.train_on(self) for c in self.components):
                    batches.close()
                    batches = self.batches()
                    meter = self._train_loop(batches)
        finally:
            batches.close()  # stops the reader's prefetch thread now, not at interpreter exit
        self.wait_for_save()
        if self.stopping and (self.step < self.total_steps or self.cfg.data.follow):
            raise Interrupted(f"stopped by {self.checks.signal.name} after step {self.step}" +
                              (f"; resume from {self.checkpoints.latest()}" if self.checkpoints.latest() else ""))
        extra = {k: v for c in self.components for k, v in c.after_training(self).items()}
        return self.finish({**extra, **self.evaluate()}, meter.examples_per_sec)

    def _train_loop(self, batches: Iterator[Batch]) -> StepMeter:
        """Steps until train.steps (or the epochs) are done; returns the throughput meter."""
        meter = StepMeter(len(self.task_names), self.env.device)
        while self.step < self.total_steps and not self.stop_requested:
            for component in self.components:
                component.before_step(self)
            tic = time.perf_counter()
            task_losses = self.train_step(batches)
            meter.add(task_losses, self.batch_size * self.env.world_size, time.perf_counter() - tic)
            self.logger.advance()
            last = self.step == self.total_steps
            # the flags every train.check_every steps, at every log step (which reads the losses back
            # anyway) and after the last step; validation, evaluation and saves read them first too
            if self.due(self.cfg.train.check_every) or self.due(self.cfg.metrics.log_every) or last:
                self.check()
            if self.due(self.cfg.metrics.log_every) or last:
                self.report.train(self.step, *meter.flush(), self.optimizer)
            for component in self.components:
                component.after_step(self)
            if self.due(self.cfg.metrics.eval_every) and not last:
                self.evaluate()
            saved = self.checkpoints.due(self.step, last=last or self.stop_requested,
                                         timed=self.checks.timed_save_step == self.step)
            if saved:
                self.save_checkpoint()
            for component in self.components:
                component.after_checkpoint(self)
            if self.checks.stop_now(self.step, self.cfg.checkpoint, self.total_steps):
                if not saved and self.cfg.checkpoint.enabled:
                    self.save_checkpoint()
                break
        return meter

    def batches(self) -> Iterator[Batch]:
        """The training batches from the current position, for `train_step`."""
        return self.position.track(iter(self.train_reader))

    def side_batches(self) -> Iterator[Batch]:
        """Training batches from a copy of the reader: taking them moves no data position (the
        benchmarks time the parts of a step on them)."""
        return iter(copy.copy(self.train_reader))

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """One whole training step on the next batch of `batches` (from `batches()`): the
        optimizer step, then the LR schedule, the step count, the data position, the
        after-step hooks and the epoch-end row report. Returns the per-task losses [K] (detached)."""
        if self.pipeline is not None:  # the same stages, with the next batch's input dist overlapped
            task_losses = self.pipeline.progress(batches)
        else:
            loss, task_losses = self.forward(self.fetch(batches))
            self.check_finite(loss)
            loss.backward()  # the fused sparse optimizer updates the embeddings here
            self.check_gradients()
            self.optimizer_step()
            task_losses = task_losses.detach()
        self.scheduler.step()
        self.step += 1
        trim_heap(self.step)
        for hook in self.hooks.after_optimizer_step:
            hook(self.step)
        self.position.advance()
        self._epoch_end()
        return task_losses

    def fetch(self, batches: Iterator[Batch]) -> Batch:
        """Next training batch, on the device (the reader's batches are on the CPU: there, as they are)."""
        batch = next(batches)
        return batch if self.env.device.type == "cpu" else batch.to(self.env.device, non_blocking=True)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The task loss plus the tower's auxiliary losses (the MoE's L1 and router consistency),
        and the per-task losses [K]."""
        loss, task_losses = self.loss(self.model(batch), batch.labels)
        for extra_loss in self.hooks.extra_losses:
            loss = loss + extra_loss()
        return loss, task_losses

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The task-weighted sum of each task's mean binary cross-entropy, and those [K], of `logits` [B, K]."""
        task_losses = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(dim=0)
        return (task_losses * self.task_weights).sum(), task_losses

    def _pipeline_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, task_losses = self.forward(batch)
        return loss, task_losses.detach()

    def check_finite(self, loss: torch.Tensor) -> None:
        """Note on the device whether the loss is finite; `check` reads it (reading it here
        would wait for the device every step)."""
        self.checks.flags.note_non_finite(LOSS, loss, self.step + 1)

    def check_gradients(self) -> None:
        """Note on the device whether the dense gradient norm is finite (read by `check`); clip."""
        grads = [p.grad for p in self.dense_params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        self.checks.flags.note_non_finite(GRADIENT, norm, self.step + 1)
        if self.cfg.optim.grad_clip_norm:
            torch.nn.utils.clip_grads_with_norm_(grads, self.cfg.optim.grad_clip_norm, norm)

    def optimizer_step(self) -> None:
        """Both optimizers' step, then the gradients cleared."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters the dense optimizer steps (the tables' are stepped inside backward)."""
        return self.dense_params

    def check(self) -> None:
        """Read the flags of the steps since the last read in one all-reduce (collective; once per
        step at most; lifecycle.py StepChecks). Every save reads them first, so no checkpoint
        holds an update of a non-finite step (docs/training.md, "Checks")."""
        if self.run_lock is not None:  # a run whose folder another took over stops here, before any write
            self.run_lock.verify()
        self.checks.check(self.step, self.checkpoints.time_due)

    @property
    def stopping(self) -> bool:
        """Every rank has seen a stop signal, and the step to stop after is set."""
        return self.checks.stop_at is not None

    def poll_stop(self) -> bool:
        """Read the flags again now, the stop vote with them (collective). True when every rank has
        seen a stop signal: the run stops after this step, which is then saved."""
        if not self.checks.poll(self.step, self.checkpoints.time_due):
            return False
        if self.cfg.checkpoint.enabled and not self.cfg.checkpoint.save_final:  # else saved at this step
            self.save_checkpoint()
        return True

    def _epoch_end(self) -> None:
        """At an epoch's last step: its rows reported, and in time order, where an epoch is a
        partition, the components' `partition_end`."""
        if not self.epoch_ended():
            return
        partition = self.position.current.get("partition", "")
        self.report.epoch(self.step, self.position.epoch, self.train_reader.epoch_rows(self.position.epoch), partition)
        if isinstance(self.train_reader, PartitionedReader):
            for component in self.components:
                component.partition_end(self, partition)

    def epoch_ended(self) -> bool:
        """The step just trained was its epoch's last."""
        return self.position.step >= self.train_reader.steps_in_epoch(self.position.epoch)

    def epochs_trained(self) -> float:
        """Passes over the training split so far, in fractions of an epoch."""
        epoch, step = self.position.epoch, self.position.step
        return epoch + step / max(self.train_reader.steps_in_epoch(epoch), 1)

    def steps_in_epoch(self) -> int:
        """Steps of the epoch being trained (in time order: of the partition)."""
        return self.train_reader.steps_in_epoch(self.position.epoch)

    def due(self, every: int) -> bool:
        """This step is one of every `every` (0: none)."""
        return every > 0 and self.step % every == 0

    # ------------------------------------------------------------------ metrics

    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole held-out (test) split, logged as `eval`."""
        self.check()
        metrics = self.metrics_on(self.eval_path)
        self.logger.log(self.step, "eval", metrics)
        return metrics

    def metrics_on(self, path: str, **split) -> dict[str, float]:
        """The model's metrics over the files at `path` (`split`: a holdout of them)."""
        if self.pipeline is not None:
            self.pipeline.detach()  # the original forward; the next progress() re-attaches
        self.model.eval()
        with memory_returned():
            metrics = on_own_arena(self.evaluator, path, **split)
        # Back to training mode now: the pipeline decides whether to zero gradients from
        # the mode the model is in when its next step begins.
        self.model.train()
        return metrics

    def finish(self, metrics: dict[str, float], examples_per_sec: float) -> dict:
        """The run's summary: final metrics and throughput, also saved as summary.json."""
        trained = {"steps": self.step, "epochs": self.epochs_trained(),
                   **{k: v for c in self.components for k, v in c.summary().items()},
                   "data/rows_reread": self.position.rows_reread}
        return self.report.summary(metrics, examples_per_sec, trained, self.run_dir, self.env.is_main)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The run's progress, the same on every rank (the `trainer` part of a checkpoint;
        the other parts are `checkpoint_parts`)."""
        return {"step": self.step, "world_size": self.env.world_size,
                "epoch": self.position.epoch, "epoch_step": self.position.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def weights(self, step: int | None = None) -> dict:
        """The checkpoint parts of the model's weights as they are, trained to `step` (default: this one)."""
        return {"model": self.checkpoint_parts["model"],
                "trainer": {"step": self.step if step is None else step, "world_size": self.env.world_size}}

    def wait_for_save(self) -> None:
        """Wait for the checkpoint save in flight, if any."""
        self.checkpoints.wait()

    def save_checkpoint(self) -> None:
        """Save the run at this step, once the flags are read (`check`): never a non-finite update."""
        self.check()
        self.checkpoints.save(self.step, self.checkpoint_parts, on_done=self.logger.write)

    def restore(self) -> None:
        """Resume from this run's newest complete checkpoint, else start from checkpoint.load_path
        (collective)."""
        loaded = self.checkpoints.restore(self.checkpoint_parts, self.cfg.features, self.env.world_size)
        if loaded:
            path, full = loaded
            self.logger.write(f"resumed from {path} at step {self.step}" if full
                              else f"initialised weights from {path}")
        self.after_restore(self.step)

    def after_restore(self, step: int) -> None:
        """The model's after_restore hooks, for weights trained to `step` (UniMixer's temperature)."""
        for hook in self.hooks.after_restore:
            hook(step)

    def close(self, ok: bool = True) -> None:
        """Release what outlives the loop, in dependency order, on success and failure alike:
        an async save is finished (after a failure only waited on for a bounded time: a
        dead rank would never join its collectives), then the metric writers close. The
        reader's threads are already stopped by fit(); the caller then leaves the process group
        (`trainer.dist.shutdown`), which waits for the collectives still in flight."""
        if self.pipeline is not None:
            self.pipeline.reset()  # its read-ahead batches and their input-dist outputs
        self.checkpoints.close(wait=ok)
        self.logger.close()
        if self.run_lock is not None:
            self.run_lock.release()
