"""Losses against float64 references written here (verl's definitions)."""

import math

import pytest
import torch

from verl_fast.algos.losses import agg_loss, dpo_loss, kl_penalty, policy_loss, value_loss


def rnd(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).double()


def mask_of(B, L, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    m = (torch.rand(B, L, generator=g) < 0.7).double()
    m[:, 0] = 1
    return m


def ref_agg(x, m, mode):
    B, L = x.shape
    if mode == "token-mean":
        return sum(x[b, t] * m[b, t] for b in range(B) for t in range(L)) / m.sum()
    per = []
    for b in range(B):
        s = sum(x[b, t] * m[b, t] for t in range(L))
        if mode == "seq-mean-token-sum":
            per.append(s)
        elif mode == "seq-mean-token-mean":
            per.append(s / m[b].sum())
        else:
            per.append(s / L)
    return sum(per) / B


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_modes_and_exact_micro_batch_split(mode):
    x, m = rnd(5, 7), mask_of(5, 7)
    full = agg_loss(x, m, mode)
    assert torch.allclose(full, torch.as_tensor(ref_agg(x, m, mode), dtype=torch.float64), atol=1e-10)
    # micro-batches of unequal sizes, scaled by the whole batch's counts, add up to the full loss
    counts = {"num_tokens": float(m.sum()), "num_seqs": 5.0}
    parts = agg_loss(x[:2], m[:2], mode, **counts) + agg_loss(x[2:], m[2:], mode, **counts)
    assert torch.allclose(parts, full, atol=1e-10)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(x, m, "bogus")


def test_policy_loss_matches_reference_and_dual_clip():
    B, L = 4, 9
    logp, old = rnd(B, L, seed=1, scale=0.5), rnd(B, L, seed=2, scale=0.5)
    adv, m = rnd(B, L, seed=3), mask_of(B, L)
    lo, hi, c = 0.2, 0.28, 3.0
    loss, stats = policy_loss(logp, old, adv, m, lo, hi, c)
    ref = torch.zeros(B, L, dtype=torch.float64)
    clipped_n = 0
    for b in range(B):
        for t in range(L):
            r = math.exp(max(-20.0, min(20.0, float(logp[b, t] - old[b, t]))))
            a = float(adv[b, t])
            l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            v = max(l1, l2)
            if a < 0:
                v = min(v, -a * c)
            ref[b, t] = v
            clipped_n += (l2 > l1) * m[b, t]
    assert torch.allclose(loss, (ref * m).sum() / m.sum(), atol=1e-10)
    assert abs(float(stats["clipfrac"]) - float(clipped_n / m.sum())) < 1e-9
    # gradient flows to logp only
    lp = logp.clone().requires_grad_(True)
    policy_loss(lp, old, adv, m)[0].backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, m, clip_ratio_c=1.0)


def test_policy_loss_extreme_log_ratio_is_finite():
    logp = torch.tensor([[100.0, -100.0]], dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_penalty_values(kind):
    logp, ref = rnd(3, 5, seed=4), rnd(3, 5, seed=5)
    out = kl_penalty(logp, ref, kind)
    d = logp - ref
    expected = {"k1": d, "kl": d, "abs": d.abs(), "k2": 0.5 * d * d, "mse": 0.5 * d * d,
                "k3": (torch.exp(-d) + d - 1).clamp(-10, 10), "low_var_kl": (torch.exp(-d) + d - 1).clamp(-10, 10)}[kind]
    assert torch.allclose(out, expected, atol=1e-10)


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_kl_straight_through_forms(kind):
    logp = rnd(2, 4, seed=6).requires_grad_(True)
    ref = rnd(2, 4, seed=7)
    out = kl_penalty(logp, ref, kind)
    assert torch.allclose(out, kl_penalty(logp, ref, kind[:-1]))  # value of the named estimator
    out.sum().backward()
    assert torch.allclose(logp.grad, (logp - ref).detach())  # gradient of k2 = 0.5 (logp - ref)^2


def test_kl_bad_kind():
    with pytest.raises(ValueError, match="kl kind"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")


def test_value_loss_reference():
    v, old, ret, m = rnd(3, 6, seed=8), rnd(3, 6, seed=9), rnd(3, 6, seed=10), mask_of(3, 6)
    loss, _ = value_loss(v, old, ret, m, cliprange_value=0.2)
    clipped = old + (v - old).clamp(-0.2, 0.2)
    per = 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    assert torch.allclose(loss, (per * m).sum() / m.sum(), atol=1e-10)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_reference(loss_type):
    pc, pr, rc, rr = rnd(6, seed=11), rnd(6, seed=12), rnd(6, seed=13), rnd(6, seed=14)
    beta = 0.3
    loss, stats = dpo_loss(pc, pr, rc, rr, beta, loss_type)
    margin = (pc - pr) - (rc - rr)
    ref = {"sigmoid": -torch.log(torch.sigmoid(beta * margin)), "ipo": (margin - 1 / (2 * beta)) ** 2,
           "hinge": torch.relu(1 - beta * margin)}[loss_type].mean()
    assert torch.allclose(loss, ref, atol=1e-10)
    assert abs(float(stats["reward_accuracy"]) - float((margin > 0).double().mean())) < 1e-12
