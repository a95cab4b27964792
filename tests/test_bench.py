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
    (["--set", "num_experts=abc"], "--set 'num_experts=abc': 'abc' is not a int"),
    (["--set", "experts=4"], "--set 'experts=4': ModelConfig has no field 'experts'"),
])
def test_tower_bench_names_what_is_wrong_with_its_options(args, message):
    proc = subprocess.run([sys.executable, "bench/tower.py", *args, "--shapes", "2,8,1,1,8"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert message in proc.stderr.strip().splitlines()[-1]


def test_e2e_bench_prints_one_line_per_tower(tmp_path):
    proc = subprocess.run([sys.executable, "bench/e2e.py", "--towers", "rankmixer,rankmixer_moe,mlp",
                           "--tower-set", "mlp:model.mlp_hidden=[32]", "--set", "data.synth_rows=4000",
                           "--set", "data.batch_size=64", "--set", f"data.cache_dir={tmp_path}",
                           "--rounds", "1", "--warmup", "0", "--steps", "1"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^(\w+) +examples/s +([\d,]+) ratio_to_rankmixer ([\d.]+) flops_ratio ([\d.]+) mfu ([\d.]+)$",
                      proc.stdout, re.M)
    assert [r[0] for r in rows] == ["rankmixer", "rankmixer_moe", "mlp"]
    assert rows[0][2] == rows[0][3] == "1.00"  # the first tower is the reference
    assert float(rows[2][3]) < 0.1  # a 32-unit MLP next to a RankMixer


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


@pytest.mark.slow
def test_tower_bench_compiles_the_towers_with_hand_written_steps():
    """torch.compile around the fused FFN, the MoE's training step (run eagerly inside the
    compiled tower) and UniMixer's SwiGLU and fixed-iteration Sinkhorn."""
    towers = ("rankmixer", "rankmixer_moe", "unimixer")
    proc = subprocess.run([sys.executable, "bench/tower.py", "--towers", ",".join(towers), "--shapes", "4,16,2,2,32",
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
