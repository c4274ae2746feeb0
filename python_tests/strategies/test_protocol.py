"""Every training strategy offers what strategies/protocol.py asks: the one training entry
(forward_backward + optimizer_step) and the passes, the capability flags the trainer reads instead of
a backend's name, and the start-up hooks the CLI calls before any model loads."""

import inspect

import pytest
import torch

from verl_fast import config as config_mod
from verl_fast.strategies import backends, protocol

# autocast: a callable each strategy sets when built (the actor's autocast on its device)
METHODS = [name for name, _ in inspect.getmembers(protocol.Strategy, inspect.isfunction)
           if not name.startswith("_") and name != "autocast"]
FLAGS = ("budgets_tokens", "hf_decode_by_default")
START_UP = ("check_machine", "check_fits", "planned")


@pytest.mark.parametrize("name", sorted(set(backends.STRATEGIES)))
def test_each_strategy_offers_the_protocol(name):
    cls = backends.STRATEGIES[name]
    assert {"forward_backward", "optimizer_step", "actor_logprobs", "ref_logprobs"} <= set(METHODS)
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for flag in FLAGS:
        assert isinstance(getattr(cls, flag), bool), (cls.__name__, flag)
    for hook in START_UP:
        assert isinstance(inspect.getattr_static(cls, hook), staticmethod), (cls.__name__, hook)


def test_the_cli_asks_the_strategy_what_auto_becomes():
    cpu = torch.device("cpu")
    megatron = config_mod.from_dict({"actor": {"strategy": "megatron"}})
    assert backends.strategy_class(megatron).planned(megatron, cpu) == {
        "resolved on": "cpu: actor.strategy=megatron trains in actor.dtype=float32"}
    plain = config_mod.from_dict({"trainer": {"device": "cpu"}})
    assert backends.strategy_class(plain).planned(plain, cpu)["actor.autocast"] == "none"
    backends.strategy_class(plain).check_fits(plain, False, cpu)  # the memory plan runs on a GPU only
