"""Scalar arguments of the public ops, in Python and again at the compiled core's boundary: every
float finite and in its range (a discount of 1e30 gave all-NaN advantages, GRPO's epsilon 0 gave
NaN for a group of equal rewards), every flag a real bool (a truthy "no" turned entropies on), every
size an int (2.9 was taken as 2, True as 1). Each refusal names the argument."""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config

import verl_fast as vf
from verl_fast import _C
from verl_fast import config as config_mod
from verl_fast import load_megatron_checkpoint
from verl_fast import schedule as S
from verl_fast.ops.reshard import ModelSpec, hf_layout, plan, vllm_layout, vllm_weights
from verl_fast.ops.reshard.megatron import megatron_layout

CFG = Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=128)


def gae_inputs():
    return torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5)


@pytest.mark.parametrize("kwargs,err,message", [
    ({"gamma": 1e30}, ValueError, r"gamma must be in \[0, 1\], got 1e\+30"),
    ({"gamma": -0.1}, ValueError, r"gamma must be in \[0, 1\]"),
    ({"lam": 1.5}, ValueError, r"lam must be in \[0, 1\], got 1.5"),
    ({"gamma": float("inf")}, ValueError, "gamma must be finite"),
    ({"gamma": True}, TypeError, "gamma must be a number, got True"),
    ({"whiten": 1}, TypeError, "whiten must be True or False, got 1"),
])
def test_gae_scalars(kwargs, err, message):
    with pytest.raises(err, match=message):
        vf.compute_gae(*gae_inputs(), **kwargs)
    vf.compute_gae(*gae_inputs(), gamma=np.float32(0.99), lam=0, whiten=np.bool_(True))  # numpy's are fine


def test_grpo_epsilon_must_be_positive_so_equal_rewards_never_give_nan():
    r, m = torch.ones(4, 3), torch.ones(4, 3)  # one group of four equal rewards: std 0
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="epsilon must be"):
            vf.compute_grpo_advantage(r, m, [0, 0, 0, 0], epsilon=eps)
    adv, _ = vf.compute_grpo_advantage(r, m, [0, 0, 0, 0], epsilon=1e-6)
    assert torch.equal(adv, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"algorithm.epsilon must be > 0, got 0.0"):
        config_mod.from_dict({"algorithm": {"epsilon": 0.0}})
    with pytest.raises(ValueError, match=r"algorithm.gamma must be <= 1"):
        config_mod.from_dict({"algorithm": {"gamma": 1e30}})


def test_logprob_flags_and_temperature():
    logits, labels = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    with pytest.raises(TypeError, match="with_entropy must be True or False, got 'no'"):
        vf.logprobs_from_logits(logits, labels, with_entropy="no")
    with pytest.raises(TypeError, match="check must be True or False, got 0"):
        vf.logprobs_from_logits(logits, labels, check=0)
    with pytest.raises(TypeError, match="temperature must be a number, got True"):
        vf.logprobs_from_logits(logits, labels, temperature=True)
    with pytest.raises(TypeError, match="temperature must be a number, got '1.0'"):
        vf.logprobs_from_logits(logits, labels, temperature="1.0")
    hidden, weight = torch.randn(2, 3, 4), torch.randn(7, 4)
    with pytest.raises(TypeError, match="with_entropy must be True or False, got 'yes'"):
        vf.linear_logprobs(hidden, weight, labels, with_entropy="yes")
    assert isinstance(vf.logprobs_from_logits(logits, labels, with_entropy=False), torch.Tensor)


def test_masked_flags():
    from verl_fast.ops.masked import masked_var, masked_whiten

    x, m = torch.randn(3, 4), torch.ones(3, 4)
    with pytest.raises(TypeError, match="unbiased must be True or False, got 'false'"):
        masked_var(x, m, unbiased="false")
    with pytest.raises(TypeError, match="shift_mean must be True or False, got 0"):
        masked_whiten(x, m, shift_mean=0)


@pytest.mark.parametrize("bad,err,shown", [(2.9, TypeError, r"2.9 \(float\)"), (True, TypeError, r"True \(bool\)"),
                                          (0, ValueError, "must be >= 1, got 0")])
def test_reshard_sizes_are_ints(bad, err, shown):
    model = __import__("transformers").Qwen2ForCausalLM(CFG)
    spec = ModelSpec.from_hf_config(CFG)
    for call in (lambda: dict(vllm_weights(model, tensor_parallel_size=bad)),
                 lambda: vllm_layout(spec, bad),
                 lambda: megatron_layout(spec, bad)):
        with pytest.raises(err, match=rf"tensor_parallel_size must be .*{shown}" if err is TypeError else shown):
            call()
    with pytest.raises(err, match=rf"tile_bytes must be" if err is TypeError else "tile_bytes must be >= 1"):
        dict(vllm_weights(model, tile_bytes=bad))
    with pytest.raises(err, match=rf"bucket_bytes must be" if err is TypeError else "bucket_bytes must be >= 1"):
        plan(hf_layout(spec), vllm_layout(spec, 1), bucket_bytes=bad)
    with pytest.raises(TypeError, match=r"tp_rank must be an int, got 1.0"):
        dict(vllm_weights(model, tensor_parallel_size=2, tp_rank=1.0))
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, tensor_parallel_size\) = \[0, 2\), got 2"):
        dict(vllm_weights(model, tensor_parallel_size=2, tp_rank=2))
    with pytest.raises(err, match=r"tp_size must be"):
        load_megatron_checkpoint("/nonexistent", bad)


