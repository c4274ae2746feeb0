"""Tool-call parsing against the chat templates of four families, and multi-turn trajectories whose
tokens are the template's rendering of the conversation with a mask on the model's tokens only."""

import pytest
import torch

from chat_templates import FAMILIES, family_tokenizer
from verl_fast.agents.chat import ChatRenderer
from verl_fast.agents.settings import MultiTurnConfig
from verl_fast.agents.parsing import detect_format, parse_tool_calls
from verl_fast.agents.rollout import MultiTurnRolloutOperator
from verl_fast.agents.tools import tool_schema
from verl_fast.data import PromptRow
from verl_fast.records.generation import SamplingSpec, pad_completions
from verl_fast.rollout.base import RolloutEngine


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


CALL = {"id": "call00000", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
USER = {"role": "user", "content": "What is 2 + 3?"}


def render(tok, messages, generation_prompt=False):
    return tok.apply_chat_template(messages, tools=[tool_schema(add)], tokenize=False,
                                   add_generation_prompt=generation_prompt)


def model_turn(tok, messages):
    """The text the template writes for the last (assistant) message, up to and including its EOS."""
    before = render(tok, messages[:-1], generation_prompt=True)
    after = render(tok, messages)
    assert after.startswith(before)
    turn = after[len(before):]
    return turn[: turn.index(tok.eos_token) + len(tok.eos_token)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_declares_its_format_and_its_calls_parse_back(family):
    tok = family_tokenizer(family)
    assert detect_format(tok.chat_template) == FAMILIES[family][3]
    turn = model_turn(tok, [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}])
    calls = parse_tool_calls(turn[: -len(tok.eos_token)], FAMILIES[family][3])
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2, "b": 3}, None)]


@pytest.mark.parametrize("fmt, text, want", [
    ("hermes", "I will add.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\n"
               "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 4, \\\"b\\\": 5}\"}</tool_call>",
     [("add", {"a": 1, "b": 2}, None), ("add", {"a": 4, "b": 5}, None)]),
    ("hermes", "no call here", []),
    ("hermes", "<tool_call>{\"name\": add}</tool_call>", [("", {}, "not valid JSON")]),
    ("hermes", "<tool_call>{\"arguments\": {}}</tool_call>", [("", {}, "needs a 'name'")]),
    ("hermes", "<tool_call>{\"name\": \"add\", \"arguments\": [1]}", [("add", {}, "must be a JSON object")]),
    ("llama3", "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}",
     [("add", {"a": 1, "b": 2}, None)]),
    ("llama3", "{\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"add\", \"parameters\": {\"b\": 2}}",
     [("add", {"a": 1}, None), ("add", {"b": 2}, None)]),
    ("llama3", "The answer is 5.", []),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}]",
     [("add", {"a": 1, "b": 2}, None)]),
    ("mistral", "[TOOL_CALLS]add[ARGS]{\"a\": 1, \"b\": 2}", [("add", {"a": 1, "b": 2}, None)]),
    ("mistral", "[TOOL_CALLS] [{\"name\": ", [("", {}, "not valid JSON")]),
])
def test_parser_cases(fmt, text, want):
    calls = parse_tool_calls(text, fmt)
    assert len(calls) == len(want)
    for call, (name, args, error) in zip(calls, want):
        assert (call.name, call.arguments) == (name, args)
        assert (call.error is None) if error is None else (error in call.error)
    assert len({c.id for c in calls}) == len(calls) and all(len(c.id) == 9 for c in calls)


