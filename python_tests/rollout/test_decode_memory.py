"""What the HF decode plans to hold at long caps: ``decode_memory.prompts_per_call`` and the memory plan's
``decode_prompts_per_call`` against the KV arithmetic written out here, at the 1.5B full fine-tune with
a 16k cap and the 7B LoRA with an 8k cap on one H100 (80 GiB): a step's prompts in several calls,
never the whole batch x cap that does not fit."""

import pytest
import transformers

from verl_fast.config import from_dict
from verl_fast.rollout import decode_memory
from verl_fast.strategies import memory_plan

GIB = 2**30
# published shapes (config.json of Qwen/Qwen2.5-1.5B and Qwen/Qwen2.5-7B)
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def per_prompt_bytes(shape, width, cap, n, element):
    """One prompt's n rows: keys and values of every layer over width + cap columns, float32 sampling rows
    (the logits and five temporaries), and the prefill's activations and mask over the prompt once."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * element * (width + cap)
    if width <= 2048:  # one forward over the prompt
        prefill = decode_memory.PREFILL_BYTES * width * (shape["hidden_size"] + shape["intermediate_size"]) + width * width
    else:  # chunks of 2,048 columns, a later one's mask over the whole cache
        prefill = decode_memory.PREFILL_BYTES * 2048 * (shape["hidden_size"] + shape["intermediate_size"]) + \
            2048 * (width + cap)
    return n * (kv + 6 * 4 * shape["vocab_size"]) + prefill


@pytest.mark.parametrize("element", [2, 4])
def test_prompts_per_call_is_what_the_room_holds(element):
    cfg = transformers.Qwen2Config(**QWEN25_1_5B)
    one = per_prompt_bytes(QWEN25_1_5B, 512, 16384, 8, element)
    assert decode_memory.bytes_per_prompt(cfg, 512, 16384, 8, element) == one
    assert decode_memory.PREFILL_CHUNK == 2048
    assert decode_memory.bytes_per_prompt(cfg, 8192, 4096, 8, element) == per_prompt_bytes(QWEN25_1_5B, 8192, 4096, 8,
                                                                                       element)
    for room, want in ((None, 16), (100 * one, 16), (5.5 * one, 5), (one - 1, 1), (0.0, 1)):
        assert decode_memory.prompts_per_call(cfg, 512, 16384, 8, 16, room, element) == want


@pytest.mark.parametrize("case", ["1.5b full fine-tune, cap 16k", "7b lora r16, cap 8k"])
def test_long_caps_plan_calls_that_fit_one_h100(case, tmp_path):
    shape, cap, lora = ((QWEN25_1_5B, 16384, None) if case.startswith("1.5b")
                        else (QWEN25_7B, 8192, {"r": 16}))
    hf_config = transformers.Qwen2Config(**shape)
    hf_config.save_pretrained(tmp_path)
    cfg = from_dict({"actor": {"lora": lora}, "rollout": {"n": 8, "max_new_tokens": cap},
                     "trainer": {"train_batch_size": 16, "max_prompt_length": 500}})
    plan = memory_plan.plan(cfg, memory_plan.shape_from_folder(str(tmp_path), cfg.actor.lora), 80 * GIB,
                            needs_reference=False, peft=lora is not None)
    assert plan.fits()
    per_call = memory_plan.decode_prompts_per_call(plan, cfg, hf_config)
    one = per_prompt_bytes(shape, 512, cap, 8, 2)  # the prompt width rounded up to 64; bf16 keys and values
    assert 16 * one > plan.room  # the whole step's batch x cap does not fit ...
    assert per_call * one <= plan.room < (per_call + 1) * one  # ... so each call takes what does
    assert 1 < per_call < 16
