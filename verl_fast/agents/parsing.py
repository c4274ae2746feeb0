"""Tool calls read from a model's turn, in the format its chat template declares.

Formats (``detect_format`` picks one from the template's text):

- ``hermes`` (Qwen2.5 / Qwen3, Hermes 2-3, SmolLM3, ...): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the turn.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``; several may be separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects (v3 templates)
  or by ``name[ARGS]{...}`` pairs (v11+ templates).

A call whose JSON does not parse, or that names no function, is returned as a ``ToolCall`` with
``error`` set: the model is told what was wrong (a tool message) instead of the turn silently
ending. What a degenerate turn can hold is bounded before any JSON is parsed: a call's text
(``MAX_CALL_CHARS``), its nesting (``MAX_DEPTH`` brackets, counted in one pass outside strings) and
the calls a turn makes (``MAX_CALLS``, the rest dropped); past them the call is an error, never an
exception out of the rollout.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

FORMATS = ("hermes", "llama3", "mistral")
MAX_CALL_CHARS = 1 << 20  # a call's JSON text
MAX_DEPTH = 64  # nested brackets in a call's JSON
MAX_CALLS = 64  # calls read from one turn


@dataclass
class ToolCall:
    """One call the model asked for; ``error`` set when it could not be read."""

    name: str
    arguments: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    id: str = ""

    def as_message_call(self) -> Dict[str, Any]:
        """The OpenAI-style entry of an assistant message's ``tool_calls`` (chat templates render it)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def detect_format(chat_template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template declares, or None when it renders no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3"
    return None


def _depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in ``text`` outside JSON strings (one pass, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _loads(text: str) -> Tuple[Any, Optional[str]]:
    """``(value, None)``, or ``(None, what is wrong)`` for text that is too long, too deep or not JSON."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"a tool call longer than {MAX_CALL_CHARS} characters ({len(text)})"
    depth = _depth(text)
    if depth > MAX_DEPTH:
        return None, f"a tool call nested {depth} brackets deep (at most {MAX_DEPTH}): {text[:80]!r}"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at {e.pos}): {text[:80]!r}"
    except RecursionError:  # the count above keeps it out; json's own limit, should the count miss a case
        return None, f"a tool call nested too deep to read: {text[:80]!r}"


def _from_json_object(obj: Any, source: str) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall(name="", error=f"a tool call must be a JSON object, got {source[:80]!r}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", error=f"a tool call needs a 'name' string, got {source[:80]!r}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args, error = _loads(args)
        if error is not None:
            return ToolCall(name=name, error=f"the arguments of {name}: {error}")
    if not isinstance(args, dict):
        return ToolCall(name=name, error=f"the arguments of {name} must be a JSON object, got {args!r:.80}")
    return ToolCall(name=name, arguments=args)


def _parse_json(text: str) -> ToolCall:
    obj, error = _loads(text)
    if error is not None:
        return ToolCall(name="", error=error)
    return _from_json_object(obj, text)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> List[ToolCall]:
    return [_parse_json(m.group(1).strip()) for m in itertools.islice(_HERMES.finditer(text), MAX_CALLS)]


def _llama3(text: str) -> List[ToolCall]:
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    body = body.strip()
    if not body.startswith("{"):
        return []
    obj, error = _loads(body)  # one object, or several joined by ';'
    if error is None:
        return [_from_json_object(obj, body)]
    parts = [p.strip() for p in body.split(";") if p.strip()]
    if len(parts) > 1 and all(p.startswith("{") for p in parts):
        return [_parse_json(p) for p in parts[:MAX_CALLS]]
    return [_parse_json(body)]


_MISTRAL_NAMED = re.compile(r"([A-Za-z_][\w.-]*)\[ARGS\]")


def _mistral(text: str) -> List[ToolCall]:
    if "[TOOL_CALLS]" not in text:
        return []
    calls: List[ToolCall] = []
    for chunk in text.split("[TOOL_CALLS]", MAX_CALLS)[1:]:
        chunk = chunk.strip()
        named = _MISTRAL_NAMED.match(chunk)
        if named:  # name[ARGS]{...}
            args = chunk[named.end():].strip()
            calls.append(_from_json_object({"name": named.group(1), "arguments": args}, args))
            continue
        obj, error = _loads(chunk)
        if error is not None:
            calls.append(ToolCall(name="", error=error))
            continue
        calls.extend(_from_json_object(o, json.dumps(o)[:80]) for o in (obj if isinstance(obj, list) else [obj]))
    return calls


_PARSERS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}


def parse_tool_calls(text: str, fmt: str) -> List[ToolCall]:
    """The tool calls in a model's turn (``text`` decoded with special tokens kept), ``[]`` when it
    makes none; each call gets an id unique within the turn (Mistral templates want 9 characters)."""
    if fmt not in _PARSERS:
        raise ValueError(f"tool-call format must be one of {list(FORMATS)}, got {fmt!r}")
    calls = _PARSERS[fmt](text)[:MAX_CALLS]
    for i, call in enumerate(calls):
        call.id = f"call{i:05d}"[:9]
    return calls


def tools_system_prompt(schemas: List[Dict[str, Any]]) -> str:
    """The Hermes instructions for a model whose chat template renders no tools: put in the system
    message, they list the tools (name, parameters, description) and the ``<tool_call>`` format the
    parser reads, in few tokens (a small model's context, and the update's cost, grow with them)."""
    lines = []
    for schema in schemas:
        fn = schema.get("function", schema)
        params = fn.get("parameters", {}).get("properties", {})
        signature = ", ".join(f"{name}: {p.get('type', 'any')}" for name, p in params.items())
        lines.append(f"- {fn['name']}({signature}): {fn.get('description', '').strip()}")
    return ("Tools you may call:\n" + "\n".join(lines) + "\n"
            'To call one, write <tool_call>{"name": "<tool name>", "arguments": {<the arguments as JSON>}}</tool_call> '
            "and stop; its result comes back in <tool_response></tool_response>.")
