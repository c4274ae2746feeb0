"""The advantage engine against plain float64 references written here (verl's definitions)."""

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_fast as vf
from conftest import DEVICES
from verl_fast.ops import advantage as A
from verl_fast.ops import pending_checks as P

# ---------------------------------------------------------------- float64 references


def ref_whiten(x, m):
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / (n - 1)
    return (x - mean) / torch.sqrt(var + 1e-8)


def ref_gae(r, v, m, gamma, lam, whiten=True):
    r, v, m = r.double(), v.double(), m.double()
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        next_value, last = 0.0, 0.0
        for t in reversed(range(T)):
            delta = r[b, t] + gamma * next_value - v[b, t]
            if m[b, t]:
                next_value = v[b, t]
                last = delta + gamma * lam * last
            adv[b, t] = last
    ret = adv + v
    return (ref_whiten(adv, m) if whiten else adv), ret


def ref_group_stats(scores, index):
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(float(scores[i]))
    stats = {}
    for g, xs in groups.items():
        n = len(xs)
        mean = sum(xs) / n
        std = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5 if n > 1 else None
        stats[g] = (n, mean, std)
    return stats


def ref_grpo(r, m, index, eps=1e-6, norm_by_std=True):
    r, m = r.double(), m.double()
    scores = r.sum(-1)
    stats = ref_group_stats(scores, index)
    out = torch.zeros_like(scores)
    for i, g in enumerate(index):
        n, mean, std = stats[g]
        if n == 1:
            mean, std = 0.0, 1.0
        out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out[:, None] * m


def ref_rloo(r, m, index):
    r, m = r.double(), m.double()
    scores = r.sum(-1)
    stats = ref_group_stats(scores, index)
    out = scores.clone()
    for i, g in enumerate(index):
        n, mean, _ = stats[g]
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out[:, None] * m


def ref_reinforce_pp(r, m, gamma, whiten=True):
    r, m = r.double(), m.double()
    B, T = r.shape
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if m[b, t]:  # masked-out positions carry the running return through untouched
                running = r[b, t] + gamma * running
                ret[b, t] = running
    adv = (ref_whiten(ret, m) if whiten else ret) * m
    return adv, ret


def ref_reinforce_pp_baseline(r, m, index):
    r, m = r.double(), m.double()
    scores = r.sum(-1)
    stats = ref_group_stats(scores, index)
    out = scores.clone()
    for i, g in enumerate(index):
        n, mean, _ = stats[g]
        out[i] = scores[i] - (mean if n > 1 else 0.0)
    x = out[:, None] * m
    return ref_whiten(x, m) * m


def ref_remax(r, base, m):
    r, m, base = r.double(), m.double(), base.double()
    B, T = r.shape
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running += r[b, t] * m[b, t]
            ret[b, t] = running
    return ret - base[:, None] * m, ret


# ---------------------------------------------------------------- helpers

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-4, torch.float16: 1e-4, torch.float64: 1e-4}


def close(out, ref, dtype=torch.float32, scale=None):
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    scale = scale if scale is not None else max(1.0, ref.abs().max().item())
    err = (out.double().cpu() - ref.cpu()).abs().max().item() if out.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"max error {err:.3e} > {TOL[dtype] * scale:.3e}"


def make(B, T, dtype=torch.float32, seed=0, p_mask=0.7, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g).to(dtype)
    v = torch.randn(B, T, generator=g).to(dtype)
    m = torch.rand(B, T, generator=g) < p_mask
    return r.to(device), v.to(device), m.to(device)


def groups_for(B, seed=0, max_size=5):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, max(1, B // 2), size=B)] if B else []


def enough_mask(m):
    return int(m.sum()) >= 2


def checked(fn, *args, **kwargs):
    """A checking call as a test waits for it: on CUDA the verdict lands after the call returns."""
    out = fn(*args, **kwargs)
    P.raise_pending()
    return out


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (5, 1), (3, 17), (16, 100), (64, 300), (3, 5000)])
def test_gae_matches_reference(device, dtype, B, T):
    r, v, m = make(B, T, dtype, seed=B * 1000 + T, device=device)
    m[0, :] = True  # at least the whitening needs two set positions
    whiten = enough_mask(m)
    adv, ret = vf.compute_gae(r, v, m, gamma=0.99, lam=0.95, whiten=whiten)
    ra, rr = ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95, whiten)
    close(ret, rr, dtype)
    close(adv, ra, dtype)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(1, 40),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    p=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 10_000),
)
def test_gae_hypothesis(B, T, gamma, lam, p, seed):
    r, v, m = make(B, T, seed=seed, p_mask=p)
    adv, ret = vf.compute_gae(r, v, m, gamma=gamma, lam=lam, whiten=False)
    ra, rr = ref_gae(r, v, m, gamma, lam, whiten=False)
    close(adv, ra)
    close(ret, rr)


