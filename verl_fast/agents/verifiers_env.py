"""A ``verifiers`` environment as a verl_fast environment: verifiers 0.3's in-process environments
(``verifiers.legacy``: ``MultiTurnEnv``, ``SingleTurnEnv``, ``ToolEnv`` and their subclasses, with their
dataset and ``Rubric``).

Named as ``rollout.multi_turn.environment: verl_fast.agents.verifiers_env:VerifiersEnvironment`` with
``environment_kwargs.env``: a function or class (``module:name`` or ``file.py:name``, usually the
environment's ``load_environment``) called with ``env_kwargs``, or the id of an installed verifiers
environment package (verifiers' ``load_environment(id, **env_kwargs)``). It is built once per process
(per ``env`` and ``env_kwargs``); ``trainer.dataset: verifiers:<env>`` gives its dataset's rows
(``verifiers_rows``; ``dataset_kwargs`` are ``env_kwargs``).

Per trajectory, verifiers' own ``rollout`` runs on one event loop shared by the trajectories (as
verifiers' ``generate`` runs them), its model client answered by the trainer: ``reset`` returns the
first prompt the rollout asks the model with (the row's ``prompt``; its ``answer``, or the ground truth,
``info``, ``example_id`` and other columns are the rollout's input), each model turn goes back as the
client's response, and ``step`` returns what the rollout asks with next past the conversation so far
(``env_response``'s messages), or, once its stop conditions (``is_completed``) end it, the rubric's
reward (its functions' weighted sum, each ``async`` or not) on that last turn, done. Turns before carry
no reward. A rollout that raises, or ends with ``state["error"]`` set, scores 0 and is counted in
``verifiers_errors``; one the trainer's limits (``rollout.multi_turn.max_turns``,
``rollout.max_new_tokens``) end first is never scored and is counted in ``verifiers_unscored``: keep the
environment's ``max_turns`` at most the rollout's. A model turn's tool calls (read in ``tool_format``)
are the response's ``tool_calls``; a ``ToolEnv``'s tools are advertised through the chat template
(``tool_schemas``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import threading
import time
import types
from typing import Any, Dict, List, Optional, Tuple

from verl_fast import extras
from verl_fast.agents.environments import Environment, Message, StepResult, row_messages
from verl_fast.agents.parsing import FORMATS, parse_tool_calls
from verl_fast.agents.tools import load_tool
from verl_fast.records.prompts import PromptRow

RELEASE = extras.NO_DEPS["verifiers"]  # the release whose in-process environments are tested here
_MODEL = "verl_fast"  # the model name the rollout's requests carry (the trainer's policy answers them)
logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- verifiers, imported and built


def _legacy() -> types.ModuleType:
    """verifiers' in-process stack (``verifiers.legacy``), or an ImportError naming what is missing."""
    install = extras.hint("verifiers", "verifiers")
    try:
        import verifiers
    except ImportError:
        raise ImportError(f"the verifiers adapter needs {install}") from None
    try:
        import verifiers.legacy.envs.environment  # noqa: F401 - the import that pulls verifiers' packages
        import verifiers.legacy as vf
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("verifiers"):
            raise ImportError(f"verifiers {getattr(verifiers, '__version__', '?')} has no in-process environments "
                              f"(verifiers.legacy); the adapter runs {RELEASE}'s: {install}") from None
        raise ImportError(f"verifiers' in-process environments import {e.name}, which is not installed; "
                          f"{install}") from None
    return vf


_BUILT: Dict[Tuple[str, str], Any] = {}  # (env, its arguments as JSON) -> the built environment
_BUILD_LOCK = threading.Lock()
# verifiers' Environment sets process-wide SIGINT / SIGTERM handlers that exit at once (and only can on the
# main thread); the trainer's own handlers (a checkpoint at the step's end) stay: built with these instead
_NO_HANDLERS = types.SimpleNamespace(**{**vars(signal), "signal": lambda signum, handler: None})


_ADAPTER_KEYS = ("environment_kwargs.env=", "environment_kwargs.env_kwargs")  # how errors name the keys


def build_environment(env: str, env_kwargs: Optional[Dict[str, Any]] = None,
                      keys: Tuple[str, str] = _ADAPTER_KEYS) -> Any:
    """The verifiers Environment ``env`` names (see the module docstring), built once per process;
    errors name ``env`` after ``keys[0]`` and its arguments as ``keys[1]``."""
    named, arguments = f"{keys[0]}{env}", keys[1]
    if not isinstance(env, str) or not env:
        raise ValueError(f"{named}: names no verifiers environment (module:load_environment, "
                         "file.py:load_environment or an installed environment's id)")
    if not isinstance(env_kwargs, (dict, type(None))):
        raise ValueError(f"{arguments} must be a mapping, got {type(env_kwargs).__name__}")
    kwargs = dict(env_kwargs or {})
    key = (env, json.dumps(kwargs, sort_keys=True, default=repr))
    with _BUILD_LOCK:
        if key not in _BUILT:
            _BUILT[key] = _build(env, kwargs, named, arguments)
        return _BUILT[key]


