"""A training step reads nothing back from the device (issues 31, 39): the finiteness checks, the
stop-signal and timed-save votes are read once every train.check_every steps; a non-finite
step is found at the next read and never reaches a checkpoint. bf16 runs through the
pipeline and DDP on the CPU, and the CUDA precision settings."""

from __future__ import annotations

import json
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from cli import rankmix, rendezvous_port, spawn
from test_checkpoint import tensors
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
TORCH = Path(torch.__file__).parent
SITE = TORCH.parent
aten = torch.ops.aten
# What makes the host wait for the device on a GPU: a value read back, and an operation
# whose output size depends on the values (the host waits to allocate it).
SYNC_OPS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
            aten.masked_select.default: "masked_select", aten._unique2.default: "unique",
            aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique",
            aten.repeat_interleave.Tensor: "repeat_interleave"}
INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "barrier")


@pytest.fixture(scope="module")
def cache(made_once) -> Path:
    return made_once("step-checks-cache", lambda folder: None)


def _caller() -> tuple[str, str]:
    """(`file:line`, function) of the innermost caller outside torch: rankmix's, torchrec's, fbgemm's."""
    frame = sys._getframe(1)
    while frame is not None and (Path(frame.f_code.co_filename).is_relative_to(TORCH)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?", "?"
    path = Path(frame.f_code.co_filename)
    for root in (SITE, REPO):
        if path.is_relative_to(root):
            path = path.relative_to(root)
            break
    return f"{path}:{frame.f_lineno}", frame.f_code.co_name


def torchrec_own(call: list) -> bool:
    """A read TorchRec makes by design: its input distribution reads the split sizes back
    (on a GPU on its data-distribution stream, while the compute stream runs on), and it
    validates the first batch once as it builds the input distribution."""
    _, _, where, function = call
    return (function in ("_safe_tolist", "_safe_tolist_2d")
            or where.startswith("torchrec/sparse/jagged_tensor_validator.py"))


class DeviceTensors:
    """Which tensors of this CPU run would be on the device in a GPU run: the model's
    parameters and buffers, tensors made on the run's device (the trainer's `device`, or a
    device tensor's `.device`), whatever is moved there, and every result computed from one.
    Everything else is on the host: the reader's batches before they are moved, the
    optimizers' step counts, tensors made with `device="cpu"`."""

    def __init__(self, device: torch.device, tensors):
        self.tensors = WeakTensorKeyDictionary()
        self.devices = {id(device): device}  # held, so that no other device object takes an id
        self.tag(list(tensors))

    def tag(self, tree) -> None:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self.tensors[t] = True

    def untag(self, tensor: torch.Tensor) -> None:
        self.tensors.pop(tensor, None)

    def holds(self, *trees) -> bool:
        return any(isinstance(t, torch.Tensor) and t in self.tensors for t in pytree.tree_leaves(trees))

    def is_device(self, where) -> bool:
        return id(where) in self.devices or isinstance(where, torch.Tensor) and self.holds(where)

    def is_host(self, where) -> bool:
        """`where` names the host: "cpu", or a CPU device object not taken from the device."""
        if isinstance(where, str):
            where = torch.device(where)
        return (isinstance(where, torch.device) and where.type == "cpu" and not self.is_device(where)
                or isinstance(where, torch.Tensor) and not self.holds(where))


def _destination(args: tuple, kwargs: dict):
    """The device or tensor that `Tensor.to(*args, **kwargs)` moves to; None for a dtype only."""
    for where in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(where, (str, torch.device, torch.Tensor)):
            return where
    return None


class _Moves(TorchFunctionMode):
    """Python's calls, from anyone's code: reads and transfers of device tensors to the host
    (on a CPU build `.to("cpu")` and `.cpu()` return the tensor itself, below any dispatch)."""

    def __init__(self, device: DeviceTensors, record):
        super().__init__()
        self.device, self.record = device, record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name, on_device = getattr(func, "__name__", ""), self.device.holds(args[:1])
        if getattr(func, "__self__", None) is torch.Tensor.device:
            if on_device:
                self.device.devices[id(out)] = out
        elif name in ("tolist", "numpy", "__array__") and on_device:
            self.record(name)
        elif on_device and (name == "cpu" or name == "to" and self.device.is_host(_destination(args[1:], kwargs))):
            self.record(f"{name} to the host")
            self.device.untag(out)  # on the host now (and on a CPU build, the very tensor moved)
        elif self.device.is_device(kwargs.get("device")) or name == "to" and self.device.is_device(
                _destination(args[1:], kwargs)):
            self.device.tag(out)  # made on the device, or moved there
        return out


def _sync(func, args: tuple) -> str | None:
    """What makes `func(*args)` a host sync on a GPU; None when nothing does. A boolean index
    is one: the GPU's kernels count its true entries (a nonzero) first."""
    if func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                for i in args[1]):
        return "boolean index"
    return SYNC_OPS.get(func)