def test_gae_mask_with_holes_and_empty_rows():
    r, v, _ = make(4, 12, seed=3)
    m = torch.tensor([[1] * 3 + [0] * 3 + [1] * 4 + [0] * 2,  # multi-turn: a hole in the middle
                      [0] * 12,  # empty row
                      [1] * 12,
                      [0, 1] * 6], dtype=torch.int64)
    adv, ret = vf.compute_gae(r, v, m, 0.9, 0.7)
    ra, rr = ref_gae(r, v, m, 0.9, 0.7)
    close(adv, ra)
    close(ret, rr)
    # the empty row carries nothing: advantages 0 before whitening, returns = values
    adv_raw, ret_raw = vf.compute_gae(r, v, m, 0.9, 0.7, whiten=False)
    assert torch.equal(adv_raw[1], torch.zeros(12))
    assert torch.allclose(ret_raw[1], v[1])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16])
def test_gae_mask_dtypes(mask_dtype):
    r, v, m = make(6, 20, seed=5)
    adv, ret = vf.compute_gae(r, v, m.to(mask_dtype), 1.0, 0.9)
    ra, rr = ref_gae(r, v, m, 1.0, 0.9)
    close(adv, ra)
    close(ret, rr)


def test_gae_non_contiguous_inputs():
    r, v, m = make(8, 40, seed=7)
    rt, vt, mt = r.t().contiguous().t(), v[:, :].clone().t().contiguous().t(), m.t().contiguous().t()
    assert not rt.is_contiguous()
    wide = torch.randn(8, 80)
    wide[:, ::2] = r
    adv, ret = vf.compute_gae(wide[:, ::2], vt, mt, 0.95, 0.9)
    ra, rr = ref_gae(r, v, m, 0.95, 0.9)
    close(adv, ra)
    close(ret, rr)
    adv2, _ = vf.compute_gae(rt, v, m, 0.95, 0.9)
    close(adv2, ra)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_writes_a_clean_status(device):
    from verl_fast import _C

    r = torch.zeros(0, 5, device=device)
    adv, ret = vf.compute_gae(r, r, r.bool())
    assert adv.shape == (0, 5) and ret.shape == (0, 5)
    assert vf.compute_grpo_advantage(r, r.bool(), [])[0].shape == (0, 5)
    # the status record comes uninitialised from the caller: poison it, the call must overwrite it
    a = _C.ScanArgs()
    a.rewards, a.values, a.mask = r, r, r.bool().view(torch.uint8)
    a.advantages, a.returns = torch.empty(0, 5, device=device), torch.empty(0, 5, device=device)
    status = torch.full((_C.status_words,), -1, dtype=torch.int32, device=device)
    a.status = status
    _C.advantage_scan(a)
    assert status.cpu().tolist() == [0] * _C.status_words


# ---------------------------------------------------------------- group estimators


INDEX_FORMS = {
    "list_int": lambda ids: ids,
    "list_str": lambda ids: [f"uid-{i}" for i in ids],
    "numpy": lambda ids: np.asarray(ids),
    "numpy_str": lambda ids: np.asarray([f"u{i}" for i in ids], dtype=object),
    "tensor": lambda ids: torch.tensor(ids),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", list(INDEX_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_matches_reference(device, form, dtype):
    B, T = 23, 13
    r, _, m = make(B, T, dtype, seed=11, device=device)
    ids = groups_for(B, seed=1)
    index = INDEX_FORMS[form](ids)
    adv, ret = vf.compute_grpo_advantage(r, m, index)
    assert adv is ret or torch.equal(adv, ret)
    close(adv, ref_grpo(r.cpu(), m.cpu(), ids), dtype)
    adv, _ = vf.compute_grpo_advantage(r, m, index, norm_by_std=False)
    close(adv, ref_grpo(r.cpu(), m.cpu(), ids, norm_by_std=False), dtype)
    adv, _ = vf.compute_drgrpo_advantage(r, m, index)
    close(adv, ref_grpo(r.cpu(), m.cpu(), ids, norm_by_std=False), dtype)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 30),
    T=st.integers(1, 12),
    n_groups=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    eps=st.sampled_from([1e-6, 1e-3]),
)
def test_group_estimators_hypothesis(B, T, n_groups, seed, eps):
    r, _, m = make(B, T, seed=seed)
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, n_groups, size=B)]
    close(vf.compute_grpo_advantage(r, m, ids, epsilon=eps)[0], ref_grpo(r, m, ids, eps), scale=1e3)
    close(vf.compute_rloo_advantage(r, m, ids)[0], ref_rloo(r, m, ids))
    if enough_mask(m):
        close(vf.compute_reinforce_pp_baseline_advantage(r, m, ids)[0], ref_reinforce_pp_baseline(r, m, ids),
              scale=1e3)


