"""vllm_weights' results belong to the caller: a later call never changes a result kept from an
earlier one (two models' weights kept side by side used to share buffers: the second call overwrote
10 of the first's 15 tensors), unless the caller asks for reuse (reuse=True, a sync loop's choice),
which keeps the short path of repeated calls."""

import pytest
import torch

from reshard_refs import plain_config, random_state, ref_vllm
from verl_fast.ops.reshard import ModelSpec, vllm_weights

CFG = plain_config("qwen2", num_hidden_layers=2)
SPEC = ModelSpec.from_hf_config(CFG, dtype=torch.float32)


def same(got, want):
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_two_models_kept_side_by_side_stay_their_own():
    torch.manual_seed(0)
    a, b = random_state(SPEC), random_state(SPEC)
    first = dict(vllm_weights(a, SPEC))
    second = dict(vllm_weights(b, SPEC))  # same shapes: the same plan
    same(first, ref_vllm(a, CFG, 1, 0))
    same(second, ref_vllm(b, CFG, 1, 0))
    again = dict(vllm_weights(a, SPEC))  # the same model again: new tensors too
    assert all(again[k].data_ptr() != first[k].data_ptr() for k in first if first[k].numel())
    for tensors in (first, again):
        same(tensors, ref_vllm(a, CFG, 1, 0))


def test_reuse_is_asked_for():
    """reuse=True writes the same tensors again (the short path of repeated calls, timed by
    bench_reshard and checked in test_reshard_oneshot, is taken from there)."""
    sd = random_state(SPEC)
    first = dict(vllm_weights(sd, SPEC, reuse=True))
    with torch.no_grad():
        for v in sd.values():
            v.mul_(2)
    second = dict(vllm_weights(sd, SPEC, reuse=True))
    assert all(first[k] is second[k] for k in first)  # written again, as asked
    same(second, ref_vllm(sd, CFG, 1, 0))
    third = dict(vllm_weights(sd, SPEC))  # not reusing: new tensors, which the reusing calls never write
    assert not any(third[k] is second[k] for k in second)
    with pytest.raises(TypeError, match="reuse must be True or False, got 1"):
        vllm_weights(sd, SPEC, reuse=1)
