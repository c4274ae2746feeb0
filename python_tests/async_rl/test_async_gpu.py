"""The asynchronous modes on a GPU: ``one_step``'s decode on its high-priority stream; ``full``'s worker
sharing the GPU (weights through the CUDA IPC buffer), holding bf16 weights under the default bf16
autocast and decoding with the trainer engine's settings (the compiled step)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_toy import PROMPTS, reward, tiny_path  # noqa: F401 (tiny_path: a fixture)
from verl_fast.trainer.rl_trainer import RLTrainer


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_an_async_mode_trains_on_one_gpu(tiny_path, tmp_path, mode):
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 8},
           "rollout": {"type": "hf", "n": 4, "max_new_tokens": 12},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(tmp_path), "progress_bar": False,
                       "plot": False, "device": "cuda", "async_mode": mode, "partial_rollouts": False,
                       "loggers": ["jsonl"]}}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tr = RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path), reward_fn=reward, config=cfg)
    rollout = tr.async_rollout
    if mode == "one_step":
        assert rollout._stream.priority < 0  # above the default stream's
    else:
        assert rollout.kind == "shared" and rollout.dtype == torch.bfloat16
        assert rollout.engine_settings["compile_decode"] and rollout.engine_settings["autocast_dtype"] == torch.bfloat16
    history = [h for h in tr.fit(PROMPTS) if "actor/pg_loss" in h]
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history)
    assert all(h["async/staleness_max"] <= 1 for h in history)
    assert next(tr.actor.parameters()).dtype == torch.float32