@pytest.mark.parametrize("device", DEVICES)
def test_group_edge_cases(device):
    r, _, m = make(8, 6, seed=2, device=device)
    # every sample its own group: GRPO gives s / (1 + eps), RLOO keeps s
    ids = list(range(8))
    close(vf.compute_grpo_advantage(r, m, ids)[0], ref_grpo(r.cpu(), m.cpu(), ids))
    close(vf.compute_rloo_advantage(r, m, ids)[0], ref_rloo(r.cpu(), m.cpu(), ids))
    # a single group; unequal group sizes
    for ids in ([7] * 8, [0, 0, 0, 0, 0, 1, 1, 2]):
        close(vf.compute_grpo_advantage(r, m, ids)[0], ref_grpo(r.cpu(), m.cpu(), ids))
        close(vf.compute_rloo_advantage(r, m, ids)[0], ref_rloo(r.cpu(), m.cpu(), ids))
        close(vf.compute_reinforce_pp_baseline_advantage(r, m, ids)[0],
              ref_reinforce_pp_baseline(r.cpu(), m.cpu(), ids), scale=1e2)
    # equal scores within a group: std 0, advantage 0
    flat = torch.ones(4, 3, device=device)
    adv, _ = vf.compute_grpo_advantage(flat, torch.ones(4, 3, device=device), [0, 0, 1, 1])
    assert torch.equal(adv.cpu(), torch.zeros(4, 3))
    # an empty row keeps zeros
    m2 = m.clone()
    m2[3] = False
    adv, _ = vf.compute_grpo_advantage(r, m2, [0, 0, 1, 1, 2, 2, 3, 3])
    assert torch.equal(adv[3].cpu(), torch.zeros(6))


# ---------------------------------------------------------------- REINFORCE++ and ReMax


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,T", [(1, 2), (4, 9), (7, 33), (2, 4100)])
def test_reinforce_pp_matches_reference(device, B, T):
    r, _, m = make(B, T, seed=B + T, device=device)
    m[0, :2] = True
    for gamma in (1.0, 0.9):
        adv, ret = vf.compute_reinforce_pp_advantage(r, m, gamma=gamma)
        ra, rr = ref_reinforce_pp(r.cpu(), m.cpu(), gamma)
        close(ret, rr)
        close(adv, ra)
        assert torch.equal(adv.cpu()[~m.cpu()], torch.zeros(int((~m).sum())))


@pytest.mark.parametrize("device", DEVICES)
def test_reinforce_pp_carries_across_a_masked_span(device):
    # a multi-turn response: an observation span (mask 0) inside it, trailing padding after it
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 5.0, 0.0, 1.0], [0.0, 0.0, 2.0, 7.0]], device=device)
    m = torch.tensor([[1, 0, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool, device=device)
    adv, ret = vf.compute_reinforce_pp_advantage(r, m, gamma=0.5, whiten=False)
    expected = torch.tensor([[0.25, 0.0, 0.5, 1.0], [0.25, 0.0, 0.5, 1.0], [0.5, 1.0, 2.0, 0.0]])
    assert torch.equal(ret.cpu(), expected)
    assert torch.equal(adv.cpu(), expected)
    ra, rr = ref_reinforce_pp(r.cpu(), m.cpu(), 0.5, whiten=True)
    adv, ret = vf.compute_reinforce_pp_advantage(r, m, gamma=0.5)
    close(ret, rr)
    close(adv, ra)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 40), gamma=st.floats(0.0, 1.0),
       p=st.sampled_from([0.0, 0.3, 0.9, 1.0]), seed=st.integers(0, 10_000))
