"""`rankmix plan` counts host memory: the init's blocks, the reader's buffers, evaluation's
fixed state and async-save staging, per rank, and says `fits: no` when a node's ranks need
more than its RAM. The expected bytes are worked out here by hand from the synthetic schema."""

import re
from pathlib import Path

from torch import nn

from cli import rankmix
from dense.cost import activation_bytes
from dense.heads import build_dense
from launch.plan import GB, plan_cluster
from trainer.config_loader import load_config
from trainer.data.datasets import declared_features

SYNTH = str(Path(__file__).resolve().parents[1] / "configs" / "synth.toml")
OPTIONS = ["--data.shuffle_buffer=8192", "--data.batch_size=32", "--data.eval_batch_size=1024",
           "--metrics.window_batches=10", "--checkpoint.async_save=true"]
# configs/synth.toml's encoded row: 8 `id` features x 8 B; item_tags (id_list, no max_len) one
# id and an offset, 16 B; hist_items (sequence, max_len 30) 30 ids and an offset, 248 B; two
# float32 numeric features, one float32 label, the int64 user: 64 + 16 + 248 + 8 + 4 + 8 B.
ROW = 348
COLUMNS = 13  # 12 feature columns (user_id among them) and the label `click`
RUNTIME = 2**29
SLICE, BUCKET, BINS, BLOCK = 65_536, 131_072, 2**20, 16_384


def expected_host() -> dict[str, int]:
    """Every rank's init, reader and evaluation bytes for OPTIONS on 2 CPU ranks."""
    return {
        "init": 2 * BLOCK * 16 * 4,  # two fp32 blocks of the widest table (dim 16)
        # three windows of shuffle_buffer + a slice, the slice being encoded and one decoded ahead, one
        # batch; a 1 MiB read buffer per column
        "reader": (3 * (8192 + SLICE) + 2 * SLICE + 32) * ROW + COLUMNS * 2**20,
        # one task: 2 x 2^20 float64 bins, UAUC's bucket of (user, logit, label) rows thrice,
        # 10 windowed batches of int64 codes, the evaluation reader's 4 slices and batch
        "evaluation": 2 * BINS * 8 + 3 * BUCKET * 16 + 10 * 32 * 8 + (4 * SLICE + 1024) * ROW,
    }


def test_plan_prints_each_ranks_host_memory():
    cfg = load_config(SYNTH, OPTIONS)
    plan = plan_cluster(cfg, 2, "cpu", 0.0, 24.0, 2)
    params = int(re.search(r"dense tower and heads: ([\d,]+) parameters", plan.text).group(1).replace(",", ""))
    want = expected_host()
    layout, tower, heads = build_dense(cfg.model, declared_features(cfg))
    model = nn.Sequential(tower, heads)
    activations = (activation_bytes(model, layout.width, 32, True), activation_bytes(model, layout.width, 1024, False))
    assert activations[1] > 0 and len(plan.host) == 2
    for rank, (m, h) in enumerate(zip(plan.memory, plan.host)):
        assert (h.init, h.reader, h.evaluation) == (want["init"], want["reader"], want["evaluation"])
        # a CPU rank holds its shards and the dense weights, gradients and RMSProp state in host memory;
        # the async save stages the tables, optimizer state, weights and RMSProp state
        assert h.resident == m.estimate + params * 4 * 3
        assert h.async_save == m.tables + m.optimizer + params * 4 * 2
        assert h.load == 0  # rows go straight into a CPU rank's tensors
        assert h.activations == max(activations)  # training and evaluation take turns
        total = RUNTIME + h.resident + sum(want.values()) + h.async_save + h.load + h.activations
        assert h.total == total
        row = (f"{rank:>4} {h.resident / GB:>12.3f} {want['init'] / GB:>8.3f} {want['reader'] / GB:>10.3f} "
               f"{want['evaluation'] / GB:>8.3f} {h.async_save / GB:>14.3f} {h.load / GB:>8.3f} "
               f"{h.activations / GB:>15.3f} {total / GB:>8.3f}")
        assert row in plan.text.splitlines(), plan.text
    assert "rank  resident GB  init GB  reader GB  eval GB  async save GB  load GB  activations GB  host GB" \
        in plan.text
    assert (f"dense activations per rank: training {activations[0] / GB:.3f} GB at 32 rows, evaluation "
            f"{activations[1] / GB:.3f} GB at 1024 rows (the larger is counted)") in plan.text
    assert plan.fits and plan.text.splitlines()[-1].endswith(
        f"host memory: fullest node {sum(h.total for h in plan.host) / GB:.2f} GB of 48 GB)")


def test_a_gpu_rank_keeps_no_tables_on_the_host_and_a_sync_save_stages_nothing():
    cfg = load_config(SYNTH, OPTIONS[:-1])
    plan = plan_cluster(cfg, 2, "cuda", 80.0, 24.0, 2)
    # on a GPU rank the reader also pins PREFETCH_BATCHES = 2 more batches; the activations are in HBM
    assert [(h.resident, h.reader, h.async_save, h.activations) for h in plan.host] == \
        [(0, expected_host()["reader"] + 2 * 32 * ROW, 0, 0)] * 2


