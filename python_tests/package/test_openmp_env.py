"""``verl-fast`` sets OpenMP's passive wait policy for itself on a GPU machine, before torch loads."""

import os
import subprocess
import sys

from verl_fast import openmp_env


def test_passive_only_where_an_nvidia_device_is(tmp_path, monkeypatch):
    device = tmp_path / "nvidiactl"
    monkeypatch.setattr(openmp_env, "NVIDIA_MARKERS", (str(device), str(tmp_path / "absent")))
    env = {}
    openmp_env.use(env)
    assert env == {}  # no GPU: the spinning workers keep torch's CPU ops fast
    device.touch()
    openmp_env.use(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    openmp_env.use(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}  # the user's own setting stays


def test_the_command_sets_it_before_torch_is_imported():
    """``program()`` calls ``use`` before the command's imports (libgomp reads the variable when torch loads it)."""
    code = ("import sys; from verl_fast import openmp_env; "
            "openmp_env.use = lambda environ=None: print('use; torch loaded:', 'torch' in sys.modules, flush=True); "
            "sys.argv = ['verl-fast', 'info']; from verl_fast.cli import main as cli; cli.program()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "use; torch loaded: False"
    assert "verl_fast" in out.stdout  # then the command ran
