"""The multi-turn rollout on vLLM-CPU: each trajectory's next turn is submitted to the running engine as
soon as its observation is in (continuous batching across turns); every turn is what the engine
samples from that trajectory's context, its earlier tokens served from the prefix cache."""

import pytest
import torch

from tiny_models import save_tiny_model
from verl_fast.agents.environments import Environment, StepResult, row_messages
from verl_fast.agents.rollout import MultiTurnRolloutOperator
from verl_fast.agents.settings import MultiTurnConfig
from verl_fast.data import PromptRow
from verl_fast.records.generation import SamplingSpec

pytest.importorskip("vllm", reason="vLLM is not installed")


class Twice(Environment):
    """Two observations ("Go on." then "Once more."), a reward of 0.5 on each turn, then done."""

    def reset(self, row):
        self.turn = 0
        return row_messages(row)

    def step(self, message):
        self.turn += 1
        if self.turn == 3:
            return StepResult(reward=0.5, done=True)
        return StepResult([{"role": "user", "content": ["Go on.", "Once more."][self.turn - 1]}], reward=0.5)


def test_vllm_streams_turns_and_each_turn_is_the_engines_continuation(tmp_path):
    from transformers import AutoTokenizer

    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine
    from verl_fast.rollout.vllm_env import configure_vllm_env

    path = save_tiny_model(tmp_path / "qwen2", family="qwen2", initializer_range=0.2)
    configure_vllm_env()
    engine = VLLMInferenceEngine(path, dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512,
                                 block_size=32, seed=0, enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    tok = AutoTokenizer.from_pretrained(path)
    rows = [PromptRow(prompt_ids=[], prompt_text="", columns={"prompt": f"What is {a} + {a}?"}) for a in (1, 2, 3)]
    mt = MultiTurnConfig(environment=f"{__file__}:Twice", max_turns=5, max_tokens_per_turn=6)
    op = MultiTurnRolloutOperator(engine, SamplingSpec(n=2, max_tokens=120, temperature=0.0, logprobs=True), tok, mt, {})
    try:
        assert engine.streams
        engine.metrics()  # the counts start here
        out = op.rollout(rows, seed=0)
        metrics = op.metrics()
        # each later turn's context (prompt, turns, observations: past a 32-token block) comes from the prefix cache
        assert engine.metrics()["prefix_cache_hit_rate"] > 0.3
        assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
        assert metrics["multi_turn/turns_max"] == 3 and metrics["multi_turn/generate_calls"] == 18  # turns submitted
        for r in range(6):
            k = int(out.attention_mask[r].sum())
            ids, mask = out.response_ids[r, :k].tolist(), out.response_mask[r, :k].tolist()
            starts = [i for i in range(k) if mask[i] and (i == 0 or not mask[i - 1])]
            assert len(starts) == 3 and len(out.turn_ends[r]) == 3
            for s, e in zip(starts, out.turn_ends[r]):  # greedy: the turn is the engine's own continuation
                again = engine.generate([out.prompt_ids[r] + ids[:s]], SamplingSpec(max_tokens=6, temperature=0.0))
                assert again.response_ids[0, : int(again.response_mask[0].sum())].tolist() == ids[s : e + 1]
            assert torch.all(out.logprobs[r, :k][torch.tensor(mask) == 0] == 0)
            assert torch.all(out.logprobs[r, :k][torch.tensor(mask) == 1] <= 0)
            assert out.token_rewards[r, out.turn_ends[r]].tolist() == [0.5, 0.5, 0.5]
        assert "Once more." in tok.decode(out.response_ids[0, : int(out.attention_mask[0].sum())])
    finally:
        op.close()
        engine.close()
