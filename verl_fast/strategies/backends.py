"""Training strategies by name: ``actor.strategy`` picks one when the trainer is built (``build``)
and answers the CLI's start-up questions before any model loads (``strategy_class``: its
``check_machine``, ``check_fits``, ``planned``); the names (also ``critic.strategy``'s), each
strategy's config checks and the packages it needs are registered here."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from verl_fast import config, extras
from verl_fast.strategies.fsdp_strategy import FSDPStrategy
from verl_fast.strategies.protocol import Strategy
from verl_fast.strategies.megatron import strategy as megatron

# auto: fsdp2 with several processes, none (a plain module) in one (sharding.Sharding.from_config)
STRATEGIES: Dict[str, Any] = {"auto": FSDPStrategy, "fsdp2": FSDPStrategy, "fsdp1": FSDPStrategy,
                              "none": FSDPStrategy, "megatron": megatron.MegatronStrategy}


def strategy_class(cfg: config.Config) -> Any:
    """The class ``actor.strategy`` names (its start-up hooks are static methods)."""
    return STRATEGIES[cfg.actor.strategy]


def build(cfg: config.Config, actor: torch.nn.Module, ref: Optional[torch.nn.Module] = None,
          critic: Optional[torch.nn.Module] = None, needs_reference: bool = False) -> Strategy:
    """The strategy ``cfg.actor.strategy`` names, holding the actor, its reference (when
    ``needs_reference``: ``ref``, else a copy of the actor) and ``critic`` (when given); collective
    under torchrun."""
    return STRATEGIES[cfg.actor.strategy](cfg, actor, ref, critic, needs_reference)


config.STRATEGIES.register(*STRATEGIES)
config.register_check(megatron.check)
extras.register("megatron.core", "megatron", megatron.needs_megatron_core)