def _build(env: str, kwargs: Dict[str, Any], named: str, arguments: str) -> Any:
    vf = _legacy()
    from verifiers.legacy.envs import environment as module

    make = load_tool(env) if ":" in env else (lambda **a: vf.load_environment(env, **a))
    module.signal = _NO_HANDLERS
    try:
        built = make(**kwargs)
    except TypeError as e:
        raise ValueError(f"{named}: {e} ({arguments})") from None
    finally:
        module.signal = signal
    if not isinstance(built, vf.Environment):
        raise ValueError(f"{named} must give a verifiers Environment (verifiers.legacy: MultiTurnEnv, "
                         f"SingleTurnEnv, ToolEnv, ...), got {type(built).__name__}")
    if built.requires_group_rollouts:
        raise ValueError(f"{named}: its rubric has group reward functions, which score a prompt's samples "
                         "together; each trajectory here is scored alone")
    return built


def verifiers_rows(env: str, **env_kwargs: Any) -> List[Dict[str, Any]]:
    """The rows of the environment's dataset (``get_dataset``), each its columns (``prompt``, ``answer``,
    ``info``, ``example_id``, ...) as plain Python; what ``trainer.dataset: verifiers:<env>`` loads."""
    rows = []
    for r in build_environment(env, env_kwargs, ("dataset verifiers:", "dataset_kwargs")).get_dataset():
        row = dict(r)
        if isinstance(row.get("prompt"), list):  # Arrow fills absent message fields with None
            row["prompt"] = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- one event loop, shared


class _Loop:
    """A daemon thread running the event loop every trajectory's rollout runs on (started at first use)."""

    def __init__(self) -> None:
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._lock = threading.Lock()

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="verl_fast verifiers").start()
            return self._loop

    def forget(self) -> None:  # a forked child has no thread running it
        self._loop, self._lock = None, threading.Lock()


_LOOP = _Loop()
os.register_at_fork(after_in_child=_LOOP.forget)


