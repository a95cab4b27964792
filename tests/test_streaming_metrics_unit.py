"""trainer/metrics/streaming.py piece by piece, in-process and in seconds (so that `make
test-mutation` reaches it): the histogram's cells, the float64 sums, the figures against
independent references, the spilled buckets of users, and the training window."""

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.metrics import streaming as sm
from trainer.metrics.ranking import task_metrics, uauc_sums

TASKS = ["click", "like"]


def _pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The share of (positive, negative) pairs ranked right, ties counting half."""
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    return float(((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size))


def _entropy(rate: float) -> float:
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def _reference(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """One task's logloss, NE and calibration in float64, written out."""
    z, y = logits.astype(np.float64), labels.astype(np.float64)
    p = 1 / (1 + np.exp(-z))
    loss = float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())
    return {"logloss": loss, "ne": loss / _entropy(y.mean()), "calibration": float(p.sum() / y.sum())}


def _rows(n: int, seed: int, users: int = 40):
    """Logits on a grid of hundredths (distinct values never share a lifetime bin, equal ones
    do: the histogram's AUC is the exact one), labels drawn from them, `users` users."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.normal(-0.5, 1.5, (n, 2)), 2).astype(np.float32)
    labels = (rng.random((n, 2)) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return torch.tensor(logits), torch.tensor(labels), torch.tensor(rng.integers(0, users, n))


# ---------------------------------------------------------------- cells and sums

def test_codes_place_each_logit_in_its_task_label_and_cell():
    # 8 bins over [-16, 16]: cells of 4 logits; outside the range the end cells
    logits = torch.tensor([[-100.0, -16.0], [-12.001, -12.0], [-0.001, 0.0], [15.999, 16.0], [40.0, 3.9]])
    labels = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    cells = [[0, 0], [0, 1], [3, 4], [7, 7], [7, 4]]
    want = [[(k * 2 + int(labels[i, k])) * 8 + cells[i][k] for k in range(2)] for i in range(5)]
    codes = sm._codes(logits, labels, 8)
    assert codes.dtype == torch.int64 and codes.tolist() == want


def test_codes_cut_the_range_in_equal_bins():
    edges = np.linspace(-16, 16, 4097)[:-1]  # WINDOW_BINS' left edges, and a hair inside each
    logits = torch.tensor(np.stack([edges + 1e-6, edges + 32 / 4096 - 1e-6], 1))
    codes = sm._codes(logits, torch.zeros_like(logits), sm.WINDOW_BINS)
    # the second column is task 1's: after task 0's two labels
    assert codes[:, 0].tolist() == list(range(4096)) and codes[:, 1].tolist() == list(range(8192, 12288))


def test_sums_are_rows_positives_probabilities_and_log_losses():
    logits = torch.tensor([[0.0, 2.0], [1.5, -3.0], [-2.0, 0.5], [4.0, 1.0]])
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    sums = sm._sums(logits, labels)
    assert sums.dtype == torch.float64 and sums.shape == (2, 4)
    for k in range(2):
        p, y = 1 / (1 + np.exp(-logits[:, k].double().numpy())), labels[:, k].double().numpy()
        losses = -(y * np.log(p) + (1 - y) * np.log(1 - p))
        assert sums[k].tolist() == pytest.approx([4, y.sum(), p.sum(), losses.sum()], rel=1e-14)


def test_the_sums_of_a_single_row():
    sums = sm._sums(torch.tensor([[-1.0, 3.0]]), torch.tensor([[0.0, 1.0]]))
    p = 1 / (1 + np.exp(-np.array([-1.0, 3.0])))
    assert sums.flatten().tolist() == pytest.approx([1, 0, p[0], -math.log(1 - p[0]), 1, 1, p[1], -math.log(p[1])],
                                                    rel=1e-14)


def test_a_non_finite_logit_counts_as_a_half():
    # the step checks report a NaN; the sums must not fail on it first
    sums = sm._sums(torch.tensor([[float("nan")], [0.0]]), torch.tensor([[1.0], [0.0]]))
    assert sums[0].tolist() == pytest.approx([2, 1, 1.0, 2 * math.log(2)], rel=1e-14)


# ---------------------------------------------------------------- figures

def test_histogram_auc_matches_pairs_and_bounds_the_ties():
    rng = np.random.default_rng(0)
    neg, pos = rng.integers(0, 4, 30), rng.integers(0, 4, 30)
    scores = np.repeat(np.r_[np.arange(30), np.arange(30)], np.r_[neg, pos])
    labels = np.repeat(np.r_[np.zeros(30), np.ones(30)], np.r_[neg, pos])
    auc, bound = sm.histogram_auc(neg, pos)
    assert auc == pytest.approx(_pairwise_auc(scores, labels), abs=1e-15)
    assert bound == pytest.approx((neg * pos).sum() / (2 * neg.sum() * pos.sum()), abs=1e-15)


# NaN without a warning: evaluation's log says nothing of a division by zero
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("neg, pos", [([0, 0], [1, 2]), ([3, 1], [0, 0]), ([0, 0], [0, 0])])
def test_histogram_auc_is_nan_without_both_classes(neg, pos):
    assert all(math.isnan(v) for v in sm.histogram_auc(np.array(neg), np.array(pos)))


def test_task_figures_of_each_task():
    hist = np.zeros((2, 2, 4))
    hist[0, 0], hist[0, 1] = [2, 1, 0, 0], [0, 1, 1, 2]  # click: 3 negatives, 4 positives
    hist[1, 0], hist[1, 1] = [0, 0, 1, 0], [1, 0, 0, 0]  # like: ranked wrong
    sums = np.array([[7, 4, 3.5, 2.8], [2, 1, 0.9, 1.6]])
    out = sm._task_figures(hist, sums, TASKS)
    assert set(out) == {f"{t}/{m}" for t in TASKS for m in ("auc", "auc_bound", "logloss", "ne", "calibration")}
    assert out["click/auc"] == (0 * 2 + 1 * 2.5 + 1 * 3 + 2 * 3) / 12 and out["click/auc_bound"] == 1 / 24
    assert out["like/auc"] == 0.0 and out["like/auc_bound"] == 0.0
    assert out["click/logloss"] == 2.8 / 7 and out["like/logloss"] == 0.8
    assert out["click/ne"] == pytest.approx(0.4 / _entropy(4 / 7), rel=1e-15)
    assert out["like/ne"] == pytest.approx(0.8 / math.log(2), rel=1e-15)
    assert out["click/calibration"] == 3.5 / 4 and out["like/calibration"] == 0.9


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("sums, nan", [
    ([0, 0, 0, 0], {"logloss", "ne", "calibration"}),  # no rows
    ([3, 0, 0.5, 0.6], {"ne", "calibration"}),  # no positives
    ([3, 3, 2.5, 0.6], {"ne"}),  # no negatives
])
def test_task_figures_without_a_class_are_nan(sums, nan):
    out = sm._task_figures(np.zeros((1, 2, 2)), np.array([sums]), ["click"])
    assert {m for m in ("logloss", "ne", "calibration") if math.isnan(out[f"click/{m}"])} == nan
    if sums[0]:
        assert out["click/logloss"] == sums[3] / sums[0]


def test_first_task_copies_only_the_named_figures_it_has():
    out = {"a/auc": 0.7, "a/ne": 0.9, "b/auc": 0.6, "a/auc_bound": 0.01}
    assert sm._first_task(out, ["a", "b"], ("auc", "uauc", "ne")) == {**out, "auc": 0.7, "ne": 0.9}


# ---------------------------------------------------------------- a whole split

def _exact(logits, labels, users, tasks=TASKS) -> dict[str, float]:
    return task_metrics(logits, labels, users, tasks)


def test_split_metrics_match_the_exact_ones(tmp_path):
    logits, labels, users = _rows(600, seed=1)
    with sm.SplitMetrics(TASKS, torch.device("cpu"), tmp_path, rows=600) as metrics:
        for start in range(0, 600, 250):
            metrics.add(logits[start:start + 250], labels[start:start + 250], users[start:start + 250])
        metrics.add(logits[:0], labels[:0], users[:0])  # a batch of padding only
        out = metrics.compute()
    exact = _exact(logits, labels, users)
    figures = ("auc", "uauc", "logloss", "ne", "calibration")
    assert set(out) == {*figures, "examples", *(f"{t}/{m}" for t in TASKS for m in (*figures, "auc_bound"))}
    for key in exact:  # torchmetrics' AUC is a float32
        assert out[key] == pytest.approx(exact[key], abs=1e-7 if key.endswith("auc") else 1e-12), key
    for k, task in enumerate(TASKS):
        mine = _reference(logits[:, k].numpy(), labels[:, k].numpy())
        for metric in ("logloss", "ne", "calibration"):
            assert out[f"{task}/{metric}"] == pytest.approx(mine[metric], rel=1e-12)
        assert out[f"{task}/auc"] == pytest.approx(_pairwise_auc(logits[:, k].numpy(), labels[:, k].numpy()),
                                                   abs=1e-12)
    assert out["examples"] == 600
    assert list(tmp_path.iterdir()) == []


def test_split_metrics_keep_the_histogram_of_every_task_and_label():
    logits = torch.tensor([[-20.0, 0.0], [0.0, 1e-5], [15.9999, 3.0], [0.0, 3.0]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    metrics = sm.SplitMetrics(TASKS, torch.device("cpu"))
    metrics.add(logits, labels, torch.zeros(4, dtype=torch.int64))
    out = metrics.compute()
    assert metrics.users is None and "uauc" not in out and "click/uauc" not in out
    want = np.zeros((2, 2, sm.LIFETIME_BINS))
    for i in range(4):
        for k in range(2):
            cell = min(max(math.floor((float(logits[i, k]) + 16) * sm.LIFETIME_BINS / 32), 0), sm.LIFETIME_BINS - 1)
            want[k, int(labels[i, k]), cell] += 1
    assert np.array_equal(metrics.histogram, want)
    assert out["examples"] == 4 and out["click/calibration"] == pytest.approx(
        (1 / (1 + math.exp(20)) + 0.5 + 1 / (1 + math.exp(-15.9999)) + 0.5) / 3, rel=1e-12)


def test_split_metrics_sum_over_batches_without_users(tmp_path):
    logits, labels, users = _rows(300, seed=2)
    metrics = sm.SplitMetrics(["click", "like"], torch.device("cpu"))
    metrics.add(logits[:100], labels[:100], users[:100])
    metrics.add(logits[100:], labels[100:], users[100:])
    out = metrics.compute()
    exact = task_metrics(logits, labels, users, TASKS, with_uauc=False)
    for key in exact:
        assert out[key] == pytest.approx(exact[key], abs=1e-7 if key.endswith("auc") else 1e-12), key


def test_the_state_and_each_collective_stay_on_the_metrics_device(tmp_path, monkeypatch):
    """NCCL reduces and gathers device tensors only: the histogram, the sums, UAUC's gathers
    and its totals live on the metrics' device. The meta device stands in for a GPU (its
    tensors mix with no CPU tensor); the collectives record the device they are handed."""
    meta = torch.device("meta")
    seen = []

    def all_reduce(t):
        seen.append(("reduce", t.device))
        return torch.zeros(t.shape, dtype=t.dtype)

    def gather(rows, owner, device, num_tasks):
        seen.append(("gather", device))
        return rows
    monkeypatch.setattr(sm, "_all_reduce", all_reduce)
    monkeypatch.setattr(sm, "_gather_rows", gather)
    logits, labels, users = _rows(50, seed=9)
    metrics = sm.SplitMetrics(TASKS, meta)
    metrics.add(logits.to(meta), labels.to(meta), users.to(meta))
    assert metrics.state.device == meta
    metrics.users = sm.UserBuckets(tmp_path, 2, rows=2 * sm.BUCKET_ROWS)
    metrics.users.add(logits.numpy(), labels.numpy(), users.numpy())
    metrics.compute()
    assert seen == [("reduce", meta), ("gather", meta), ("gather", meta), ("reduce", meta)]
    metrics.users.close()


# ---------------------------------------------------------------- users in buckets

def _splitmix64_bucket(user: int, buckets: int) -> int:
    """splitmix64's finaliser of `user`, written with Python integers."""
    mask = (1 << 64) - 1
    z = user & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) % buckets