class _Syncs(TorchDispatchMode):
    """Every operator, from Python or C++: reads of device tensors, data-sized outputs, and
    copies from a device tensor into a host one; and which results are device tensors."""

    def __init__(self, device: DeviceTensors, record):
        super().__init__()
        self.device, self.record = device, record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = self.device.holds(args, kwargs)
        to_host = func is aten.copy_.default and not self.device.holds(args[0]) and on_device
        if on_device and _sync(func, args) is not None:
            self.record(_sync(func, args))
        if to_host:
            self.record("copy_ to the host")
        out = func(*args, **kwargs)
        if on_device and not to_host:
            self.device.tag(out)
        return out


@contextmanager
def counting(calls: list, step: list[int], device: DeviceTensors):
    """Record (step[0], what, caller) for each host sync on this thread, whoever's code makes it
    (rankmix's, torch's, torchrec's, fbgemm's), and each object collective or barrier (the
    reader's prefetch threads work on host data). Every call still runs."""
    main = threading.current_thread()
    saved = {}

    def record(what: str) -> None:
        calls.append((step[0], what, *_caller()))

    def wrap(name: str) -> None:
        original = saved[name] = getattr(dist, name)

        def counted(*args, **kwargs):
            if threading.current_thread() is main:
                record(name)
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    for name in OBJECT_COLLECTIVES:
        wrap(name)
    try:
        with _Moves(device, record), _Syncs(device, record):
            yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _count_worker(rank: int, world: int, port: int, args: list[str], out: str, config: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trainer.assembly import build_trainer
    from trainer.dist import shutdown

    trainer = build_trainer(load_config(config, args))
    calls: list = []
    step = [0]
    device = DeviceTensors(trainer.env.device, [*trainer.model.parameters(), *trainer.model.buffers()])
    train_step = trainer.train_step

    def step_counted(batches):  # what follows is attributed to the step it starts
        step[0] = trainer.step + 1
        return train_step(batches)
    trainer.train_step = step_counted
    try:
        with counting(calls, step, device):
            trainer.fit()
    finally:
        trainer.close()
        shutdown()
    Path(f"{out}.{rank}").write_text(json.dumps({"calls": calls, "pipelined": trainer.pipeline is not None}))


# unimixer_lite with a transformer sequence: its device-side scaling and the attention in one run
@pytest.mark.parametrize("tower,sequence", [("rankmixer", "pool"), ("rankmixer_moe", "pool"),
                                            ("unimixer_lite", "transformer")])
def test_steps_between_checks_read_nothing_back(tower, sequence, cache, tmp_path):
    """10 steps on 2 ranks (pipelined, DDP), checks, logs and saves every 5 steps, a timed
    save configured: steps 1-4 and 6-9 make no host sync (a read, a data-sized output, a
    move or copy to the host) and no object collective, on either rank, whoever's code would
    make it: rankmix's, torch's, torchrec's or fbgemm's, but for TorchRec's own input
    distribution (`torchrec_own`). Steps 5 and 10 read the flags once. With an attended
    sequence too: the sequence teacher's behaviours with their timestamps, the item table an
    EmbeddingCollection, each batch padded to its longest row, the gaps bucketed by the reader."""
    config = REPO / "configs" / ("debug.toml" if sequence == "pool" else "sequence.toml")
    extra = ([] if sequence == "pool"
             else [f"--features.hist_items.sequence_module={sequence}", "--data.synth_rows=4000"])
    args = [*extra, f"--model.tower={tower}", "--train.steps=10", "--train.check_every=5", "--metrics.log_every=5",
            "--checkpoint.interval=5", "--checkpoint.interval_minutes=600", "--metrics.eval_batches=1",
            "--metrics.progress=false", "--metrics.tensorboard=false", f"--train.run_dir={tmp_path / 'run'}",
            f"--data.cache_dir={cache}"]
    spawn(_count_worker, (2, rendezvous_port(), args, str(tmp_path / "calls"), str(config)), 2)
    for rank in range(2):
        result = json.loads((tmp_path / f"calls.{rank}").read_text())
        assert result["pipelined"]
        calls = result["calls"]
        assert any(c[3] == "_safe_tolist" for c in calls), "the counting sees into torchrec"
        syncs = [c for c in calls if not torchrec_own(c)]
        assert [c for c in syncs if c[0] not in (5, 10)] == [], rank
        flag_reads = [c for c in syncs if c[1] == "tolist" and c[2].startswith("trainer/lifecycle.py")]
        assert [c[0] for c in flag_reads] == [5, 10], calls


def _nan_data(tmp_path: Path, row: int) -> Path:
    """A config of the debug model on a 2000-row synthetic log whose raw `item_price` is 3e38
    at `row`: finite in float32, and non-finite once the tokenizer sums it."""
    data = tmp_path / "data"
    proc = rankmix("data", "synth", "--out", str(data), "--rows", "2000", "--files", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    part = data / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    values = table.column("item_price").to_numpy().astype(np.float32)
    values[row] = 3e38
    pq.write_table(table.set_column(table.schema.get_field_index("item_price"), "item_price", pa.array(values)),
                   part, row_group_size=table.num_rows)
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
    cfg.features = synth_features()
    next(f for f in cfg.features if f.name == "item_price").transform = []  # the raw value reaches the model
    dump_toml(cfg, tmp_path / "config.toml")
    return data


def test_a_non_finite_step_is_found_at_the_next_check_and_no_checkpoint_holds_it(tmp_path):
    """Step 7's batch overflows (batch 16, rows in order); checks and saves every 5 steps: the
    run stops at step 10's check with exit code 3, naming step 7; the checkpoint of step 5
    is the last and finite, step 10's never written."""
    data = _nan_data(tmp_path, row=6 * 16 + 3)
    run = tmp_path / "run"
    proc = rankmix("train", "--config", str(tmp_path / "config.toml"), f"--data.train_path={data / 'train'}",
                   f"--data.eval_path={data / 'valid'}", "--data.shuffle=false", "--data.batch_size=16",
                   "--train.steps=12", "--train.check_every=5", "--metrics.log_every=0", "--checkpoint.interval=5",
                   f"--train.run_dir={run}", "--metrics.progress=false", "--metrics.tensorboard=false")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("rankmix: stopped: non-finite loss at step 7 (read after step 10); "
                                            "training stopped: no checkpoint holds an update of step 7 or later")
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-5"]
    state = tensors(run / "checkpoints" / "step-5", tmp_path)
    weights = [v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()]
    assert weights and all(torch.isfinite(w).all() for w in weights)


def _bf16_worker(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.nn.parallel import DistributedDataParallel

    from dense.rankmixer import RankMixerTower
    from trainer.assembly import build_trainer
    from trainer.dist import shutdown

    trainer = build_trainer(load_config(str(REPO / "configs" / "debug.toml"), args))
    tower = next(m for m in trainer.model.modules() if isinstance(m, RankMixerTower))
    dtypes: list[str] = []
    tower.register_forward_hook(lambda module, inputs, output: dtypes.append(str(output.dtype)))
    batches = trainer.batches()
    losses = [float((trainer.train_step(batches) * trainer.task_weights).sum()) for _ in range(4)]
    ddp = any(isinstance(m, DistributedDataParallel) for m in trainer.model.modules())
    batches.close()
    trainer.close()
    shutdown()
    Path(f"{out}.{rank}").write_text(json.dumps({"losses": losses, "dtypes": dtypes, "ddp": ddp,
                                                 "pipelined": trainer.pipeline is not None}))


def test_bf16_trains_through_the_pipeline_and_ddp_on_two_cpu_ranks(cache, tmp_path):
    args = ["--train.mixed_precision=bf16", "--train.device=cpu", "--metrics.progress=false",
            "--metrics.tensorboard=false", f"--train.run_dir={tmp_path / 'run'}", f"--data.cache_dir={cache}"]
    spawn(_bf16_worker, (2, rendezvous_port(), args, str(tmp_path / "out")), 2)
    for rank in range(2):
        result = json.loads((tmp_path / f"out.{rank}").read_text())
        assert result["pipelined"] and result["ddp"]
        assert result["dtypes"] and set(result["dtypes"]) == {"torch.bfloat16"}
        assert all(np.isfinite(result["losses"])) and result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("choice,device,dtype,matmul", [
    ("auto", "cuda", torch.bfloat16, "high"), ("bf16", "cuda", torch.bfloat16, "high"),
    ("none", "cuda", None, "highest"), ("auto", "cpu", None, "highest"), ("bf16", "cpu", torch.bfloat16, "highest")])
def test_precision_choices(choice, device, dtype, matmul):
    """auto is bf16 autocast with TF32 matmuls on CUDA and float32 on the CPU; none opts out of both."""
    from trainer.precision import autocast_dtype, set_matmul_precision

    assert autocast_dtype(choice, torch.device(device)) == dtype
    try:
        set_matmul_precision(choice, torch.device(device))
        assert torch.get_float32_matmul_precision() == matmul
    finally:
        torch.set_float32_matmul_precision("highest")
