"""The built-in reasoning-gym environment: a wrong answer is told to try again, the first right one
ends the episode with reward 1 on its turn."""

from tiny_models import build_tokenizer
from verl_fast.agents.chat import ChatRenderer
from verl_fast.agents.environments import row_messages
from verl_fast.agents.rollout import MultiTurnRolloutOperator
from verl_fast.agents.settings import MultiTurnConfig
from verl_fast.data import RLDataProcessor
from verl_fast.records.generation import SamplingSpec, pad_completions
from verl_fast.rollout.base import RolloutEngine


class Answers(RolloutEngine):
    """Answers the first prompt with ``wrong``, any continuation of it with ``right``."""

    def __init__(self, tok, first_len, wrong, right):
        self.tok, self.first_len, self.wrong, self.right = tok, first_len, wrong, right
        self.pad_token_id = tok.pad_token_id

    def generate(self, prompts, sampling):
        eos = self.tok.eos_token_id
        out = [self.tok(self.right if len(p) > self.first_len else self.wrong)["input_ids"] + [eos] for p in prompts]
        return pad_completions(out, None, list(range(len(prompts))), self.pad_token_id, ["" for _ in out], ["stop"] * len(out))


def test_reasoning_gym_retries_until_right():
    tok = build_tokenizer()
    proc = RLDataProcessor(tok, 256, 128)
    row = proc.encode_all(proc.reasoning_gym_rows("chain_sum", size=1, seed=3, min_terms=2, max_terms=2,
                                                  min_digits=1, max_digits=1))[0]
    answer = row.ground_truth["answer"]
    mt = MultiTurnConfig(environment="reasoning_gym", max_turns=4, environment_kwargs={"max_attempts": 3})
    first_len = len(ChatRenderer(tok, []).prompt_ids(row_messages(row)))
    engine = Answers(tok, first_len, f"It is {int(answer) + 1}", f"It is {answer}")
    op = MultiTurnRolloutOperator(engine, SamplingSpec(n=1, max_tokens=128, logprobs=False), tok, mt, {})
    try:
        out = op.rollout([row])
        assert len(out.turn_ends[0]) == 2  # wrong, told to retry, then right: done
        assert out.token_rewards[0, out.turn_ends[0]].tolist() == [0.0, 1.0]
        assert out.token_rewards[0].sum() == 1.0 and out.texts[0] == f"It is {answer}"
        text = tok.decode(out.response_ids[0, : int(out.attention_mask[0].sum())])
        assert "That is not right. Try again" in text
        assert op.metrics()["multi_turn/env_attempts"] == 2
    finally:
        op.close()