def test_a_users_bucket_is_splitmix64s_finaliser():
    users = np.array([0, 1, 2, 3, 12345, 2**40 + 7, 2**62, -1, -(2**63)], dtype=np.int64)
    for buckets in (1, 7, 1000):
        got = sm._bucket_of(users, buckets)
        assert got.dtype == np.int64
        assert got.tolist() == [_splitmix64_bucket(int(u), buckets) for u in users]
    # consecutive ids spread evenly
    assert np.bincount(sm._bucket_of(np.arange(10_000), 10)).min() > 900


@pytest.mark.parametrize("rows, world, buckets", [(0, 1, 1), (1, 1, 1), (sm.BUCKET_ROWS, 1, 1),
                                                   (sm.BUCKET_ROWS + 1, 1, 2), (5 * sm.BUCKET_ROWS, 1, 5),
                                                   (0, 3, 3), (4 * sm.BUCKET_ROWS, 3, 4)])
def test_buckets_hold_about_bucket_rows_and_one_per_rank_at_least(rows, world, buckets, tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "_world", lambda: world)
    users = sm.UserBuckets(tmp_path / "run" / "spill", 2, rows)  # its parents made too
    assert users.buckets == buckets and users.folder.parent == tmp_path / "run" / "spill"
    assert users.folder.name.startswith(".uauc-")
    users.close()
    assert not users.folder.exists() and (tmp_path / "run" / "spill").exists()
    users.close()  # again, or after someone else removed it: nothing to do


