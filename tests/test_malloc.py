"""Training keeps freed memory in the process (trainer/dist.py `tune_malloc`: no page faults per
step), and evaluation hands it back (`memory_returned`), so that a rank's peak is what
`rankmix plan` counts. Run in a child: mallopt's settings are the whole process's."""

import json
import subprocess
import sys

from cli import run_env

CHILD = """
import json, re
from pathlib import Path
import torch
from trainer.dist import memory_returned, tune_malloc

def rss_mb():
    return int(re.search(r"^VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024

def freed_block_mb():
    # a 256 MB tensor, written (its pages resident), then freed: how much of it stays resident
    before = rss_mb()
    block = torch.ones(64 << 20)
    del block
    return rss_mb() - before

tune_malloc()
kept = freed_block_mb()
before = rss_mb()
with memory_returned():
    trimmed = before - rss_mb()
    during = freed_block_mb()
out = {"kept": kept, "trimmed": trimmed, "during": during}
tune_malloc()
out["kept_again"] = freed_block_mb()
print(json.dumps(out))
"""


def test_training_keeps_a_freed_block_and_evaluation_returns_it():
    proc = subprocess.run([sys.executable, "-c", CHILD], env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["kept"] > 200  # tuned: the freed 256 MB stay in the heap, resident
    assert got["trimmed"] > 200  # entering hands the kept block back
    assert got["during"] < 20  # within memory_returned: mapped, and unmapped when freed
    assert got["kept_again"] > 200  # training's tuning is back after it
