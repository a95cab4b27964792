"""The training loop: fetch, forward, finiteness check, backward, step, log, validate, evaluate."""

from __future__ import annotations

import json
import logging
import random
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dense.cost import measure_cost, mfu, peak_flops
from embeddings.hooks import TrainingHooks
from trainer.ranking_model import build_model
from embeddings.init import init_embeddings
from embeddings.sharding import shard_model
from trainer.config import Config, per_rank_batch_size
from trainer.config_loader import dump_toml
from trainer.data.batch import Batch
from trainer.data.datasets import build_dataset
from trainer.data.encode import RowEncoder
from trainer.data.partitions import PartitionedReader
from trainer.metrics.progressive import ProgressiveMetrics
from trainer.data.reader import ParquetReader
from trainer.dist import (DistEnv, init_distributed, job_cluster, raise_on_every_rank, reduce_gradients_in_fixed_order,
                          side_group)
from trainer.checkpoint.files import write_atomic
from trainer.checkpoint import manager
from trainer.checkpoint.manager import CheckpointManager, resolve_load_path
from trainer.metrics.logger import MetricLogger, StepMeter
from trainer.metrics.streaming import TrainingWindow
from trainer.pipeline import CheckedSparseDistPipeline
from trainer.credentials import redact_uri
from trainer.errors import Interrupted, NonFiniteLossError
from trainer.lifecycle import GRADIENT, LOSS, StepFlags, StopSignal
from trainer.checkpoint.run_folder import RunLocks
from trainer.calibration import calibrate_heads, reset_heads
from trainer.metrics.evaluation import Evaluator
from trainer.checkpoint.selection import ModelSelection
from trainer.serving.publish import Publisher
from trainer.checkpoint.state import (LRScheduleState, ModelState, OptimizerState, PerRankState, RNGState,
                           TrainedPosition)

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
        self.run_lock = self._claim_run_folder()
        try:
            self._build(cfg)
        except BaseException:
            if self.run_lock is not None:
                self.run_lock.release()
            raise

    def _claim_run_folder(self) -> RunLocks | None:
        """Rank 0 takes the locks of the run folder and of a checkpoint folder configured apart
        (one run per folder); every rank stops when it cannot."""
        folders = {self.run_dir: "--train.run_dir"}
        if self.cfg.checkpoint.folder:
            folders[Path(self.cfg.checkpoint.folder)] = "--checkpoint.folder"
        lock, error = (RunLocks(folders), None) if self.env.is_main else (None, None)
        if lock is not None:
            try:
                lock.acquire()
            except ValueError as e:
                error = str(e)
        raise_on_every_rank(error)
        return lock

    def _build(self, cfg: Config) -> None:
        """Everything the run needs, its checkpoint restored; the run folder's config and plan
        are written last, once the restore accepted this config."""
        seed_everything(cfg.train.seed, cfg.train.deterministic and self.env.device.type == "cpu")
        set_matmul_precision(cfg.train.mixed_precision, self.env.device)
        files = build_dataset(cfg)
        cfg.features = files.features
        self.eval_path = files.eval_path
        self.task_names = [t.name for t in cfg.model.tasks]
        self.task_weights = torch.tensor([t.weight for t in cfg.model.tasks], device=self.env.device)
        self.encoder = RowEncoder(cfg.features, cfg.model.tasks, cfg.data.user_column)
        self.batch_size = per_rank_batch_size(cfg, self.env.world_size)
        self.time_order = cfg.data.order == "time"
        self.train_reader = self._train_reader(files.train_path)
        # The validation split: its own files, or the tail of every training row group.
        self.valid_split = ((cfg.data.valid_path, {}) if cfg.data.valid_path else
                            (files.train_path, {"holdout_fraction": cfg.data.valid_fraction, "holdout": True})
                            if cfg.data.valid_fraction else None)
        if self.valid_split:  # its files' schema and its rows checked now, not after an epoch
            ParquetReader(self.valid_split[0], self.encoder, batch_size=1, drop_last=False,
                          **self.valid_split[1], **self._retries())
        self.selection = ModelSelection(cfg, self.run_dir)
        self.model = self._build_model()
        self.hooks = TrainingHooks.of(self.model)  # what the tower asks of the loop (embeddings/hooks.py)
        self.evaluator = Evaluator(self.model, self.encoder, cfg, self.env, self.hooks, self._retries())
        self.peak_flops = cfg.metrics.peak_tflops * 1e12 or peak_flops(
            self.env.device, autocast_dtype(cfg.train.mixed_precision, self.env.device) or torch.float32)
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._warmups())
        self.pipeline = self._build_pipeline()
        self.step = 0
        self.position = TrainedPosition(self.train_reader, cfg.checkpoint.data_position)
        # In time order the steps are those of the partitions after the restored position (_plan_partitions).
        self.total_steps = cfg.train.steps or (0 if self.time_order else sum(
            self.train_reader.steps_in_epoch(e) for e in range(cfg.train.epochs)))
        if self.total_steps == 0 and not self.time_order:
            raise ValueError(f"{redact_uri(files.train_path)}: not one batch of {self.batch_size} rows "
                             f"per rank in {cfg.train.epochs} epoch(s)")
        self.logger = MetricLogger(self.run_dir, self.total_steps, enabled=self.env.is_main,
                                   tensorboard=cfg.metrics.tensorboard, progress=cfg.metrics.progress)
        self.window = TrainingWindow(self.model, self.task_names, cfg.metrics.window_batches)
        self.progressive = ProgressiveMetrics(self.model, self.task_names, self.env.device) if self.time_order else None
        self._next_evaluated = -1  # the last partition (epoch) metrics.eval_next_partition evaluated
        self.partition_end: list[Callable[[str], None]] = []
        """Called with a partition's name once its last step is trained (data.order=time), after its
        progressive metrics are logged and before any checkpoint of that step: where publishing hooks in."""
        self.checkpoints = CheckpointManager(cfg.checkpoint, self.run_dir, self.env.rank)
        self.stop_signal = StopSignal()
        self.flags = StepFlags(self.env.device)
        self._checked_step = -1  # the step `check` last read the flags after
        self._timed_save_step = -1  # the step after which every rank agreed a timed save is due
        self._stop_at: int | None = None  # the step to stop after, once every rank saw a signal
        self.data_rows: dict[str, int] = {}  # the last complete epoch's rows (see _log_epoch_rows)
        self.checkpoint_parts = {
            "model": ModelState(self.model), "optim": OptimizerState(self.optimizer, self.dense_optimizer),
            "trainer": self, "ranks": PerRankState({"reader": self.position, "rng": RNGState(),
                                                    "scheduler": LRScheduleState(self.scheduler, self.optimizer)})}
        if self.valid_split:
            self.checkpoint_parts["best"] = self.selection.best
        self.restore()
        if self.time_order:
            self._plan_partitions(files.train_path)
        self.publisher = Publisher(cfg, self.model, self.run_dir)  # after the restore: it tracks from here
        if cfg.publish.every_partition:
            self.partition_end.append(lambda partition: self.publish(partition, partition))
        if self.env.is_main:
            self._describe_run()

    def _describe_run(self) -> None:
        """The resolved config and sharding plan into the run folder, and onto the console."""
        dump_toml(self.cfg, self.run_dir / "config.toml")
        plan = str(self.model.plan)
        write_atomic(self.run_dir / "plan.txt", plan + "\n")
        print(f"world size {self.env.world_size}, {self.batch_size} rows per rank, sharding plan:\n{plan}", flush=True)
        print(f"{self.cost.describe()}; peak {self.peak_flops / 1e12:.3g} TFLOP/s per device for MFU", flush=True)

    # ------------------------------------------------------------------ building

    def _retries(self) -> dict:
        """How the readers ride out object-store faults (data.retry_*)."""
        return {"retry_seconds": self.cfg.data.retry_seconds, "retry_attempts": self.cfg.data.retry_attempts}

    def _train_reader(self, path: str) -> ParquetReader | PartitionedReader:
        """data.order: one shuffled file list, or the partitions in time order, each read by a
        ParquetReader of its own (trainer/data/partitions.py)."""
        data = self.cfg.data

        def reader(paths: str, seed: int, epochs: int = 0) -> ParquetReader:
            return ParquetReader(
                paths, self.encoder, batch_size=self.batch_size, shuffle=data.shuffle,
                shuffle_buffer=data.shuffle_buffer, seed=seed, num_epochs=epochs,
                rank=self.env.rank, world_size=self.env.world_size, holdout_fraction=data.valid_fraction,
                pin_memory=self.env.device.type == "cuda", **self._retries())  # then the H2D copies are async
        if not self.time_order:
            return reader(path, self.cfg.train.seed)
        # each partition shuffled with a seed of its own name: the same rows wherever it falls in a run
        return PartitionedReader(
            path, lambda uri, name: reader(uri, (self.cfg.train.seed << 32) + zlib.crc32(name.encode()), 1),
            marker=data.success_marker, **self._retries())

    def _plan_partitions(self, path: str) -> None:
        """Time order, once restored: train.steps, else the steps of the complete partitions after
        the restored position (none is an error for a run that has trained nothing, unless it follows)."""
        self.total_steps = self.cfg.train.steps or self.step + self.train_reader.steps_left()
        if self.total_steps == 0 and not self.cfg.data.follow:
            raise ValueError(f"{redact_uri(path)}: no complete partition with a batch of {self.batch_size} rows "
                             f"per rank (data.order=time, data.success_marker={self.cfg.data.success_marker!r})")
        if self.logger.bar is not None:
            self.logger.bar.total = self.total_steps
        if self.step == self.total_steps and self.step:
            self.logger.write(f"no new complete partition after {self.train_reader.sequence[-1].name}")

    def _build_model(self) -> nn.Module:
        model = build_model(self.cfg, autocast_dtype(self.cfg.train.mixed_precision, self.env.device),
                            self.env.device.type)
        self.cost = measure_cost(model.tower, model.heads, model.layout.width, torch.device("cpu"))  # before it moves
        sharded = shard_model(model, self.cfg.embeddings, self.env.device, job_cluster(self.env.device, self.batch_size),
                              output_dtensor=self.cfg.checkpoint.async_save)
        init_embeddings(sharded, self.cfg.train.seed)
        reduce_gradients_in_fixed_order(sharded)
        return sharded

    def _build_optimizer(self) -> CombinedOptimizer:
        o = self.cfg.optim
        dense = dict(in_backward_optimizer_filter(self.model.named_parameters()))
        self.dense_params = list(dense.values())
        # foreach on every device (torch picks it only on CUDA): one kernel per stage for all
        # tensors instead of a Python loop over them, a tenth of a small model's CPU step.
        self.dense_optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.RMSprop(
            params, lr=o.lr, alpha=o.alpha, eps=o.eps, momentum=o.momentum, weight_decay=o.weight_decay,
            foreach=True))
        # One optimizer for both sides, so that LR schedules reach the fused sparse kernel too.
        return CombinedOptimizer([("sparse", self.model.fused_optimizer), ("dense", self.dense_optimizer)])

    def _warmups(self) -> list:
        """The LR factor of every parameter group after `step` steps (sparse groups first):
        optim.warmup_steps ramps both learning rates, optim.dense_warmup_steps the dense one."""
        def ramp(steps: int):
            return lambda step: min(1.0, (step + 1) / max(steps, 1))
        both, dense = ramp(self.cfg.optim.warmup_steps), ramp(self.cfg.optim.dense_warmup_steps)
        sparse_groups = len(self.model.fused_optimizer.param_groups)
        return [both if i < sparse_groups else (lambda step: both(step) * dense(step))
                for i in range(len(self.optimizer.param_groups))]

    def _build_pipeline(self) -> CheckedSparseDistPipeline | None:
        """train.pipeline; auto pipelines where there is communication to hide."""
        choice = self.cfg.train.pipeline
        if choice == "auto":
            choice = "sparse_dist" if self.env.world_size > 1 or self.env.device.type == "cuda" else "none"
        if choice == "none":
            return None
        # Time order's batches end with the known partitions: the pipeline must still train the
        # two it read ahead (the loop never steps past them).
        return CheckedSparseDistPipeline(self.model, self.optimizer, self.env.device, loss_fn=self._pipeline_loss,
                                         check=self.check_finite, after_backward=self.check_gradients,
                                         execute_all_batches=self.time_order)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train for the configured steps, evaluating on schedule and at the end.
        Raises `Interrupted` after a SIGTERM/SIGINT, once the due checkpoint is saved."""
        batches = self.batches()
        try:
            with self.stop_signal:
                meter = self._train_loop(batches)
                while self._followed():
                    batches.close()
                    batches = self.batches()
                    meter = self._train_loop(batches)
        finally:
            batches.close()  # stops the reader's prefetch thread now, not at interpreter exit
        self.checkpoints.wait()
        if self._stop_at is not None and (self.step < self.total_steps or self.cfg.data.follow):
            raise Interrupted(f"stopped by {self.stop_signal.name} after step {self.step}" +
                              (f"; resume from {self.checkpoints.latest()}" if self.checkpoints.latest() else ""))
        self.restore_best()
        uncalibrated = self.calibrate()
        return self.finish({**uncalibrated, **self.evaluate()}, meter.examples_per_sec)

    def _followed(self) -> bool:
        """data.follow, once the known partitions are trained: poll data.train_path every
        data.poll_seconds until new complete partitions land (True: train them) or a stop signal
        reaches every rank (False, after a checkpoint of this step). Collective: the ranks agree
        on the stop in the flags' all-reduce and on the partitions through rank 0's listing."""
        if not self.cfg.data.follow or self._stop_at is not None or self.step < self.total_steps \
                or self.cfg.train.steps or self.selection.best.exhausted:
            return False
        while True:
            self._checked_step = -1  # every poll reads the flags again, the stop vote with them
            self.check()
            if self.stop_signal.agreed:
                self._stop_at = self.step
                if self.cfg.checkpoint.enabled and not self.cfg.checkpoint.save_final:  # else saved at this step
                    self.save_checkpoint()
                return False
            if self.train_reader.refresh():
                self.total_steps = self.step + self.train_reader.steps_left()
                if self.total_steps > self.step:
                    return True
            time.sleep(self.cfg.data.poll_seconds)

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

    def _train_loop(self, batches: Iterator[Batch]) -> StepMeter:
        """Steps until train.steps (or the epochs) are done; returns the throughput meter."""
        meter = StepMeter(len(self.task_names), self.env.device)
        while self.step < self.total_steps and not self.selection.best.exhausted:
            if self.cfg.metrics.eval_next_partition:
                self.evaluate_next_partition()
            tic = time.perf_counter()
            task_losses = self.train_step(batches)
            meter.add(task_losses, self.batch_size * self.env.world_size, time.perf_counter() - tic)
            self.logger.advance()
            if self._check_due():
                self.check()
            if self._due(self.cfg.metrics.log_every) or self.step == self.total_steps:
                self.log_train(*meter.flush())
            if self.valid_split and self._validation_due():
                self.validate()
            if self._due(self.cfg.metrics.eval_every) and self.step < self.total_steps:
                self.evaluate()
            saved = self.checkpoints.due(self.step, last=self.step == self.total_steps or self.selection.best.exhausted,
                                         timed=self._timed_save_step == self.step)
            if saved:
                self.save_checkpoint()
            if self.publisher.due(self.step):
                self.publish(f"step-{self.step}")
            if self._stopping(saved):
                break
        return meter

    def _log_epoch_rows(self) -> None:
        """At an epoch's last step, log the rows its steps trained on all ranks against the
        rows of the split, so no data goes missing unseen (every training batch is full, so
        the rows trained are the epoch's steps x batch x ranks; fewer than ranks x batch rows
        of the split are left out, see trainer/data/reader.py)."""
        if not self._epoch_ended():
            return
        epoch = self.position.epoch
        rows = self.train_reader.epoch_rows(epoch)
        self.data_rows = {"epoch": epoch, "rows": rows.rows, "rows_trained": rows.used, "rows_dropped": rows.dropped}
        partition = self.position.current.get("partition", "")  # data.order=time: an epoch is a partition
        self.logger.log(self.step, "data", {**self.data_rows, **({"partition": partition} if partition else {})})
        if self.time_order:
            self.on_partition_end(partition)

    def on_partition_end(self, partition: str) -> None:
        """After the last step of `partition` (data.order=time): log its progressive metrics
        (collective), then call the `partition_end` callbacks."""
        self.logger.log(self.step, "progressive", {"partition": partition, "epoch": self.position.epoch,
                                                   **self.progressive.compute()})
        for callback in self.partition_end:
            callback(partition)

    def evaluate_next_partition(self) -> None:
        """Before the first step of a partition that follows trained steps (data.order=time):
        the model's metrics over its files, logged as `next_partition` (collective)."""
        epoch = self._partition_ahead()
        if epoch in (-1, self._next_evaluated):
            return
        self._next_evaluated = epoch
        self.check()
        metrics = self._metrics_on(self.train_reader.uri(epoch))
        self.logger.log(self.step, "next_partition", {"partition": self.train_reader.sequence[epoch].name,
                                                      "epoch": epoch, **metrics})

    def _partition_ahead(self) -> int:
        """The partition (epoch) whose first step is next, -1 inside a partition or before any step."""
        epoch, step = self.position.epoch, self.position.step
        if not self.step or 0 < step < self.train_reader.steps_in_epoch(epoch):
            return -1
        epoch += step > 0
        while self.train_reader.steps_in_epoch(epoch) == 0:  # skipped: fewer rows than a batch per rank
            epoch += 1
        return epoch

    def _epoch_ended(self) -> bool:
        """The step just trained was its epoch's last."""
        return self.position.step >= self.train_reader.steps_in_epoch(self.position.epoch)

    def _validation_due(self) -> bool:
        """Every metrics.valid_every steps, else at every epoch's end, and after the last step."""
        every = self.cfg.metrics.valid_every
        return (self._due(every) if every else self._epoch_ended()) or self.step == self.total_steps

    def epochs_trained(self) -> float:
        """Passes over the training split so far, in fractions of an epoch."""
        epoch, step = self.position.epoch, self.position.step
        return epoch + step / max(self.train_reader.steps_in_epoch(epoch), 1)

    def _stopping(self, saved: bool) -> bool:
        """After a signal that every rank has seen: stop now, saving first unless this step
        was just saved, or train on to a scheduled save due within signal_grace_steps."""
        if self._stop_at is None:
            if not self.stop_signal.agreed:
                return False
            self._stop_at = self._stop_step()
        if self.step < self._stop_at:
            return False
        if not saved and self.cfg.checkpoint.enabled:
            self.save_checkpoint()
        return True

    def _stop_step(self) -> int:
        """The step to stop after: the next scheduled save if it is within the grace, else now."""
        ck = self.cfg.checkpoint
        due = [self.total_steps] if ck.save_final else []
        if ck.interval:
            due.append(-(-self.step // ck.interval) * ck.interval)
        within = [s for s in due if self.step <= s <= self.step + ck.signal_grace_steps]
        return min(within, default=self.step) if ck.enabled else self.step

    def batches(self) -> Iterator[Batch]:
        """The training batches from the current position, for `train_step`."""
        return self.position.track(iter(self.train_reader))

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """One whole training step on the next batch of `batches` (from `batches()`): the
        optimizer step, then the LR schedule, the step count, the data position, the
        after-step hooks and the epoch-end row report. Returns the per-task losses [K] (detached)."""
        task_losses = self._optimizer_step(batches)
        self.scheduler.step()
        self.step += 1
        for hook in self.hooks.after_optimizer_step:
            hook(self.step)
        self.position.advance()
        self._log_epoch_rows()
        return task_losses

    def _optimizer_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Fetch, forward, finiteness check, backward, gradient check, optimizer step."""
        if self.pipeline is not None:  # the same stages, with the next batch's input dist overlapped
            return self.pipeline.progress(batches)
        batch = self.fetch(batches)
        loss, task_losses = self.forward(batch)
        self.check_finite(loss)
        self.backward(loss)
        self.check_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return task_losses.detach()

    def _check_due(self) -> bool:
        """Read the flags (`check`) every train.check_every steps, at every log step (which
        reads the losses back anyway) and after the last step; validation, evaluation and
        saves read them first too."""
        return (self._due(self.cfg.train.check_every) or self._due(self.cfg.metrics.log_every)
                or self.step == self.total_steps)

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def finish(self, metrics: dict[str, float], examples_per_sec: float) -> dict:
        """The run's summary: final metrics and throughput, also saved as summary.json."""
        summary = {"auc": metrics["auc"], "uauc": metrics.get("uauc", float("nan")),
                   "logloss": metrics["logloss"], "ne": metrics["ne"], "calibration": metrics["calibration"],
                   "steps": self.step, "epochs": self.epochs_trained(), "examples_per_sec": examples_per_sec,
                   "dense_params": self.cost.params, "flops_per_sample": self.cost.flops,
                   self.mfu_name: self.mfu(examples_per_sec), "peak_tflops": self.peak_flops / 1e12,
                   "run_dir": str(self.run_dir),
                   **{f"data/{k}": v for k, v in self.data_rows.items()},
                   **(self.selection.summary() if self.valid_split else {}),
                   # per-task and top-level tower metrics, not per layer
                   **{k: v for k, v in metrics.items() if k.count("/") == 1}}
        self.logger.close()
        if self.env.is_main:
            write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary

    def fetch(self, batches) -> Batch:
        """Next training batch, on the device."""
        return next(batches).to(self.env.device, non_blocking=True)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted sum of per-task BCE losses plus the tower's auxiliary losses (the MoE's
        L1 and router consistency), and the per-task losses [K]."""
        logits = self.model(batch)
        task_losses = nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none").mean(dim=0)
        loss = (task_losses * self.task_weights).sum()
        for extra_loss in self.hooks.extra_losses:
            loss = loss + extra_loss()
        return loss, task_losses

    def check_finite(self, loss: torch.Tensor) -> None:
        """Note on the device whether the loss is finite; `check` reads it (reading it here
        would wait for the device every step)."""
        self.flags.note_non_finite(LOSS, loss, self.step + 1)

    def check_gradients(self) -> None:
        """Note on the device whether the dense gradient norm is finite (read by `check`); clip."""
        grads = [p.grad for p in self.dense_params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        self.flags.note_non_finite(GRADIENT, norm, self.step + 1)
        if self.cfg.optim.grad_clip_norm:
            torch.nn.utils.clip_grads_with_norm_(grads, self.cfg.optim.grad_clip_norm, norm)

    def check(self) -> None:
        """Read the flags of the steps since the last read, agreed by every rank in one
        all-reduce (collective; once per step at most): raise NonFiniteLossError on every rank
        if a loss or dense gradient norm was not finite, and take up a stop signal or a timed
        save any rank voted for. Every save reads them first, so no checkpoint holds an update
        of a non-finite step (docs/training.md, "Checks")."""
        if self._checked_step == self.step:
            return
        self._checked_step = self.step
        loss, gradient, stop, save = self.flags.read(
            bool(self.stop_signal.received), self.env.is_main and self.checkpoints.time_due(), self.env.world_size)
        found = [(step, what) for step, what in ((loss, "loss"), (gradient, "dense gradient norm")) if step]
        if found:
            step, what = min(found, key=lambda f: f[0])  # a non-finite loss makes its gradients non-finite too
            raise NonFiniteLossError(f"non-finite {what} at step {step} (read after step {self.step}); training "
                                     f"stopped: no checkpoint holds an update of step {step} or later")
        if stop:
            self.stop_signal.agreed = True
        if save:
            self._timed_save_step = self.step

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients for the dense side; the fused sparse optimizer updates embeddings here."""
        loss.backward()

    def _pipeline_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, task_losses = self.forward(batch)
        return loss, task_losses.detach()

    def log_train(self, task_losses: torch.Tensor, examples_per_sec: float) -> None:
        """Weighted and per-task loss, throughput, both learning rates, the window's AUC, NE and calibration."""
        values = {"loss": float(task_losses @ self.task_weights.cpu().double()),
                  "examples_per_sec": examples_per_sec,
                  **{f"{n}/loss": float(v) for n, v in zip(self.task_names, task_losses)},
                  **{f"lr/{name}": opt.param_groups[0]["lr"] for name, opt in self.optimizer.optimizers},
                  self.mfu_name: self.mfu(examples_per_sec)}
        values.update(self.window.compute())  # a collective: every rank logs
        for hook in self.hooks.metrics:
            values.update(hook("train"))
        self.logger.log(self.step, "train", values)
        self.logger.postfix(loss=values["loss"], ex_per_s=examples_per_sec)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole held-out (test) split, logged as `eval`."""
        self.check()
        metrics = self._metrics_on(self.eval_path)
        self.logger.log(self.step, "eval", metrics)
        return metrics

    def validate(self) -> dict[str, float]:
        """Metrics over the validation split, logged as `valid`; the best so far keeps its
        weights in <run_dir>/best (trainer/checkpoint/selection.py::ModelSelection)."""
        self.check()  # before the best weights are saved
        path, split = self.valid_split
        metrics = self._metrics_on(path, **split)
        epochs = self.epochs_trained()
        self.logger.log(self.step, "valid", {**metrics, "epochs": epochs})
        self.checkpoints.wait()  # one save at a time
        self.selection.record(metrics, self.step, epochs, {"model": self.checkpoint_parts["model"],
                                                            "trainer": {"step": self.step,
                                                                        "world_size": self.env.world_size}})
        return metrics

    def restore_best(self) -> None:
        """End on the best validation's weights (train.restore_best), unless they are the last."""
        if self.valid_split:
            done = self.selection.restore({"model": self.checkpoint_parts["model"]}, self.step)
            if done:
                self.logger.write(done)
                for hook in self.hooks.after_restore:  # the weights' own step (UniMixer's temperature)
                    hook(self.selection.best.step)

    def calibrate(self) -> dict[str, float]:
        """train.calibrate: fit the heads' logit maps on the validation split for the weights the
        run ends on, and keep them with the best weights; returns the test metrics before the
        fit as uncalibrated/*, and the maps (empty when off)."""
        kind = self.cfg.train.calibrate
        if kind == "none" or not self.valid_split:
            return {}
        reset_heads(self.model)  # the raw logits, whatever map the initial weights brought
        before = self._metrics_on(self.eval_path)
        path, split = self.valid_split
        self._metrics_on(path, **split)  # its histogram: the logits before any map
        fitted = calibrate_heads(self.model, self.evaluator.histogram, kind)
        tasks = [t.name for t in self.cfg.model.tasks]
        self.logger.write("calibrated on the validation split: "
                          + ", ".join(f"{t} {a:.4f} z {b:+.4f}" for t, (a, b) in zip(tasks, fitted)))
        if self.selection.keep_weights and self.selection.best.step:  # the run ends on the best weights
            manager.save_weights(self.selection.folder, {"model": self.checkpoint_parts["model"], "trainer": {
                "step": self.selection.best.step, "world_size": self.env.world_size}},
                self.selection.best.step, tag=".calibrated")
        return {**{f"uncalibrated/{k}": before[k] for k in ("auc", "uauc", "logloss", "ne", "calibration") if k in before},
                **{f"{t}/calibration_{name}": v for t, ab in zip(tasks, fitted) for name, v in zip("ab", ab)}}

    def _metrics_on(self, path: str, **split) -> dict[str, float]:
        """The model's metrics over the files at `path` (`split`: a holdout of them)."""
        if self.pipeline is not None:
            self.pipeline.detach()  # the original forward; the next progress() re-attaches
        self.model.eval()
        metrics = self.evaluator(path, **split)
        # Back to training mode now: the pipeline decides whether to zero gradients from
        # the mode the model is in when its next step begins.
        self.model.train()
        return metrics

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The run's progress, the same on every rank (the `trainer` part of a checkpoint;
        the other parts are `checkpoint_parts`)."""
        return {"step": self.step, "world_size": self.env.world_size,
                "epoch": self.position.epoch, "epoch_step": self.position.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]

    def save_checkpoint(self) -> None:
        """Save the run at this step, once the flags are read (`check`): never a non-finite update."""
        self.check()
        self.checkpoints.save(self.step, self.checkpoint_parts, on_done=self.logger.write)

    def publish(self, name: str, partition: str | None = None) -> None:
        """Publish the model as it is after this step as `<publish folder>/<name>`, a serving
        artifact and its delta (trainer/serving/publish.py; collective), once the flags are read."""
        self.check()
        self.checkpoints.wait()  # one save at a time
        folder = self.publisher.publish(name, self.step, {"model": self.checkpoint_parts["model"], "trainer": {
            "step": self.step, "world_size": self.env.world_size}}, partition)
        self.logger.write(f"published {folder}")

    def restore(self) -> None:
        """Resume from this run's newest complete checkpoint, else start from checkpoint.load_path."""
        ck = self.cfg.checkpoint
        latest = [self.checkpoints.latest() if ck.enabled and ck.resume else None]
        dist.broadcast_object_list(latest, src=0, group=side_group())  # every rank resumes from the same one
        if latest[0] is not None:
            self.load_checkpoint(latest[0], full=True)
        elif ck.load_path:
            self.load_checkpoint(resolve_load_path(ck.load_path), full=ck.load_mode == "full")
        for hook in self.hooks.after_restore:
            hook(self.step)

    @property
    def mfu_name(self) -> str:
        """What the MFU is relative to: the peak the user gave (metrics.peak_tflops), or
        a matrix multiply timed at start, which is no vendor peak (bench/tower.py's is)."""
        return "mfu_vs_peak" if self.cfg.metrics.peak_tflops else "mfu_vs_matmul"

    def mfu(self, examples_per_sec: float) -> float:
        """Model FLOPs utilisation of the dense model on this rank's device."""
        return mfu(examples_per_sec / self.env.world_size, self.cost.flops, self.peak_flops)

    def load_checkpoint(self, path: Path, full: bool) -> None:
        """Load `path` into this run: weights only, or the whole training state (collective)."""
        manager.require_saved_world_size(self.cfg.features, path, self.env.world_size)
        if not full:
            manager.load(path, {"model": self.checkpoint_parts["model"]})
            self.logger.write(f"initialised weights from {path}")
            return
        manager.load(path, self.checkpoint_parts)
        self.logger.write(f"resumed from {path} at step {self.step}")


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