def test_rows_wait_in_memory_then_go_to_their_users_bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "BUCKET_ROWS", 10)
    users = sm.UserBuckets(tmp_path, 2, rows=40)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 50, 13)
    logits, labels = rng.normal(size=(13, 2)).astype(np.float32), rng.integers(0, 2, (13, 2)).astype(np.float32)
    users.add(logits[:6], labels[:6], ids[:6])
    users.add(logits[6:9], labels[6:9], ids[6:9])
    assert list(users.folder.iterdir()) == [] and users.pending_rows == 9
    users.add(logits[9:10], labels[9:10], ids[9:10])  # the 10th row: written out
    assert users.pending == [] and users.pending_rows == 0
    users.add(logits[10:], labels[10:], ids[10:])
    users._flush()
    users._flush()  # nothing waits: writes nothing more
    assert users._read(99).dtype == users.dtype and len(users._read(99)) == 0
    bucket = np.array([_splitmix64_bucket(int(u), 4) for u in ids])
    for b in range(4):
        rows = users._read(b)
        assert (users.folder / f"{b}.bin").exists() == bool((bucket == b).any())
        assert rows.dtype == users.dtype
        assert rows["user"].tolist() == ids[bucket == b].tolist()  # in the order added
        assert np.array_equal(rows["logits"], logits[bucket == b])
        assert np.array_equal(rows["labels"], labels[bucket == b])
    users.close()


