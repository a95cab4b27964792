"""The sharding plan is made on rank 0 and sent to the others (embeddings/sharding.py): when
rank 0's planner fails, every rank ends at once with its line, instead of the others waiting
in the broadcast until the process group's timeout."""

import json
import os
import time
from datetime import timedelta
from pathlib import Path

from cli import rankmix_ranks, rendezvous_port, spawn

NO_PLAN = ("TorchRec's planner found no plan for 2 x cpu with 1000000000 rows per rank and step "
           "(data.batch_size, or data.global_batch_size over the ranks): Unable to find a plan for this model "
           "because of insufficient storage. `rankmix plan` shows the details")


def _plan_with_a_live_rank_0(rank: int, port: int, out: str) -> None:
    """Each rank plans a batch no host holds; rank 0 then stays up until rank 1 has written its
    outcome (at most 40 s), as a rank does whose process outlives its error (its connection
    stays open, so rank 1 learns nothing from it closing). The group's timeout is 30 s."""
    import torch.distributed as dist

    from embeddings.sharding import Cluster, build_plan
    from trainer.config_loader import load_config
    from trainer.data.datasets import synth_features
    from trainer.ranking_model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    cfg = load_config(None, ["--embeddings.plan=auto"])
    cfg.features = synth_features()
    start = time.monotonic()
    try:
        build_plan(build_model(cfg), cfg.embeddings, Cluster(2, 2, "cpu", 10 ** 9, None, None))
        outcome = "planned"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    Path(f"{out}/{rank}.json").write_text(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start}))
    deadline = time.monotonic() + 40
    while rank == 0 and not Path(f"{out}/1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_planner_error_on_rank_0_reaches_a_waiting_rank_at_once(tmp_path):
    """Before, rank 1 waited in the broadcast for the group's whole timeout (30 s here, 30
    minutes in a job), then failed with gloo's timeout, not the planner's line."""
    spawn(_plan_with_a_live_rank_0, (rendezvous_port(), str(tmp_path)), 2)
    outcomes = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [o["outcome"] for o in outcomes] == [f"NoPlanError: {NO_PLAN}"] * 2, outcomes
    assert outcomes[1]["seconds"] < 15, outcomes  # rank 0's planning; the broadcast itself takes no time


def test_a_planner_error_ends_every_rank_of_a_run_with_its_line(tmp_path):
    """Before, rank 1 ended in a traceback of gloo's ("Connection closed by peer") once rank 0
    had exited; a rank still waiting is killed by `rankmix_ranks` 30 s after the first exit
    (TimeoutExpired)."""
    proc = rankmix_ranks(2, "--config", "configs/debug.toml", f"--train.run_dir={tmp_path}/run",
                         f"--data.cache_dir={tmp_path}/data", "--data.batch_size=1000000000", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rankmix:")]
    assert lines == [f"rankmix: error: {NO_PLAN}"] * 2, proc.stderr[-3000:]  # one per rank
