"""Files written whole: whoever reads them (another process, a run resumed after a kill)
sees the old version or the new one, never half of either."""

from __future__ import annotations

import os
import shutil
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


def swap_folder(link: Path, new: Path) -> None:
    """Make `link` (a symbolic link beside `new`) point at folder `new` with one rename, then
    delete the folder it pointed at before. A real folder at `link` (not a link) is replaced."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(new.name, tmp)
    old = link.parent / os.readlink(link) if link.is_symlink() else None
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)  # a folder written before `best` became a link
    os.replace(tmp, link)
    if old is not None and old.resolve() != new.resolve():
        shutil.rmtree(old, ignore_errors=True)
