"""Model turns with pathological tool calls (python_tests/support/agent_faults.py's
PATHOLOGICAL_TURNS: ~1,100 nested brackets, thousands of opening tags, a 2 MiB argument): each is
read in bounded time as failed calls, never an exception out of the rollout, and counted."""

import time

import pytest

from agent_faults import PATHOLOGICAL_TURNS, TOOLS
from tiny_models import build_tokenizer
from verl_fast.agents.environments import ToolEnvironment
from verl_fast.agents.parsing import parse_tool_calls
from verl_fast.agents.tools import ToolExecutor
from verl_fast.data import RLDataProcessor
from verl_fast.records.generation import SamplingSpec, pad_completions
from verl_fast.rollout.base import RolloutEngine


@pytest.mark.parametrize("fmt,turn", PATHOLOGICAL_TURNS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(PATHOLOGICAL_TURNS)])
def test_pathological_turns_are_failed_calls(fmt, turn):
    start = time.perf_counter()
    calls = parse_tool_calls(turn, fmt)
    assert time.perf_counter() - start < 2.0
    assert calls and len(calls) <= 64 and all(c.error for c in calls), [c.error for c in calls][:3]
    assert all(len(c.error) < 300 for c in calls)


def test_deep_but_legal_calls_still_parse():
    nested = '{"a": ' * 30 + "1" + "}" * 30
    call = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {{"x": {nested}}}}}</tool_call>', "hermes")[0]
    assert call.error is None and call.name == "f"
    quoted = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"s": "[[[[\\"{{{{"}}</tool_call>', "hermes")[0]
    assert quoted.error is None and quoted.arguments == {"s": '[[[["{{{{'}


class Degenerate(RolloutEngine):
    """Every turn: a tool call of 1,100 nested brackets (degenerate repetition)."""

    def __init__(self, tok):
        self.tok, self.pad_token_id = tok, tok.pad_token_id

    def generate(self, prompts, sampling):
        ids = self.tok("<tool_call>" + "[" * 1100 + "</tool_call>")["input_ids"] + [self.tok.eos_token_id]
        out = [ids for _ in prompts]
        return pad_completions(out, None, list(range(len(prompts))), self.pad_token_id, ["" for _ in out], ["stop"] * len(out))


def test_a_degenerate_call_is_a_failed_call_in_the_trajectory_and_a_metric():
    from verl_fast.agents.rollout import MultiTurnRolloutOperator
    from verl_fast.agents.settings import MultiTurnConfig

    tok = build_tokenizer()
    proc = RLDataProcessor(tok, 256, 4096)
    rows = proc.encode_all([{"prompt": "Call a tool."}])
    mt = MultiTurnConfig(max_turns=2, tool_format="hermes", tool_timeout_s=1.0)
    op = MultiTurnRolloutOperator(Degenerate(tok), SamplingSpec(n=2, max_tokens=4096, logprobs=False), tok, mt,
                                  {"stall": TOOLS["stall"]})
    try:
        out = op.rollout(rows)
        metrics = op.metrics()
    finally:
        op.close()
    # two turns of two trajectories, each read as a failed call (the last turn goes to step too)
    assert metrics["multi_turn/tool_calls_malformed"] == 4 and metrics["multi_turn/turns_max"] == 2
    text = tok.decode(out.response_ids[0, : int(out.attention_mask[0].sum())])
    assert "nested 1100 brackets deep (at most 64)" in text  # the model reads what was wrong


def test_tool_output_is_counted_in_the_environments_metrics():
    with ToolExecutor(TOOLS, workers=1, timeout_s=30.0, max_result_bytes=64, max_output_bytes=16) as ex:
        env = ToolEnvironment(ex, "hermes", max_tool_calls=4)
        env.step({"role": "assistant", "content": '<tool_call>{"name": "flood", "arguments": {"mib": 1}}</tool_call>'
                                                  '<tool_call>{"name": "stall", "arguments": {"seconds": 0}}</tool_call>'})
        m = env.metrics()
    assert m["tool_stdout_bytes"] >= 1 << 20 and m["tool_stderr_bytes"] == 1 << 20
    assert m["tool_output_truncated"] == 1 and m["tool_results_truncated"] == 0 and m["tool_calls"] == 2