def test_uauc_adds_up_every_buckets_users(tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "BUCKET_ROWS", 64)
    logits, labels, ids = (t.numpy() for t in _rows(500, seed=5, users=60))
    users = sm.UserBuckets(tmp_path, 2, rows=500)
    assert users.buckets == 8
    for start in range(0, 500, 30):
        users.add(logits[start:start + 30], labels[start:start + 30], ids[start:start + 30])
    got = users.uauc(torch.device("cpu"))  # the last rows still wait in memory
    for k in range(2):
        total, weight = uauc_sums(logits[:, k].astype(np.float64), labels[:, k], ids)
        assert got[k] == pytest.approx(total / weight, abs=1e-12)
    users.close()


@pytest.mark.filterwarnings("error")
def test_uauc_is_nan_without_a_user_of_both_classes(tmp_path):
    users = sm.UserBuckets(tmp_path, 1, rows=10)
    users.add(np.zeros((4, 1), np.float32), np.array([[1], [1], [0], [0]], np.float32), np.array([1, 1, 2, 2]))
    assert math.isnan(users.uauc(torch.device("cpu"))[0])
    users.close()


def test_each_bucket_is_gathered_onto_rank_b_mod_world(tmp_path, monkeypatch):
    """On 3 ranks every rank takes part in each bucket's gather, owned by rank b % 3, and sums
    the users of the buckets it owns (here rank 0, whose gathers return the rows)."""
    calls = []

    def gather(rows, owner, device, num_tasks):
        calls.append((len(rows), owner, num_tasks))
        return rows if owner == 0 else None
    monkeypatch.setattr(sm, "_world", lambda: 3)
    monkeypatch.setattr(sm, "_gather_rows", gather)
    monkeypatch.setattr(sm, "_all_reduce", lambda t: t)
    logits, labels, ids = (t.numpy() for t in _rows(400, seed=6, users=80))
    users = sm.UserBuckets(tmp_path, 2, rows=5 * sm.BUCKET_ROWS)
    users.add(logits, labels, ids)
    got = users.uauc(torch.device("cpu"))
    bucket = np.array([_splitmix64_bucket(int(u), 5) for u in ids])
    assert calls == [((bucket == b).sum(), b % 3, 2) for b in range(5)]
    mine = np.isin(bucket, [0, 3])
    for k in range(2):
        total, weight = uauc_sums(logits[mine, k].astype(np.float64), labels[mine, k], ids[mine])
        assert got[k] == pytest.approx(total / weight, abs=1e-12)
    users.close()


# ---------------------------------------------------------------- the training window

class _Echo(torch.nn.Module):
    """A model whose logits are the batch's own."""

    def forward(self, batch: SimpleNamespace) -> torch.Tensor:
        return batch.logits * 1.0


def _batch(rng: np.random.Generator, n: int = 40) -> SimpleNamespace:
    """Logits on a grid of quarters (a window bin each, so the window's AUC is the exact one)."""
    logits = rng.integers(-12, 13, (n, 2)) / 4
    labels = rng.random((n, 2)) < 1 / (1 + np.exp(-logits))
    return SimpleNamespace(logits=torch.tensor(logits, dtype=torch.float32),
                           labels=torch.tensor(labels, dtype=torch.float32))


