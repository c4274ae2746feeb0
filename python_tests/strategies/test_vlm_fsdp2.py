"""FSDP2 (2 processes, gloo) with a vision-language actor: the log-probs of rows with images and one SFT
step's loss, gradient norm and updated weights (the vision tower trained) match one process's run."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")

from tiny_vlm import build_vlm  # noqa: E402
from vlm_dist_worker import run  # noqa: E402


def test_fsdp2_with_images_matches_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).resolve().parents[1] / "support" / "vlm_dist_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(tmp_path / "dist")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    dist = torch.load(tmp_path / "dist" / "rank0.pt", weights_only=False)
    one = run(str(tmp_path / "one"), "none")
    torch.testing.assert_close(dist["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
    assert one["logprobs"].abs().sum() > 0
    for key in ("sft/loss", "actor/grad_norm"):
        assert dist["history"][0][key] == pytest.approx(one["history"][0][key], rel=1e-5), key
    assert dist["weights"].keys() == one["weights"].keys()
    initial = build_vlm("qwen2_vl")[0].state_dict()
    moved = set()
    for name, value in one["weights"].items():
        torch.testing.assert_close(dist["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        if not torch.equal(value, initial[name]):
            moved.add("visual" if "visual" in name else "language")
    assert moved == {"visual", "language"}  # the tower trained too: its gradients through the pixels match


def test_several_processes_need_images_in_every_row():
    from types import SimpleNamespace

    from verl_fast.models.vision import check_rows

    rows = [SimpleNamespace(vision=object()), SimpleNamespace(vision=None)]
    check_rows(rows, 1)
    with pytest.raises(ValueError, match="encoded row 1 has no images: with 2 processes"):
        check_rows(rows, 2)
