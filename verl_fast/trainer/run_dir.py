"""A run's life around its output folder: one writer per folder (an fcntl lock), the rules for a
folder that holds an older run, cheap checks before any model loads, and SIGTERM / Ctrl-C.

- Lock: ``<output_dir>/.lock`` held with ``fcntl.flock`` by rank 0 for the whole run; it holds the
  owner's PID, which a second run names when it refuses. The kernel drops the lock when the owner
  dies, even by kill -9, so a stale file never blocks a restart.
- Older run: ``trainer.resume=false`` over a folder with checkpoints or metrics refuses unless
  ``trainer.overwrite=true``, which removes what a run writes there (nothing else; a symbolic link
  by that name is unlinked, never followed).
- Nothing outside the folder: a run refuses a symbolic link at any name it writes (``.lock``,
  ``checkpoints``, ``metrics.jsonl``, ...; files it replaces atomically and opens with
  ``O_NOFOLLOW``, ``run_files``), and a folder that is the current one or one of its parents unless
  that folder is empty (the run's files would land among the user's, and overwrite remove them).
- Signals: the first SIGTERM or SIGINT lets the current step finish, then the trainer writes a
  checkpoint and returns (the CLI exits 0); a second one ends the process at once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from verl_fast.algos import registry as algorithms
from verl_fast.data import readers
from verl_fast.metrics.logger import check_loggers
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.files import run_files
from verl_fast.distributed import any_rank, on_main, rank_world

GROUND_TRUTH_REWARDS = ("gsm8k", "reasoning_gym")  # rewards that score against each row's ground truth
LOCK = ".lock"
# what a run writes into its output_dir (overwrite removes these, the loggers' folders only where
# RECORD says a run of verl_fast created them)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "generations.jsonl", "reward_curve.png", "tensorboard", "wandb")
LOGGER_FOLDERS = ("tensorboard", "wandb")  # named by the loggers, so perhaps the user's own
RECORD = ".verl_fast_outputs.json"  # the logger folders a run created here (a JSON list)

_held: Dict[str, Tuple[int, int]] = {}  # folder -> (fd, count): the CLI and fit() take the same lock


def _acquire(folder: Path) -> None:
    key = str(folder.resolve())
    if key in _held:
        fd, count = _held[key]
        _held[key] = (fd, count + 1)
        return
    try:
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            run_files.refuse_link(folder / LOCK, "the run's lock")
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RuntimeError(f"trainer.output_dir={folder} is in use by another run (PID {owner}); "
                               "one run writes a folder at a time: wait for it, stop it, or choose another "
                               "output_dir") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = (fd, 1)


def _release(folder: Path) -> None:
    key = str(folder.resolve())
    if key not in _held:
        return
    fd, count = _held.pop(key)
    if count > 1:
        _held[key] = (fd, count - 1)
        return
    os.ftruncate(fd, 0)
    os.close(fd)  # closing the descriptor drops the flock


def _recorded(folder: Path) -> List[str]:
    """The logger folders that RECORD says a run created in ``folder``."""
    try:
        names = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return []
    return [n for n in names if n in LOGGER_FOLDERS] if isinstance(names, list) else []


def _record_loggers(folder: Path, loggers: List[str]) -> None:
    """Adds to RECORD the logger folders this run is about to create (those not there already: a
    folder that was there first is not the run's, and overwrite never removes it)."""
    names = _recorded(folder)
    new = [n for n in LOGGER_FOLDERS if n in loggers and n not in names and not os.path.lexists(folder / n)]
    if new:
        run_files.replace_file(folder / RECORD, lambda f: f.write(json.dumps(names + new).encode()))


def _older_run(folder: Path) -> List[str]:
    mine = _recorded(folder)
    found = [name for name in RUN_OUTPUTS if os.path.lexists(folder / name)
             and (name not in LOGGER_FOLDERS or name in mine or (folder / name).is_symlink())]
    root = folder / "checkpoints"
    if "checkpoints" in found and not root.is_symlink() and not any(root.iterdir()):
        found.remove("checkpoints")
    return found


def _check_own_folder(folder: Path) -> None:
    """The current folder or one of its parents ('', '.', '..', '~', '/') as output_dir puts a run's
    files among the user's own, and overwrite would remove ./checkpoints, ./metrics.jsonl, ... there:
    refused unless the folder is empty."""
    here, target = Path.cwd().resolve(), folder.resolve()
    if (target == here or target in here.parents) and target.is_dir() and any(target.iterdir()):
        which = "the current folder" if target == here else "a parent of the current folder"
        raise RuntimeError(f"trainer.output_dir={folder} is {which} ({target}), which holds other files: a run "
                           f"writes {', '.join(RUN_OUTPUTS)} into its folder (and trainer.overwrite=true removes "
                           "them there); choose a folder of its own, e.g. runs/<name>")


def _check_not_inside_a_run(folder: Path) -> None:
    """An output_dir inside another run's outputs (its ``checkpoints/``, ``tensorboard/``, ...) would
    make that run's checkpoint look damaged, and its next save of the step remove it: refused."""
    target = folder.resolve()
    for parent in target.parents:
        if not (parent / LOCK).is_file():
            continue
        for name in RUN_OUTPUTS:
            inside = parent / name
            if inside == target or inside in target.parents:
                raise RuntimeError(f"trainer.output_dir={folder} lies inside the run {parent}'s {name} folder: a "
                                   f"run there would take it for part of that run (and remove it with a damaged "
                                   "checkpoint); choose a folder outside it")


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")  # a new name: never an existing file
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RuntimeError(f"trainer.output_dir={folder} is not writable: {e.strerror or e}") from None


def claim(trainer_cfg: Any) -> Path:
    """Rank 0 checks the folder, takes its lock and applies the resume / overwrite rules; every rank
    gets the same outcome. Pair with ``release``."""
    folder = Path(trainer_cfg.output_dir)

    def main() -> None:
        _check_own_folder(folder)
        _check_not_inside_a_run(folder)
        _check_writable(folder)
        _acquire(folder)
        try:
            older = _older_run(folder)
            if older and trainer_cfg.overwrite:
                for name in older:
                    run_files.remove(folder / name)  # a link: the link itself, never its target
            for name in RUN_OUTPUTS:
                run_files.refuse_link(folder / name, f"trainer.output_dir's {name}")
            if older and not trainer_cfg.overwrite and not trainer_cfg.resume:
                raise RuntimeError(
                    f"trainer.output_dir={folder} holds an older run ({', '.join(older)}) and trainer.resume is "
                    "false: set trainer.overwrite=true to clear it, trainer.resume=true to continue it, or "
                    "choose another output_dir")
            _record_loggers(folder, list(trainer_cfg.loggers))
        except BaseException:
            _release(folder)
            raise

    on_main(main)
    return folder


def release(trainer_cfg: Any) -> None:
    if rank_world()[0] == 0:
        _release(Path(trainer_cfg.output_dir))


def check_port(host: str, port: Optional[int]) -> None:
    """Raises naming the port when the metrics endpoint could not bind it."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds it
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"trainer.metrics_port={port} on {host} is not free ({e.strerror or e}): choose "
                               "another port, or stop what listens there") from None


def precheck(cfg: Any) -> List[Dict[str, Any]]:
    """Everything that can fail before the models load, checked first: the output folder (writable,
    not another run's), the metrics port, ``trainer.resume_from``, and the dataset (whose rows are
    returned, for ``fit``)."""
    from verl_fast.data import RLDataProcessor

    t = cfg.trainer
    if t.dataset is None:
        raise SystemExit("no dataset: set trainer.dataset in the config or pass --dataset_path")
    claim(t)  # held until the trainer releases it at the end of fit (a re-entrant lock)
    try:
        on_main(lambda: check_port(t.metrics_host, t.metrics_port))
        check_loggers(t.loggers)
        if t.resume_from:  # there and a checkpoint (its files are verified when it loads)
            checkpoint.resolve_start(t.resume_from, t.output_dir, check_files=False)
        # reading rows needs no tokenizer; the trainer tokenizes them later
        rows = RLDataProcessor(None, t.max_prompt_length).load(t.dataset, **t.dataset_kwargs)
        if not rows:
            raise ValueError(f"trainer.dataset={t.dataset} has no rows")
        if algorithms.spec(cfg).samples and cfg.reward_fn.type in GROUND_TRUTH_REWARDS:  # offline runs score nothing
            readers.require_truth(rows, f"reward_fn.type={cfg.reward_fn.type}")
    except BaseException:
        release(t)
        raise
    return rows


class StopSignals:
    """``with StopSignals() as stop:`` ... ``if stop.requested(): ...`` (a collective with several
    ranks: true everywhere when any rank was signalled, so all stop after the same step)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._got: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self.event = threading.Event()  # set by the first signal: what a thread waiting on a reward watches

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._got is not None:  # the second one: stop now
            print(f"\n{name} again: stopping at once (no checkpoint)", file=sys.stderr, flush=True)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self._got = signum
        self.event.set()
        print(f"\n{name}: finishing this step, then writing a checkpoint and exiting (send it again to stop "
              "at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        return any_rank(self._got is not None)