def test_reinforce_pp_hypothesis(B, T, gamma, p, seed):
    r, _, m = make(B, T, seed=seed, p_mask=p)
    adv, ret = vf.compute_reinforce_pp_advantage(r, m, gamma=gamma, whiten=False)
    ra, rr = ref_reinforce_pp(r, m, gamma, whiten=False)
    close(ret, rr)
    close(adv, ra)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,T", [(1, 1), (5, 8), (3, 2500)])
def test_remax_matches_reference(device, B, T):
    r, v, m = make(B, T, seed=B * T, device=device)
    base = v[:, 0].contiguous()
    adv, ret = vf.compute_remax_advantage(r, base, m)
    ra, rr = ref_remax(r.cpu(), base.cpu(), m.cpu())
    close(ret, rr)
    close(adv, ra)


@pytest.mark.parametrize("threads", [2, 3])
def test_estimators_split_over_threads_match_reference(threads):
    """A batch big enough for the CPU path to split its rows and its whitening over threads (each takes at
    least 32k elements, fewer run on the calling thread): the threads' sums merge to the reference."""
    B, T = 48, 2048
    r, v, m = make(B, T, seed=threads)
    ids = groups_for(B, seed=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gae = vf.compute_gae(r, v, m, gamma=0.99, lam=0.95)
        rpp = vf.compute_reinforce_pp_advantage(r, m, gamma=0.9)
        remax = vf.compute_remax_advantage(r, v[:, 0].contiguous(), m)
        grpo, _ = vf.compute_grpo_advantage(r, m, ids)
    finally:
        torch.set_num_threads(before)
    for (adv, ret), (ra, rr) in [(gae, ref_gae(r, v, m, 0.99, 0.95)), (rpp, ref_reinforce_pp(r, m, 0.9)),
                                 (remax, ref_remax(r, v[:, 0], m))]:
        close(ret, rr)
        close(adv, ra)
    close(grpo, ref_grpo(r, m, ids))


# ---------------------------------------------------------------- CUDA against the CPU path


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (33, 2049), (128, 4096), (3, 10_000), (5, 258), (9, 255)])
def test_cuda_matches_cpu(B, T):
    r, v, m = make(B, T, seed=B + T)
    m[0, :2] = True
    w = enough_mask(m)
    ids = groups_for(B, seed=B)
    cpu = [vf.compute_gae(r, v, m, 0.99, 0.95, w), vf.compute_reinforce_pp_advantage(r, m, 0.99, w),
           vf.compute_grpo_advantage(r, m, ids), vf.compute_rloo_advantage(r, m, ids)]
    rc, vc, mc = r.cuda(), v.cuda(), m.cuda()
    gpu = [vf.compute_gae(rc, vc, mc, 0.99, 0.95, w), vf.compute_reinforce_pp_advantage(rc, mc, 0.99, w),
           vf.compute_grpo_advantage(rc, mc, ids), vf.compute_rloo_advantage(rc, mc, ids)]
    for (ca, cr), (ga, gr) in zip(cpu, gpu):
        assert ga.device.type == "cuda"
        scale = max(1.0, ca.abs().max().item())
        assert (ga.cpu() - ca).abs().max().item() <= 1e-4 * scale
        assert (gr.cpu() - cr).abs().max().item() <= 1e-4 * max(1.0, cr.abs().max().item())


# ---------------------------------------------------------------- bad input


def test_bad_inputs_name_the_argument():
    r, v, m = make(4, 6)
    with pytest.raises(ValueError, match="values"):
        vf.compute_gae(r, v[:, :5], m)
    with pytest.raises(TypeError, match="token_level_rewards"):
        vf.compute_gae(r.long(), v, m)
    with pytest.raises(ValueError, match="response_mask"):
        vf.compute_gae(r, v, m[:3])
    with pytest.raises(ValueError, match="token_level_rewards must be a 2-D"):
        vf.compute_gae(r[0], v[0], m[0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        vf.compute_gae(r.numpy(), v, m)
    with pytest.raises(ValueError, match="index must have one group id per sample"):
        vf.compute_grpo_advantage(r, m, [0, 1, 2])
    with pytest.raises(TypeError, match="index"):
        vf.compute_grpo_advantage(r, m, torch.rand(4))
    with pytest.raises(ValueError, match="reward_baselines"):
        vf.compute_remax_advantage(r, torch.zeros(3), m)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_inputs_raise(device):
    r, v, m = make(4, 6, device=device)
    bad = r.clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="token_level_rewards contains NaN"):
        checked(vf.compute_gae, bad, v, m)
    with pytest.raises(ValueError, match="token_level_rewards contains NaN"):
        checked(vf.compute_grpo_advantage, bad, m, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="token_level_rewards contains NaN"):
        checked(vf.compute_reinforce_pp_advantage, bad, m)
    badv = v.clone()
    badv[0, 0] = float("inf")
    with pytest.raises(ValueError, match="values contains NaN"):
        checked(vf.compute_gae, r, badv, m)
    with pytest.raises(ValueError, match="whitening needs at least 2"):
        checked(vf.compute_gae, r, v, torch.zeros_like(m))
    with pytest.raises(ValueError, match="reward_baselines contains NaN"):
        checked(vf.compute_remax_advantage, r, torch.tensor([0.0, float("nan"), 0.0, 0.0], device=device), m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype,value", [(torch.int64, 2), (torch.int32, -1), (torch.uint8, 3),
                                              (torch.float32, 0.5)])
