"""The link to the best weights (`best` -> `best.step-N/`), replaced with one rename, and the
checks that it and the folder it points at are rankmix's own before anything is deleted."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def swap_folder(link: Path, new: Path) -> None:
    """Make `link` (a symbolic link beside `new`) point at folder `new` with one rename, then
    delete the folder it pointed at before, once `check_swap` found both rankmix's own."""
    link, new = Path(link), Path(new)
    old = check_swap(link, new)
    assert new.is_dir(), f"{new}: the save to link to is missing"
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(new.name, tmp)
    if old is None and link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)  # the old layout, checked by check_swap
    os.replace(tmp, link)
    if old is not None and old != new.name:
        shutil.rmtree(link.parent / old, ignore_errors=True)


def check_swap(link: Path, new: Path) -> str | None:
    """The sibling folder `link` points at (None when `link` is no link), once `swap_folder` may
    replace it by `new`; else a ValueError naming what is not rankmix's, before anything is written
    or deleted. Both are siblings named `<link>.step-<N>[.<tag>]`, as manager.save_weights names
    them, and plain folders (or, `new`, not yet there). A real folder at `link` holding a DCP save
    (`.metadata`), how `best` was written before it became a link, may be replaced; any other
    folder, a file, or a link of another shape (planted, pointing anywhere) may not."""
    link, new = Path(link), Path(new)
    assert new.parent == link.parent and _own_name(link, new.name), f"{new}: not a save of {link}"
    if new.is_symlink() or (new.exists() and not new.is_dir()):
        kind = f"link to {os.readlink(new)}" if new.is_symlink() else "file"
        raise ValueError(f"{new} is a {kind}, not a folder of rankmix's: refused to write or link to it (nothing "
                         f"was deleted); move it away")
    if link.is_symlink():
        target = os.readlink(link)
        folder = link.parent / target
        if not _own_name(link, target) or folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise ValueError(f"{link} is a link to {target}, not to a folder {link.name}.step-N of rankmix's "
                             f"beside it: refused to replace it (nothing was deleted); move it away")
        return target
    if link.is_dir() and not (link / ".metadata").is_file():
        raise ValueError(f"{link} is a folder that holds no checkpoint (.metadata), not rankmix's: refused to "
                         f"replace it (nothing was deleted); move it away")
    if link.exists() and not link.is_dir():
        raise ValueError(f"{link} is a file, not rankmix's link: refused to replace it; move it away")
    return None


def _own_name(link: Path, name: str) -> bool:
    """Whether `name` is one of `link`'s folders: `<link>.step-<N>`, maybe with a `.<tag>`."""
    return re.fullmatch(re.escape(link.name) + r"\.step-[0-9]+(\.[a-z]+)?", name) is not None
