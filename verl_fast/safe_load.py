"""``torch.load`` for files from outside the process (checkpoints, datasets): data only.

Every file is read with ``weights_only=True``: tensors, plain containers, numbers and strings, plus
the globals a caller allowlists for its format. Anything else in the pickle (a class to build, a
function to call, such as ``os.system``) is refused with a ValueError that names the file and the
global; nothing stored in a file ever runs.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any, Sequence

import torch


def load(path: "str | os.PathLike", safe_globals: Sequence[Any] = (), what: str = "a torch checkpoint") -> Any:
    """The object saved in ``path`` (on the CPU). ``safe_globals``: torch's allowlist entries (a
    callable, or a ``(callable, "module.name")`` pair when the pickle names it differently)."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found is None:  # not a global: a damaged file or one torch.save did not write
            raise ValueError(f"{path}: not a readable torch file ({_reason(e)})") from None
        raise ValueError(f"{path}: refused to unpickle the global {found.group(1)}: {what} is loaded as data "
                         "only (tensors, containers, numbers, strings and its format's allowlist), never as code") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None


def _reason(e: Exception) -> str:
    """The specific line of torch's weights_only error (its other lines are general advice)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation", "WeightsUnpickler error")
    specific = [ln for ln in lines if not ln.startswith(advice)]
    return specific[0] if specific else type(e).__name__