def test_non_binary_mask_raises_in_every_estimator(device, mask_dtype, value):
    r, v, m = make(4, 6, device=device, p_mask=1.0)
    bad = m.to(mask_dtype)
    bad[1, 4] = value
    calls = [lambda: vf.compute_gae(r, v, bad), lambda: vf.compute_reinforce_pp_advantage(r, bad),
             lambda: vf.compute_remax_advantage(r, torch.zeros(4, device=device), bad),
             lambda: vf.compute_grpo_advantage(r, bad, [0, 0, 1, 1]),
             lambda: vf.compute_rloo_advantage(r, bad, [0, 0, 1, 1]),
             lambda: vf.compute_reinforce_pp_baseline_advantage(r, bad, [0, 0, 1, 1])]
    good = m.to(mask_dtype)
    for call in calls:
        with pytest.raises(ValueError, match=r"^response_mask must hold only 0 and 1"):
            checked(call)
        checked(vf.compute_gae, r, v, good)  # nothing left over for the next check
    close(checked(vf.compute_gae, r, v, good, 0.9, 0.8)[0], ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.9, 0.8)[0])


def test_direct_core_call_with_inconsistent_sizes_raises():
    from verl_fast import _C

    r, v, m = make(4, 6)
    a = _C.ScanArgs()
    a.rewards, a.values, a.mask = r, v[:, :5].contiguous(), m.view(torch.uint8)
    a.advantages = torch.empty(4, 6)
    a.returns = torch.empty(4, 6)
    a.status = torch.zeros(_C.status_words, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"values must be a 2-D tensor of shape \[B, T\] = \[4, 6\], got \[4, 5\]"):
        _C.advantage_scan(a)
    a.values = v
    a.advantages = torch.empty(4, 5)
    with pytest.raises(ValueError, match="advantages"):
        _C.advantage_scan(a)
    a.advantages = torch.empty(4, 6)
    a.status = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="status"):
        _C.advantage_scan(a)
    a.status = torch.zeros(_C.status_words, dtype=torch.int32)
    a.returns = torch.empty(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match="returns must be float32"):
        _C.advantage_scan(a)
    g = _C.GroupArgs()
    g.rewards, g.mask = r, m.view(torch.uint8)
    g.ids = torch.zeros(3, dtype=torch.int64)
    g.advantages = torch.empty(4, 6)
    g.workspace = torch.empty(_C.group_workspace_bytes(4), dtype=torch.uint8)
    g.status = torch.zeros(_C.status_words, dtype=torch.int32)
    with pytest.raises(ValueError, match="index must have one group id per sample"):
        _C.group_advantage(g)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        g.rewards = [1, 2, 3]


# ---------------------------------------------------------------- masked reductions


