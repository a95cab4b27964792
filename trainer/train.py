"""The training loop: fetch, forward, finiteness check, backward, step, log, validate, evaluate.

The Trainer holds the loop; what a run adds to it are components the loop calls through
hooks (trainer/loop_hooks.py): continuous training, calibration and publishing.
"""

from __future__ import annotations

import copy
import logging
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dense.cost import peak_flops
from embeddings.hooks import TrainingHooks
from embeddings.torchrec_compat import input_feature_order
from trainer.calibration import Calibration
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.run_folder import claim_run_folders, run_folders
from trainer.checkpoint.selection import ModelSelection
from trainer.checkpoint.state import LRScheduleState, ModelState, OptimizerState, PerRankState, RNGState, TrainedPosition
from trainer.config import Config, per_rank_batch_size
from trainer.config_loader import dump_toml
from trainer.continuous import ContinuousTraining, partitioned_reader
from trainer.credentials import redact_uri
from trainer.data.batch import Batch
from trainer.data.datasets import build_dataset
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.partitions import PartitionedReader, complete_partitions
from trainer.data.reader import ParquetReader
from trainer.dist import DistEnv, init_distributed, memory_returned, on_own_arena, trim_heap
from trainer.errors import Interrupted
from trainer.lifecycle import GRADIENT, LOSS, StepChecks
from trainer.loop_hooks import LoopComponent
from trainer.metrics.evaluation import Evaluator
from trainer.metrics.logger import MetricLogger, StepMeter
from trainer.metrics.report import TrainingReport
from trainer.metrics.streaming import TrainingWindow
from trainer.optimizer import build_optimizer, warmups
from trainer.pipeline import build_pipeline
from trainer.ranking_model import build_sharded_model
from trainer.serving.publish import Publisher

# TorchRec's own chatter (planner reservations, deprecations inside DMP) is not the user's to act on.
warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
logging.getLogger("torchrec").setLevel(logging.ERROR)
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


