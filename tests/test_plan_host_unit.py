"""`rankmix plan`'s host memory (launch/plan.py `host_memory`), in-process and without the
planner, so that `make test-mutation` reaches it: a schema of each feature kind, the bytes
worked out by hand from the reader's, the init's and evaluation's buffers, and the fullest
node. tests/test_plan_host.py checks the same figures through whole plans."""

from pathlib import Path

import pytest

from launch.plan import HostMemory, RankMemory, _fullest_node, evaluation_bytes, host_memory, row_bytes
from trainer.config_loader import load_config

SLICE, BUCKET, BINS, BLOCK, READ_BUFFER, RUNTIME = 65_536, 131_072, 2**20, 16_384, 2**20, 2**29

SCHEMA = """
[data]
dataset = "synth"
user_column = "user"
batch_size = 32
eval_batch_size = 1000
shuffle_buffer = 5000

[metrics]
window_batches = 7

[[model.tasks]]
name = "click"

[[model.tasks]]
name = "like"

[[features]]
name = "user"
num_embeddings = 100
embedding_dim = 8

[[features]]
name = "tags"
kind = "id_list"
num_embeddings = 50
embedding_dim = 12
max_len = 5

[[features]]
name = "history"
kind = "sequence"
num_embeddings = 50
embedding_dim = 4

[[features]]
name = "price"
kind = "numeric"

[[features]]
name = "age"
kind = "numeric"
"""
# user: one int64 id; tags: 5 ids and an offset; history (no max_len): one id and an offset;
# two float32 numeric features, two float32 labels, the int64 user
ROW = 8 + (5 * 8 + 8) + (8 + 8) + 2 * 4 + 2 * 4 + 8
COLUMNS = 7  # user (the user column too), tags, history, price, age, click, like


def _config(tmp_path: Path, *overrides: str, schema: str = SCHEMA):
    path = tmp_path / "schema.toml"
    path.write_text(schema)
    return load_config(str(path), list(overrides))


def test_a_rows_bytes_count_each_kind_of_feature(tmp_path):
    assert row_bytes(_config(tmp_path)) == ROW == 96
    assert row_bytes(_config(tmp_path, "--data.user_column=")) == ROW - 8
    assert row_bytes(_config(tmp_path, "--features.history.max_len=3")) == ROW + 2 * 8


def test_evaluation_holds_histograms_a_uauc_bucket_the_window_and_its_reader(tmp_path):
    cfg = _config(tmp_path)
    histograms = 2 * 2 * BINS * 8  # two tasks, two labels, float64 bins
    uauc = 3 * BUCKET * (8 + 2 * 8)  # a bucket of (user, two logits, two labels) rows and the sort's copies
    window = 7 * 32 * 2 * 8  # 7 batches of int64 codes for two tasks
    reader = (4 * SLICE + 1000) * ROW  # the window, the next, the slice being encoded and one decoded ahead
    assert evaluation_bytes(cfg, 32, ROW) == histograms + uauc + window + reader
    # no user column: no UAUC; another batch changes only the window
    assert evaluation_bytes(_config(tmp_path, "--data.user_column="), 48, ROW) == \
        histograms + 7 * 48 * 2 * 8 + reader


MEMORY = [RankMemory(tables=1000, optimizer=300, estimate=1500, id_maps=40, largest=600),
          RankMemory(tables=7000, optimizer=900, estimate=9000, id_maps=0, largest=4000)]
DENSE, DENSE_PARAMS = 2400, 200  # weights, gradients and RMSProp state of 200 parameters


@pytest.mark.parametrize("device, prefetched", [("cpu", 0), ("cuda", 2)])
@pytest.mark.parametrize("async_save", [False, True])
def test_each_ranks_host_memory(tmp_path, device, prefetched, async_save):
    cfg = _config(tmp_path, f"--checkpoint.async_save={str(async_save).lower()}")
    host = host_memory(cfg, MEMORY, DENSE, DENSE_PARAMS, device, 32)
    init = 2 * BLOCK * 12 * 4  # two fp32 blocks of the widest table (tags, 12), numeric features have none
    # the window consumed, the next one and its pieces being concatenated, the slice being encoded
    # and one decoded ahead, the batch (and on a GPU the pinned ones), a read buffer per column
    reader = (3 * (5000 + SLICE) + 2 * SLICE + (1 + prefetched) * 32) * ROW + COLUMNS * READ_BUFFER
    evaluation = evaluation_bytes(cfg, 32, ROW)
    want = []
    for m in MEMORY:
        resident = m.estimate + DENSE if device == "cpu" else 0
        # a checkpoint stages the tables, optimizer state, id maps and the dense state without gradients
        staged = m.tables + m.optimizer + m.id_maps + DENSE - 4 * DENSE_PARAMS if async_save else 0
        # a load reads a CPU rank's rows into place, a GPU rank's through a buffer of its largest shard
        load = m.largest if device == "cuda" else 0
        want.append(HostMemory(resident, init, reader, evaluation, staged, load))
    assert host == want
    assert host[0].total == RUNTIME + sum((host[0].resident, init, reader, evaluation, host[0].async_save,
                                           600 if device == "cuda" else 0))