def test_parser_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="tool-call format must be one of"):
        parse_tool_calls("", "json")


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with the next of ``turns`` (token lists): the k-th once the prompt is
    longer than the first prompt plus ``starts[k]`` tokens (the (k-1)-th turn's start)."""

    def __init__(self, turns, first_prompt_len, pad_id, starts):
        self.turns, self.first, self.pad_token_id, self.starts = turns, first_prompt_len, pad_id, starts
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            out.append(self.turns[min(len(self.turns) - 1, sum(len(p) > self.first + t for t in self.starts))])
        return pad_completions(out, [[-0.5] * len(o) for o in out], list(range(len(prompts))), self.pad_token_id,
                               ["" for _ in out], ["stop"] * len(out))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trajectory_is_the_templates_rendering_with_an_exact_mask(family):
    tok = family_tokenizer(family)
    conversation = [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "5"},
                    {"role": "assistant", "content": "The answer is 5."}]
    text1, text2 = model_turn(tok, conversation[:2]), model_turn(tok, [USER, conversation[3]])
    turn1 = tok(text1, add_special_tokens=False)["input_ids"]
    turn2 = tok(text2, add_special_tokens=False)["input_ids"]
    renderer = ChatRenderer(tok, [tool_schema(add)])
    prompt = renderer.prompt_ids([USER])
    engine = ScriptedEngine([turn1, turn2], len(prompt), tok.pad_token_id, [0])
    row = PromptRow(prompt_ids=[1], prompt_text="", columns={"prompt": [USER]})
    op = MultiTurnRolloutOperator(engine, SamplingSpec(n=2, max_tokens=400), tok,
                                  MultiTurnConfig(max_turns=4, tool_workers=1), {"add": add})
    try:
        out = op.rollout([row], seed=3)
        metrics = op.metrics()
    finally:
        op.close()
    assert engine.calls == [2, 2]  # both samples' turns in one call per turn
    # what the template writes for the conversation at the model's second turn, then that turn
    # (Hermes-3 writes a tool result differently once more messages follow it: the rendering at
    # generation time is the one the model saw)
    full = render(tok, conversation[:3], generation_prompt=True) + text2
    for r in range(2):
        k = int(out.attention_mask[r].sum())
        ids = out.prompt_ids[r] + out.response_ids[r, :k].tolist()
        text = tok.decode(ids, skip_special_tokens=False)
        assert text == full
        obs = k - len(turn1) - len(turn2)
        assert out.response_ids[r, :len(turn1)].tolist() == turn1 and out.response_ids[r, k - len(turn2):k].tolist() == turn2
        want = [1] * len(turn1) + [0] * obs + [1] * len(turn2)
        assert out.response_mask[r, :k].tolist() == want and not out.response_mask[r, k:].any()
        assert out.turn_ends[r] == [len(turn1) - 1, k - 1]
        assert torch.equal(out.logprobs[r, :k], torch.tensor(want, dtype=torch.float32) * -0.5)
    assert out.texts[0] == tok.decode(turn2, skip_special_tokens=True)
    assert metrics["multi_turn/tool_calls"] == 2 and metrics["multi_turn/turns_mean"] == 2
    assert metrics["multi_turn/masked_tokens"] == 2 * obs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_rendering_equals_one_by_one(family):
    """``prompts_ids`` / ``observations_ids`` (each distinct conversation rendered once, all encoded in one
    tokenizer call) give each item's ``prompt_ids`` / ``observation_ids``: repeated, distinct and empty items,
    the same messages after different stop tokens."""
    tok = family_tokenizer(family)
    renderer = ChatRenderer(tok, [tool_schema(add)])
    other = {"role": "user", "content": "and 7 + 8, twice over?"}
    conversations = [[USER], [other], [USER], [{"role": "system", "content": "Be brief."}, other], [USER]]
    assert renderer.prompts_ids(conversations) == [renderer.prompt_ids(m) for m in conversations]
    tool = {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "5"}
    stop = tok.convert_tokens_to_ids(FAMILIES[family][2])
    items = [([tool], stop), ([tool], None), ([other], stop), ([tool], stop), ([tool, other], stop)]
    assert renderer.observations_ids(items) == [renderer.observation_ids(m, last) for m, last in items]
    assert renderer.observations_ids([]) == [] and renderer.prompts_ids([]) == []
    texts = ["", "a b", "a b", " 12 + 30 = 42"]
    assert renderer.encode_all(texts) == [renderer.encode(t) for t in texts]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_batch_of_endpoint_prompts_equals_each_made_alone(family):
    """``chat.prompts_ids`` (the endpoint's batch: every distinct text rendered once, all encoded in one
    tokenizer call) gives each prompt the ids of making it alone, for a mix: fresh conversations with and
    without tools (two renderers), observations continuing kept tokens after a stop token or none, plain
    text after kept tokens, given ids, repeats; a prompt whose rendering raises gets its error, alone."""
    from verl_fast.agents.chat import Prompt, prompts_ids, render_key

    tok = family_tokenizer(family)
    tools, plain = ChatRenderer(tok, [tool_schema(add)]), ChatRenderer(tok, [])
    other = {"role": "user", "content": "and 7 + 8, twice over?"}
    tool = {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "5"}
    stop = tok.convert_tokens_to_ids(FAMILIES[family][2])
    head = tools.prompt_ids([USER]) + tok("The sum is", add_special_tokens=False)["input_ids"] + [stop]

    def fresh(renderer, messages):
        return (Prompt([], lambda: renderer.prompt_text(messages), (renderer, "prompt", render_key(messages)), tok),
                renderer.prompt_ids(messages))

    def observed(renderer, messages, last):
        return (Prompt(head, lambda: renderer.observation_text(messages, last),
                       (renderer, "observations", render_key(messages, last)), tok),
                head + renderer.observation_ids(messages, last))

    def text(before, words):
        return Prompt(before, lambda: words, ("text", words), tok), before + tok.encode(words, add_special_tokens=False)

    def broken():
        raise ValueError("the template refused")

    brief = {"role": "system", "content": "Be brief."}
    cases = [fresh(tools, [USER]), fresh(plain, [USER]), fresh(tools, [USER]), fresh(plain, [brief, other]),
             observed(tools, [tool], stop), observed(tools, [tool], None), observed(plain, [other], stop),
             observed(tools, [tool], stop), observed(tools, [tool, other], stop), text([5, 6], " 12 + 30 = 42"),
             text([], "a b"), (Prompt([7, 8, 9]), [7, 8, 9]), (Prompt([1], broken, "broken", tok), None)]
    calls = []
    encode = tok.__class__.__call__

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return encode(self, *args, **kwargs)

    tok.__class__.__call__ = counted
    try:
        got = prompts_ids([p for p, _ in cases])
    finally:
        tok.__class__.__call__ = encode
    assert got[:-1] == [want for _, want in cases[:-1]]
    assert isinstance(got[-1], ValueError) and str(got[-1]) == "the template refused"
    assert len(calls) == 1 and isinstance(calls[0], list)  # one tokenizer call for the batch
