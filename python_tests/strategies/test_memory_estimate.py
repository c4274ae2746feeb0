"""The memory plan's estimate (strategies/memory_plan.estimate) at the long-cap shapes of issue 66 (1.5B
full fine-tune at a 16k cap, 7B LoRA at an 8k cap; prime-rl's Qwen3-0.6B at 16k-token and Qwen3-4B LoRA at
65k-token sequences) within one 80 GB H100 (75 GiB) by its count. Its count against the passes' counted
peak on the CPU: test_activation_count.py; the GPU's measured peaks of the same shapes:
``SECTIONS=long_caps`` in benchmarks/gpu_run.sh."""

import pytest
import transformers

from verl_fast.bench.shapes import shape as bench_shape
from verl_fast.config import from_dict
from verl_fast.strategies import memory_plan

GIB = 2**30
H100 = 75 * GIB


def hf_config(name: str) -> transformers.PretrainedConfig:
    s = bench_shape(name)
    qwen3 = {"head_dim": s.head_dim, "max_position_embeddings": 65536} if s.qk_norm else {}
    return (transformers.Qwen3Config if s.qk_norm else transformers.Qwen2Config)(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        tie_word_embeddings=s.tied_embeddings, **qwen3)


def long_cap(name: str, cap: int, lora: bool, rank: int = 64):
    cfg = from_dict({"actor": {"model_name": "m", **({"lora": {"r": rank}} if lora else {})},
                     "rollout": {"max_new_tokens": cap, "n": 8},
                     "trainer": {"train_batch_size": 16, "max_prompt_length": 512}})
    hf = hf_config(name)
    shape = memory_plan.shape_from_config(hf, cfg.actor.lora)
    return cfg, hf, shape


def test_a_15b_full_fine_tune_at_a_16k_cap_fits_one_h100():
    cfg, hf, shape = long_cap("Qwen2.5-1.5B", 16384, lora=False)
    assert shape.parameters == bench_shape("Qwen2.5-1.5B").params() and shape.trained == shape.parameters
    # fp32 weights, their gradients, AdamW's two moments, the passes' and the decode's bf16 copies
    assert memory_plan.plan(cfg, shape, H100, False, False).static_bytes == 20 * shape.parameters
    est = memory_plan.estimate(cfg, shape, hf, H100, compiled=True, fused_head=True)
    sequence = 512 + 16384
    assert est.micro_tokens >= sequence and est.peak <= H100
    assert est.rollout_peak <= H100 and 1 <= est.rollout_prompts < 16  # the decode splits the step's prompts
    # a whole sequence of activations fits (no recompute), and only with the fused head: the plain
    # head's [16896, 151936] logits and their gradient would not
    assert est.mode == "plain"
    whole = memory_plan.activation_bytes(shape, 2, compiled=True, checkpointed=False)
    assert est.static + sequence * whole + memory_plan.head_bytes(sequence, shape.hidden, shape.vocab, True) <= H100
    assert est.static + sequence * whole + memory_plan.head_bytes(sequence, shape.hidden, shape.vocab, False) > H100


def test_7b_lora_at_an_8k_cap_fits_one_h100_with_checkpointing():
    cfg, hf, shape = long_cap("Qwen2.5-7B", 8192, lora=True)
    est = memory_plan.estimate(cfg, shape, hf, H100, peft=True, compiled=False, fused_head=True)
    assert est.mode == "checkpointed" and est.micro_tokens >= 512 + 8192 and est.peak <= H100
    assert est.rollout_peak <= H100 and est.rollout_prompts < 16
    # the frozen base in bf16 and the decode's merged bf16 copy: 4 bytes a base parameter, the adapters
    # fp32 with their gradients, AdamW's moments and bf16 copies
    base = shape.parameters - shape.trained
    assert est.static == pytest.approx(4 * base + (4 + 4 + 8 + 2 + 2) * shape.trained)
    eager = memory_plan.activation_bytes(shape, 2, compiled=False, checkpointed=False)
    assert est.static + (512 + 8192) * eager > H100  # unrecomputed, one sequence would not fit


def test_qwen3_4b_lora_at_65k_token_sequences_fits_one_h100_only_checkpointed():
    # prime-rl's single-H100 LoRA row (bench_long_caps qwen3_4b_lora_64k): one sequence is a micro-batch,
    # never split, its activations recomputed layer by layer
    cfg, hf, shape = long_cap("Qwen3-4B", 65536 - 512, lora=True, rank=16)
    assert shape.parameters - shape.trained == bench_shape("Qwen3-4B").params()
    est = memory_plan.estimate(cfg, shape, hf, H100, peft=True, compiled=False, fused_head=True)
    assert est.mode == "checkpointed" and est.micro_tokens >= 65536 and est.update_peak <= H100
    eager = memory_plan.activation_bytes(shape, 2, compiled=False, checkpointed=False)
    assert est.static + 65536 * eager > 4 * H100  # unrecomputed, one sequence would need several GPUs


def test_qwen3_06b_at_16k_token_sequences_spends_the_room_or_matches_a_small_peak():
    # prime-rl's full fine-tune row: the defaults keep whole activations of several sequences a micro-batch;
    # checkpointed with one sequence a micro-batch, the update's activations are a small part of the peak
    cfg, hf, shape = long_cap("Qwen3-0.6B", 16384 - 512, lora=False)
    est = memory_plan.estimate(cfg, shape, hf, H100, compiled=True, fused_head=True)
    assert est.mode == "plain" and est.micro_tokens >= 2 * 16384 and est.update_peak <= H100
    cfg.actor.gradient_checkpointing, cfg.actor.max_token_len_per_gpu = True, 16384
    matched = memory_plan.estimate(cfg, shape, hf, H100, compiled=True, fused_head=True)
    assert matched.mode == "checkpointed" and matched.micro_tokens == 16384
    assert matched.activations + matched.head < 0.25 * matched.static


def test_the_estimate_takes_a_set_token_budget_and_refuses_nothing_silently():
    cfg, hf, shape = long_cap("Qwen2.5-1.5B", 4096, lora=False)
    cfg.actor.max_token_len_per_gpu = 20000
    est = memory_plan.estimate(cfg, shape, hf, H100)
    assert est.micro_tokens == 20000
    cfg.actor.max_token_len_per_gpu = 100  # below one sequence: a sequence is never split
    assert memory_plan.estimate(cfg, shape, hf, H100).micro_tokens == 512 + 4096


def test_the_estimate_at_a_given_micro_batch_and_its_log_prob_pass():
    # a caller that cut its micro-batches (the benchmark's two rows) plans at their tokens, below one
    # sequence included; the log-prob passes without a graph hold far less than the update
    cfg, hf, shape = long_cap("Qwen2.5-1.5B", 16384, lora=False)
    est = memory_plan.estimate(cfg, shape, hf, H100, micro_tokens=16896)
    assert est.micro_tokens == 16896
    assert est.activations == pytest.approx(16896 * memory_plan.activation_bytes(shape, 2, True, est.mode != "plain"))
    assert 0 < est.logprob_pass < 0.1 * est.activations and est.peak >= est.logprob_peak > est.static
    assert memory_plan.estimate(cfg, shape, hf, H100, micro_tokens=100).micro_tokens == 100
