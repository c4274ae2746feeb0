"""Writing and removing inside a run's folder without ever going through a symbolic link, so that
nothing outside the folder is written or deleted whatever a user (or another process) left there.

- ``replace_file``: a new file under a unique temporary name beside the target, created exclusively
  (``O_EXCL`` never opens an existing file or follows a link), then renamed over the target: a link
  at the target's name is replaced, never written through.
- ``open_append``: appending with ``O_NOFOLLOW``.
- ``remove``: a name itself: a link or a file is unlinked, a real folder removed whole
  (``shutil.rmtree`` does not follow links inside it); never what a link points to.
- ``refuse_link``: the error for a link where a run writes, naming the path and its target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, TextIO


def replace_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` fills a new file that then takes ``path``'s name (atomically)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_append(path: Path) -> TextIO:
    """``open(path, "a")`` that refuses (naming the path) when ``path`` is a symbolic link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path, "the run's file")
        raise
    return os.fdopen(fd, "a")


def remove(path: Path) -> None:
    """Removes the entry ``path`` (a link: the link only)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path)


def refuse_link(path: Path, what: str) -> None:
    """Raises when ``path`` is a symbolic link: writing through it would write outside the run."""
    if os.path.islink(path):
        raise RuntimeError(f"{path} ({what}) is a symbolic link (to {os.readlink(path)}): a run writes and removes "
                           "only inside its folder, never through a link; remove the link")

