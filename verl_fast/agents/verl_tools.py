"""verl's tools (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) as an environment here.

verl's tool YAML lists tools, each ``class_name`` (a class in verl's tool interface), ``config`` (a
mapping given to its constructor) and ``tool_schema`` (the OpenAI function schema the chat template
advertises)::

    tools:
      - class_name: my_tools.Calculator          # or path/to/file.py:Calculator
        config: {type: native}
        tool_schema:
          type: function
          function: {name: calc, description: ..., parameters: {type: object, properties: {...}, required: [...]}}

The interface (verl's ``BaseTool``; each method may be ``async``, as verl's are)::

    class Calculator:
        def __init__(self, config: dict, tool_schema): ...
        async def create(self, instance_id, **create_kwargs) -> str | (str, ToolResponse)
        async def execute(self, instance_id, parameters: dict, **kwargs) -> (ToolResponse | str, float, dict)
        async def calc_reward(self, instance_id, **kwargs) -> float
        async def release(self, instance_id, **kwargs) -> None

``VerlToolEnvironment`` (``rollout.multi_turn.environment``, set by the verl keys) builds each tool class
once per run, ``create``s an instance per trajectory with the row's ``extra_info.tools_kwargs[<tool
name>].create_kwargs`` (verl's data layout), runs the model's calls through ``execute`` (the first
``max_parallel_calls`` of a turn; the text cut to ``max_response_chars`` from the ``truncate_side``), and
``release``s at the end. The tools run in the trainer's process, as they do in verl. Where verl is not
installed, ``verl.tools.base_tool`` / ``verl.tools.schemas`` are served to the tool files (``BaseTool``,
``OpenAIFunctionToolSchema``, ``ToolResponse``), and ``verl.tools.gsm8k_tool.Gsm8kTool`` is the GSM8K tool
of verl's examples (the answer scored against the row's ground truth).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from verl_fast.agents.environments import Environment, Message, StepResult, row_messages
from verl_fast.agents.parsing import parse_tool_calls
from verl_fast.agents.tools import load_tool
from verl_fast.config import yaml_files
from verl_fast.data import PromptRow
from verl_fast.rewards import verl_shim

TRUNCATE_SIDES = ("left", "middle", "right")


# ----------------------------------------------------------------------------- verl's tool names, served


class ToolResponse:
    """verl's ``ToolResponse``: the text the model reads (images and videos are not read here)."""

    def __init__(self, text: Optional[str] = None, image: Any = None, video: Any = None):
        self.text, self.image, self.video = text, image, video


class OpenAIFunctionToolSchema(dict):
    """verl's schema type, as the mapping it was validated from (``.function.name`` read as keys)."""

    @classmethod
    def model_validate(cls, data: Dict[str, Any]) -> "OpenAIFunctionToolSchema":
        return cls(data)

    def model_dump(self, **kwargs: Any) -> Dict[str, Any]:
        return dict(self)


class BaseTool:
    """verl's ``BaseTool``: a subclass overrides the methods it needs."""

    def __init__(self, config: Dict[str, Any], tool_schema: Any):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> Tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: Dict[str, Any], **kwargs: Any
                      ) -> Tuple[ToolResponse, float, Dict[str, Any]]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class Gsm8kTool(BaseTool):
    """verl's example GSM8K tool, by behaviour: the answer (``#### `` prefixed) scored against the row's
    ground truth as verl's flexible GSM8K score; -0.05 for a call that does not improve it."""

    def __init__(self, config: Dict[str, Any], tool_schema: Any):
        super().__init__(config, tool_schema)
        self.instances: Dict[str, Dict[str, Any]] = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs: Any) -> Tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        truth = ground_truth if ground_truth is not None else kwargs.get("create_kwargs", {}).get("ground_truth")
        self.instances[instance_id] = {"response": "", "ground_truth": truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: Dict[str, Any], **kwargs: Any
                      ) -> Tuple[ToolResponse, float, Dict[str, Any]]:
        answer = str(parameters.get("answer", ""))
        state = self.instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward!r}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        from verl_fast.rewards.verl_shim import MODULES

        state = self.instances[instance_id]
        score = MODULES["verl.utils.reward_score.gsm8k"]["compute_score"]
        return score(state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.instances.pop(instance_id, None)


verl_shim.serve("verl.tools", {}, package=True)
verl_shim.serve("verl.tools.base_tool", {"BaseTool": BaseTool})
verl_shim.serve("verl.tools.schemas", {"OpenAIFunctionToolSchema": OpenAIFunctionToolSchema,
                                       "ToolResponse": ToolResponse})
verl_shim.serve("verl.tools.gsm8k_tool", {"Gsm8kTool": Gsm8kTool})


# ----------------------------------------------------------------------------- the tool YAML


@dataclass
class ToolSpec:
    class_name: str
    config: Dict[str, Any]
    schema: Dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def read_tool_config(path: str) -> List[ToolSpec]:
    """The tools of verl's tool YAML ``path``; a malformed entry is one line naming the file and tool."""
    data = yaml_files.load_file(path, "the tool config")
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or not data["tools"]:
        raise ValueError(f"{path}: a tool config is a mapping with a non-empty tools: list (verl's layout)")
    out, names = [], set()
    for i, entry in enumerate(data["tools"]):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where}: needs class_name (the tool's class)")
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: needs tool_schema in OpenAI's function form (type: function, function: "
                             "{name, description, parameters})")
        if function["name"] in names:
            raise ValueError(f"{where}: a second tool named {function['name']!r}; tool names must be unique")
        names.add(function["name"])
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config must be a mapping, got {type(config).__name__}")
        out.append(ToolSpec(entry["class_name"], config, {"type": "function", **schema}))
    return out


