"""``actor.autocast: auto``: bf16 where the device multiplies it natively, else fp32 (no autocast)."""

import pytest
import torch

from verl_fast.config import from_dict
from verl_fast.strategies.fsdp_strategy import autocast_dtype
from verl_fast.strategies.megatron.strategy import check


def test_auto_follows_the_cpus_bf16_support(monkeypatch):
    cpu = torch.device("cpu")
    for avx512_bf16, amx, want in [(False, False, None), (True, False, torch.bfloat16), (False, True, torch.bfloat16)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert autocast_dtype("auto", cpu) is want
    assert autocast_dtype("bfloat16", cpu) is torch.bfloat16 and autocast_dtype("none", cpu) is None  # as set
    assert autocast_dtype("float16", cpu) is torch.float16
    for supported, want in [(True, torch.bfloat16), (False, None)]:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, v=supported, **k: v)
        assert autocast_dtype("auto", torch.device("cuda")) is want


def test_auto_is_allowed_with_megatron_which_trains_bf16_weights():
    check(from_dict({"actor": {"strategy": "megatron", "autocast": "auto"}}))
    with pytest.raises(ValueError, match="actor.autocast"):
        check(from_dict({"actor": {"strategy": "megatron", "autocast": "bfloat16"}}))
