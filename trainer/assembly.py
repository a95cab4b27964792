"""A run's parts built from its config (`build_trainer`): the data and its readers, the model
and its optimizers, the metrics and checkpoints, and the loop's components
(trainer/components/); trainer/train.py's `Trainer` is the loop that runs them.

The order of the building is the run's: the seeds first, then every part that draws from them
in a fixed order, so that two runs of one config start from the same weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from dense.cost import peak_flops
from embeddings.hooks import TrainingHooks
from embeddings.torchrec_compat import input_feature_order
from trainer.auto_width import choose_width
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.run_folder import RunLocks, claim_run_folders, run_folders
from trainer.checkpoint.state import TrainedPosition
from trainer.components.base import LoopComponent
from trainer.components.calibration import Calibration
from trainer.components.continuous import ContinuousTraining, partitioned_reader
from trainer.components.publisher import Publishing
from trainer.components.selection import ModelSelection
from trainer.config import Config, per_rank_batch_size
from trainer.config_loader import to_dict
from trainer.credentials import redact_uri
from trainer.data.datasets import build_dataset
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.partitions import complete_partitions
from trainer.data.reader import ParquetReader
from trainer.dist import DistEnv, init_distributed
from trainer.metrics.evaluation import Evaluator
from trainer.metrics.logger import MetricLogger
from trainer.metrics.mlflow_run import flat_params
from trainer.metrics.report import TrainingReport
from trainer.metrics.streaming import TrainingWindow
from trainer.optimizer import build_optimizer, warmups
from trainer.precision import autocast_dtype, set_matmul_precision
from trainer.ranking_model import build_sharded_model
from trainer.serving.publish import Publisher
from trainer.train import RunParts, Trainer


def build_trainer(cfg: Config) -> Trainer:
    """The Trainer of one run of `rankmix train`, its parts built and its checkpoint restored
    (collective). One run per folder: the run folder and the checkpoint folder, wherever it
    points, are claimed first, and released again if the building fails."""
    env = init_distributed(cfg.launch.backend, cfg.train.device, cfg.launch.pg_timeout_minutes)
    run_dir = Path(cfg.train.run_dir)
    run_lock = claim_run_folders(run_folders(run_dir, cfg.checkpoint), env.is_main)
    try:
        return Trainer(*build_parts(cfg, env, run_dir, run_lock))
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise


def build_parts(cfg: Config, env: DistEnv, run_dir: Path, run_lock: RunLocks | None) \
        -> tuple[RunParts, list[LoopComponent]]:
    """Everything the loop runs, and its components in the order it calls them; nothing restored yet."""
    seed_everything(cfg.train.seed, cfg.train.deterministic and env.device.type == "cpu")
    set_matmul_precision(cfg.train.mixed_precision, env.device)
    files = build_dataset(cfg)
    cfg.features = files.features
    task_names = [t.name for t in cfg.model.tasks]
    task_weights = torch.tensor([t.weight for t in cfg.model.tasks], device=env.device)
    encoder = RowEncoder(cfg.features, cfg.model.tasks, cfg.data.user_column, cfg.data.time_column,
                         cfg.model.sequence.time_buckets, cfg.data.request_column)
    batch_size = per_rank_batch_size(cfg, env.world_size)
    retries = {"retry_seconds": cfg.data.retry_seconds, "retry_attempts": cfg.data.retry_attempts}
    time_order = cfg.data.order == "time"

    def reader(paths: str, seed: int, epochs: int = 0) -> ParquetReader:
        """A training reader of this rank's share of `paths`."""
        return ParquetReader(paths, encoder, ReaderOptions.from_config(
            cfg.data, training=True, batch_size=batch_size, rank=env.rank, world_size=env.world_size,
            seed=seed, num_epochs=epochs, pin_memory=env.device.type == "cuda"))  # then the H2D copies are async

    # shuffled order over KEY=VALUE folders reads the complete partitions only, as time order does
    train_path = files.train_path if time_order else complete_partitions(
        files.train_path, cfg.data.success_marker, **retries)
    train_reader = partitioned_reader(cfg, train_path, retries, reader) if time_order else reader(train_path,
                                                                                                  cfg.train.seed)
    selection = ModelSelection(cfg, run_dir, train_path, files.valid_path)
    if selection.split:  # its files' schema and its rows checked now, not after an epoch
        path, split = selection.split
        ParquetReader(path, encoder, ReaderOptions.from_config(cfg.data, training=False, batch_size=1, **split))
    width_choice = choose_width(cfg, None if time_order else train_reader.num_rows, run_dir)
    if width_choice and env.is_main:
        print(width_choice, flush=True)
    precision = autocast_dtype(cfg.train.mixed_precision, env.device)
    model, cost = build_sharded_model(cfg, env.device, batch_size, precision)
    order = input_feature_order(model.module.ebc)
    if order:  # before any batch is read: the batches' keys in the sharded tables' order
        encoder.order_pooled(order)
    hooks = TrainingHooks.of(model)  # what the tower asks of the loop (embeddings/hooks.py)
    evaluator = Evaluator(model, encoder, cfg, env, hooks)
    flops = cfg.metrics.peak_tflops * 1e12 or peak_flops(env.device, precision or torch.float32)
    optimizer, dense_optimizer, dense_params = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmups(
        optimizer, len(model.fused_optimizer.param_groups), cfg.optim))
    position = TrainedPosition(train_reader, cfg.checkpoint.data_position, files.pin)
    # In time order the steps are those of the partitions after the restored position (ContinuousTraining).
    total_steps = cfg.train.steps or (0 if time_order else sum(
        train_reader.steps_in_epoch(e) for e in range(cfg.train.epochs)))
    if total_steps == 0 and not time_order:
        raise ValueError(f"{redact_uri(files.train_path)}: not one batch of {batch_size} rows "
                         f"per rank in {cfg.train.epochs} epoch(s)")
    mlflow = (cfg.metrics.mlflow_uri, cfg.metrics.mlflow_experiment, flat_params(to_dict(cfg))) \
        if cfg.metrics.mlflow_uri and env.is_main else None
    logger = MetricLogger(run_dir, total_steps, enabled=env.is_main, tensorboard=cfg.metrics.tensorboard,
                          progress=cfg.metrics.progress, mlflow=mlflow)
    window = TrainingWindow(model, task_names, cfg.metrics.window_batches)
    report = TrainingReport(logger, window, hooks, task_names, task_weights, cost, flops,
                            bool(cfg.metrics.peak_tflops), env.world_size)
    continuous = (ContinuousTraining(cfg, files.train_path, train_reader, model, task_names, env.device, batch_size)
                  if time_order else None)
    calibration = Calibration(cfg.train.calibrate, task_names, selection, model, evaluator, files.eval_path)
    # the publisher tracks lookups from here on: the restore looks none up
    publishing = Publishing(Publisher(cfg, model, run_dir))
    parts = RunParts(
        cfg=cfg, env=env, run_dir=run_dir, run_lock=run_lock, eval_path=files.eval_path, task_names=task_names,
        task_weights=task_weights, encoder=encoder, batch_size=batch_size, train_reader=train_reader,
        position=position, total_steps=total_steps, model=model, hooks=hooks, evaluator=evaluator,
        optimizer=optimizer, dense_optimizer=dense_optimizer, dense_params=dense_params, scheduler=scheduler,
        logger=logger, window=window, report=report,
        checkpoints=CheckpointManager(cfg.checkpoint, run_dir, env.rank))
    return parts, [c for c in (selection, continuous, publishing, calibration) if c]


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
