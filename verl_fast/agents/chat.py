"""Trajectory tokens through the model's chat template: the first prompt (with the tools), and the
tokens of the observations that follow a model turn.

A trajectory is kept as tokens, never re-tokenised: the model's own tokens stay exactly what it
sampled (their log-probs are the ones trained). Observation messages become tokens by rendering
them after a fixed stand-in conversation and keeping what the template adds
(``render(prefix + observations, generation prompt) - render(prefix)``), bridged to the model's turn:
the template's end of an assistant turn (e.g. ``<|im_end|>\\n``) minus the stop token the model
already emitted. So the token sequence is what the template writes for the whole conversation,
except that the model's turns are its sampled tokens.

A batch's texts are rendered once each where equal and encoded in one tokenizer call, with the ids of
encoding each alone: ``ChatRenderer.prompts_ids`` / ``observations_ids`` for the built-in multi-turn
rollout's turns, ``prompts_ids`` for the endpoint's batch of calls (``Prompt``: kept ids, then a text).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

from verl_fast.agents.parsing import detect_format, tools_system_prompt

_MARK = "VERLFASTTURNEND"  # a stand-in assistant turn whose end we locate in the rendering


class ChatRenderer:
    """Renders for ``tokenizer``; ``schemas``: the tools' JSON schemas (empty: no tools)."""

    def __init__(self, tokenizer: Any, schemas: List[Dict[str, Any]], tool_format: str = "auto"):
        self.tokenizer = tokenizer
        self.schemas = list(schemas)
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("rollout.multi_turn needs a tokenizer with a chat template (the model's turns and the "
                             "observations are rendered through it)")
        declared = detect_format(template)
        # a template that renders no tools: the tools are described in the system message (Hermes format)
        self.template_renders_tools = declared is not None
        self.format = (declared or "hermes") if tool_format == "auto" else tool_format
        prefix = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        self._prefix = prefix
        base = self._render(prefix, generation_prompt=False)
        if _MARK not in base:
            raise ValueError("the chat template dropped the assistant's content; multi-turn rollouts cannot render it")
        self._base = base
        self._turn_end = base[base.rindex(_MARK) + len(_MARK):]  # what the template writes after a turn's text

    def _render(self, messages: List[Dict[str, Any]], generation_prompt: bool, tools: Optional[list] = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_all(self, texts: Sequence[str]) -> List[List[int]]:
        """Each of ``texts`` as ``encode`` gives it, the distinct ones in one call of the tokenizer."""
        return encode_all(self.tokenizer, texts)

    def with_tool_instructions(self, messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """``messages`` with the Hermes tool instructions in the system message, where the template
        renders no tools itself (else as they are)."""
        if self.template_renders_tools or not self.schemas:
            return messages
        text = tools_system_prompt(self.schemas)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + list(messages[1:])
        return [{"role": "system", "content": text}] + list(messages)

    def prompt_ids(self, messages: List[Dict[str, Any]]) -> List[int]:
        """The first prompt's tokens: ``messages`` (the tools rendered or described) and the generation prompt."""
        return self.encode(self.prompt_text(messages))

    def prompts_ids(self, conversations: Sequence[List[Dict[str, Any]]]) -> List[List[int]]:
        """``prompt_ids`` of each of ``conversations``: each distinct one rendered once, all encoded together."""
        return self.encode_all(_each_once([render_key(m) for m in conversations], conversations, self.prompt_text))

    def observation_ids(self, messages: List[Dict[str, Any]], last_token: Optional[int]) -> List[int]:
        """The tokens between a model turn that ended with ``last_token`` and the model's next turn:
        the end of the turn the model did not write, ``messages``, the next generation prompt."""
        return self.encode(self.observation_text(messages, last_token))

    def observations_ids(self, items: Sequence[Tuple[List[Dict[str, Any]], Optional[int]]]) -> List[List[int]]:
        """``observation_ids`` of each (messages, last token): each distinct one rendered once, all encoded
        together."""
        return self.encode_all(_each_once([render_key(m, last) for m, last in items], items,
                                          lambda item: self.observation_text(*item)))

    def prompt_text(self, messages: List[Dict[str, Any]]) -> str:
        """The text ``prompt_ids`` encodes."""
        tools = self.schemas if self.template_renders_tools and self.schemas else None
        return self._render(self.with_tool_instructions(messages), True, tools)

    def observation_text(self, messages: List[Dict[str, Any]], last_token: Optional[int]) -> str:
        """The text ``observation_ids`` encodes."""
        whole = self._render(self._prefix + list(messages), generation_prompt=True)
        if not whole.startswith(self._base):
            raise ValueError("the chat template renders a conversation differently once observation messages follow "
                             "(its prefix changed); multi-turn rollouts need a template that appends turns")
        end = self._turn_end
        if last_token is not None:
            emitted = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if emitted and end.startswith(emitted):
                end = end[len(emitted):]
        return end + whole[len(self._base):]


class Prompt(NamedTuple):
    """A call's prompt as ``prompts_ids`` makes it tokens with the other prompts of a batch: ``head`` (token
    ids kept as they are: a previous call's prompt and sampled tokens, or ids given), then ``text()`` encoded
    by ``tokenizer`` (None: nothing follows). Prompts of equal ``key`` have equal texts (rendered once)."""

    head: List[int]
    text: Optional[Callable[[], str]] = None
    key: Hashable = None
    tokenizer: Any = None


def prompts_ids(prompts: Sequence[Prompt]) -> List[Union[List[int], Exception]]:
    """Each prompt's token ids: ``head`` and the tokens of its text, each distinct text rendered once and
    the texts of one tokenizer encoded in one call. A prompt whose rendering raised gets the exception."""
    texts: Dict[Hashable, Union[str, Exception]] = {}
    for p in prompts:
        if p.text is not None and p.key not in texts:
            try:
                texts[p.key] = p.text()
            except Exception as e:  # noqa: BLE001 - a template's failure on one request is that request's answer
                texts[p.key] = e
    rendered = [p for p in prompts if p.text is not None and isinstance(texts[p.key], str)]
    tokens: Dict[Tuple[int, Hashable], List[int]] = {}
    for tokenizer_id in dict.fromkeys(id(p.tokenizer) for p in rendered):
        group = [p for p in rendered if id(p.tokenizer) == tokenizer_id]
        keys = list(dict.fromkeys(p.key for p in group))
        ids = encode_all(group[0].tokenizer, [texts[k] for k in keys])
        tokens.update(((tokenizer_id, k), i) for k, i in zip(keys, ids))
    return [list(p.head) if p.text is None else
            texts[p.key] if isinstance(texts[p.key], Exception) else list(p.head) + tokens[id(p.tokenizer), p.key]
            for p in prompts]


def encode_all(tokenizer: Any, texts: Sequence[str]) -> List[List[int]]:
    """Each of ``texts`` as ``tokenizer(text, add_special_tokens=False)`` encodes it, the distinct ones in one
    call of the tokenizer."""
    distinct = list(dict.fromkeys(texts))
    if not distinct:
        return []
    ids = dict(zip(distinct, tokenizer(distinct, add_special_tokens=False)["input_ids"]))
    return [list(ids[text]) for text in texts]


def _each_once(keys: List[str], items: Sequence[Any], render: Callable[[Any], str]) -> List[str]:
    """``render(item)`` for each of ``items``, rendered once per distinct key."""
    texts: Dict[str, str] = {}
    for key, item in zip(keys, items):
        if key not in texts:
            texts[key] = render(item)
    return [texts[key] for key in keys]


def render_key(messages: List[Dict[str, Any]], last_token: Optional[int] = None) -> str:
    """What a rendering depends on: the messages and the token before them."""
    return json.dumps([messages, last_token], sort_keys=True, default=str)
