"""Saving and loading FBGEMM's table shards without DCP's whole copies (trainer/checkpoint/views.py):
the fused kernel's tables and optimizer states are views of shared buffers, DCP's writer clones
every such view before writing it, and `ViewSavePlanner` hands it the same bytes as tensors of
their own size instead, so that nothing is cloned and the checkpoint reads back the same; a
load reads the rows each target needs, not each saved tensor whole."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torch.distributed.checkpoint import LoadPlan
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.utils import _ReaderView

from trainer.checkpoint.manager import _dcp_load
from trainer.checkpoint.safe_load import LoadPlanner, SafeReader, read_metadata
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


def read(folder, fqn: str, target: torch.Tensor, offsets: list[int]) -> None:
    """SafeReader's read of the part of saved tensor `fqn` at `offsets` that fills `target`: the
    read items a load plans when the saved shards and the rank's differ (another world size)."""
    metadata = read_metadata(folder)
    reader = SafeReader(folder, metadata)
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    planner = LoadPlanner()
    planner.set_up_planner({fqn: target}, metadata, is_coordinator=True)
    zeros = torch.Size([0] * target.dim())
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, zeros), zeros, MetadataIndex(fqn, zeros, 0),
                    torch.Size(offsets), target.shape)
    reader.read_data(LoadPlan([item]), planner).wait()


def test_a_load_reads_only_the_rows_each_target_needs(tmp_path, monkeypatch):
    """A 100,000-row table saved whole, read as two shards of 50,000 rows (what 2 ranks read of a
    1-rank checkpoint): each reads its own rows' bytes alone (and the item's pickle), straight
    into its target. A column-wise
    part, and a tensor saved non-contiguous, go DCP's way (read whole) and come out the same."""
    torch.manual_seed(1)
    rows, half_bytes = 100_000, 50_000 * 8 * 4
    table, dense = torch.randn(rows, 8), torch.randn(6, 3).t()
    dcp.save({"table": table, "dense": dense}, checkpoint_id=str(tmp_path / "ck"), planner=ViewSavePlanner())
    reads = []
    real = _ReaderView.readinto
    monkeypatch.setattr(_ReaderView, "readinto", lambda self, b: reads.append(len(b)) or real(self, b))
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("map_location")) or real_load(*a, **k))
    for lo in (0, rows // 2):
        reads.clear(), loads.clear()
        half = torch.zeros(rows // 2, 8)
        read(tmp_path / "ck", "table", half, [lo, 0])
        assert torch.equal(half, table[lo:lo + rows // 2])
        # the pickle on the meta device (a few small reads), then its rows in one
        assert loads == ["meta"] and max(reads) == half_bytes and sum(reads) < half_bytes + (64 << 10)
    # a target the rows cannot be read into (a GPU's; here one laid out column-major): through a
    # buffer of LOAD_CHUNK_BYTES, 25,000 rows at a time
    monkeypatch.setattr("trainer.checkpoint.views.LOAD_CHUNK_BYTES", 25_000 * 8 * 4)
    reads.clear()
    strided = torch.zeros(8, rows // 2).t()
    read(tmp_path / "ck", "table", strided, [rows // 2, 0])
    assert torch.equal(strided, table[rows // 2:]) and max(reads) == half_bytes // 2
    loads.clear(), reads.clear()
    right = torch.zeros(rows, 4)
    read(tmp_path / "ck", "table", right, [0, 4])
    assert torch.equal(right, table[:, 4:]) and loads == ["meta", "cpu"]  # DCP's whole read after all
    assert sum(reads) > 2 * half_bytes
    loads.clear()
    back = torch.zeros(3, 6)
    read(tmp_path / "ck", "dense", back, [0, 0])
    assert torch.equal(back, dense) and loads == ["meta", "cpu"]
