"""Training keeps freed memory in the process (trainer/dist.py `tune_malloc`: no page faults per
step) and trims it every fifth step (`trim_heap`: no creep); evaluation hands it back
(`memory_returned`) and runs in a malloc arena of its own (`on_own_arena`), so that a rank's
peak is what `rankmix plan` counts. Run in a child: mallopt's settings are the whole process's."""

import json
import subprocess
import sys

from cli import run_env

HELPERS = """
import json, re, threading
from pathlib import Path
import torch
from trainer.dist import memory_returned, on_own_arena, trim_heap, tune_malloc

def rss_mb():
    return int(re.search(r"^VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024

def freed_block_mb():
    # a 256 MB tensor, written (its pages resident), then freed: how much of it stays resident
    before = rss_mb()
    block = torch.ones(64 << 20)
    del block
    return rss_mb() - before
"""

CHILD = HELPERS + """
tune_malloc()
kept = freed_block_mb()
before = rss_mb()
with memory_returned():
    trimmed = before - rss_mb()
    during = freed_block_mb()
out = {"kept": kept, "trimmed": trimmed, "during": during}
out["kept_again"] = freed_block_mb()  # memory_returned restored the tuning
print(json.dumps(out))
"""


# Training's heap with a free range in its middle (a freed 320 MB block below a live one): trimmed,
# its pages go back, but malloc fills the range again before it maps anything.
HOLE = HELPERS + """
tune_malloc()
hole = torch.ones(80 << 20)
above = torch.ones(4 << 20)  # live, above the hole (no free range of the young heap holds 16 MB)
del hole
with memory_returned():
    out = {"main": freed_block_mb(), "own": on_own_arena(freed_block_mb),
           "thread": on_own_arena(threading.current_thread).name}
    try:
        on_own_arena(torch.ones, -1)
    except RuntimeError as e:
        out["error"] = str(e)
print(json.dumps(out))
"""


# Training's kept heap, trimmed at every fifth step only.
TRIM = HELPERS + """
tune_malloc()
kept = freed_block_mb()
before = rss_mb()
out = {"kept": kept, "step_4": trim_heap(4), "after_4": before - rss_mb(), "step_10": trim_heap(10)}
out["after_10"] = before - rss_mb()
out["every_3"] = [s for s in range(1, 10) if trim_heap(s, every=3)]
print(json.dumps(out))
"""


def _child(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_evaluation_on_its_own_arena_does_not_refill_trainings_heap():
    got = _child(HOLE)
    assert got["main"] > 200  # on the caller's thread the 256 MB land in the trimmed range and stay resident
    assert got["own"] < 20  # on its own arena they are mapped, and unmapped when freed
    assert got["thread"] == "rankmix-own-arena"
    assert got["error"] == "Trying to create tensor with negative dimension -1: [-1]"  # raised to the caller


def test_training_keeps_a_freed_block_and_evaluation_returns_it():
    got = _child(CHILD)
    assert got["kept"] > 200  # tuned: the freed 256 MB stay in the heap, resident
    assert got["trimmed"] > 200  # entering hands the kept block back
    assert got["during"] < 20  # within memory_returned: mapped, and unmapped when freed
    assert got["kept_again"] > 200  # training's tuning is back after it, with no call of tune_malloc


def test_training_trims_its_kept_heap_every_fifth_step():
    got = _child(TRIM)
    assert got["kept"] > 200  # the freed 256 MB stay resident between trims
    assert got["step_4"] is False and got["after_4"] < 20
    assert got["step_10"] is True and got["after_10"] > 200  # handed back
    assert got["every_3"] == [3, 6, 9]
