"""The folder a command writes because it was asked to (`verl-fast export`, `verl-fast convert`):
written whole under a unique temporary name beside it, then put in place, touching nothing it did
not write.

- The target may not be the source (a run, a checkpoint) or lie inside it.
- A missing target or an empty folder: the temporary folder is renamed to it (atomic).
- A folder holding files: refused unless ``overwrite``; then each file written replaces its
  namesake (a rename, atomic per file), the stale files of the kinds it writes (``stale``: an older
  export's weight shards) go, and every other file stays.
- The temporary name comes from ``mkdtemp`` (``.DIR.tmp-XXXXXXXX``): a sibling such as a
  pre-existing ``DIR.tmp`` is never opened, replaced or removed. The writer holds an ``flock`` on its
  temporary folder; one of that pattern that nobody holds (left by a write killed with -9) is removed
  by the next write of ``DIR``.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def check_target(out: Path, source: Path, overwrite: bool, what: str) -> None:
    """Raises, naming ``out`` and why, when writing ``what`` there is refused (before any work)."""
    target, src = out.resolve(), source.resolve()
    if target == src or src in target.parents:
        raise ValueError(f"{out} is {'the source' if target == src else 'inside the source'} {source}: {what} "
                         "goes to a folder of its own, outside it")
    if os.path.lexists(out) and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder: {what} writes a folder there")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty: pass --overwrite to replace the files {what} writes there "
                         "(other files stay), or choose an empty or new folder")


def write_folder(out: Path, source: Path, fill: Callable[[Path], None], *, overwrite: bool, what: str,
                 stale: Callable[[str], bool] = lambda name: False) -> Path:
    """``fill(tmp)`` writes the files into a fresh temporary folder, which then becomes ``out`` (see
    the module docstring). Returns ``out``."""
    check_target(out, source, overwrite, what)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # "being written": a later write's clean-up leaves it alone
    try:
        fill(tmp)
        check_target(out, source, overwrite, what)  # again: the folder may have changed meanwhile
        if not os.path.lexists(out) or (not out.is_symlink() and not any(out.iterdir())):
            os.replace(tmp, out)  # new, or an empty folder: replaced whole
        else:
            _merge(tmp, out, stale, what)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed; else only what this call made
        os.close(held)
    return out


def remove_stale(out: Path) -> None:
    """Removes the temporary folders of earlier writes of ``out`` that were killed: siblings named
    exactly as ``mkdtemp`` names ours (``.DIR.tmp-`` and 8 characters), real folders (not links),
    whose ``flock`` nobody holds."""
    pattern = re.compile(re.escape(f".{out.name}.tmp-") + r"[a-z0-9_]{8}")
    for p in out.parent.iterdir():
        if not pattern.fullmatch(p.name) or p.is_symlink() or not p.is_dir():
            continue
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another export is writing it now
            continue
        finally:
            os.close(fd)
        shutil.rmtree(p, ignore_errors=True)


def _merge(tmp: Path, out: Path, stale: Callable[[str], bool], what: str) -> None:
    """``tmp``'s files into the folder ``out``, each replacing its namesake; stale ones removed."""
    written = {p.name for p in tmp.iterdir()}
    for name in sorted(written):
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise ValueError(f"{out / name} is a folder where {what} writes a file; remove or rename it")
    for p in out.iterdir():
        if p.name not in written and stale(p.name) and not (p.is_dir() and not p.is_symlink()):
            p.unlink()
    for name in sorted(written):
        os.replace(tmp / name, out / name)  # a link at the name is replaced, not followed
