"""A run's lifecycle, what `rankmix train` calls once it has read the config: one training, or
UniMixer's two (trainer/unimixer_two_stage.py); each built (trainer/assembly.py), fitted and
closed, whatever happened, in the order its parts need."""

from __future__ import annotations

from trainer.assembly import build_trainer
from trainer.config import Config
from trainer.dist import shutdown
from trainer.errors import Interrupted, NonFiniteLossError
from trainer.unimixer_two_stage import cold_stage, hot_stage, hot_summary, two_stages


def train(cfg: Config) -> dict | None:
    """Train `cfg`, in UniMixer's two stages where it asks for them; its summary on rank 0 (the
    cold stage's, with the hot stage's as `hot/<key>`), None on the other ranks."""
    if not two_stages(cfg):
        return train_once(cfg)
    if hot_summary(cfg) is None:
        train_once(hot_stage(cfg), last=False)
    hot = {f"hot/{k}": v for k, v in hot_summary(cfg).items() if isinstance(v, (int, float))}
    summary = train_once(cold_stage(cfg))
    return None if summary is None else {**summary, **hot}


def train_once(cfg: Config, last: bool = True) -> dict | None:
    """Train `cfg`; its summary on rank 0, None on the other ranks. A training that is not the
    `last` leaves the process group to the next."""
    trainer, ok = None, False  # ok: every rank reached the same point, so they can still meet
    try:
        trainer = build_trainer(cfg)
        summary = trainer.fit()
        ok = True
    except (NonFiniteLossError, Interrupted):  # every rank raises these after the same step
        ok = True
        raise
    finally:  # threads and writers first, the process group last, whatever happened
        if trainer is not None:
            trainer.close(ok)
        if last or not ok:
            shutdown(wait_for_peers=ok)
    return summary if trainer.env.is_main else None
