"""The benchmarks' own contracts: bench/tower.py runs every tower where only torch is
installed, and bench/e2e.py --towers prints one line per tower in its stated format."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli import run_env
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
TOWERS = ("rankmixer", "rankmixer_moe", "unimixer", "unimixer_lite", "mlp", "dcnv2")
# What the GPU machine lacks: everything this project installs besides torch.
NOT_INSTALLED = ("torchrec", "fbgemm_gpu", "pyarrow", "tensorboard", "torchmetrics", "torchx", "tensordict",
                 "tqdm", "rich")

# A None entry in sys.modules makes `import name` fail as a missing package does, and
# importlib.util.find_spec(name) answer None (torch probes for optional packages so).
# The repository is not installed there either: no editable-install finder, no current
# folder on the path, only the script's own folder, as `python3 bench/tower.py` has it.
STOCK_TORCH = f"""
import runpy, sys
for name in {NOT_INSTALLED!r}:
    sys.modules[name] = None
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path = ["bench", *(p for p in sys.path if p not in ("", "."))]
sys.argv = ["bench/tower.py", *sys.argv[1:]]
runpy.run_path("bench/tower.py", run_name="__main__")
"""


def test_tower_bench_runs_every_tower_with_torch_alone():
    proc = subprocess.run([sys.executable, "-c", STOCK_TORCH, "--towers", ",".join(TOWERS), "--shapes", "4,16,2,2,32",
                           "--repeats", "1", "--moe-inference"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for tower in TOWERS:
        line = next(line for line in lines if line.startswith(f"{tower} T=4 D=16 L=2 k=2 B=32: "))
        assert re.search(r"\d GFLOP/step, [\d.]+ TFLOP/s, [\d,]+ rows/s, matmul [\d.]+ TFLOP/s, ratio [\d.]+$", line)
    assert re.search(r"^rankmixer_moe inference T=4 D=16 B=32: sparse [\d,]+ rows/s, dense [\d,]+ rows/s, "
                     r"sparse/dense [\d.]+x at \d+% of the gates active$", proc.stdout, re.M)


@pytest.mark.parametrize("args,message", [
    (["--towers", "rankmixer,transformer"], "ValueError: model.tower='transformer' is not one of"),
    (["--set", "moe.num_experts=abc"], "--set 'moe.num_experts=abc': 'abc' is not a int"),
    (["--set", "experts=4"], "--set 'experts=4': ModelConfig has no field 'experts'"),
])
def test_tower_bench_names_what_is_wrong_with_its_options(args, message):
    proc = subprocess.run([sys.executable, "bench/tower.py", *args, "--shapes", "2,8,1,1,8"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert message in proc.stderr.strip().splitlines()[-1]


@pytest.mark.bench
def test_e2e_bench_prints_one_line_per_tower(tmp_path):
    proc = subprocess.run([sys.executable, "bench/e2e.py", "--towers", "rankmixer,rankmixer_moe,mlp",
                           "--tower-set", "mlp:model.mlp.hidden=[32]", "--set", "data.synth_rows=4000",
                           "--set", "data.batch_size=64", "--set", f"data.cache_dir={tmp_path}",
                           "--rounds", "1", "--warmup", "0", "--steps", "1"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^(\w+) +examples/s +([\d,]+) ratio_to_rankmixer ([\d.]+) flops_ratio ([\d.]+) mfu ([\d.]+)$",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["rankmixer", "rankmixer_moe", "mlp"]
    assert rows[0][2] == rows[0][3] == "1.00"  # the first tower is the reference
    assert float(rows[2][3]) < 0.1  # a 32-unit MLP next to a RankMixer


@pytest.mark.bench
def test_step_counts_counts_a_step_that_reads_nothing_back(tmp_path):
    proc = subprocess.run([sys.executable, "bench/step_counts.py", "--config", "configs/debug.toml",
                           "--set", "data.synth_rows=4000", "--set", "data.batch_size=64",
                           "--set", f"data.cache_dir={tmp_path}", "--steps", "2", "--warmup", "1", "--top", "3"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"^per step: aten ops ([\d.]+), host syncs ([\d.]+), Python calls ([\d,]+) \((.*)\); "
                     r"main-thread CPU [\d.]+ ms$", proc.stdout, re.M)
    assert line, proc.stdout
    assert float(line[1]) > 50 and "rankmix" in line[4]
    # nothing read back, TorchRec's input dist included: the batch's keys come in the sharded
    # tables' order (no permute) with their ids per key counted on the host
    assert line[2] == "0.0" and "host syncs per step" not in proc.stdout
    assert len(re.findall(r"^ +[\d.]+  \S+\.py:\d+\(", proc.stdout, re.M)) == 3


def test_gpu_check_runs_the_tower_bench_with_options_it_has():
    """bench/gpu_check.sh cannot run here; every tower-bench command in it must parse."""
    spec = importlib.util.spec_from_file_location("tower_bench", REPO / "bench" / "tower.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"], cwd=REPO).returncode == 0
    prefix = shlex.split(re.search(r'^TOWER="\$PY bench/tower.py (.*)"$', script, re.M).group(1))
    commands = [shlex.split(line)[1:] for line in script.splitlines() if line.startswith("$TOWER ")]
    assert len(commands) == 5
    for args in commands:
        parsed = bench.parser().parse_args([*prefix, *args])
        assert parsed.device == "cuda" and parsed.bf16
        for name in parsed.towers.split(","):
            bench.TOWERS.get(name)


@pytest.mark.bench
def test_tower_bench_compiles_the_towers_with_hand_written_steps():
    """torch.compile around the fused FFN, the MoE's training step (run eagerly inside the
    compiled tower) and UniMixer's SwiGLU and fixed-iteration Sinkhorn. One layer: a second adds
    nothing to compile but time."""
    towers = ("rankmixer", "rankmixer_moe", "unimixer")
    proc = subprocess.run([sys.executable, "bench/tower.py", "--towers", ",".join(towers), "--shapes", "4,16,1,2,32",
                           "--repeats", "1", "--compile"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()[1:]] == list(towers)


def test_gpu_check_trains_managed_tables_with_a_config_that_loads():
    """The managed-table run of bench/gpu_check.sh needs a GPU; its options must load here."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    args = shlex.split(re.search(r'^MANAGED="(.*?)"$', script, re.M | re.S).group(1))
    assert args[0] == "--config"
    cfg = load_config(str(REPO / args[1]), args[2:])
    assert cfg.train.device == "cuda" and [f.name for f in cfg.features if f.hashing == "managed"] == ["user_id"]