def test_the_window_reports_the_figures_of_its_last_batches_only():
    rng = np.random.default_rng(7)
    batches = [_batch(rng) for _ in range(5)]
    model = _Echo()
    window = sm.TrainingWindow(model, TASKS, batches=2)
    for batch in batches:
        model(batch)
    model.eval()
    model(_batch(rng))  # evaluation: not training's
    out = window.compute()
    keys = {f"{t}/{m}" for t in ("click", "like") for m in ("auc", "ne", "calibration")} | {"auc", "ne", "calibration"}
    assert set(out) == {f"window/{k}" for k in keys}
    logits, labels = (torch.cat([getattr(b, name) for b in batches[3:]]).numpy() for name in ("logits", "labels"))
    for k, task in enumerate(TASKS):
        mine = _reference(logits[:, k], labels[:, k])
        assert out[f"window/{task}/auc"] == pytest.approx(_pairwise_auc(logits[:, k], labels[:, k]), abs=1e-12)
        assert out[f"window/{task}/ne"] == pytest.approx(mine["ne"], rel=1e-12)
        assert out[f"window/{task}/calibration"] == pytest.approx(mine["calibration"], rel=1e-12)
    for m in ("auc", "ne", "calibration"):
        assert out[f"window/{m}"] == out[f"window/click/{m}"]


def test_a_window_of_no_batches_is_off():
    model = _Echo()
    window = sm.TrainingWindow(model, TASKS, batches=0)
    assert not model._forward_hooks
    model(_batch(np.random.default_rng(8)))
    assert window.compute() == {}
    assert sm.TrainingWindow(model, TASKS, batches=3).compute() == {}  # on, before any batch


@pytest.mark.parametrize("keep_open", [True, False])
def test_each_buckets_file_is_opened_once_per_split(tmp_path, monkeypatch, keep_open):
    """20 flushes into 8 buckets: opened per write, that was 20 x 8 opens (the split's rows over
    BUCKET_ROWS, squared); held open, each file once, for its writes and its read."""
    monkeypatch.setattr(sm, "BUCKET_ROWS", 25)
    monkeypatch.setattr(sm, "_allow_open_files", lambda files: keep_open)
    opened = []

    def counting_open(path, mode):
        opened.append(Path(path).name)
        return open(path, mode)
    monkeypatch.setattr(sm, "open", counting_open, raising=False)
    logits, labels, ids = (t.numpy() for t in _rows(500, seed=7, users=90))
    users = sm.UserBuckets(tmp_path, 2, rows=200)
    assert users.buckets == 8
    for start in range(0, 500, 25):
        users.add(logits[start:start + 25], labels[start:start + 25], ids[start:start + 25])
    got = users.uauc(torch.device("cpu"))
    if keep_open:
        assert sorted(opened) == [f"{b}.bin" for b in range(8)] and users.files == {}
    else:
        assert len(opened) > 8 * 15  # about every flush touched every bucket
    for k in range(2):
        total, weight = uauc_sums(logits[:, k].astype(np.float64), labels[:, k], ids)
        assert got[k] == pytest.approx(total / weight, abs=1e-12)
    users.close()


def test_the_open_files_limit_is_raised_only_up_to_the_hard_one(monkeypatch):
    import resource

    limits = {"now": (1024, 4096)}
    calls = []

    def setrlimit(which, value):
        calls.append(which)
        if value[0] > 5000:
            raise ValueError("not allowed")
        limits.update(now=value)
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert sm._allow_open_files(100) and sm._allow_open_files(1024 - sm.OPEN_FILES_MARGIN)
    assert limits["now"] == (1024, 4096) and calls == []  # room enough: left alone
    assert sm._allow_open_files(2000) and limits["now"] == (2000 + sm.OPEN_FILES_MARGIN, 4096)
    assert calls == [resource.RLIMIT_NOFILE]
    assert not sm._allow_open_files(4096 - sm.OPEN_FILES_MARGIN + 1) and limits["now"] == (2256, 4096)
    assert sm._allow_open_files(4096 - sm.OPEN_FILES_MARGIN) and limits["now"] == (4096, 4096)  # the hard limit
    limits["now"] = (1024, resource.RLIM_INFINITY)
    assert not sm._allow_open_files(6000) and limits["now"] == (1024, resource.RLIM_INFINITY)  # refused
    assert sm._allow_open_files(3000) and limits["now"] == (3256, resource.RLIM_INFINITY)
    limits["now"] = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert sm._allow_open_files(10**7) and limits["now"] == (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
