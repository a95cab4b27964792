"""An annealed UniMixer checkpoint serves at its annealed temperature (issue 56): the temperature
is a non-persistent buffer, a function of the trained step, so what loads a checkpoint must run
the tower's `after_restore` hook. Saved and loaded through the checkpoint code in this process
(a world of one), the scoring model (`rankmix score`) and the export's serving model give what
the in-memory model gives at the schedule's temperature, not at tau 1."""

import pytest
import torch

from dense.model_config import TaskSpec
from dense.unimixer import UniMixerTower
from test_serving_model import features, table
from trainer.checkpoint.manager import model_tensors, save_weights, trained_step
from trainer.checkpoint.state import ModelState
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.run_layout import resolve_checkpoint
from trainer.serving.export import serving_model
from trainer.serving.predict import raw_inputs

STEP = 5  # of tau_anneal_steps = 10 from 1.0 to 0.05: tau = 1 - 0.95 * 5 / 10
TAU = 0.525


def tower_of(model: torch.nn.Module) -> UniMixerTower:
    return next(m for m in model.modules() if isinstance(m, UniMixerTower))


def test_an_annealed_checkpoint_scores_and_exports_at_its_annealed_temperature(world_of_one, tmp_path):
    from embeddings.sharding import shard_model
    from trainer.ranking_model import build_model
    from trainer.score import CheckpointModel

    cfg = load_config(None, ["--model.tower=unimixer", "--model.num_tokens=4", "--model.hidden_dim=16",
                             "--model.unimixer.tau_anneal_steps=10", "--model.unimixer.tau_end=0.05",
                             "--train.device=cpu", "--launch.backend=gloo"])
    cfg.features = features()
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    torch.manual_seed(0)
    trained = shard_model(build_model(cfg), cfg.embeddings, world_of_one.device)
    # best weights are saved as `Trainer.weights` gives them: the model and the step that trained it
    save_weights(tmp_path / "best", {"model": ModelState(trained), "trainer": {"step": STEP, "world_size": 1}}, STEP)

    rows = table()
    batch = RowEncoder(cfg.features, cfg.model.tasks).encode(rows, "test").to_batch()
    trained.eval()
    tower = tower_of(trained)
    with torch.no_grad():
        at_start = torch.sigmoid(trained(batch))
        tower.set_step(STEP)
        assert tower.tau.item() == pytest.approx(TAU)
        expected = torch.sigmoid(trained(batch))
    assert (expected - at_start).abs().max() > 1e-3  # the temperature shows in the scores

    scoring = CheckpointModel(cfg, str(tmp_path / "best"))
    assert tower_of(scoring.model).tau.item() == pytest.approx(TAU)
    with torch.no_grad():
        _, scored, _ = scoring.predict(rows, RowEncoder(cfg.features, cfg.model.tasks), "test")
    torch.testing.assert_close(scored, expected, atol=1e-6, rtol=0)

    source = resolve_checkpoint(str(tmp_path / "best"), "--checkpoint")
    assert trained_step(source) == STEP
    served = serving_model(cfg, model_tensors(source), trained_step(source))
    assert served.tower.tower.tau.item() == pytest.approx(TAU)  # the FrozenMixing's tower
    with torch.no_grad():
        exported = served(*raw_inputs(rows, cfg.features, "test"))
    torch.testing.assert_close(exported, expected, atol=1e-6, rtol=0)