def test_gpu_check_trains_the_layouts_of_a_cuda_planner_with_a_config_that_loads():
    """The fp16, row-wise Adagrad, table-row-wise and column-wise run of bench/gpu_check.sh
    needs a GPU; its options must load here, and name tables the config has."""
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    args = shlex.split(re.search(r'^LAYOUT="(.*?)"$', script, re.M | re.S).group(1))
    cfg = load_config(str(REPO / args[1]), args[2:])
    assert (cfg.train.device, cfg.embeddings.data_type, cfg.embeddings.optimizer) == ("cuda", "fp16", "rowwise_adagrad")
    assert cfg.embeddings.table_sharding == {"user_id": "table_row_wise", "item": "column_wise"}
    assert cfg.data.dataset == "synth" and set(cfg.embeddings.table_sharding) <= {f.table for f in synth_features()}


SCALE_FIGURES = [
    "data: rows (train + eval)", "data: Parquet", "data: table rows (dim 8)",
    "loader unshuffled: rows/s", "loader unshuffled: peak RSS at 10/50/100%",
    "loader shuffled: rows/s", "loader shuffled: peak RSS at 10/50/100%",
    "training, 4 ranks: rows/s", *(f"training, 4 ranks: rank {r} peak RSS" for r in range(4)),
    "async save at step 20 (4 ranks)", "async save at step 40 (4 ranks)", "resumed on 2 ranks (resharded)",
    "sync save at step 50 (2 ranks)", "load of the model (DCP, one process)",
    *(f"training, 2 ranks: rank {r} peak RSS" for r in range(2)),
    "evaluation, 2 ranks: rows/s", *(f"evaluation, 2 ranks: rank {r} peak RSS" for r in range(2)),
    "export, int8 tables",
    *(f"RankMixer T16 D256 L2 k4, {what}" for what in (
        "4 ranks: rows/s", "4 ranks: MFU",
        *(f"step split (rank 0): {part}" for part in (
            "data", "lookup + fused update", "tokenizer", "tower", "heads+loss", "grad check", "optimizer",
            "all-reduce", "end-to-end")),
        *(f"4 ranks: rank {r} peak RSS" for r in range(4)))),
    "whole rehearsal",
]


