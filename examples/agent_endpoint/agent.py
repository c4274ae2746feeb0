"""An agent program trained through verl_fast's OpenAI-compatible endpoint: a plain urllib loop (any
client works: openai.OpenAI(base_url=base_url), LangGraph, smolagents, ...). verl_fast calls
solve(row, base_url) once per sample; every call it makes is recorded as the engine sampled it."""

import json
import urllib.request

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression such as '3 + 4 * 2'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def chat(base_url, messages):
    body = json.dumps({"model": "policy", "messages": messages, "tools": [CALCULATOR], "max_tokens": 24}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]


def calculate(expression):
    allowed = set("0123456789+-*/(). ")
    if not expression or not set(expression) <= allowed:
        return "error: only numbers and + - * / ( )"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # digits and operators only, checked above
    except Exception as e:  # noqa: BLE001 - the model reads the error
        return f"error: {type(e).__name__}"


def solve(row, base_url):
    """Up to three model turns; the calculator's results go back as tool messages. Returns None: the
    run's reward_fn scores the last turn."""
    messages = list(row["messages"])
    for _ in range(3):
        reply = chat(base_url, messages)
        messages.append({"role": "assistant", "content": reply["content"]})
        calls = reply.get("tool_calls") or []
        if not calls:
            return None
        for call in calls:
            args = json.loads(call["function"]["arguments"] or "{}")
            messages.append({"role": "tool", "content": calculate(str(args.get("expression", "")))})
    return None