def test_schedule_sizes_and_flags():
    with pytest.raises(TypeError, match=r"k must be an int, got 2.0 \(float\)"):
        S.balance_partitions([3, 4, 5, 6], 2.0)
    with pytest.raises(TypeError, match="equal_size must be True or False"):
        S.balance_partitions([3, 4, 5, 6], 2, equal_size="yes")
    with pytest.raises(TypeError, match=r"max_tokens must be an int, got True \(bool\)"):
        S.pack_micro_batches([3, 4], True)


# ---- the compiled core's boundary: the same refusals without the Python wrappers -------------------


@pytest.mark.parametrize("record,field,value,message", [
    ("ScanArgs", "num_threads", True, "num_threads must be an int, got bool"),
    ("ScanArgs", "num_threads", 2.9, "num_threads must be an int, got float"),
    ("ScanArgs", "gamma", True, "gamma must be a number, got bool"),
    ("ScanArgs", "gamma", "0.9", "gamma must be a number, got str"),
    ("ScanArgs", "whiten", 1, "whiten must be True or False, got int"),
    ("GroupArgs", "norm_by_std", "no", "norm_by_std must be True or False, got str"),
    ("GroupArgs", "epsilon", False, "epsilon must be a number, got bool"),
    ("ReshardPlanArgs", "rank", True, "rank must be an int, got bool"),
    ("ReshardPlanArgs", "tile_bytes", 2.5, "tile_bytes must be an int, got float"),
    ("ReshardPlanArgs", "world_size", np.float64(2.0), "world_size must be an int, got numpy.float64"),
])
def test_record_fields_take_only_their_own_kind(record, field, value, message):
    with pytest.raises(TypeError, match=message):
        setattr(getattr(_C, record)(), field, value)


def test_record_fields_take_python_and_numpy_scalars_and_check_width():
    a = _C.ScanArgs()
    a.num_threads, a.gamma, a.whiten = np.int64(3), np.float32(0.5), np.bool_(False)
    assert (a.num_threads, a.gamma, a.whiten) == (3, 0.5, False)
    with pytest.raises(ValueError, match="num_threads must fit in 32 bits, got 1099511627776"):
        a.num_threads = 2**40


def _scan_record(gamma=1.0, lam=1.0):
    B, T = 2, 3
    a = _C.ScanArgs()
    a.kind = _C.ScanKind.gae
    a.rewards, a.values, a.mask = torch.randn(B, T), torch.randn(B, T), torch.ones(B, T)
    a.advantages, a.returns = torch.empty(B, T), torch.empty(B, T)
    a.status = torch.empty(_C.status_words, dtype=torch.int32)
    a.gamma, a.lam = gamma, lam
    return a


@pytest.mark.parametrize("gamma,lam,message", [(1e30, 1.0, r"gamma must be in \[0, 1\]"),
                                               (float("nan"), 1.0, r"gamma must be in \[0, 1\], got nan"),
                                               (1.0, -0.5, r"lam must be in \[0, 1\], got -0.5")])
def test_the_launcher_refuses_discounts_outside_0_1(gamma, lam, message):
    with pytest.raises(ValueError, match=message):
        _C.advantage_scan(_scan_record(gamma, lam))
    _C.advantage_scan(_scan_record(0.99, 0.95))


def test_the_launcher_refuses_epsilon_zero():
    B, T = 4, 3
    a = _C.GroupArgs()
    a.kind = _C.GroupKind.grpo
    a.rewards, a.mask = torch.ones(B, T), torch.ones(B, T)
    a.ids = torch.zeros(B, dtype=torch.int64)
    a.advantages = torch.empty(B, T)
    a.workspace = torch.empty(_C.group_workspace_bytes(B), dtype=torch.uint8)
    a.status = torch.empty(_C.status_words, dtype=torch.int32)
    a.epsilon = 0.0
    with pytest.raises(ValueError, match="epsilon must be finite and > 0, got 0"):
        _C.group_advantage(a)


def test_functions_take_only_their_own_kind():
    lengths = torch.tensor([3, 4, 5, 6])
    out = (torch.empty(4, dtype=torch.int64), torch.empty(3, dtype=torch.int64), torch.empty(2, dtype=torch.int64))
    for k, equal, linear, message in [(True, True, 1, "k must be an int, got bool"),
                                      (2.9, True, 1, "k must be an int, got float"),
                                      (2, 1, 1, "equal_size must be True or False, got int"),
                                      (2, True, 1.0, "linear must be an int, got float")]:
        with pytest.raises(TypeError, match=message):
            _C.balance_partitions(lengths, k, equal, linear, 0, *out)
    with pytest.raises(TypeError, match="max_tokens must be an int, got bool"):
        _C.pack_micro_batches(lengths, True, 1, False, out[0], torch.empty(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="max_length_ratio must be a number, got bool"):
        _C.rollout_buckets(lengths, lengths, 4, 100, 0, True, out[0], torch.empty(5, dtype=torch.int64), out[0])
    with pytest.raises(TypeError, match="batch must be an int, got bool"):
        _C.group_workspace_bytes(True)
    spec = ModelSpec.from_hf_config(CFG)
    p = plan(hf_layout(spec), vllm_layout(spec, 1))
    with pytest.raises(TypeError, match="bucket must be an int, got float"):
        p._c.sends(0.0)
    with pytest.raises(TypeError, match="num_threads must be an int, got bool"):
        p._c.run(0, _C.ReshardPhase.pack, None, True)
    with pytest.raises(TypeError, match="check_memory must be True or False, got int"):
        p._c.is_bound([], [], 1)
