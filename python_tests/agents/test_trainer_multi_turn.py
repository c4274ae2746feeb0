"""Multi-turn rollouts in the trainer: batches mixing single- and multi-turn rows, the loss on the
model's own tokens only, per-turn rewards, checkpoint and resume mid-run; experience helpers on
responses with holes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.agents.environments import Environment, StepResult, row_messages
from verl_fast.records.experience import Experience, last_token_rewards
from verl_fast.trainer.rl_trainer import RLTrainer

ROWS = [{"prompt": f"What is {a} + {b}?", "environment": "single_turn" if a % 2 else None,
         "ground_truth": str(a + b)} for a, b in [(1, 2), (2, 4), (3, 6), (4, 8)]]


class Countdown(Environment):
    """Answers every turn with the same user message and a reward of 0.25, for two observations."""

    def reset(self, row):
        self.left = 2
        return row_messages(row)

    def step(self, message):
        self.left -= 1
        if self.left < 0:
            return StepResult(reward=0.25, done=True)
        return StepResult([{"role": "user", "content": "Go on."}], reward=0.25)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


def trainer(tiny_path, out, **t):
    cfg = {"actor": {"lr": 1e-3}, "rollout": {"type": "hf", "n": 2, "max_new_tokens": 96,
                                              "multi_turn": {"environment": f"{__file__}:Countdown", "max_turns": 3,
                                                             "max_tokens_per_turn": 4}},
           "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 4, "output_dir": str(out), "progress_bar": False,
                       "plot": False, "device": "cpu", **t}}
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return RLTrainer(actor_model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_path), config=cfg)


def test_a_mixed_batch_trains_on_the_models_tokens_only(tiny_path, tmp_path):
    tr = trainer(tiny_path, tmp_path / "run")
    batch = tr.processor.encode_all(ROWS)
    metrics = {}
    exp = tr.make_experience(batch, metrics)
    assert metrics["multi_turn/turns_max"] == 3 and metrics["multi_turn/masked_tokens"] > 0
    L = exp.response_length
    single = [i for i, p in enumerate(exp.prompt_index.tolist()) if ROWS[p]["environment"] == "single_turn"]
    for r in range(exp.num_sequences):
        resp_attn = exp.attention_mask[r, -L:]
        mask = exp.response_mask[r]
        k = int(resp_attn.sum())
        assert resp_attn[:k].all() and not resp_attn[k:].any()  # the response's tokens are contiguous
        if r in single:  # single-turn rows: the single-turn rollout's layout, the row's own prompt tokens
            assert torch.equal(mask, resp_attn)
            assert exp.input_ids[r, -L - len(batch[exp.prompt_index[r]].prompt_ids): -L].tolist() == \
                batch[exp.prompt_index[r]].prompt_ids
        else:  # three model turns of 4 tokens, two observations between them (holes in the mask)
            assert int(mask.sum()) == 12 and k > 12
            turns = [i for i in range(k) if mask[i] and (i + 1 == k or not mask[i + 1])]
            assert len(turns) == 3
            want = torch.zeros(L)
            want[turns] = 0.25
            want[turns[-1]] += exp.scores[r] - 0.75  # the reward function's score on the last model token
            assert torch.allclose(exp.token_level_rewards[r], want)
        assert not (exp.advantages[r] * (1 - mask)).any()  # nothing outside the model's tokens


def test_checkpoint_and_resume_mid_run(tiny_path, tmp_path):
    out = tmp_path / "run"
    first = trainer(tiny_path, out, save_freq=1).fit(ROWS)
    assert [h["step"] for h in first] == [1, 2] and all(h["multi_turn/turns_mean"] > 1 for h in first)
    resumed = trainer(tiny_path, out, save_freq=1, total_steps=3, resume=True)
    history = resumed.fit(ROWS)
    assert [h["step"] for h in history] == [1, 2, 3] and history[:2] == first
    assert history[2]["multi_turn/turns_mean"] > 1


def test_last_token_rewards_and_select_with_holes():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    got = last_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    want = torch.zeros(3, 6, dtype=torch.float64)
    want[0, 4], want[1, 0], want[2, 0] = 2.0, 3.0, 4.0  # the last trained token (a row with none: column 0)
    assert torch.equal(got.double(), want)
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    exp = Experience(input_ids=torch.arange(3 * 8).view(3, 8), attention_mask=torch.cat([torch.ones(3, 2, dtype=torch.long),
                     attn], 1), response_mask=mask, prompt_index=torch.arange(3))
    sub = exp.select(torch.tensor([1]))
    assert sub.response_length == 3  # the observation tokens after its last model token are kept
    assert exp.select(torch.tensor([0, 1])).response_length == 5


def test_tools_passed_to_the_trainer_are_described_to_a_template_without_tools(tiny_path, tmp_path):
    import importlib.util
    from pathlib import Path

    from verl_fast.agents.rollout import MultiTurnRolloutOperator

    spec = importlib.util.spec_from_file_location("example_tools", Path(__file__).resolve().parents[2]
                                                  / "examples" / "tool_calling" / "tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tr = RLTrainer(actor_model=model, tokenizer=tok, tools=[module.calculator],
                   config={"rollout": {"type": "hf", "n": 2}, "trainer": {"output_dir": str(tmp_path), "device": "cpu"}})
    try:
        assert isinstance(tr.rollout, MultiTurnRolloutOperator) and tr.rollout.renderer.format == "hermes"
        text = tok.decode(tr.rollout.renderer.prompt_ids([{"role": "user", "content": "What is 2 + 2?"}]))
        assert "- calculator(expression: string): Evaluates an arithmetic expression" in text
        assert tr.rollout.executor.call("calculator", {"expression": "6 * 7"}).content == "42"
    finally:
        tr.rollout.close()


def test_validation_rolls_out_multi_turn_too(tiny_path, tmp_path):
    tr = trainer(tiny_path, tmp_path / "run", total_steps=1, val_before_train=True, val_n=1)
    history = tr.fit(ROWS, val_dataset=ROWS)
    assert [h["step"] for h in history] == [0, 1]
    assert tr.validation.operator.default.n == 1 and tr.validation.operator.executor is tr.rollout.executor
    assert tr.validation.operator.metrics()["multi_turn/turns_max"] == 3  # the Countdown rows: three turns
