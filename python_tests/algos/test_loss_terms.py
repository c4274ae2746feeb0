"""Losses against float64 references written here (verl's definitions)."""

import math

import pytest
import torch

from verl_fast.algos.loss_terms import agg_loss, kl_penalty, policy_loss, value_loss
from verl_fast.algos.preference_losses import dpo_loss


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
    total = sum(x[b, t] * m[b, t] for b in range(B) for t in range(L))
    if mode == "token-mean":
        return total / m.sum()
    if mode == "token-sum":
        return total
    per = []
    for b in range(B):
        if m[b].sum() == 0:  # an all-padding row is no sequence
            continue
        s = sum(x[b, t] * m[b, t] for t in range(L))
        if mode == "seq-mean-token-sum":
            per.append(s)
        elif mode == "seq-mean-token-mean":
            per.append(s / m[b].sum())
        else:
            per.append(s / L)
    return sum(per) / len(per)


MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_all_padding_row_changes_nothing(mode):
    x, m = rnd(5, 7, seed=3), mask_of(5, 7, seed=3)
    padded_x = torch.cat([x[:2], rnd(1, 7, seed=9) * 100, x[2:]])  # garbage under the padding
    padded_m = torch.cat([m[:2], torch.zeros(1, 7, dtype=m.dtype), m[2:]])
    ref = torch.as_tensor(ref_agg(x, m, mode), dtype=torch.float64)
    assert torch.allclose(agg_loss(padded_x, padded_m, mode), ref, atol=1e-10)
    # micro-batched, with the trainer's counts (rows that hold a response token)
    from verl_fast.algos.loss_terms import active_rows

    counts = {"num_tokens": float(padded_m.sum()), "num_seqs": float(active_rows(padded_m))}
    assert counts["num_seqs"] == 5.0
    parts = sum(agg_loss(padded_x[i:j], padded_m[i:j], mode, **counts) for i, j in ((0, 2), (2, 3), (3, 6)))
    assert torch.allclose(parts, ref, atol=1e-10)
    # a batch of padding only: loss 0, not NaN
    assert float(agg_loss(padded_x[2:3], padded_m[2:3], mode)) == 0.0


def test_agg_loss_token_sum_under_data_parallelism():
    # ranks average their gradients: each rank's token-sum times the rank count averages to the global sum
    x, m = rnd(6, 5, seed=4), mask_of(6, 5, seed=4)
    ranks = [agg_loss(x[:4], m[:4], "token-sum", dp_size=2), agg_loss(x[4:], m[4:], "token-sum", dp_size=2)]
    assert torch.allclose(sum(ranks) / 2, agg_loss(x, m, "token-sum"), atol=1e-10)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["k1+", "k2+", "k3+", "low_var_kl+", "abs+"])
def test_kl_straight_through_value_equals_plain_form_exactly(kind, dtype):
    # small penalties next to a large k2 (and the reverse): any other order of the terms rounds
    logp = (rnd(4, 64, seed=11, scale=3.0)).to(dtype).requires_grad_(True)
    ref = (logp.detach() + rnd(4, 64, seed=12, scale=1e-3).to(dtype))
    ref[:, :8] = logp.detach()[:, :8] - 5.0
    assert torch.equal(kl_penalty(logp, ref, kind).detach(), kl_penalty(logp, ref, kind[:-1]).detach())


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