class Trainer:
    """One run of `rankmix train`: builds everything from the config, then `fit()`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.env: DistEnv = init_distributed(cfg.launch.backend, cfg.train.device, cfg.launch.pg_timeout_minutes)
        self.run_dir = Path(cfg.train.run_dir)
        # one run per folder: the run folder and the checkpoint folder, wherever it points
        self.run_lock = claim_run_folders(run_folders(self.run_dir, cfg.checkpoint), self.env.is_main)
        try:
            self._build(cfg)
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.release()
            raise

    def _build(self, cfg: Config) -> None:
        """Everything the run needs, its checkpoint restored; the run folder's config and plan
        are written last, once the restore accepted this config."""
        env = self.env
        seed_everything(cfg.train.seed, cfg.train.deterministic and env.device.type == "cpu")
        set_matmul_precision(cfg.train.mixed_precision, env.device)
        files = build_dataset(cfg)
        cfg.features, self.eval_path = files.features, files.eval_path
        self.task_names = [t.name for t in cfg.model.tasks]
        self.task_weights = torch.tensor([t.weight for t in cfg.model.tasks], device=env.device)
        self.encoder = RowEncoder(cfg.features, cfg.model.tasks, cfg.data.user_column, cfg.data.time_column,
                                  cfg.model.sequence.time_buckets)
        self.batch_size = per_rank_batch_size(cfg, env.world_size)
        self.retries = {"retry_seconds": cfg.data.retry_seconds, "retry_attempts": cfg.data.retry_attempts}
        time_order = cfg.data.order == "time"
        # shuffled order over KEY=VALUE folders reads the complete partitions only, as time order does
        train_path = files.train_path if time_order else complete_partitions(
            files.train_path, cfg.data.success_marker, **self.retries)
        self.train_reader = (partitioned_reader(cfg, train_path, self.retries, self._reader) if time_order
                             else self._reader(train_path, cfg.train.seed))
        self.selection = ModelSelection(cfg, self.run_dir, train_path)
        if self.selection.split:  # its files' schema and its rows checked now, not after an epoch
            path, split = self.selection.split
            ParquetReader(path, self.encoder, ReaderOptions.from_config(cfg.data, training=False, batch_size=1,
                                                                        **split))
        precision = autocast_dtype(cfg.train.mixed_precision, env.device)
        self.model, self.cost = build_sharded_model(cfg, env.device, self.batch_size, precision)
        order = input_feature_order(self.model.module.ebc)
        if order:  # before any batch is read: the batches' keys in the sharded tables' order
            self.encoder.order_pooled(order)
        self.hooks = TrainingHooks.of(self.model)  # what the tower asks of the loop (embeddings/hooks.py)
        self.evaluator = Evaluator(self.model, self.encoder, cfg, env, self.hooks, self.retries)
        self.peak_flops = cfg.metrics.peak_tflops * 1e12 or peak_flops(env.device, precision or torch.float32)
        self.optimizer, self.dense_optimizer, self.dense_params = build_optimizer(self.model, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmups(
            self.optimizer, len(self.model.fused_optimizer.param_groups), cfg.optim))
        self.pipeline = build_pipeline(cfg.train.pipeline, env.world_size, env.device, self.model, self.optimizer,
                                       self._pipeline_loss, self.check_finite, self.check_gradients, time_order)
        self.step = 0
        self.position = TrainedPosition(self.train_reader, cfg.checkpoint.data_position)
        # In time order the steps are those of the partitions after the restored position (ContinuousTraining).
        self.total_steps = cfg.train.steps or (0 if time_order else sum(
            self.train_reader.steps_in_epoch(e) for e in range(cfg.train.epochs)))
        if self.total_steps == 0 and not time_order:
            raise ValueError(f"{redact_uri(files.train_path)}: not one batch of {self.batch_size} rows "
                             f"per rank in {cfg.train.epochs} epoch(s)")
        self.logger = MetricLogger(self.run_dir, self.total_steps, enabled=env.is_main,
                                   tensorboard=cfg.metrics.tensorboard, progress=cfg.metrics.progress)
        self.window = TrainingWindow(self.model, self.task_names, cfg.metrics.window_batches)
        self.report = TrainingReport(self.logger, self.window, self.hooks, self.task_names, self.task_weights, self.cost,
                                     self.peak_flops, bool(cfg.metrics.peak_tflops), env.world_size)
        continuous = (ContinuousTraining(cfg, files.train_path, self.train_reader, self.model, self.task_names,
                                         env.device) if time_order else None)
        calibration = Calibration(cfg.train.calibrate, self.task_names)
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir, env.rank)
        self.checks = StepChecks(env.device, env.world_size, env.is_main)
        self.checkpoint_parts = {
            "model": ModelState(self.model), "optim": OptimizerState(self.optimizer, self.dense_optimizer),
            "trainer": self, "ranks": PerRankState({"reader": self.position, "rng": RNGState(),
                                                    "scheduler": LRScheduleState(self.scheduler, self.optimizer)}),
            **{c.checkpoint_part: c for c in (self.selection, continuous, calibration) if c and c.checkpoint_part}}
        self.restore()
        if not (cfg.train.steps or time_order):
            self._count_epoch_steps(cfg.train.epochs)
        # In the order the loop calls them; the publisher tracks lookups from the restored state on.
        self.components: list[LoopComponent] = [c for c in (self.selection, continuous, Publisher(
            cfg, self.model, self.run_dir), calibration) if c]
        for component in self.components:
            component.after_restore(self)
        if env.is_main:
            dump_toml(cfg, self.run_dir / "config.toml")
            self.report.describe(self.run_dir, self.model.plan, self.batch_size)

    def _count_epoch_steps(self, epochs: int) -> None:
        """train.epochs' steps from the restored position: a resume at another world size splits
        the rest of its epoch into another number of steps (trainer/data/elastic.py)."""
        position, reader = self.position, self.train_reader
        self.total_steps = self.step - position.step + sum(reader.steps_in_epoch(e)
                                                           for e in range(position.epoch, epochs))
        if self.logger.bar is not None:
            self.logger.bar.total = self.total_steps

    def _reader(self, paths: str, seed: int, epochs: int = 0) -> ParquetReader:
        """A training reader of this rank's share of `paths`."""
        data = self.cfg.data
        return ParquetReader(paths, self.encoder, ReaderOptions.from_config(
            data, training=True, batch_size=self.batch_size, rank=self.env.rank, world_size=self.env.world_size,
            seed=seed, num_epochs=epochs, pin_memory=self.env.device.type == "cuda"))  # then the H2D copies are async

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
        self.checkpoints.wait()
        if self.stopping and (self.step < self.total_steps or self.cfg.data.follow):
            raise Interrupted(f"stopped by {self.checks.signal.name} after step {self.step}" +
                              (f"; resume from {self.checkpoints.latest()}" if self.checkpoints.latest() else ""))
        extra = {k: v for c in self.components for k, v in c.after_training(self).items()}
        return self.finish({**extra, **self.evaluate()}, meter.examples_per_sec)

    def _train_loop(self, batches: Iterator[Batch]) -> StepMeter:
        """Steps until train.steps (or the epochs) are done; returns the throughput meter."""
        meter = StepMeter(len(self.task_names), self.env.device)
        while self.step < self.total_steps and not self.selection.best.exhausted:
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
            saved = self.checkpoints.due(self.step, last=last or self.selection.best.exhausted,
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
        trained = {"steps": self.step, "epochs": self.epochs_trained(), **self.selection.summary(),
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
            self.logger.write(f"resumed from {path} at step {self.step}" if full else f"initialised weights from {path}")
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


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """train.mixed_precision -> the tower's autocast dtype (weights stay fp32). auto is bf16
    on CUDA only: most CPUs have no bf16 matrix units, and the CPU tests' exact comparisons are fp32."""
    if mixed_precision == "none" or (mixed_precision == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def set_matmul_precision(mixed_precision: str, device: torch.device) -> None:
    """On CUDA, float32 matmuls outside autocast in TF32, unless train.mixed_precision=none
    asks for float32 throughout. The CPU's are left alone (exact tests)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest" if mixed_precision == "none" else "high")


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every generator the run draws from; `deterministic` kernels (CPU runs: on CUDA
    they cost a fill of every new tensor and NCCL and FBGEMM stay non-deterministic)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new tensor with NaN to expose reads of
        # uninitialised memory: a debugging aid that costs a pass over each allocation.
        torch.utils.deterministic.fill_uninitialized_memory = False