def test_masked_reductions_match_reference():
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    m = torch.rand(5, 9) < 0.6
    n = m.sum().double()
    ref_mean = (x.detach() * m).sum() / n
    ref_var = (((x.detach() - ref_mean) ** 2) * m).sum() / (n - 1)
    assert torch.allclose(vf.masked_mean(x, m), ref_mean, atol=1e-8)
    assert torch.allclose(vf.masked_var(x, m), ref_var, atol=1e-8)
    assert torch.allclose(vf.masked_whiten(x, m), ref_whiten(x.detach(), m.double()), atol=1e-6)
    assert torch.allclose(vf.masked_mean(x, m, axis=1), (x.detach() * m).sum(1) / m.sum(1).clamp(min=1e-8), atol=1e-6)
    vf.masked_whiten(x, m).sum().backward()  # differentiable
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="at least 2"):
        vf.masked_var(x, torch.zeros_like(m))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_vector_and_scalar_loads_agree(dtype):
    """Aligned rows take 16-byte loads, offset or strided rows scalar ones: same results. 1040 columns:
    every row 16-byte aligned in each dtype (the mask's too), the last tile partial."""
    r, v, m = make(7, 1040, dtype, seed=3)
    wide_r, wide_v, wide_m = (torch.zeros(7, 1041, dtype=dtype), torch.zeros(7, 1041, dtype=dtype),
                              torch.zeros(7, 1041, dtype=torch.bool))
    wide_r[:, 1:], wide_v[:, 1:], wide_m[:, 1:] = r, v, m  # misaligned by one element
    ref = vf.compute_gae(r, v, m, 0.97, 0.9)
    for args in [(r, v, m), (wide_r[:, 1:], wide_v[:, 1:], wide_m[:, 1:])]:
        out = vf.compute_gae(*(x.cuda() for x in args), 0.97, 0.9)
        for o, e in zip(out, ref):
            assert (o.cpu() - e).abs().max().item() <= 1e-4 * max(1.0, e.abs().max().item())


# ---------------------------------------------------------------- the host path as users call it
# (issue 48): one allocation for both outputs, a status record kept per (device, stream, thread) and
# cleared by every call, the common arguments checked in a few comparisons. Each call's results against
# the float64 reference, a failing call followed by good ones, threads calling at once, and arguments
# off the common path still checked by name.


def inputs(B, T, device, seed):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    m = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    return r.to(device), v.to(device), m.to(device)


def close_to(got, want):
    assert torch.allclose(got.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_new_outputs_each_exact(device):
    kept = []
    for seed in range(4):
        r, v, m = inputs(5, 37, device, seed)
        adv, ret = vf.compute_gae(r, v, m, 0.99, 0.95)
        ra, rr = ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95)
        close_to(adv, ra)
        close_to(ret, rr)
        kept.append((adv, ret, ra, rr))
    for adv, ret, ra, rr in kept:  # no later call wrote an earlier call's outputs
        close_to(adv, ra)
        close_to(ret, rr)
    assert adv.is_contiguous() and ret.is_contiguous() and adv.dtype == ret.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_a_failing_call_leaves_nothing_for_the_next(device):
    r, v, m = inputs(3, 16, device, 0)
    bad = r.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="token_level_rewards contains NaN or inf"):
        checked(vf.compute_gae, bad, v, m, 0.99, 0.95)
    vf.compute_gae(bad, v, m, 0.99, 0.95, check=False)  # unchecked: the record holds the bits, unread
    adv, _ = checked(vf.compute_gae, r, v, m, 0.99, 0.95)  # cleared by this call: no error
    close_to(adv, ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.99, 0.95)[0])
    with pytest.raises(ValueError, match="whitening needs at least 2 positions"):
        checked(vf.compute_gae, r, v, torch.zeros_like(m), 0.99, 0.95)
    checked(vf.compute_gae, r, v, m, 0.99, 0.95)


def test_threads_keep_their_own_records():
    errors, results = [], {}

    def work(i):
        try:
            for k in range(20):
                r, v, m = inputs(4, 24, "cpu", i)
                if i % 2 and k % 3 == 0:
                    r = r.clone()
                    r[0, 0] = float("inf")
                    with pytest.raises(ValueError, match="contains NaN or inf"):
                        vf.compute_gae(r, v, m, 0.9, 0.8)
                    continue
                results[(i, k)] = (vf.compute_gae(r, v, m, 0.9, 0.8)[0], ref_gae(r, v, m, 0.9, 0.8)[0])
        except Exception as e:  # collected for the main thread's assert
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in results.values():
        close_to(got, want)


