"""The FP8 kernel's division (csrc/reshard/fp8.h's fp8_divide: the block's reciprocal and one correcting FMA,
what the CUDA kernel runs for 16-bit sources) gives IEEE division's e4m3 byte for every (x, amax) pair of
bfloat16 and of float16: the header itself, compiled on the host (``std::fma``, no contraction) by
python_tests/support/fp8_division_check.cpp, over all of them. The check fails without the correction."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the header")


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    exe = tmp_path_factory.mktemp("fp8_division") / "check"
    subprocess.run(["g++", "-O2", "-std=c++17", "-ffp-contract=off", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "python_tests" / "support" / "fp8_division_check.cpp"), "-o", str(exe)], check=True)
    return exe


def run(checker, *args):
    done = subprocess.run([str(checker), *args], capture_output=True, text=True, timeout=600)
    pairs, differing = map(int, done.stdout.split())
    return done.returncode, pairs, differing


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_every_16_bit_pair_gives_the_division_bytes(checker, dtype):
    rc, pairs, differing = run(checker, dtype)
    assert pairs > 5 * 10**8 and differing == 0 and rc == 0, (pairs, differing)


def test_without_the_correction_bytes_differ(checker):
    rc, pairs, differing = run(checker, "bf16", "uncorrected")
    assert differing > 0 and rc == 1, (pairs, differing)