def _text(content: Any) -> str:
    """A verifiers message's content as text (its text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"a verifiers message holds a {kind} part; the adapter passes text only")
        parts.append(part["text"] if isinstance(part, dict) else part.text)
    return "".join(parts)


def _plain(message: Any) -> Message:
    """A verifiers message (a pydantic model) as a chat message (``role``, ``content`` and a tool
    message's ``tool_call_id``)."""
    out = {"role": message.role, "content": _text(message.content)}
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


# ----------------------------------------------------------------------------- the adapter


class VerifiersEnvironment(Environment):
    """One trajectory's verifiers rollout (see the module docstring)."""

    def __init__(self, env: Optional[str] = None, env_kwargs: Optional[Dict[str, Any]] = None,
                 tool_format: str = "hermes"):
        if env is None:
            raise ValueError("VerifiersEnvironment needs environment_kwargs.env (module:load_environment, "
                             "file.py:load_environment or an installed verifiers environment's id)")
        if tool_format not in FORMATS:
            raise ValueError(f"environment_kwargs.tool_format must be one of {list(FORMATS)}, got {tool_format!r}")
        self.name, self.format = env, tool_format
        self.env = build_environment(env, env_kwargs)
        self.client = _turn_client(self)
        self.seen: List[Message] = []  # the conversation so far, as the model read it
        self.counts = {"verifiers_reward": 0.0, "verifiers_errors": 0.0}  # and the rubric's metrics, once scored
        self._episode: Optional[concurrent.futures.Future] = None  # the rollout, scored: (reward, metrics)
        self._asked: Optional[concurrent.futures.Future] = None  # the prompt of the model turn asked next
        self._answer: Optional[asyncio.Future] = None  # that turn's text, awaited by the rollout
        self._scored = False

    @classmethod
    def tool_schemas(cls, env: Optional[str] = None, env_kwargs: Optional[Dict[str, Any]] = None,
                     **kwargs: Any) -> List[Dict[str, Any]]:
        """The environment's tools (``tool_defs``, a ``ToolEnv``'s) as the chat template advertises them."""
        if env is None:
            return []
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}}
                for t in build_environment(env, env_kwargs).tool_defs or []]

    # ------------------------------------------------------------------ the rollout, run on the loop

    def _input(self, row: PromptRow) -> Dict[str, Any]:
        """The rollout's input: the row's columns, its prompt as chat messages, its answer (else the
        ground truth), ``info`` and ``example_id`` (else ``extra_info.index``)."""
        extra = row.extra_info or {}
        columns = {k: v for k, v in row.columns.items() if k not in ("reward_model", "extra_info")}
        answer = columns.get("answer", row.ground_truth)
        return {**columns, "prompt": row_messages(row), "answer": "" if answer is None else answer,
                "info": columns.get("info", extra.get("info")) or {},
                "example_id": int(columns.get("example_id", extra.get("index", 0)) or 0)}

    async def _run(self, rollout_input: Dict[str, Any]) -> Tuple[float, Dict[str, float]]:
        """verifiers' rollout of ``rollout_input`` and its rubric's score (``run_rollout``'s steps):
        ``(reward, metrics)``; a rollout that ended with an error raises it."""
        env = self.env
        state = await env.rollout(rollout_input, self.client, _MODEL, {})
        if state.get("error") is not None:
            raise RuntimeError(f"the rollout ended with an error: {state['error']!r}")
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        return float(state["reward"]), {str(k): float(v) for k, v in (state.get("metrics") or {}).items()}

    async def model_turn(self, prompt: List[Any]) -> str:
        """The client's request: hands ``prompt`` to the trainer and waits for the model's turn."""
        self._answer = asyncio.get_running_loop().create_future()
        self._asked.set_result(prompt)
        return await self._answer

    def _advance(self) -> Optional[List[Message]]:
        """Waits until the rollout asks for the next model turn (its prompt) or ends (None)."""
        concurrent.futures.wait([self._asked, self._episode], return_when=concurrent.futures.FIRST_COMPLETED)
        if self._asked.done():
            return [_plain(m) for m in self._asked.result()]
        return None

    # ------------------------------------------------------------------ Environment

    def reset(self, row: PromptRow) -> List[Message]:
        self._asked = concurrent.futures.Future()
        self._episode = asyncio.run_coroutine_threadsafe(self._run(self._input(row)), _LOOP.get())
        prompt = self._advance()
        # a rollout that ends before asking (its setup failed): the row's prompt, and the first step ends it
        self.seen = prompt if prompt is not None else row_messages(row)
        return list(self.seen)

    def step(self, message: Message) -> StepResult:
        self.seen.append({"role": "assistant", "content": message["content"]})
        prompt = None
        if not self._episode.done():
            answer, self._asked = self._answer, concurrent.futures.Future()
            _LOOP.get().call_soon_threadsafe(_deliver, answer, message["content"])
            prompt = self._advance()
        if prompt is None:
            return self._end()
        if prompt[: len(self.seen)] != self.seen:
            raise ValueError(f"verifiers environment {self.name}: its next prompt does not continue the "
                             "conversation (get_prompt_messages rewrote it); a trajectory here only appends")
        new, self.seen = prompt[len(self.seen):], prompt
        return StepResult(new)

    def _end(self) -> StepResult:
        """The ended rollout's score on the last turn (0 where it failed), done."""
        self._scored = True
        try:
            reward, metrics = self._episode.result()
        except Exception as e:  # the environment's (or its rubric's) failure: this trajectory fails
            self.counts["verifiers_errors"] += 1
            logger.warning("verifiers environment %s: a rollout failed, scored 0: %s: %s", self.name,
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return StepResult([], 0.0, True)
        self.counts["verifiers_reward"] += reward
        for k, v in metrics.items():
            self.counts[f"verifiers_{k}"] = self.counts.get(f"verifiers_{k}", 0.0) + v
        return StepResult([], reward, True)

    def metrics(self) -> Dict[str, float]:
        return {**self.counts, "verifiers_unscored": float(self._episode is not None and not self._scored)}

    def close(self) -> None:
        """Cancels a rollout the trainer ended before the environment did (idempotent)."""
        if self._episode is not None and not self._episode.done():
            self._episode.cancel()


def _deliver(answer: asyncio.Future, text: str) -> None:
    if not answer.done():  # cancelled where the rollout's own time limit (timeout_seconds) ended it
        answer.set_result(text)


_CLIENT: List[type] = []  # the client class, made at first use (verifiers is imported then)


def _turn_client(adapter: VerifiersEnvironment) -> Any:
    """verifiers' model client for ``adapter``'s rollout: its requests are answered by the trainer's
    model turns (``adapter.model_turn``); the responses carry the turn's text and, where the environment has
    tools, its tool calls."""
    if not _CLIENT:
        from verifiers.legacy.clients.client import Client
        from verifiers.legacy.types import Response, ResponseMessage, ToolCall

        class TrainerTurns(Client):
            """A client whose "native client" is the adapter and whose native response is a turn's text."""

            def setup_client(self, config: Any) -> Any:  # built from the adapter, never from a ClientConfig
                raise ValueError("the trainer's turns client is built from its adapter")

            async def to_native_tool(self, tool: Any) -> Any:
                return tool

            async def to_native_prompt(self, messages: Any) -> Tuple[Any, Dict[str, Any]]:
                return messages, {}

            async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                          **kwargs: Any) -> str:
                return await self.client.model_turn(prompt)

            async def raise_from_native_response(self, response: str) -> None:
                return None

            async def from_native_response(self, response: str) -> Any:
                calls = parse_tool_calls(response, self.client.format) if self.client.env.tool_defs else []
                tool_calls = [ToolCall(id=c.id, name=c.name,
                                       arguments=c.error if c.error is not None else json.dumps(c.arguments))
                              for c in calls]
                message = ResponseMessage(content=response, finish_reason="tool_calls" if calls else "stop",
                                          is_truncated=False, tool_calls=tool_calls or None)
                return Response(id="verl_fast", created=int(time.time()), model=_MODEL, message=message)

            async def close(self) -> None:
                return None

        _CLIENT.append(TrainerTurns)
    return _CLIENT[0](adapter)
