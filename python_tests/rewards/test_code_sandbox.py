"""The code sandbox against escape attempts, at each isolation level this machine has: writing outside
its folder, reading the run's files, a fork bomb, the network, huge output, an infinite loop, a memory
bomb, a process left behind. Each test's id names the level it ran under (bwrap / rlimits); a guarantee
a level does not give (docs/faults.md, "The code sandbox") is skipped there with the reason."""

import os
import socket
import textwrap
import threading
import time

import pytest

from verl_fast import config as config_mod
from verl_fast.rewards import RewardInput, build_reward
from verl_fast.rewards import sandbox as sandbox_mod
from verl_fast.rewards.code import CodeReward, SandboxConfig, extract_program
from verl_fast.rewards.sandbox import Limits, Sandbox

BWRAP_WHY = sandbox_mod.bwrap_status()[2]
LEVELS = [pytest.param("bwrap", id="bwrap", marks=pytest.mark.skipif(bool(BWRAP_WHY), reason=BWRAP_WHY)),
          pytest.param("rlimits", id="rlimits")]
ROOT = os.geteuid() == 0


def run(level, program, stdin="", **limits):
    box = Sandbox(level, Limits(**{"cpu_s": 2.0, "wall_s": 5.0, **limits}))
    assert box.level == level
    return box.run(textwrap.dedent(program), stdin)