def test_a_node_whose_ranks_need_more_host_memory_than_it_has_does_not_fit():
    proc = rankmix("plan", "--config", "configs/synth.toml", "--world-size", "4", "--local-world-size", "2",
                   "--device", "cpu", "--ddr-gb", "0.6", *OPTIONS)
    assert proc.returncode == 1, proc.stderr[-2000:]
    cfg = load_config(SYNTH, OPTIONS)
    host = plan_cluster(cfg, 4, "cpu", 0.0, 0.6, 2).host
    node = max((0, 1), key=lambda n: host[2 * n].total + host[2 * n + 1].total)
    need = (host[2 * node].total + host[2 * node + 1].total) / GB
    assert need > 1.2  # the runtime alone is 0.5 GB a rank
    assert proc.stdout.splitlines()[-1] == \
        f"fits: no (host memory: node {node}'s 2 ranks need {need:.2f} GB of 2 x 0.6 GB)"
    assert "Traceback" not in proc.stderr


def largest_dense(cfg) -> int:
    """The largest dense parameter's fp32 bytes."""
    from dense.heads import build_dense

    _, tower, heads = build_dense(cfg.model, cfg.features)
    return max(p.numel() * 4 for m in (tower, heads) for p in m.parameters())


def shards_of(plan, rank: int) -> list[tuple[int, int]]:
    """(rows, cols) of every table shard TorchRec's sharding plan places on `rank`."""
    return [tuple(s.shard_sizes) for module in plan.plan.values() for sharding in module.values()
            for s in sharding.sharding_spec.shards if s.placement.rank() == rank]


def test_plans_of_two_and_four_ranks_differ_as_their_shards_do():
    """The per-rank figures, checked against TorchRec's own sharding plan at each world size: a
    rank's tables, Adagrad state and largest shard (a GPU rank's load buffer, up to 64 MiB) are
    those of the shards the plan places on it, so 2 ranks hold twice what 4 do."""
    cfg = load_config(SYNTH, ["--embeddings.plan=row_wise", "--embeddings.optimizer=adagrad",
                              "--features.user_id.num_embeddings=400000"])
    plans = {world: plan_cluster(cfg, world, "cpu", 0.0, 24.0, world) for world in (2, 4)}
    for _world, plan in plans.items():
        for rank, (m, h) in enumerate(zip(plan.memory, plan.host)):
            shards = shards_of(plan.plan, rank)
            assert m.tables == m.optimizer == sum(rows * cols * 4 for rows, cols in shards)
            assert m.largest == max(rows * cols * 4 for rows, cols in shards)
            assert h.load == 0  # read straight into a CPU rank's tables
    two, four = plans[2], plans[4]
    assert sum(m.tables for m in two.memory) == sum(m.tables for m in four.memory)
    # user_id's 400,000 rows of dim 16: 200,000 a rank at 2 ranks, 100,000 at 4
    assert [m.largest for m in two.memory] == [200_000 * 16 * 4] * 2 and [m.largest for m in four.memory] == \
        [100_000 * 16 * 4] * 4
    assert min(h.total for h in two.host) > max(h.total for h in four.host)
    gpu = plan_cluster(cfg, 2, "cuda", 80.0, 24.0, 2)
    assert [h.load for h in gpu.host] == [min(max(m.largest, largest_dense(cfg)), 64 << 20) for m in gpu.memory]


def test_an_explicit_row_wise_plan_on_cpu_is_sized_as_training_shards_it():
    """TorchRec's planner has no row-wise sharding on CPU: `rankmix plan` builds training's own
    plan instead, each table cut into 4 blocks of ceil(rows / 4) rows."""
    cfg = load_config(SYNTH, ["--embeddings.plan=row_wise", "--embeddings.optimizer=rowwise_adagrad"])
    plan = plan_cluster(cfg, 4, "cpu", 0.0, 24.0, 4)
    tables = {"user_id": (5001, 16), "user_age": (9, 8), "user_gender": (3, 4), "item": (2001, 16),
              "item_category": (33, 8), "item_tags": (201, 8), "hour": (24, 4), "weekday": (7, 4), "device": (5, 4)}
    for rank, m in enumerate(plan.memory):
        rows = {name: min(max(n - rank * -(-n // 4), 0), -(-n // 4)) for name, (n, _) in tables.items()}
        assert m.tables == sum(rows[name] * dim * 4 for name, (_, dim) in tables.items())
        assert m.optimizer == m.estimate - m.tables == sum(rows.values()) * 4
    assert plan.fits and "user_id       | [3753, 0]     | [1248, 16]  | rank:3/cpu" in plan.text, plan.text
