"""The hybrid engine on the real vLLM: a sharded actor and one in-process vLLM engine per rank (external
launcher under several processes), a few GRPO steps (hybrid_worker.py). On the CPU: FSDP2 on 2 gloo
ranks with vLLM-CPU at TP=2 and TP=1 x DP=2, and FSDP1 at TP=2. On a GPU machine: one process per GPU
over NCCL, the engine in bf16 writing its weights in place: FSDP2, FSDP1 and FSDP1 with
``use_orig_params`` on one GPU, and the 2-process cases where there are 2 GPUs.

Every rank's engine must then decode greedily what the trained actor decodes through HF (and not
what the untrained model decodes: an engine left stale fails), and every rank must have received
exactly the bytes of its TP shard it did not hold (the float64-free count in received_reference)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import save_tiny_model

pytest.importorskip("vllm", reason="vLLM is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32 (vLLM-CPU attention needs >= 32); 2 kv heads so that TP=2 splits them
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", num_kv_heads=2,
                           initializer_range=0.2)


def run_workers(model_dir, out_dir, tp, worker="hybrid_worker.py", world=2, *extra):
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (one process per GPU)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).resolve().parents[1] / "support" / worker
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(world), str(port), str(model_dir),
                               str(out_dir), str(tp), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outs)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)], outs


CASES = [pytest.param(2, 2, "fsdp2", id="fsdp2-tp2"), pytest.param(2, 1, "fsdp2", id="fsdp2-tp1xdp2"),
         pytest.param(2, 2, "fsdp1", id="fsdp1-tp2")]
CASES += [pytest.param(1, 1, wrap, id=f"{wrap}-1gpu", marks=pytest.mark.gpu) for wrap in ("fsdp2", "fsdp1", "fsdp1_orig")]


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,wrap", CASES)
def test_sharded_actor_with_vllm_per_rank(model_dir, tmp_path, world, tp, wrap):
    results, outs = run_workers(model_dir, tmp_path, tp, "hybrid_worker.py", world, wrap)
    for rank, res in enumerate(results):
        assert res["engine_type"] == "VLLMInferenceEngine"  # rollout.type auto chose vLLM for the sharded actor
        assert res["trained"] != res["initial"], "training did not change greedy outputs: the test cannot see staleness"
        assert res["engine_ok"] == "ok", f"rank {rank}: engine {res['engine']} vs actor {res['trained']}: {res['engine_ok']}"
        if res["minimum"] is not None:  # FSDP2
            assert res["bytes"] == res["minimum"], f"rank {rank}: received {res['bytes']}, minimum {res['minimum']}"
        assert (res["bytes"] > 0) == (world > 1)
        history = res["history"]
        assert [h["step"] for h in history] == [1, 2, 3]
        # the logged figure is the ranks' mean
        assert all(h["time/weight_sync"] > 0 and (h["sync/bytes_per_rank"] > 0) == (world > 1) for h in history)
        if torch.cuda.is_available():  # sleep level 2 through every update, the sync refilling the weights
            assert all(h["rollout/sleep_freed_gib"] > 0 for h in history)
    assert "Failed to load weights" not in "".join(outs)  # the reload is quiet
