"""``rollout.server``: the keys of an agent rollout through the OpenAI-compatible endpoint
(``agents/agent_rollout.py``), checked at config validation (the agent is imported then)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from verl_fast import config as config_mod
from verl_fast.config import option, read_section

TOOL_FORMATS = ("auto", "hermes", "llama3", "mistral")


@dataclass
class ServerConfig:
    agent: Optional[str] = option(None, doc="the agent program: module:function or path/to/file.py:function, called as "
                              "agent(row, base_url) per sample (RLTrainer(agent=f) passes a function)")
    host: str = option("127.0.0.1", doc="the address the endpoint listens on")
    port: int = option(0, min=0, max=65535, doc="its port (0: any free one)")
    concurrency: int = option(64, min=1, doc="agent runs at once")
    timeout_s: float = option(300.0, above=0.0, doc="seconds one agent run may take; then its trajectory is closed "
                          "(later calls refused) and the sample scored as failed")
    batch_window_s: float = option(0.2, min=0.0, doc="the longest a request waits for others to join its generate "
                               "call; the call goes at once when every running agent has a request waiting")
    tool_format: str = option("auto", choices=TOOL_FORMATS, doc="how tool calls in the model's text are read into "
                          "tool_calls (auto: from the chat template)")
    kv_continuation: bool = option(True, doc="HF decode: a trajectory's call that extends its previous call's "
                                   "prompt and sampled tokens exactly prefills only the new tokens (the previous "
                                   "call's KV cache kept); false: every call prefills its whole prompt")


def parse(rollout_cfg: Any) -> Optional[ServerConfig]:
    raw = rollout_cfg.server
    return None if raw is None else read_section(ServerConfig, raw, "rollout.server")


def _check(cfg: config_mod.Config) -> None:
    server = parse(cfg.rollout)
    if server is None:
        return
    if cfg.rollout.multi_turn is not None:
        raise ValueError("rollout.server is not supported with rollout.multi_turn: the agent program runs the turns; "
                         "remove one")
    if server.agent is not None:
        from verl_fast.agents.tools import load_tool

        try:
            load_tool(server.agent)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"rollout.server.agent: {e}") from None


config_mod.register_check(_check)
