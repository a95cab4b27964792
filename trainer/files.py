"""Files written whole: whoever reads them (another process, a run resumed after a kill)
sees the old version or the new one, never half of either. At the floor of trainer/: the config
loader, the metrics report, the converters and launch/ write through it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
