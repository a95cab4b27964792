"""The debug config's per-step losses for a few towers: `tests/assets/reference_losses.json`,
which tests/test_reference_losses.py compares a fresh run against (a refactoring guard).

Regenerate the file only when a change is meant to alter training numerics, and say why in
the commit:

    OMP_NUM_THREADS=1 .venv/bin/python tests/reference_losses.py

One thread, as `make test`'s workers run on 2 cores: on a CPU of the same capability the
test then checks the losses bit for bit; elsewhere to within kernel rounding.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "tests" / "assets" / "reference_losses.json"
TOWERS = ("rankmixer", "rankmixer_moe", "unimixer", "dcnv2")
STEPS = 20


def train_args(tower: str, run_dir: Path) -> list[str]:
    """`rankmix train` arguments of the reference run of `tower`."""
    return ["train", "--config", "configs/debug.toml", f"--model.tower={tower}", f"--train.steps={STEPS}",
            "--metrics.log_every=1", "--metrics.tensorboard=false", "--metrics.progress=false",
            f"--train.run_dir={run_dir}"]


def machine() -> dict:
    """What decides a run's rounding: torch, its CPU kernels, the thread count, the processor
    (an AMD and an Intel CPU of the same capability round differently: MKL dispatches on
    vendor and model) and the BLAS torch was built with."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": os.environ.get("OMP_NUM_THREADS", ""), "cpu": processor(), "blas": blas()}


def processor() -> str:
    """The CPU's vendor and model name, as /proc/cpuinfo gives them (platform's elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields = dict(re.findall(r"^(vendor_id|model name)\s*:\s*(.*)$", info, re.M))
    return f"{fields.get('vendor_id', '')} {fields.get('model name', '')}".strip()


def blas() -> str:
    """The BLAS torch uses, with its version line where torch's build report has one."""
    config = torch.__config__.show()
    name = re.search(r"BLAS_INFO=(\w+)", config)
    version = re.search(r"Math Kernel Library Version (\S+)", config)
    return " ".join(m.group(1) for m in (name, version) if m)


def losses(run_dir: Path) -> list[list[float]]:
    """[step, loss, click/loss, like/loss] of every training step logged in `run_dir`."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [[r["step"], r["loss"], r["click/loss"], r["like/loss"]] for r in records if r["kind"] == "train"]


def main(asset: Path = ASSET) -> None:
    towers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tower in TOWERS:
            run_dir = Path(tmp) / tower
            subprocess.run([sys.executable, "-m", "launch.cli", *train_args(tower, run_dir)], cwd=ROOT, check=True,
                           capture_output=True)
            towers[tower] = losses(run_dir)
    made_with = machine()
    rows = {tower: "[\n" + ",\n".join(f"   {json.dumps(r)}" for r in steps) + "\n  ]"
            for tower, steps in towers.items()}
    body = ",\n".join(f"  {json.dumps(t)}: {r}" for t, r in rows.items())
    asset.write_text(f'{{\n "made_with": {json.dumps(made_with)},\n "losses": {{\n{body}\n }}\n}}\n')
    print(f"wrote {asset}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSET)