def tool_class(spec: ToolSpec, path: str) -> type:
    """The class ``spec.class_name`` names (``package.module.Class`` or ``file.py:Class``), checked for
    verl's interface; its module loaded with verl's tool names served where verl is absent."""
    name = spec.class_name
    ref = name if ":" in name else ":".join(name.rsplit(".", 1))
    with verl_shim.loading_user_code():
        try:
            cls = load_tool(ref)
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise ValueError(f"{path}: tool {spec.name}: class_name {name}: {' '.join(str(e).split())}") from None
    missing = [m for m in ("create", "execute", "release") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{path}: tool {spec.name}: {name} is not a tool class in verl's interface (missing "
                         f"{', '.join(missing) or 'a class'}: create, execute, calc_reward, release)")
    return cls


def _call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """A tool method, ``async`` or not, run to its result."""
    result = method(*args, **kwargs)
    return asyncio.run(result) if inspect.isawaitable(result) else result


_BUILT: Dict[str, Dict[str, Tuple[Any, ToolSpec]]] = {}  # tool_config_path -> name -> (tool object, spec)
_LOCK = threading.Lock()


def tools_of(path: str) -> Dict[str, Tuple[Any, ToolSpec]]:
    """The tool objects of ``path``, built once per run (verl builds each tool once too)."""
    with _LOCK:
        if path not in _BUILT:
            specs = read_tool_config(path)
            built = {}
            for spec in specs:
                cls = tool_class(spec, path)
                schema = OpenAIFunctionToolSchema.model_validate(spec.schema)
                built[spec.name] = (cls(spec.config, schema), spec)
            _BUILT[path] = built
        return _BUILT[path]


def _cut(text: str, limit: int, side: str) -> str:
    if len(text) <= limit:
        return text
    if side == "left":
        return "...(truncated)" + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class VerlToolEnvironment(Environment):
    """verl's tools for one trajectory (module docstring)."""

    def __init__(self, tool_config_path: str, tool_format: str = "hermes", max_parallel_calls: int = 1,
                 max_response_chars: int = 256, truncate_side: str = "middle", system_prompt: Optional[str] = None):
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {truncate_side!r}")
        self.tools = tools_of(tool_config_path)
        self.format, self.parallel = tool_format, max_parallel_calls
        self.limit, self.side, self.system_prompt = max_response_chars, truncate_side, system_prompt
        self.instances: Dict[str, str] = {}  # tool name -> this trajectory's instance id
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_reward": 0.0}

    @classmethod
    def tool_schemas(cls, tool_config_path: str, **kwargs: Any) -> List[Dict[str, Any]]:
        """The schemas the chat template advertises (every tool built, so a bad one fails at start)."""
        return [spec.schema for _, spec in tools_of(tool_config_path).values()]

    def reset(self, row: PromptRow) -> List[Message]:
        tools_kwargs = (row.extra_info or {}).get("tools_kwargs") or {}
        for name, (tool, _) in self.tools.items():
            create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
            created = _call(tool.create, str(uuid.uuid4()), **create_kwargs)
            self.instances[name] = created[0] if isinstance(created, tuple) else created
        return row_messages(row, self.system_prompt)

    def _execute(self, name: str, arguments: Dict[str, Any]) -> str:
        if name not in self.tools:
            self.counts["tool_errors"] += 1
            return f"error: no tool named {name!r} (tools: {', '.join(self.tools)})"
        try:
            response, reward, _ = _call(self.tools[name][0].execute, self.instances[name], arguments)
        except Exception as e:  # the tool's own failure: the model reads it, as in verl
            self.counts["tool_errors"] += 1
            return f"error: {type(e).__name__}: {e}"
        self.counts["tool_reward"] += float(reward or 0.0)
        text = response if isinstance(response, str) else (getattr(response, "text", None) or "")
        return _cut(text, self.limit, self.side)

    def step(self, message: Message) -> StepResult:
        calls = parse_tool_calls(message["content"], self.format)[: self.parallel]
        if not calls:
            self.release()
            return StepResult(done=True)
        out = []
        for call in calls:
            self.counts["tool_calls"] += 1
            content = call.error if call.error is not None else self._execute(call.name, call.arguments)
            out.append({"role": "tool", "name": call.name or "unknown", "tool_call_id": call.id, "content": content})
        return StepResult(out)

    def release(self) -> None:
        for name, instance in list(self.instances.items()):
            _call(self.tools[name][0].release, instance)
        self.instances.clear()

    def metrics(self) -> Dict[str, float]:
        return dict(self.counts)
