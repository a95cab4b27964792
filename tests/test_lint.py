"""`make lint` inside `make test`: ruff over the repository, as pyproject.toml configures it, so
that a contributor and CI see the same verdict (issue 57)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check (run `make lint`; `ruff check --fix` mends the [*] ones):\n{proc.stdout}"
