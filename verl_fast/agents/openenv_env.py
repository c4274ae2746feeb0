"""An OpenEnv (``openenv-core``) environment as a verl_fast environment.

Named as ``rollout.multi_turn.environment: verl_fast.agents.openenv_env:OpenEnvEnvironment`` with
``environment_kwargs`` naming the environment one of two ways:

- ``env: module:Class`` (or ``file.py:Class``): an OpenEnv ``Environment`` subclass, built in this
  process once per trajectory with ``env_kwargs``; its actions are its ``Action`` class (read from
  the class's generic parameters, or named by ``action: module:Class``);
- ``url: http://host:port``: a running OpenEnv server (a Hub Space, a container, ``uvicorn``), one
  session per trajectory through OpenEnv's ``GenericEnvClient`` (actions and observations as dicts).

Per trajectory: ``reset(seed=..., **reset_kwargs)`` (the row's ``seed`` column or ``extra_info.seed``,
its ``extra_info.reset_kwargs``) gives the first observation, appended to the row's prompt (the
system prompt first where given); each model turn becomes an action (its text in the action's
``action_field``), and ``step`` gives the next observation (a message of ``role``), the turn's reward
(the environment's rubric) and ``done``. An observation is shown as its ``observation_field``, else
its one field beside ``done`` / ``reward`` / ``metadata``, else those fields as JSON.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Dict, List, Optional, Tuple

from verl_fast.agents.environments import Environment, Message, StepResult, row_messages
from verl_fast.agents.tools import load_tool
from verl_fast.records.prompts import PromptRow

_BASE_FIELDS = ("done", "reward", "metadata")


def _action_class(env_cls: type) -> Optional[type]:
    """The ``Action`` subclass among ``env_cls``'s generic parameters (``Environment[MyAction, ...]``)."""
    from openenv.core.env_server.types import Action

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, Action):
                    return arg
    return None


def _fields(observation: Any) -> Dict[str, Any]:
    if isinstance(observation, dict):
        return observation
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    raise ValueError(f"an OpenEnv observation must be a pydantic model or a dict, got {type(observation).__name__}")


class OpenEnvEnvironment(Environment):
    """One trajectory's OpenEnv environment (see the module docstring)."""

    def __init__(self, env: Optional[str] = None, url: Optional[str] = None,
                 env_kwargs: Optional[Dict[str, Any]] = None, action: Optional[str] = None,
                 action_field: str = "message", observation_field: Optional[str] = None, role: str = "user",
                 system_prompt: Optional[str] = None):
        if (env is None) == (url is None):
            raise ValueError("OpenEnvEnvironment needs one of env (module:Class, an OpenEnv Environment) or url (a "
                             "running OpenEnv server), in rollout.multi_turn.environment_kwargs")
        self.action_field, self.observation_field = action_field, observation_field
        self.role, self.system_prompt = role, system_prompt
        self.rewards = 0.0
        self._client: Any = None
        self._env: Any = None
        if url is not None:
            from openenv.core.generic_client import GenericEnvClient

            self._client = GenericEnvClient(base_url=url).sync()
            self._action: Any = dict
            return
        from openenv.core.env_server.interfaces import Environment as OpenEnvBase

        cls = load_tool(env)
        if not (isinstance(cls, type) and issubclass(cls, OpenEnvBase)):
            raise ValueError(f"environment_kwargs.env={env} must name an OpenEnv Environment subclass "
                             "(openenv.core.env_server.interfaces.Environment)")
        self._action = load_tool(action) if action is not None else _action_class(cls)
        if self._action is None:
            raise ValueError(f"environment_kwargs.env={env}: its Action class is not among its generic parameters; "
                             "name it as environment_kwargs.action (module:Class)")
        self._env = cls(**(env_kwargs or {}))

    # ------------------------------------------------------------------ the calls

    def _parts(self, result: Any) -> Tuple[Dict[str, Any], Optional[float], bool]:
        """``(observation fields, reward, done)`` of what reset / step returned (a client's StepResult
        or a server-side Observation)."""
        if hasattr(result, "observation"):  # the client's StepResult
            fields, reward, done = _fields(result.observation), result.reward, result.done
        else:
            fields = _fields(result)
            reward, done = fields.get("reward"), fields.get("done", False)
        return fields, None if reward is None else float(reward), bool(done)

    def _text(self, fields: Dict[str, Any]) -> str:
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise ValueError(f"OpenEnv observation has no field {self.observation_field!r} "
                                 f"(environment_kwargs.observation_field); its fields: {sorted(fields)}")
            value = fields[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value, default=str)
        own = {k: v for k, v in fields.items() if k not in _BASE_FIELDS}
        if len(own) == 1:
            value = next(iter(own.values()))
            return value if isinstance(value, str) else json.dumps(value, default=str)
        return json.dumps(own, default=str)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._client if self._client is not None else self._env, method)(*args, **kwargs)

    # ------------------------------------------------------------------ Environment

    def reset(self, row: PromptRow) -> List[Message]:
        extra = row.extra_info or {}
        seed = row.columns.get("seed", extra.get("seed"))
        kwargs = dict(extra.get("reset_kwargs") or {})
        if seed is not None:
            kwargs["seed"] = int(seed)
        fields, _, _ = self._parts(self._call("reset", **kwargs))
        messages = row_messages(row, self.system_prompt)
        text = self._text(fields)
        last = messages[-1]
        if last["role"] == "user":
            messages[-1] = {**last, "content": "\n\n".join(t for t in (last["content"], text) if t)}
        else:
            messages.append({"role": "user", "content": text})
        return messages

    def step(self, message: Message) -> StepResult:
        payload = {self.action_field: message["content"]}
        fields, reward, done = self._parts(self._call("step", self._action(**payload)))
        self.rewards += reward or 0.0
        if done:
            self.close()
            return StepResult([], reward, True)
        return StepResult([{"role": self.role, "content": self._text(fields)}], reward, False)

    def metrics(self) -> Dict[str, float]:
        return {"openenv_reward": self.rewards}

    def close(self) -> None:
        """Ends a server session (idempotent); an in-process environment has nothing to end."""
        if self._client is not None:
            client, self._client = self._client, None
            client.close()