def test_arguments_off_the_common_path_are_still_checked():
    r, v, m = inputs(2, 8, "cpu", 0)
    ra = ref_gae(r, v, m, 1.0, 1.0)[0]
    for gamma in (1, np.float32(1.0), np.float64(1.0)):  # accepted off the plain-float path
        close_to(vf.compute_gae(r, v, m, gamma, 1.0)[0], ra)
    with pytest.raises(TypeError, match="gamma must be a number, got True"):
        vf.compute_gae(r, v, m, True, 1.0)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got 1.5"):
        vf.compute_gae(r, v, m, 1.0, 1.5)
    with pytest.raises(TypeError, match="whiten must be True or False"):
        vf.compute_gae(r, v, m, whiten=1)
    with pytest.raises(TypeError, match="check must be True or False"):
        vf.compute_gae(r, v, m, check="no")
    with pytest.raises(ValueError, match=r"values must have the shape of token_level_rewards \[2, 8\]"):
        vf.compute_gae(r, v[:, :7], m)
    with pytest.raises(TypeError, match="values must be float32"):
        vf.compute_gae(r, v.long(), m)
    float_mask = m.double()  # converted, as before
    close_to(vf.compute_gae(r, v, float_mask)[0], ra)


def test_status_records_are_bounded():
    A._STATUS.clear()
    r, v, m = inputs(2, 8, "cpu", 0)
    threads = [threading.Thread(target=vf.compute_gae, args=(r, v, m)) for _ in range(A._MAX_STATUS + 5)]
    for t in threads:
        t.start()
        t.join()
    assert len(A._STATUS) <= A._MAX_STATUS


# ---------------------------------------------------------------- checks that never wait (pending_checks)


