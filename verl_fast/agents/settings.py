"""``rollout.multi_turn``: the keys of a multi-turn (tool-calling, environment) rollout, checked at
config validation (before any model loads; the tools are imported and their schemas built then), the
optional packages they need, and the ``verifiers:<env>`` dataset source (a verifiers environment's rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from verl_fast import config as config_mod
from verl_fast import extras
from verl_fast.algos import registry as algorithms
from verl_fast.config import option, read_section
from verl_fast.data import sources

BUILT_IN_ENVIRONMENTS = ("tools", "reasoning_gym", "single_turn")
TOOL_FORMATS = ("auto", "hermes", "llama3", "mistral")
OPENENV_ADAPTER = "verl_fast.agents.openenv_env:OpenEnvEnvironment"
VERIFIERS_ADAPTER = "verl_fast.agents.verifiers_env:VerifiersEnvironment"


@dataclass
class MultiTurnConfig:
    tools: List[str] = option(list, doc="the tools, each module:function or path/to/file.py:function (a typed function "
                                    "with a Google-style docstring); RLTrainer(tools=[...]) adds functions")
    environment: str = option("tools", doc="tools (the observations are the tool results), reasoning_gym (retry until "
                                       "right, per-turn reward), single_turn, or module:Class (an Environment)")
    environment_kwargs: Dict[str, Any] = option(dict, doc="keyword arguments of the environment's constructor")
    max_turns: int = option(4, min=1, doc="model turns per trajectory at most")
    max_tokens_per_turn: Optional[int] = option(None, min=1, doc="tokens one model turn may sample (null: "
                                            "rollout.max_new_tokens); the whole trajectory after the prompt, "
                                            "observations included, stays within rollout.max_new_tokens")
    tool_format: str = option("auto", choices=TOOL_FORMATS, doc="how tool calls are written: auto reads the chat "
                          "template (hermes <tool_call>, llama3 JSON, mistral [TOOL_CALLS]); a template that renders "
                          "no tools gets the Hermes format described in its system message")
    tool_workers: int = option(4, min=1, max=256, doc="worker processes running tool calls: the calls running at once")
    tool_timeout_s: float = option(10.0, min=0.001, doc="a call running longer has its worker killed and replaced; the "
                               "model reads a timeout error")
    tool_result_max_bytes: int = option(4096, min=64, doc="a tool's result is cut to this many bytes (in its worker)")
    tool_output_max_bytes: int = option(4096, min=0, doc="what a tool call prints (its stdout and its stderr, each) is "
                                    "captured in its worker and cut to this many bytes; every byte is counted in "
                                    "the metrics")
    mcp_servers: List[Union[str, Dict[str, Any]]] = option(list, doc="MCP servers whose tools the model may call "
                                    "next to the Python tools (under the same limits): each a command line, an "
                                    "http(s) URL (streamable HTTP), or {command, args, env, cwd} / {url}")
    mcp_start_timeout_s: float = option(60.0, min=0.001, doc="each MCP server must start and list its tools within "
                                    "this at start-up, or the run stops naming it")
    max_tool_calls: int = option(8, min=1, doc="tool calls per trajectory; later calls are refused and the episode ends")
    env_timeout_s: float = option(120.0, min=0.001, doc="an environment's reset or step running longer is given up: a "
                              "step ends its trajectory (multi_turn/env_timeouts), a reset stops the run")
    kv_continuation: bool = option(True, doc="the HF decode keeps each trajectory's keys and values between its "
                                   "turns and prefills only the new tool / environment tokens (false: every turn "
                                   "prefills the whole conversation again); vLLM reuses its prefix cache either way")
    env_isolation: str = option("thread", choices=("thread", "process"), doc="where an environment runs: thread (the "
                            "trainer's process) or process (a worker process per trajectory, killed with every "
                            "process it started when the trajectory ends or times out)")


def parse(rollout_cfg: Any) -> Optional[MultiTurnConfig]:
    """The run's ``rollout.multi_turn`` section, typed (None when the key is unset)."""
    raw = rollout_cfg.multi_turn
    if raw is None:
        return None
    return read_section(MultiTurnConfig, raw, "rollout.multi_turn")


def _check(cfg: config_mod.Config) -> None:
    mt = parse(cfg.rollout)
    if mt is None:
        return
    if mt.environment not in BUILT_IN_ENVIRONMENTS and ":" not in mt.environment:
        raise ValueError(f"rollout.multi_turn.environment must be one of {list(BUILT_IN_ENVIRONMENTS)} or "
                         f"module:Class, got {mt.environment!r}")
    if mt.env_isolation == "process" and mt.environment == "tools":
        raise ValueError("rollout.multi_turn.env_isolation=process is not supported with environment=tools (its tool "
                         "calls run in worker processes already); use env_isolation=thread")
    if not algorithms.spec(cfg).samples:
        raise ValueError(f"rollout.multi_turn is not supported with algorithm.type={cfg.algorithm.type}, which samples "
                         "nothing; remove it")
    from verl_fast.agents.mcp_tools import parse_servers
    from verl_fast.agents.tools import resolve_tools, tool_schema

    parse_servers(mt.mcp_servers)

    for i, spec in enumerate(mt.tools):
        try:
            fn = resolve_tools([spec])
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise ValueError(f"rollout.multi_turn.tools[{i}]: {e}") from None
        try:
            tool_schema(next(iter(fn.values())))
        except ValueError as e:
            raise ValueError(f"rollout.multi_turn.tools[{i}]: {e}") from None


def _needs_mcp(cfg: config_mod.Config) -> Optional[str]:
    mt = cfg.rollout.multi_turn
    return "rollout.multi_turn.mcp_servers" if isinstance(mt, dict) and mt.get("mcp_servers") else None


def _needs_openenv(cfg: config_mod.Config) -> Optional[str]:
    mt = cfg.rollout.multi_turn
    env = mt.get("environment") if isinstance(mt, dict) else None
    return f"rollout.multi_turn.environment={env}" if env == OPENENV_ADAPTER else None


def _needs_verifiers(cfg: config_mod.Config) -> Optional[str]:
    mt = cfg.rollout.multi_turn
    env = mt.get("environment") if isinstance(mt, dict) else None
    if env == VERIFIERS_ADAPTER:
        return f"rollout.multi_turn.environment={env}"
    for key in ("dataset", "val_dataset"):
        source = getattr(cfg.trainer, key)
        if isinstance(source, str) and source.startswith("verifiers:"):
            return f"trainer.{key}={source}"
    return None


def _verifiers_rows(env: str, **env_kwargs: Any) -> List[Dict[str, Any]]:
    from verl_fast.agents.verifiers_env import verifiers_rows  # imports verifiers: only when asked

    return verifiers_rows(env, **env_kwargs)


config_mod.register_check(_check)
sources.register("verifiers", _verifiers_rows)
extras.register("mcp", "agents", _needs_mcp)
extras.register("openenv", "openenv", _needs_openenv)
extras.register("verifiers", "verifiers", _needs_verifiers)