def test_a_ranks_activations_add_to_its_host_memory(tmp_path):
    cfg = _config(tmp_path)
    bare, with_activations = (host_memory(cfg, MEMORY, DENSE, DENSE_PARAMS, "cpu", 32, activations=a)
                              for a in (0, 7777))
    assert [h.activations for h in bare] == [0, 0] and [h.activations for h in with_activations] == [7777, 7777]
    assert [h.total - b.total for h, b in zip(with_activations, bare)] == [7777, 7777]


def test_a_gpu_ranks_load_buffer_holds_its_largest_tensor_up_to_64_mib(tmp_path):
    cfg = _config(tmp_path)
    assert [h.load for h in host_memory(cfg, MEMORY, DENSE, DENSE_PARAMS, "cuda", 32, largest_dense=2000)] == \
        [2000, 4000]
    rows_only = [RankMemory(1 << 40, 0, 1 << 40, largest=1 << 40)]
    assert [host_memory(cfg, rows_only, DENSE, DENSE_PARAMS, d, 32)[0].load for d in ("cuda", "cpu")] == [64 << 20, 0]
    # a GPU rank that holds no table and is told of no dense tensor needs no buffer
    assert host_memory(cfg, [RankMemory(0, 0, 0)], DENSE, DENSE_PARAMS, "cuda", 32)[0].load == 0


def test_a_user_column_of_its_own_is_read_too(tmp_path):
    """A user column that no feature reads takes a read buffer of its own; the user
    feature's column is read once."""
    user, uid = (host_memory(_config(tmp_path, f"--data.user_column={c}"), MEMORY, DENSE, DENSE_PARAMS, "cpu", 32)
                 for c in ("user", "uid"))
    assert [h.reader - READ_BUFFER for h in uid] == [h.reader for h in user]


def test_a_schema_of_numeric_features_draws_no_blocks(tmp_path):
    schema = SCHEMA.split("[[features]]")[0] + '[[features]]\nname = "price"\nkind = "numeric"\n'
    cfg = _config(tmp_path, "--data.user_column=", schema=schema)
    assert host_memory(cfg, MEMORY[:1], 0, 0, "cpu", 32)[0].init == 0


def _host(total: int) -> HostMemory:
    return HostMemory(total - RUNTIME, 0, 0, 0, 0)


@pytest.mark.parametrize("totals, per_node, fullest", [
    ([10, 20, 30, 40, 5, 6], 2, (1, 70)),
    ([10, 20, 30, 40, 5, 6], 3, (0, 60)),
    ([5, 6, 10, 20, 30, 40], 3, (1, 90)),
    ([50, 1, 30, 21, 40, 11], 2, (0, 51)),  # a tie: the first node
    ([10, 20, 30, 40], 1, (3, 40)),
    ([10, 20, 30, 40], 4, (0, 100)),
])
def test_the_fullest_node_sums_its_consecutive_ranks(totals, per_node, fullest):
    node, need = _fullest_node([_host(RUNTIME + t) for t in totals], per_node)
    assert (node, need - per_node * RUNTIME) == fullest


def test_a_sequences_timestamps_and_the_request_time_are_read_too(tmp_path):
    """An attended sequence with timestamps reads two columns more: its timestamps and the
    rows' request time."""
    attended = ["--features.history.sequence_module=target_attention", "--features.history.max_len=4",
                "--features.history.candidate=user", "--features.history.embedding_dim=8"]
    plain, timed = (host_memory(_config(tmp_path, *attended, *extra), MEMORY, DENSE, DENSE_PARAMS, "cpu", 32)
                    for extra in ([], ["--features.history.timestamps=history_ts", "--data.time_column=ts"]))
    assert [h.reader - 2 * READ_BUFFER for h in timed] == [h.reader for h in plain]