@pytest.mark.bench
def test_scale_rehearsal_runs_every_stage_in_its_small_preset(tmp_path):
    """bench/scale.py --small: data, loader, 4-rank training with async saves, a 2-rank resume,
    a load, evaluation and an int8 export; one row per figure, each with a finite ratio."""
    proc = subprocess.run([sys.executable, "bench/scale.py", "--small", "--tmp", str(tmp_path)],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("python bench/scale.py --small --tmp ")
    rows = re.findall(r"^\| (.+?) \| (.+?) \| (.+?) \| (.+?) \|$", proc.stdout, re.M)
    assert rows[0] == ("figure", "value", "reference", "ratio")
    assert [r[0] for r in rows[1:]] == SCALE_FIGURES
    for figure, _value, _reference, ratio in rows[1:]:
        assert re.fullmatch(r"\d+\.\d\d", ratio), (figure, ratio)  # a finite number: never nan or inf
    figures = {r[0]: r for r in rows[1:]}
    assert figures["data: rows (train + eval)"][1] == "300,000 in 6 files, ids Zipf over 2^40"
    assert re.match(r"10 more steps of the same epoch, [\d,]+ rows read again",
                    figures["resumed on 2 ranks (resharded)"][1])
    assert re.fullmatch(r"[\d,]+ rows in \d+ s \(start-up included\), AUC 0\.\d{4}",
                        figures["evaluation, 2 ranks: rows/s"][1])
    # the split's parts are shares of their sum, which bench/e2e.py printed beside them
    split = [float(r[3]) for r in rows[1:] if "step split" in r[0] and not r[0].endswith("end-to-end")]
    assert sum(split) == pytest.approx(1.0, abs=0.01 * len(split))
    assert re.fullmatch(r"[\d.,]+ GFLOP/s \(3 x 33\.6 MFLOP a row\)",
                        figures["RankMixer T16 D256 L2 k4, 4 ranks: MFU"][1])
    assert list(tmp_path.iterdir()) == []  # the data and runs are deleted without --keep


@pytest.mark.bench
def test_freshness_bench_times_each_publish_and_weighs_its_delta():
    import json

    proc = subprocess.run([sys.executable, "bench/freshness.py", "--small"], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.splitlines()[-1])
    assert (line["steps_per_publish"], line["publishes"]) == (3, 2)
    assert 0 < line["delta_over_full"] < 1 and line["artifact_s"] > 0 and line["train_s"] > 0
    # one publish with a delta: its medians are its own figures, so the total is the sum of its parts
    assert line["data_to_artifact_s"] == pytest.approx(line["train_s"] + line["publish_s"])
    assert line["publish_s"] == pytest.approx(line["save_s"] + line["artifact_s"] + line["delta_s"])


@pytest.mark.bench
def test_drift_study_prints_one_row_a_day_with_finite_figures(tmp_path):
    """bench/drift.py --small: days 2-4 of a drifting log, each scored by the five models, then
    the mean over the days after the freeze; the same table in --out."""
    out = tmp_path / "drift.md"
    proc = subprocess.run([sys.executable, "bench/drift.py", "--small", "--out", str(out)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == out.read_text()
    assert proc.stdout.startswith(f"python bench/drift.py --small --out {out}\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()[2:]]
    assert rows[0] == ["day", "continuous", "frozen after day 2", "from scratch", "modulo, 500 rows",
                       "managed, 500 rows"]
    assert [r[0] for r in rows[2:]] == ["date=2026-01-02", "date=2026-01-03", "date=2026-01-04",
                                        "mean AUC days 3-4, total s"]
    aucs = [[float(re.fullmatch(r"(0\.\d{4}) / \d+\.\d s", cell)[1]) for cell in row[1:]]  # finite: no nan, inf
            for row in rows[2:]]
    assert all(0.4 < auc < 1 for row in aucs for auc in row)
    # Frozen after day 2 is the continuous model, scored exactly by `rankmix score` on day 3, where the
    # trainer's Evaluator gives it from histograms (within 1e-4) and each is rounded to 4 digits.
    assert rows[2][2] == rows[2][1] and rows[3][2].endswith(" / 0.0 s")
    assert aucs[1][1] == pytest.approx(aucs[1][0], abs=3e-4)


@pytest.mark.bench
def test_sequence_bench_prints_a_row_per_module_and_the_goals_ratio():
    """bench/sequence.py at M = 200 only, small: one row per module, each of finite figures, then
    target_attention's step over pool's, timed in turns."""
    proc = subprocess.run([sys.executable, "bench/sequence.py", "--rows", "64", "--lengths", "200", "--steps", "1",
                           "--turns", "3"], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["module", "M", "rows/s", "step", "ms", "peak", "RSS", "MB", "step", "RSS", "MB",
                                "share"]
    rows = [line.split() for line in lines[1:4]]
    assert [(r[0], r[1]) for r in rows] == [("pool", "200"), ("target_attention", "200"), ("transformer", "200")]
    assert all(float(x) > 0 for r in rows for x in r[2:5]) and rows[0][6] == "nan"
    assert all(0 < float(r[6]) < 2 for r in rows[1:])  # the module's share of the step (timing noise above 1)
    ratio = re.fullmatch(r"target_attention / pool step at M=200, 3 rounds in turns: (\d+\.\d\d) "
                         r"\(rounds (\d+\.\d\d)-(\d+\.\d\d); goal <= 1\.5\)", lines[4])
    assert ratio and float(ratio[2]) <= float(ratio[1]) <= float(ratio[3]), lines[4]


@pytest.mark.bench
def test_long_sequence_bench_prints_a_row_per_length_and_the_goals_ratio():
    """bench/long_sequence.py small: the hard search keeps at most K of each length, and the goal's ratio."""
    proc = subprocess.run([sys.executable, "bench/long_sequence.py", "--rows", "32", "--lengths", "100,1000",
                           "--k", "16", "--steps", "1"], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["M", "K", "kept", "encode", "ms", "step", "ms", "lookup", "ms", "input", "MB", "peak",
                                "RSS", "MB"]
    rows = [line.split() for line in lines[1:3]]
    assert [(r[0], r[1]) for r in rows] == [("100", "16"), ("1000", "16")]
    assert all(0 < float(r[2]) <= 16 for r in rows) and float(rows[1][2]) == 16  # 1,000 of 4 genres: 16 match
    assert float(rows[1][6]) > 5 * float(rows[0][6])  # the input grows with M
    assert all(0 < float(r[5]) for r in rows)
    assert re.fullmatch(r"hard search: encode \+ step at M=1000 over M=100, K=16: \d+\.\d\d "
                        r"\(step alone \d+\.\d\d; goal <= 2\)", lines[3]), lines[3]


@pytest.mark.bench
def test_request_bench_prints_each_modules_row_once_a_row_and_once_a_request_then_the_ratios():
    """bench/sequence_requests.py small: 2 requests of 8 candidates at M = 50, each module's row read
    one history a row and one a request (today's transformer only the first), then the ratios."""
    proc = subprocess.run([sys.executable, "bench/sequence_requests.py", "--requests", "2", "--candidates", "8",
                           "--lengths", "50", "--steps", "1", "--tower", "mlp"], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "2 requests x 8 candidates a batch, tower mlp"
    rows = [line.split() for line in lines[2:9]]
    assert [(r[0], r[1], " ".join(r[2:4])) for r in rows] == [
        (m, "50", h) for m in ("pool", "target_attention", "transformer") for h in ("a row", "a request")] + [
        ("transformer_bst", "50", "a row")]
    assert all(float(x) > 0 for r in rows for x in r[4:])
    for line, module in zip(lines[9:], ("pool", "target_attention", "transformer")):
        assert re.fullmatch(rf"{module} at M=50: once a request over once a row: training \d+\.\d\dx, serving "
                            r"\d+\.\d\dx", line), line


def _ml_ceiling():
    spec = importlib.util.spec_from_file_location("ml_ceiling", REPO / "bench" / "ml_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ml_ceiling_features_are_each_rows_history_read_by_hand():
    """The recent windows' and the candidate genre's mean stars, less the user's mean; a row with
    no history gets the middle of the stars and zeros; the click rate leaves a training row's own
    label out."""
    ceiling = _ml_ceiling()
    np = ceiling.np
    rows = {"item_id": np.array([1, 0, 1]), "item_genre": np.array([7, 3, 3]),
            "label": np.array([1, 0, 0]),
            "hist_ratings": [[1, 5, 4, 2, 5, 3, 4, 4, 1, 2, 5, 3], [], [2]],
            "hist_genres": [[7] * 6 + [3] * 6, [], [3]]}
    x = ceiling.features(rows, np.array([0.1, 0.2, 0.3]))
    stars = [1, 5, 4, 2, 5, 3, 4, 4, 1, 2, 5, 3]
    mean = sum(stars) / 12
    expected = [mean, np.log1p(12), 0.1, 3 - mean, (2 + 5 + 3) / 3 - mean, (4 + 1 + 2 + 5 + 3) / 5 - mean,
                sum(stars[-10:]) / 10 - mean, (1 + 5 + 4 + 2 + 5 + 3) / 6 - mean]
    assert x[0] == pytest.approx(expected)
    assert list(x[1]) == [3.5, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert x[2] == pytest.approx([2.0, np.log1p(1), 0.3, 0.0, 0.0, 0.0, 0.0, 0.0])
    prior = 1 / 3  # item 1: seen twice, clicked once; item 0: seen once, never clicked
    assert ceiling.click_rates(rows, rows, own=True) == pytest.approx(
        [(0 + 10 * prior) / 11, (0 + 10 * prior) / 10, (1 + 10 * prior) / 11])
    assert ceiling.click_rates(rows, {"item_id": np.array([1, 2])}, own=False) == pytest.approx(
        [(1 + 10 * prior) / 12, prior])


def test_ml_ceiling_prints_a_row_per_feature_on_a_converted_log(tmp_path):
    """On a small log in the converter's columns whose label follows the newest rating, cut by the
    towers' own time split (the study's protocol): the table has the base row and one per
    feature, and the newest rating's row scores above the base's."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for split, n, start in (("train", 3000, 0), ("valid", 1000, 3000)):
        stars = [list(rng.integers(1, 6, size=rng.integers(1, 12))) for _ in range(n)]
        label = [int(s[-1] >= 4) if rng.random() < 0.8 else int(rng.random() < 0.5) for s in stars]
        (tmp_path / split).mkdir()
        pq.write_table(pa.table({
            "item_id": rng.integers(0, 50, n), "item_genre": rng.integers(0, 5, n), "timestamp": start + np.arange(n),
            "label": label, "hist_ratings": stars, "hist_genres": [list(rng.integers(0, 5, len(s))) for s in stars]}),
            tmp_path / split / "part-0.parquet")
    sets = [f"data.{k}={v}" for k, v in (("dataset", "parquet"), ("train_path", tmp_path / "train"),
                                         ("eval_path", tmp_path / "valid"), ("cache_dir", tmp_path / "cache"))]
    proc = subprocess.run([sys.executable, "bench/ml_ceiling.py", *(a for kv in sets for a in ("--set", kv))],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("data.split=time: cut at timestamp=3200: 2880 training, 320 validation, 800 test rows")
    assert lines[1] == "2880 training rows, 800 test rows"
    rows = {r[0]: float(r[1]) for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[4:])}
    assert list(rows) == ["mean stars, log1p(count), item click rate", *(f"+ newest {k}'s mean stars - the user's"
                          for k in (1, 3, 5, 10)), "+ the candidate genre's mean stars - the user's"]
    assert rows["+ newest 1's mean stars - the user's"] > rows["mean stars, log1p(count), item click rate"] + 0.05
