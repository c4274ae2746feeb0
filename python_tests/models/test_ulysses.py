"""Ulysses sequence parallelism (models/ulysses.py) across two gloo ranks against the unsharded pass on
the same rows: log-probs and every parameter's gradient (summed over the group), float32 models, rows
left- and right-padded, a length that does not split evenly, KV heads that do and do not split 2 ways."""

import pytest
import torch.multiprocessing as mp

import ulysses_worker as W
from ports import free_port
from tiny_models import build_config
from verl_fast.models.ulysses import refusal


def spawn(*args):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(W.case, args=(2, free_port(), *args, out), nprocs=2, join=True)
        results = dict(out)
    for rank in range(2):
        assert results.get(rank) == "ok", f"rank {rank}:\n{results.get(rank)}"


@pytest.mark.parametrize("family,kv_heads,total", [("qwen2", 2, 24), ("llama", 1, 23)])
def test_sequence_parallel_logprobs_and_grads_match_the_single_process(family, kv_heads, total):
    spawn(family, kv_heads, total)


def test_a_model_whose_heads_do_not_split_is_refused_in_one_line():
    assert refusal(build_config("qwen2", num_heads=4, num_kv_heads=2), 2) is None
    assert refusal(build_config("qwen2", num_heads=4, num_kv_heads=2), 3) == "the model's 4 attention heads do not split 3 ways"
