"""The Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests check the numerics on CPU but never compile; scripts/triton_compile_check.py
compiles every kernel variant with the block sizes linear_config picks on such a device.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "triton_compile_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels for real")
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--arch", "90"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == 23, run.stdout
