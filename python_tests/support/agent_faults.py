"""The agents' fault-injection harness: tools, environments and model turns written as a hostile or
careless user (or a degenerate policy) would, for python_tests/agents/test_*_faults.py and any new
agent feature to meet on the day it lands.

Tools (typed, with docstrings, so they take the real schema path): ``stall`` hangs, ``spawn_sleepers``
starts child processes that outlive the call, ``flood`` prints without end, ``hostile`` returns a
``str`` subclass whose unpickling would run code, ``surrogate`` returns a lone surrogate (what
``os.listdir`` gives for a name that is not UTF-8), ``unprintable`` returns an object whose repr
raises. Environments: ``Hang`` (a step or reset that never returns), ``Garbage`` (returns what
``kind`` names). ``PATHOLOGICAL_TURNS``: model turns that a parser must survive. ``pids_in_groups``
and ``alive`` look for processes left behind, through /proc.
"""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Set

from verl_fast.agents.environments import Environment, StepResult, row_messages


def stall(seconds: float) -> str:
    """Sleeps, then answers.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke"


def spawn_sleepers(count: int) -> str:
    """Starts processes that sleep for ten minutes, and returns their pids.

    Args:
        count: How many.
    """
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(count)]
    pids = " ".join(str(p.pid) for p in procs)
    if os.environ.get("VERL_FAST_FAULTS_SPAWNED"):  # a run's test collects them here
        with open(os.environ["VERL_FAST_FAULTS_SPAWNED"], "a") as f:
            f.write(pids + "\n")
    return pids


def spawn_and_stall(count: int) -> str:
    """Starts sleeping processes (their pids written to the file VERL_FAST_FAULTS_PIDS names), then hangs.

    Args:
        count: How many.
    """
    pids = spawn_sleepers(count)
    Path(os.environ["VERL_FAST_FAULTS_PIDS"]).write_text(f"{os.getpid()} {pids}")
    time.sleep(600)
    return "never"


def flood(mib: int) -> str:
    """Prints ``mib`` MiB to stdout and to stderr.

    Args:
        mib: How many MiB each.
    """
    line = "x" * 1023 + "\n"
    for _ in range(mib * 1024):
        sys.stdout.write(line)
        sys.stderr.write(line)
    os.system("echo from-a-child-process")
    return "flooded"


class _Reducer(str):
    """A str whose unpickling writes the file VERL_FAST_FAULTS_MARK names and ends the process."""

    def __reduce__(self):
        return (exec, (f"open({os.environ['VERL_FAST_FAULTS_MARK']!r}, 'w').write('ran'); import os; os._exit(0)",))


def hostile(text: str) -> str:
    """Returns a str subclass that runs code where it is unpickled.

    Args:
        text: Its text.
    """
    return _Reducer(text)


def surrogate(name: str) -> str:
    """Returns ``name`` with a lone surrogate, as os.listdir does for a file name that is not UTF-8.

    Args:
        name: The start of the name.
    """
    return name + "\udce9"


class _Unprintable:
    def __repr__(self):
        raise RuntimeError("no repr")


def unprintable(x: int) -> str:
    """Returns an object whose repr raises.

    Args:
        x: Anything.
    """
    return _Unprintable()


TOOLS = {f.__name__: f for f in (stall, spawn_sleepers, spawn_and_stall, flood, hostile, surrogate, unprintable)}


class Hang(Environment):
    """``where``: "step" hangs on every step (after writing its pid to VERL_FAST_FAULTS_PIDS, if set), "reset" on reset."""

    def __init__(self, where: str = "step"):
        self.where = where

    def reset(self, row):
        if self.where == "reset":
            time.sleep(600)
        return row_messages(row)

    def step(self, message):
        if os.environ.get("VERL_FAST_FAULTS_PIDS"):
            Path(os.environ["VERL_FAST_FAULTS_PIDS"]).write_text(str(os.getpid()))
        time.sleep(600)
        return StepResult(done=True)


GARBAGE = {  # kind -> (method, what it returns, a part of the one line expected)
    "step_none": ("step", None, "step must return a StepResult(messages, reward, done), got NoneType None"),
    "step_dict": ("step", {"messages": []}, "step must return a StepResult(messages, reward, done), got dict"),
    "messages_string": ("step", StepResult("Go on."), "step must return a list of chat messages"),
    "message_without_content": ("step", StepResult([{"role": "user"}]), "message [0] needs a string 'content'"),
    "int_content": ("step", StepResult([{"role": "user", "content": 5}]), "message [0] needs a string 'content'"),
    "nan_reward": ("step", StepResult([], reward=float("nan")), "the reward must be a finite number or None"),
    "reset_none": ("reset", None, "reset must return a list of chat messages"),
    "reset_string": ("reset", "What is 2 + 2?", "got str 'What is 2 + 2?'"),
    "reset_empty": ("reset", [], "reset returned no messages"),
}


class Garbage(Environment):
    """Returns ``GARBAGE[kind]``'s value from its method (and a good value from the other)."""

    def __init__(self, kind: str):
        self.method, self.value, _ = GARBAGE[kind]

    def reset(self, row):
        return self.value if self.method == "reset" else row_messages(row)

    def step(self, message):
        return self.value if self.method == "step" else StepResult(done=True)


PATHOLOGICAL_TURNS = [  # (format, a model turn)
    ("hermes", "<tool_call>" + "[" * 1100 + "</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "{\"a\": " * 1100 + "1" + "}" * 1100 + "}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * 1100 + '"}</tool_call>'),
    ("hermes", "<tool_call>" * 5000),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "' + "y" * (2 << 20) + '"}}</tool_call>'),
    ("llama3", '{"name": "f", "parameters": ' + "[" * 1100),
    ("llama3", ";".join(['{"name": "f", "parameters": ' + "[" * 1100] * 3)),
    ("mistral", "[TOOL_CALLS]" + "[" * 1100),
    ("mistral", "[TOOL_CALLS]f[ARGS]" + "[" * 1100),
    ("mistral", "[TOOL_CALLS]" * 5000),
]


def alive(pids: Iterable[int]) -> List[int]:
    """The pids still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def pids_in_groups(groups: Set[int]) -> Dict[int, int]:
    """pid -> process group of every running process in ``groups`` (scanning /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            out[int(name)] = int(fields[2])
    return out


def wait_gone(pids: Iterable[int], seconds: float = 5.0) -> List[int]:
    """Waits up to ``seconds`` for ``pids`` to end; the ones still alive."""
    deadline = time.monotonic() + seconds
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = alive(left)
    return left
