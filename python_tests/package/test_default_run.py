"""The embedded default run (`verl-fast train`, no config) as a new user starts it, for two steps:
its console shows the progress bar, a line per step and the closing summary, nothing else -- no
notes from the libraries it runs (vLLM's start-up and NUMA-binding notices, the reload warnings
of every weight sync)."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("reasoning_gym")

OURS = re.compile(r"^(train: |step +\d+ |reward/mean: |metrics: |verl-fast: on cpu: actor\.autocast=)")  # the last: the resolved defaults


@pytest.mark.slow
def test_the_default_run_prints_its_progress_and_nothing_else(tmp_path):
    from verl_fast.models.demo import demo_model_path

    try:
        demo_model_path()  # converted once, outside the run's output
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the demo model is not installed: {e}")
    cmd = [sys.executable, "-m", "verl_fast", "train", "--output_dir", str(tmp_path / "out"),
           "--set", "trainer.total_steps=2"]
    # run outside the repository: from its root, `-m verl_fast` would import the unbuilt source folder
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip()]
    assert [line for line in lines if not OURS.match(line)] == []
    assert sum(line.startswith("step ") for line in lines) == 2
    assert sum(line.startswith("verl-fast: on cpu: ") for line in lines) == 1  # the resolved defaults, once
