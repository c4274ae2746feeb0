"""The command line's error policy: an expected failure is one line on stderr and exit 2; a bug is
a traceback.

Expected (``is_expected``): ``UserError`` (and the project's own classes, which derive from it or
are listed in ``_EXPECTED``), an ``OSError`` (a named file or folder: missing, unreadable, a full
disk), a missing optional package (``ImportError``), a YAML or pickle refusal, and the refusals the
project raises itself as ``ValueError`` / ``TypeError`` / ``RuntimeError`` / ``KeyError`` (raised in a
``verl_fast`` frame, so a ``ValueError`` from deep inside torch is still a bug's traceback).
``VERL_FAST_TRACEBACK=1`` prints the traceback of expected failures too.
"""

from __future__ import annotations

import errno
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

EXIT_REFUSED = 2  # as argparse's usage errors
_PACKAGE = str(Path(__file__).resolve().parent) + os.sep


class UserError(Exception):
    """A refusal or a failure the user can fix (a config, a file, the data): its message names the
    argument, key, file (and line) or function."""


class ConfigError(UserError):
    """A config that cannot run (or cannot be read): shown as "config error"."""


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 155723856 -> '148.5 MiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _raised_here(e: BaseException) -> bool:
    """The innermost frame that raised ``e`` is verl_fast's own code."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


# the project's error classes defined elsewhere, looked up only where their module is loaded (an
# exception of a class whose module was never imported cannot have been raised)
_PROJECT_CLASSES = (("verl_fast.checkpoint.sharded", "CheckpointError"), ("verl_fast.files.hub", "NameNotFound"),
                    ("verl_fast.rewards.deadline", "RewardTimeout"), ("yaml", "YAMLError"))


def is_expected(e: BaseException) -> bool:
    """Whether ``e`` is a failure the user can fix (the module docstring), shown in one line."""
    if isinstance(e, (UserError, OSError, ImportError, pickle.UnpicklingError, UnicodeDecodeError)):
        return True
    for module, name in _PROJECT_CLASSES:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(e, getattr(loaded, name)):
            return True
    return isinstance(e, (ValueError, TypeError, RuntimeError, KeyError)) and _raised_here(e)


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line; an OSError names its path, a full disk its free space."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename:
        where = os.path.abspath(e.filename)
        while not os.path.isdir(where) and where != os.path.dirname(where):  # the nearest folder there is
            where = os.path.dirname(where)
        try:
            import shutil

            free = f" ({human_bytes(shutil.disk_usage(where).free)} free)"
        except OSError:
            free = ""
        return f"no space left on the disk of {e.filename}{free}: free space there or write elsewhere"
    if isinstance(e, OSError) and e.filename and e.strerror:
        other = f" -> {e.filename2}" if e.filename2 else ""
        return f"{e.filename}{other}: {e.strerror}"
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        text = e.args[0]
    else:
        text = str(e)
    text = " ".join(text.split())
    return text or type(e).__name__


def guarded(command: str, fn: Callable[[Any], int], args: Any) -> int:
    """``fn(args)``; an expected failure: one line on stderr ("verl-fast <command>: error: ...") and
    exit 2, a bug: its traceback (raised on)."""
    try:
        return fn(args)
    except (Exception, SystemExit) as e:  # noqa: B902 - SystemExit("message") is a refusal too
        if isinstance(e, SystemExit):
            if isinstance(e.code, str):
                print(f"verl-fast {command}: {e.code}", file=sys.stderr)
                return EXIT_REFUSED
            raise
        if not is_expected(e):
            raise
        if os.environ.get("VERL_FAST_TRACEBACK") == "1":
            traceback.print_exc()
        hub = sys.modules.get("verl_fast.files.hub")
        label = "config error" if isinstance(e, ConfigError) or (hub and isinstance(e, hub.NameNotFound)) else "error"
        # a config's problems are all reported, one line each; any other failure is one line
        lines = str(e).splitlines() if label == "config error" and str(e).strip() else [one_line(e)]
        for line in lines:
            print(f"verl-fast {command}: {label}: {line}", file=sys.stderr)
        return EXIT_REFUSED
