"""Saving FBGEMM's table views without DCP's copy of each (trainer/checkpoint/views.py): the
fused kernel's tables and optimizer states are views of shared buffers, DCP's writer clones
every such view before writing it, and `ViewSavePlanner` hands it the same bytes as tensors of
their own size instead, so that nothing is cloned and the checkpoint reads back the same."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from trainer.checkpoint.manager import _dcp_load
from trainer.checkpoint.safe_load import read_metadata
from trainer.checkpoint.views import ViewSavePlanner, own_bytes


def fused_state() -> dict[str, torch.Tensor]:
    """Two tables of one CPU kernel, with row-wise Adagrad: each weight and state a view."""
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(100, 8, EmbeddingLocation.HOST, ComputeDevice.CPU), (50, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    (m0,), (m1,) = tbe.split_optimizer_states()
    w0, w1 = tbe.split_embedding_weights()
    torch.manual_seed(0)
    for t in (w0, w1, m0, m1):
        t.copy_(torch.randn(t.shape))
    return {"w0": w0, "w1": w1, "m0": m0, "m1": m1, "plain": torch.arange(6.0)}


def test_fbgemm_tables_are_views_and_own_bytes_shares_exactly_theirs():
    state = fused_state()
    for name in ("w0", "w1", "m0", "m1"):
        view = state[name]
        assert view.untyped_storage().nbytes() > view.nbytes  # what makes DCP's writer clone it
        owned = own_bytes(view)
        assert owned.untyped_storage().nbytes() == owned.nbytes == view.nbytes
        assert owned.data_ptr() == view.data_ptr() and torch.equal(owned, view) and owned.stride() == view.stride()
    assert own_bytes(state["plain"]) is state["plain"]
    strided = state["w0"][:, :4]  # not contiguous: left to DCP's clone
    assert own_bytes(strided) is strided


def test_a_save_of_the_views_clones_nothing_and_reads_back_the_same(tmp_path, monkeypatch):
    state = fused_state()
    clones = []
    real = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: clones.append(self.nbytes) or real(self, *a, **k))
    dcp.save(state, checkpoint_id=str(tmp_path / "default"))
    assert sorted(clones) == sorted(state[n].nbytes for n in ("w0", "w1", "m0", "m1"))  # DCP's own copies
    clones.clear()
    dcp.save(state, checkpoint_id=str(tmp_path / "views"), planner=ViewSavePlanner())
    assert clones == []
    monkeypatch.undo()
    for folder in ("default", "views"):
        loaded = {name: torch.zeros_like(t) for name, t in state.items()}
        _dcp_load(loaded, tmp_path / folder, read_metadata(tmp_path / folder))
        for name, t in state.items():
            assert torch.equal(loaded[name], t), (folder, name)
