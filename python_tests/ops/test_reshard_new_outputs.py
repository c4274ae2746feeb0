"""New outputs at every call (``vllm_weights`` without reuse, ``ReshardPlan.execute_new``): the
destinations of one call are slices of one new allocation, bound without converting each tensor,
and the copy is queued before their tensor objects are made. Bit-exact against the per-parameter
torch.cat reference at every call, nothing shared between calls, and each case that must leave the
quick path (sources replaced or moved, destinations of mixed dtypes, another device asked) taken
through the full one."""

import pytest
import torch

from conftest import DEVICES
from reshard_refs import plain_config, random_state, ref_vllm
from verl_fast.ops.reshard import ModelSpec, hf_layout, plan, vllm_layout, vllm_weights
from verl_fast.ops.reshard.plan import OUTPUT_ALIGN_BYTES

CFG = plain_config("qwen2", num_hidden_layers=2)
SPEC = ModelSpec.from_hf_config(CFG, dtype=torch.float32)


def exact(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    torch.testing.assert_close(got, want, rtol=0, atol=0, check_device=False)


def cpu_ref(sd):
    return ref_vllm({k: v.cpu() for k, v in sd.items()}, CFG, 1, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_exact_and_never_shared(device):
    sd = random_state(SPEC, device=device)
    kept = []
    for step in range(4):
        with torch.no_grad():
            for v in sd.values():
                v.add_(1.0)
        got = dict(vllm_weights(sd, SPEC))
        assert all(t.device == sd["model.norm.weight"].device for t in got.values())
        exact(got, cpu_ref(sd))
        kept.append((got, {k: v.clone() for k, v in got.items()}))
    for got, copy in kept:  # a later call wrote none of an earlier call's tensors
        exact(got, copy)
    bases = {next(iter(got.values())).untyped_storage().data_ptr() for got, _ in kept}
    assert len(bases) == len(kept)


@pytest.mark.parametrize("device", DEVICES)
def test_one_allocation_aligned_disjoint_and_contiguous(device):
    sd = random_state(SPEC, device=device)
    got = list(dict(vllm_weights(sd, SPEC)).values())
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in got)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert all(t.is_contiguous() and (t.data_ptr() - spans[0][0]) % OUTPUT_ALIGN_BYTES == 0 for t in got)


def _plan_and_sources(device="cpu"):
    sd = random_state(SPEC, device=device, seed=1)
    p = plan(hf_layout(SPEC), vllm_layout(SPEC, 1))
    return p, sd


@pytest.mark.parametrize("device", DEVICES)
def test_quick_path_taken_once_sources_are_bound(monkeypatch, device):
    p, sd = _plan_and_sources(device)
    calls = {"bind": 0}
    real = p._c.bind

    def counting(*a):
        calls["bind"] += 1
        return real(*a)

    monkeypatch.setattr(p, "_c", _Proxy(p._c, bind=counting))
    first = p.execute_new(sd)
    second = p.execute_new(sd)
    third = p.execute_new({k: v.detach() for k, v in sd.items()})  # new objects over the same memory
    assert calls["bind"] == 1
    want = cpu_ref(sd)
    for got in (first, second, third):
        exact(dict(zip(p.dst_names, got)), want)
    assert first[0].data_ptr() != second[0].data_ptr() != third[0].data_ptr()


class _Proxy:
    """The plan's _C object with some methods replaced (pybind objects take no attributes)."""

    def __init__(self, inner, **methods):
        self._inner, self._methods = inner, methods

    def __getattr__(self, name):
        return self._methods.get(name) or getattr(self._inner, name)


@pytest.mark.parametrize("device", DEVICES)
def test_moved_or_replaced_sources_take_the_full_path(device):
    p, sd = _plan_and_sources(device)
    p.execute_new(sd)
    name = next(iter(sd))
    with torch.no_grad():
        sd[name].set_(sd[name].clone())  # the same object, other memory
        sd[name].mul_(3)
    exact(dict(zip(p.dst_names, p.execute_new(sd))), cpu_ref(sd))
    sd2 = {k: v.clone() + 1 for k, v in sd.items()}  # other tensors
    exact(dict(zip(p.dst_names, p.execute_new(sd2))), cpu_ref(sd2))
    dev = sd2[name].device  # the device named explicitly ("cuda" is the current one): the quick path too
    named = p.execute_new(sd2, device=dev.type)
    assert named[0].untyped_storage().data_ptr() == named[-1].untyped_storage().data_ptr()
    exact(dict(zip(p.dst_names, named)), cpu_ref(sd2))


def test_mixed_destination_dtypes_allocate_each():
    sd = random_state(SPEC)
    dst = vllm_layout(SPEC, 1)
    dst.tensors[0].dtype = torch.float64  # one destination converts
    p = plan(hf_layout(SPEC), dst)
    assert p._flat is None
    for _ in range(2):
        got = dict(zip(p.dst_names, p.execute_new(sd)))
        want = ref_vllm(sd, CFG, 1, 0)
        first = dst.tensors[0].name
        assert got[first].dtype == torch.float64 and torch.equal(got[first], want[first].double())
        assert all(torch.equal(got[k], want[k]) for k in want if k != first)


def test_bind_destinations_in_checks_its_buffer():
    p, sd = _plan_and_sources()
    p.execute_new(sd)
    dtype, sizes, offsets, total = p._flat
    with pytest.raises(TypeError, match="must be float32, the buffer is bfloat16"):
        p._c.bind_destinations_in(torch.empty(total, dtype=torch.bfloat16), offsets)
    with pytest.raises(ValueError, match="lies outside the buffer"):
        p._c.bind_destinations_in(torch.empty(total - 1), offsets)
    with pytest.raises(ValueError, match="destination offsets"):
        p._c.bind_destinations_in(torch.empty(total), offsets[:-1])
    with pytest.raises(ValueError, match="16-byte aligned"):
        p._c.bind_destinations_in(torch.empty(total + 1), [o + 1 for o in offsets])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        p._c.bind_destinations_in(torch.empty(total, 2)[:, 0], offsets)


@pytest.mark.parametrize("device", DEVICES)
def test_reusing_calls_never_write_a_new_output_bound_since(device):
    """A reusing call after new objects over the same memory copies before it checks (the short path);
    a default call in between binds the plan to its own new outputs, which that copy must not write."""
    sd = random_state(SPEC, device=device, seed=2)
    for _ in range(2):  # the second call marks the next one to copy first
        dict(vllm_weights({k: v.detach() for k, v in sd.items()}, SPEC, reuse=True))
    kept = dict(vllm_weights(sd, SPEC))
    copy = {k: v.clone() for k, v in kept.items()}
    with torch.no_grad():
        for v in sd.values():
            v.mul_(-1)
    reused = dict(vllm_weights({k: v.detach() for k, v in sd.items()}, SPEC, reuse=True))
    exact(kept, copy)
    exact(reused, cpu_ref(sd))
    p = plan(hf_layout(SPEC), vllm_layout(SPEC, 1))  # the public execute binds too
    first = p.execute_new(sd)
    before = [t.clone() for t in first]
    p.execute(sd, p.allocate_destinations(first[0].device))
    assert all(torch.equal(a, b) for a, b in zip(first, before))
