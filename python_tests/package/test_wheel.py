"""The wheel builds, installs into a fresh virtual environment and imports, compiled core and
Triton kernels included (CPU-only build here, to keep it quick). It holds the library and the
benchmark suite, not the checkout's campaign scripts nor what rewrites the repository's pages; its
`verl-fast bench --quick` runs in an empty folder and writes the results JSON, Markdown and chart."""

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv(tmp_path):
    env = dict(os.environ, VERL_FAST_CUDA="OFF")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                    "--config-settings=build-dir=" + str(tmp_path / "build"), str(ROOT)], env=env, check=True)
    wheels = list((tmp_path / "dist").glob("verl_fast-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    outside = [n for n in names if not n.startswith(("verl_fast/", "verl_fast-"))]
    assert not outside and "verl_fast/kernels/linear_logprobs.py" in names, outside
    assert not [n for n in names if n.startswith("verl_fast/benchmarks/") or "bench_docs" in n]
    assert {f"verl_fast/bench/ops_{op}.py" for op in ("advantage", "logprob", "schedule", "step")} <= set(names)
    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[0])], check=True)
    # then let it see this environment's torch (and numpy), after its own packages (written after the
    # install: that folder may hold an installed verl_fast too, which pip would take as satisfying)
    (site / "deps.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    check = (
        "import verl_fast, verl_fast._C as C, verl_fast.kernels, torch\n"
        f"assert verl_fast.__file__.startswith({str(tmp_path / 'venv')!r}), verl_fast.__file__\n"
        "assert C.__version__ == verl_fast.__version__ and C.has_cuda is False\n"
        "r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])\n"
        "adv, ret = verl_fast.compute_gae(r, torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), whiten=False)\n"
        "assert ret.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], ret\n"
        "print('ok', C.__version__)\n"
    )
    out = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("ok")
    here, out = tmp_path / "empty", tmp_path / "out"  # no checkout in sight: the suite is the wheel's
    here.mkdir()
    bench = subprocess.run([str(tmp_path / "venv" / "bin" / "verl-fast"), "bench", "--quick", "--device", "cpu",
                            "--out", str(out)], capture_output=True, text=True, cwd=here, timeout=600)
    assert bench.returncode == 0, (bench.stdout + bench.stderr)[-3000:]
    (results,) = out.glob("cpu-*.json")
    assert results.with_suffix(".md").is_file() and results.with_suffix(".png").is_file()
    data = json.loads(results.read_text())
    assert {o["op"]: o["status"] for o in data["ops"]} == {"gae": "ok", "logprob": "ok", "schedule": "ok", "step": "ok"}
    assert {row["op"] for row in data["summary"]} == {"gae", "logprob", "schedule", "step"}
    assert all(row["ours_ms"] > 0 for row in data["summary"]) and data["claims"]
    assert not list(here.iterdir())
