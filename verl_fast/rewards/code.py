"""``reward_fn.type: code``: the response's Python program run against the row's tests in the sandbox
(``rewards/sandbox.py``), several programs at once.

The program is the last fenced code block of the response (```python ... ```, or any ``` block), else
the whole response. The tests are the row's ``tests`` column (``reward_fn.sandbox.tests_key``), else
``extra_info.tests``, else its ground truth:

- a string of Python (asserts, a ``check(...)`` call): run after the program; 1.0 when it exits 0;
- a list of ``{"input": ..., "output": ...}`` cases, or ``{"inputs": [...], "outputs": [...]}`` (APPS /
  CodeContests), either also as a JSON string: the program runs once per case with the input on stdin;
  the score is the fraction of cases whose stdout equals the output (surrounding whitespace ignored).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from verl_fast import config
from verl_fast.config import option, read_section
from verl_fast.rewards.interface import RewardFunction, RewardInput
from verl_fast.rewards.sandbox import LEVELS, Limits, Result, Sandbox, bwrap_status


@dataclass
class SandboxConfig:
    isolation: str = option("auto", choices=LEVELS, doc="bwrap (Linux namespaces: no network, read-only system, private "
                        "/tmp), rlimits (limits only: the file system and network are not isolated), or auto (bwrap "
                        "where it works, else rlimits with a warning); docs/faults.md")
    cpu_s: float = option(5.0, above=0.0, doc="CPU seconds a program may use")
    wall_s: float = option(10.0, above=0.0, doc="wall-clock seconds a program may run (its whole process tree is killed)")
    memory_mb: int = option(512, min=16, doc="address space of a program, MiB")
    output_bytes: int = option(65536, min=64, doc="stdout + stderr kept; past this the program is killed")
    processes: int = option(16, min=1, doc="processes and threads a program may run at once")
    file_mb: int = option(16, min=1, doc="MiB one written file may reach (under bwrap: all of /tmp together)")
    workers: int = option(4, min=1, doc="programs running at once")
    tests_key: str = option("tests", doc="the dataset column (or extra_info key) holding a row's tests; the ground "
                        "truth when neither has it")


def parse(raw: Optional[Dict[str, Any]], key: str = "reward_fn") -> SandboxConfig:
    return read_section(SandboxConfig, raw or {}, f"{key}.sandbox")


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


def extract_program(response: str) -> str:
    """The last ```python block (else the last ``` block, else the whole response)."""
    blocks = _FENCE.findall(response)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response


def _cases(tests: Any) -> Optional[List[Tuple[str, str]]]:
    """stdin / stdout cases, or None when ``tests`` is Python source."""
    if isinstance(tests, str):
        stripped = tests.strip()
        if not stripped.startswith(("[", "{")):
            return None
        try:
            tests = json.loads(stripped)
        except ValueError:
            return None
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return [(str(t["input"]), str(t["output"])) for t in tests]
    raise ValueError("tests must be Python source, a list of {input, output} cases or {inputs, outputs}; got "
                     f"{type(tests).__name__}")


class CodeReward(RewardFunction):
    """Scores each response's program against its row's tests in a ``Sandbox``. ``last_extras`` holds, per
    sample, ``timeouts`` (a program hit the wall clock), ``truncated`` (its output limit)
    and ``seconds`` (the runs' wall time)."""

    name = "code"

    def __init__(self, settings: SandboxConfig = SandboxConfig()):
        self.settings = settings
        limits = Limits(settings.cpu_s, settings.wall_s, settings.memory_mb, settings.output_bytes,
                        settings.processes, settings.file_mb)
        self.sandbox = Sandbox(settings.isolation, limits)
        self.last_extras: Dict[str, List[float]] = {}

    def _tests(self, s: RewardInput, index: int) -> Any:
        key = self.settings.tests_key
        for source in (s.columns, s.extra_info or {}):
            if source.get(key) is not None:
                return source[key]
        if s.ground_truth is not None:
            return s.ground_truth
        raise ValueError(f"reward_fn.type=code: sample {index} has no tests (column {key!r}, extra_info.{key} or "
                         "the ground truth)")

    def _jobs(self, samples: Sequence[RewardInput]) -> List[List[Tuple[str, Optional[str], str]]]:
        """Per sample, its runs: (program, stdin or None for source tests, expected stdout)."""
        jobs = []
        for i, s in enumerate(samples):
            tests, program = self._tests(s, i), extract_program(s.response)
            cases = _cases(tests)
            if cases is None:
                jobs.append([(f"{program}\n\n{tests}\n", None, "")])
            else:
                jobs.append([(program, stdin, expected) for stdin, expected in cases])
        return jobs

    def __call__(self, samples: Sequence[RewardInput]) -> List[float]:
        jobs = self._jobs(samples)
        flat = [job for runs in jobs for job in runs]
        with ThreadPoolExecutor(self.settings.workers) as pool:
            results = list(pool.map(lambda job: self.sandbox.run(job[0], job[1] or ""), flat))
        scores, extras, at = [], {"timeouts": [], "truncated": [], "seconds": []}, 0
        for runs in jobs:
            mine: List[Result] = results[at:at + len(runs)]
            at += len(runs)
            passed = [_passed(r, job) for r, job in zip(mine, runs)]
            scores.append(sum(passed) / len(passed) if passed else 0.0)
            extras["timeouts"].append(float(any(r.timed_out for r in mine)))
            extras["truncated"].append(float(any(r.output_truncated for r in mine)))
            extras["seconds"].append(sum(r.seconds for r in mine))
        self.last_extras = extras
        return scores


def _passed(result: Result, job: Tuple[str, Optional[str], str]) -> bool:
    if not result.ok:
        return False
    return job[1] is None or result.stdout.strip() == job[2].strip()


def _check(cfg: config.Config) -> None:
    for key, r in config.keyed_reward_functions(cfg.reward_fn):
        if r.sandbox and r.type != "code":
            raise ValueError(f"{key}.sandbox applies to {key}.type=code only, got type {r.type}")
        if r.type == "code":
            settings = parse(r.sandbox, key)
            if settings.isolation == "bwrap":
                why = bwrap_status()[2]
                if why:
                    raise ValueError(f"{key}.sandbox.isolation=bwrap: {why}")


config.register_check(_check)