def sandbox_processes():
    """pids of processes running as the sandbox's own uids (root's bwrap programs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if sandbox_mod._UID_BASE <= uid < sandbox_mod._UID_BASE + sandbox_mod._UID_SPAN:
            found.append(pid)
    return found


@pytest.mark.parametrize("level", LEVELS)
def test_a_program_runs_reads_stdin_and_reports_its_exit(level):
    ok = run(level, "import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="3 4 5\n")
    assert ok.ok and ok.stdout.strip() == "12" and ok.level == level
    failed = run(level, "raise SystemExit(3)")
    assert failed.exit_code == 3 and not failed.ok
    raised = run(level, "1 / 0")
    assert raised.exit_code == 1 and "ZeroDivisionError" in raised.stderr


@pytest.mark.parametrize("level", LEVELS)
def test_writing_outside_its_folder_fails(level, tmp_path):
    if level == "rlimits":
        pytest.skip("rlimits does not isolate the file system")
    target = tmp_path / "written_by_sandbox"
    out = run(level, f"""
        import os
        for path in [{str(target)!r}, "/usr/evil", "/code/main.py", "/etc/evil"]:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
        open("/tmp/scratch", "w").write("fine")  # its private /tmp is writable
        print("scratch", open("/tmp/scratch").read())
    """)
    assert out.ok, out.stderr
    assert "WROTE" not in out.stdout and "scratch fine" in out.stdout
    assert not target.exists() and not os.path.exists("/usr/evil") and not os.path.exists("/etc/evil")


@pytest.mark.parametrize("level", LEVELS)
def test_the_runs_files_cannot_be_read(level, tmp_path):
    if level == "rlimits":
        pytest.skip("rlimits does not isolate the file system")
    secret = tmp_path / "run" / "checkpoint.txt"
    secret.parent.mkdir()
    secret.write_text("SECRET-WEIGHTS")
    os.chmod(secret, 0o644)
    out = run(level, f"""
        import os
        for path in [{str(secret)!r}, "/work", "/root", "/proc/1/environ", "/etc/passwd"]:
            try:
                data = open(path).read() if os.path.isfile(path) else os.listdir(path)
                print("READ", path, data)
            except OSError as e:
                print("refused", path, type(e).__name__)
    """)
    assert out.ok, out.stderr
    assert "SECRET-WEIGHTS" not in out.stdout
    assert "READ /work" not in out.stdout and f"READ {secret}" not in out.stdout


@pytest.mark.parametrize("level", LEVELS)
def test_a_fork_bomb_is_held_to_its_process_limit_and_killed(level):
    if level == "rlimits" and ROOT:
        pytest.skip("rlimits: the kernel never limits root's process count")
    start = time.monotonic()
    out = run(level, """
        import os, time
        n = 0
        while time.monotonic() < 1e12:
            try:
                if os.fork() == 0:
                    n = 0
                else:
                    n += 1
            except OSError:
                time.sleep(0.01)
    """, wall_s=2.0, processes=8)
    assert out.timed_out and not out.ok
    assert time.monotonic() - start < 10
    time.sleep(0.3)
    assert sandbox_processes() == []


@pytest.mark.parametrize("level", LEVELS)
def test_no_network(level):
    if level == "rlimits":
        pytest.skip("rlimits does not isolate the network")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    out = run(level, f"""
        import socket
        for host in ["127.0.0.1", "pypi.org"]:
            try:
                socket.create_connection((host, {port} if host[0] == "1" else 443), timeout=2)
                print("CONNECTED", host)
            except OSError as e:
                print("refused", host, type(e).__name__)
    """)
    assert out.ok, out.stderr
    assert "CONNECTED" not in out.stdout
    time.sleep(0.2)
    assert accepted in ([], [None])
    server.close()


def _accept(server):
    try:
        return server.accept()[1]
    except OSError:
        return None


@pytest.mark.parametrize("level", LEVELS)
def test_huge_output_is_cut_and_the_program_killed(level):
    start = time.monotonic()
    out = run(level, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", output_bytes=4096)
    assert out.output_truncated and not out.ok and out.exit_code is None
    assert len(out.stdout) + len(out.stderr) <= 4096
    assert time.monotonic() - start < 4


@pytest.mark.parametrize("level", LEVELS)
def test_an_infinite_loop_is_stopped_by_cpu_time_and_a_sleeper_by_the_wall_clock(level):
    start = time.monotonic()
    spin = run(level, "while True:\n    pass\n", cpu_s=1.0, wall_s=20.0)
    assert not spin.ok and spin.exit_code is not None and spin.exit_code < 0  # SIGXCPU / SIGKILL
    assert time.monotonic() - start < 10
    start = time.monotonic()
    sleeper = run(level, "import time\ntime.sleep(60)\n", wall_s=1.0)
    assert sleeper.timed_out and not sleeper.ok
    assert 0.9 < time.monotonic() - start < 5


@pytest.mark.parametrize("level", LEVELS)
def test_a_memory_bomb_fails_inside_its_limit(level):
    out = run(level, "x = bytearray(2 << 30)\nprint('ALLOCATED')", memory_mb=256)
    assert not out.ok and "MemoryError" in out.stderr and "ALLOCATED" not in out.stdout


@pytest.mark.parametrize("level", LEVELS)
def test_a_process_left_behind_dies_with_the_program(level):
    if level == "rlimits":
        pytest.skip("rlimits: a child in a session of its own outlives the program")
    out = run(level, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    assert out.ok and "parent done" in out.stdout
    time.sleep(0.3)
    if ROOT:
        assert sandbox_processes() == []


def test_auto_without_bwrap_warns_in_one_line_what_is_not_isolated(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "bwrap_status", lambda: (None, False, "no bwrap (test)"))
    with pytest.warns(UserWarning, match=r"isolation rlimits only: no bwrap \(test\); programs can read and "
                                         r"write the file system and use the network"):
        assert Sandbox("auto").level == "rlimits"
    with pytest.raises(ValueError, match=r"sandbox isolation bwrap: no bwrap \(test\)"):
        Sandbox("bwrap")


# ---- the reward ---------------------------------------------------------------------------------------

SOLUTION = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
STDIN_SOLUTION = "```py\na, b = map(int, input().split())\nprint(a * b)\n```"


def test_extract_program_takes_the_last_python_block():
    assert extract_program(SOLUTION) == "def add(a, b):\n    return a + b\n"
    assert extract_program("```\nprint(1)\n```\n```python\nprint(2)\n```\n```\nprint(3)\n```") == "print(2)\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("print(5)") == "print(5)"


@pytest.mark.parametrize("level", LEVELS)
def test_code_reward_scores_asserts_and_stdin_cases(level):
    reward = CodeReward(SandboxConfig(isolation=level, workers=2, wall_s=5.0))
    asserts = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    cases = [{"input": "2 3\n", "output": "6"}, {"input": "4 5", "output": "20\n"}, {"input": "1 1", "output": "2"}]
    samples = [
        RewardInput(prompt="p", response=SOLUTION, columns={"tests": asserts}),
        RewardInput(prompt="p", response=WRONG, extra_info={"tests": asserts}),
        RewardInput(prompt="p", response=STDIN_SOLUTION, ground_truth=cases),
        RewardInput(prompt="p", response=STDIN_SOLUTION,
                    columns={"tests": '{"inputs": ["2 2", "3 3"], "outputs": ["4", "9"]}'}),
        RewardInput(prompt="p", response="```python\nimport time\ntime.sleep(30)\n```", columns={"tests": "pass"}),
    ]
    reward.sandbox.limits = Limits(cpu_s=2.0, wall_s=1.5)
    assert reward(samples) == [1.0, 0.0, pytest.approx(2 / 3), 1.0, 0.0]
    assert reward.last_extras["timeouts"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert len(reward.last_extras["seconds"]) == 5


def test_code_reward_names_a_row_without_tests():
    reward = CodeReward(SandboxConfig(isolation="rlimits"))
    with pytest.raises(ValueError, match=r"reward_fn.type=code: sample 1 has no tests \(column 'tests'"):
        reward([RewardInput(prompt="p", response="x", ground_truth="pass"), RewardInput(prompt="p", response="x")])


def test_config_builds_the_code_reward_and_names_bad_keys():
    cfg = config_mod.from_dict({"reward_fn": {"type": "code", "sandbox": {"isolation": "rlimits", "wall_s": 3}}})
    reward = build_reward(cfg.reward_fn)
    inner = reward.parts[0][2].inner
    assert isinstance(inner, CodeReward) and inner.sandbox.limits.wall_s == 3
    with pytest.raises(ValueError, match=r"unknown key reward_fn.sandbox.wall; allowed keys"):
        config_mod.from_dict({"reward_fn": {"type": "code", "sandbox": {"wall": 3}}})
    with pytest.raises(ValueError, match=r"reward_fn.sandbox.isolation must be one of"):
        config_mod.from_dict({"reward_fn": {"type": "code", "sandbox": {"isolation": "docker"}}})
    with pytest.raises(ValueError, match=r"reward_fn.sandbox applies to reward_fn.type=code only"):
        config_mod.from_dict({"reward_fn": {"type": "gsm8k", "sandbox": {"wall_s": 3}}})
    with pytest.raises(ValueError, match=r"reward_fn\[1\].sandbox.cpu_s must be > 0"):
        config_mod.from_dict({"reward_fn": [{"type": "gsm8k"}, {"type": "code", "sandbox": {"cpu_s": 0}}]})
