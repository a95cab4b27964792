"""Training trims the heap it keeps (issue 56): `init_distributed` tunes malloc to keep freed
memory (trainer/dist.py `tune_malloc`), and the training step hands the free pages back every
`HEAP_TRIM_EVERY` steps (`trim_heap`), or a rank's resident memory creeps past what `rankmix
plan` counts. Observed as the process's resident memory around the steps of a Trainer in this
process, with a freed 256 MB block in its heap."""

from pathlib import Path

import pytest
import torch.distributed as dist

from test_dist_unit import freed_block_mb, rss_mb
from trainer.config_loader import load_config
from trainer.dist import HEAP_TRIM_EVERY, shutdown

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def trainer(made_once, tmp_path, monkeypatch):
    """A Trainer of the debug config in this process (a world of one), closed afterwards and its
    process group, if it made it, left again."""
    from trainer.assembly import build_trainer

    cache = made_once("trim-training-cache", lambda folder: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards, as init_distributed sets them
    own = not dist.is_initialized()
    args = ["--data.synth_rows=3000", "--data.batch_size=64", "--train.steps=12", "--checkpoint.enabled=false",
            "--metrics.progress=false", "--metrics.tensorboard=false", "--metrics.log_every=0",
            "--metrics.eval_every=0", f"--train.run_dir={tmp_path / 'run'}", f"--data.cache_dir={cache}"]
    made = build_trainer(load_config(str(REPO / "configs" / "debug.toml"), args))
    yield made
    made.close()
    if own:
        shutdown()


def test_training_steps_hand_the_kept_heap_back_every_fifth_step(trainer):
    assert HEAP_TRIM_EVERY == 5
    batches = trainer.batches()
    try:
        for _ in range(3):
            trainer.train_step(batches)
        kept = freed_block_mb()  # the Trainer tuned malloc: a freed block stays in the heap
        before = rss_mb()
        trainer.train_step(batches)  # step 4
        after_4 = rss_mb()
        trainer.train_step(batches)  # step 5: trimmed
        after_5 = rss_mb()
    finally:
        batches.close()
    assert trainer.step == 5
    assert kept > 200, kept
    assert before - after_4 < 50, (before, after_4)  # step 4 keeps it
    assert before - after_5 > 200, (before, after_5)  # step 5 hands it back