def test_gae_edge_cases_match_reference():
    """T = 1, a fully masked-out row, holes, a row of one masked position, whiten off with no mask."""
    r, v, _ = make(4, 1, seed=3)
    m = torch.tensor([[1], [0], [1], [1]], dtype=torch.bool)
    adv, ret = vf.compute_gae(r, v, m, 0.9, 0.7)
    ra, rr = ref_gae(r, v, m, 0.9, 0.7)
    close(adv, ra)
    close(ret, rr)
    r, v, _ = make(3, 9, seed=4)
    m = torch.tensor([[0] * 9, [1, 0, 0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    close(vf.compute_gae(r, v, m, 0.95, 0.9)[0], ref_gae(r, v, m, 0.95, 0.9)[0])
    none = torch.zeros(3, 9, dtype=torch.bool)
    close(vf.compute_gae(r, v, none, 0.95, 0.9, whiten=False)[0], ref_gae(r, v, none, 0.95, 0.9, whiten=False)[0])


def test_default_call_reads_nothing_back():
    """The checking call launches no read-back (no item / tolist / nonzero: each a wait on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    r, v, m = make(4, 16)
    vf.compute_gae(r, v, m)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        vf.compute_gae(r, v, m)
        vf.compute_grpo_advantage(r, m, [0, 0, 1, 1])
    names = {e.name for e in prof.events()}
    assert not names & {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::equal"}, names


class _Launch:
    """Stands in for a CUDA launch: the verdict lands only when ``land`` runs."""

    def __init__(self, value):
        self.value = value
        self.index, self.slot = P.take(torch.device("cpu"))

    def land(self):
        self.slot[0] = self.value


def test_a_verdict_is_raised_once_it_lands_and_once_only():
    cpu = torch.device("cpu")
    P.raise_pending()
    first, second = _Launch(0), _Launch(7)
    P.expect(cpu, first.index, lambda v: f"first: {v}" if v else None)
    P.expect(cpu, second.index, lambda v: f"second: {v}" if v else None)
    P.raise_landed(cpu)  # nothing landed: nothing raised, nothing waited for
    second.land()
    P.raise_landed(cpu)  # the older check is still in flight: verdicts are read in order
    first.land()
    with pytest.raises(ValueError, match="^second: 7$"):
        P.raise_landed(cpu)
    P.raise_landed(cpu)
    assert not P._QUEUES[cpu].waiting
    late = _Launch(5)
    P.expect(cpu, late.index, lambda v: f"late: {v}")
    late.land()
    with pytest.raises(ValueError, match="^late: 5$"):
        P.raise_pending("cpu")  # a device given by name
    P.raise_pending("cpu")


def test_slots_come_back_after_a_refused_launch_and_when_all_are_in_flight(monkeypatch):
    cpu = torch.device("cpu")
    P.raise_pending()
    queue = P._queue(cpu)
    free = len(queue.free)
    r, v, m = make(2, 4)
    real = A.ext()

    class Refusing:  # the core refusing the launch after the check's slot was taken
        ScanArgs, ScanKind = real.ScanArgs, real.ScanKind

        @staticmethod
        def advantage_scan(args):
            raise ValueError("refused")

    with monkeypatch.context() as patch:
        patch.setattr(A, "ext", lambda: Refusing)
        with pytest.raises(ValueError, match="^refused$"):
            vf.compute_gae(r, v, m)
    assert len(queue.free) == free
    launches = [_Launch(0) for _ in range(len(queue.free))]
    for launch in launches:
        P.expect(cpu, launch.index, lambda v: None)
    waited = []
    monkeypatch.setattr(P, "_wait", lambda d: (waited.append(d), [x.land() for x in launches]))
    checked(vf.compute_gae, r, v, m)  # every slot in flight: waits for the device, then goes on
    assert waited == [cpu] and len(queue.free) == P.SLOTS
    stuck = [_Launch(0) for _ in range(P.SLOTS)]
    for launch in stuck:  # launches that never copy their verdict: an error, not a hang
        P.expect(cpu, launch.index, lambda v: None)
    monkeypatch.setattr(P, "_wait", lambda d: None)
    with pytest.raises(RuntimeError, match="checks on cpu still unanswered after waiting"):
        vf.compute_gae(r, v, m)
    for launch in stuck:
        launch.land()
    P.raise_landed(cpu)
    assert len(queue.free) == P.SLOTS


def test_message_names_the_call_on_cuda():
    verdict = A._Verdict("token_level_rewards", "values", torch.device("cuda", 0), "compute_gae")
    bits = dict(zip(("rewards", "values", "mask", "few"), A._status_bits()))
    assert verdict(0) is None
    assert verdict(bits["values"]) == ("values contains NaN or inf (in a compute_gae call on cuda:0, checked once "
                                       "its kernels ran)")
    assert verdict(bits["rewards"] | bits["values"]).startswith("token_level_rewards contains NaN")
    assert verdict(bits["mask"]).startswith("response_mask must hold only 0 and 1")
    assert verdict(bits["few"]).startswith("whitening needs at least 2")


@pytest.mark.gpu
def test_cuda_checking_call_returns_before_its_verdict_lands():
    """With the GPU busy, a bad batch's call returns; raise_pending() (or a later call) raises it."""
    r, v, m = make(64, 512, device="cuda")
    bad = r.clone()
    bad[3, 7] = float("inf")
    checked(vf.compute_gae, r, v, m)  # the first checking call on a device pins its slots (may wait)
    torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU work queued ahead of the call
    vf.compute_gae(bad, v, m)
    assert not torch.cuda.current_stream().query()  # the call returned without waiting for the GPU
    with pytest.raises(ValueError, match=r"^token_level_rewards contains NaN or inf \(in a compute_gae call on cuda:0"):
        P.raise_pending()
    P.raise_pending()
    close(checked(vf.compute_gae, r, v, m, 0.9, 0.8)[0], ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.9, 0.8)[0])


def test_host_status_is_checked_and_written():
    from verl_fast import _C

    r, v, m = make(2, 5, p_mask=1.0)
    a = _C.ScanArgs()
    a.rewards, a.values, a.mask = r, v, m.view(torch.uint8)
    a.advantages, a.returns = torch.empty(2, 5), torch.empty(2, 5)
    a.status = torch.empty(_C.status_words, dtype=torch.int32)
    a.host_status = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="^host_status must be int32, got int64$"):
        _C.advantage_scan(a)
    a.host_status = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^host_status must be a 1-D int32 CPU tensor of shape \[1\], got \[2, 2\]$"):
        _C.advantage_scan(a)
    slot = torch.full((1,), P.NOT_LANDED, dtype=torch.int32)
    a.host_status = slot
    _C.advantage_scan(a)
    assert slot.item() == 0
    bad = r.clone()
    bad[0, 0] = float("nan")
    a.rewards = bad
    _C.advantage_scan(a)
    assert slot.item() == int(_C.AdvantageStatus.bad_rewards)


@pytest.mark.gpu
def test_cuda_stream_follows_the_current_stream():
    from verl_fast.ops.native import cuda_stream

    x = torch.zeros(1, device="cuda")
    assert cuda_stream(x).cuda_stream == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert cuda_stream(x).cuda_stream == side.cuda_stream
        r, v, m = make(3, 40, device="cuda")
        adv = checked(vf.compute_gae, r, v, m, 0.9, 0.8)[0]  # runs on the side stream
    side.synchronize()
    close(adv, ref_gae(r.cpu(), v.cpu(), m.cpu(), 0.9, 0.8)[0])
    assert cuda_stream(x).cuda_stream == torch.cuda.current_stream().cuda_stream
