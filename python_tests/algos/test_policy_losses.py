"""actor.policy_loss (algos/policy_losses.py) against float64 references written here from each
paper's formula, value and gradient, on random inputs of several shapes and at the edges.

- GSPO (Zheng et al. 2025, eq. 5-7): s_i = exp(1/|y_i| sum_t log(pi/pi_old)); J = mean_i min(s_i A_i,
  clip(s_i, 1-lo, 1+hi) A_i); its gradient on a token is s_i A_i / |y_i| where unclipped, else 0.
  GSPO-token (eq. 13-14): s_i,t = sg(s_i) pi_t / sg(pi_t), per-token advantages.
- CISPO (MiniMax-M1, eq. 4): J = sg(clip(r, 1-lo, 1+hi)) A log pi, gradient sg(clip(r)) A.
- SAPO (Gao et al. 2025): f(r) = 4/tau sigmoid(tau (r - 1)), J = f(r) A, tau_pos for A > 0 else tau_neg;
  gradient 4 sigmoid (1 - sigmoid) r A.
"""

import math

import pytest
import torch

from verl_fast.algos.loss_terms import agg_loss
from verl_fast.algos.policy_losses import actor_loss, cispo_tokens, gspo_tokens, policy_loss_tokens, sapo_tokens
from verl_fast.config import ActorConfig
from verl_fast.records.experience import Experience

SHAPES = [(1, 1), (3, 5), (4, 17), (7, 33)]


def inputs(B, L, seed, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, L, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, L, generator=g) < 0.75).double()
    mask[:, 0] = 1
    if B > 2:
        mask[1] = 0  # an all-padding row
    return logp, old, adv, mask


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def rows(mask):
    return [b for b in range(mask.shape[0]) if mask[b].sum() > 0]


def grad_of(fn, logp):
    lp = logp.clone().requires_grad_(True)
    value = fn(lp)
    value.backward()
    return value.detach(), lp.grad


@pytest.mark.parametrize("B, L", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_sequence_level(B, L, seed):
    lo, hi = 0.1, 0.15
    logp, old, adv, mask = inputs(B, L, seed, spread=0.3)
    value, grad = grad_of(lambda lp: agg_loss(gspo_tokens(lp, old, adv, mask, lo, hi)[0], mask,
                                              "seq-mean-token-mean"), logp)
    active = rows(mask)
    ref_loss, ref_grad = 0.0, torch.zeros(B, L, dtype=torch.float64)
    for b in active:
        toks = [t for t in range(L) if mask[b, t]]
        n = len(toks)
        s = math.exp(sum(float(logp[b, t] - old[b, t]) for t in toks) / n)
        a = sum(float(adv[b, t]) for t in toks) / n
        unclipped, clipped = s * a, clip(s, 1 - lo, 1 + hi) * a
        ref_loss -= min(unclipped, clipped) / len(active)
        if unclipped <= clipped:  # the objective follows s: gradient s A / |y| on each token
            for t in toks:
                ref_grad[b, t] = -s * a / n / len(active)
    # seq-mean-token-mean divides by (tokens + 1e-8): agreement to ~1e-8 relative
    assert float(value) == pytest.approx(ref_loss, rel=1e-7, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("B, L", SHAPES)
@pytest.mark.parametrize("seed", [2, 3])
def test_gspo_token_level(B, L, seed):
    lo, hi = 0.1, 0.15
    logp, old, adv, mask = inputs(B, L, seed, spread=0.3)
    per_token, _ = gspo_tokens(logp, old, adv, mask, lo, hi, token_level=True)
    _, grad = grad_of(lambda lp: (gspo_tokens(lp, old, adv, mask, lo, hi, token_level=True)[0] * mask).sum(), logp)
    for b in rows(mask):
        toks = [t for t in range(L) if mask[b, t]]
        s = math.exp(sum(float(logp[b, t] - old[b, t]) for t in toks) / len(toks))
        for t in toks:
            a = float(adv[b, t])
            unclipped, clipped = s * a, clip(s, 1 - lo, 1 + hi) * a
            assert abs(float(per_token[b, t]) + min(unclipped, clipped)) < 1e-12
            # d/d logp_t of sg(s) pi_t / sg(pi_t) is s: the token's own log-prob only
            assert abs(float(grad[b, t]) - (-s * a if unclipped <= clipped else 0.0)) < 1e-12
    assert float(grad[mask == 0].abs().sum()) == 0.0


@pytest.mark.parametrize("B, L", SHAPES)
def test_gspo_and_gspo_token_agree_when_advantages_are_per_sequence(B, L):
    logp, old, adv, mask = inputs(B, L, 4, spread=0.05)
    adv = adv[:, :1].expand(B, L).contiguous()  # GRPO's advantages: one per sequence
    seq = grad_of(lambda lp: agg_loss(gspo_tokens(lp, old, adv, mask, 0.2, 0.2)[0], mask, "seq-mean-token-mean"), logp)
    tok = grad_of(lambda lp: agg_loss(gspo_tokens(lp, old, adv, mask, 0.2, 0.2, True)[0], mask, "seq-mean-token-mean"),
                  logp)
    torch.testing.assert_close(seq[0], tok[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(seq[1], tok[1], rtol=1e-10, atol=1e-12)
    assert seq[1].abs().sum() > 0


@pytest.mark.parametrize("B, L", SHAPES)
@pytest.mark.parametrize("lo, hi", [(0.2, 0.28), (1.0, 4.0)])  # PPO-like; M1's no lower bound, wide upper one
def test_cispo(B, L, lo, hi):
    logp, old, adv, mask = inputs(B, L, 5, spread=1.0)
    per_token, stats = cispo_tokens(logp, old, adv, mask, lo, hi)
    _, grad = grad_of(lambda lp: (cispo_tokens(lp, old, adv, mask, lo, hi)[0] * mask).sum(), logp)
    clipped = 0
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            r = math.exp(float(logp[b, t] - old[b, t]))
            w, a = clip(r, 1 - lo, 1 + hi), float(adv[b, t])
            clipped += w != r
            assert abs(float(per_token[b, t]) + w * a * float(logp[b, t])) < 1e-12
            assert abs(float(grad[b, t]) + w * a) < 1e-12  # every token keeps a gradient
    assert abs(float(stats["clipfrac"]) - clipped / float(mask.sum())) < 1e-6


@pytest.mark.parametrize("B, L", SHAPES)
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo(B, L, tau_pos, tau_neg):
    logp, old, adv, mask = inputs(B, L, 6, spread=0.8)
    per_token, stats = sapo_tokens(logp, old, adv, mask, tau_pos, tau_neg)
    _, grad = grad_of(lambda lp: (sapo_tokens(lp, old, adv, mask, tau_pos, tau_neg)[0] * mask).sum(), logp)
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            r, a = math.exp(float(logp[b, t] - old[b, t])), float(adv[b, t])
            tau = tau_pos if a > 0 else tau_neg
            sg = sigmoid(tau * (r - 1))
            assert abs(float(per_token[b, t]) + 4 / tau * sg * a) < 1e-12
            assert abs(float(grad[b, t]) + 4 * sg * (1 - sg) * r * a) < 1e-12


def test_sapo_on_policy_gradient_is_the_vanilla_one():
    logp, _, adv, mask = inputs(4, 9, 7)
    _, g_sapo = grad_of(lambda lp: (sapo_tokens(lp, logp, adv, mask, 1.0, 1.05)[0] * mask).sum(), logp)
    torch.testing.assert_close(g_sapo, -adv * mask, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gspo_token", "cispo", "sapo"])
def test_extreme_log_ratios_stay_finite(name):
    logp = torch.tensor([[-0.1, -50.0, -0.2]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-80.0, -0.1, -0.3]], dtype=torch.float64)
    adv, mask = torch.tensor([[1.0, -1.0, 0.5]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    per_token, _ = policy_loss_tokens(ActorConfig(policy_loss=name), logp, old, adv, mask)
    per_token.sum().backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(logp.grad).all()


def test_actor_loss_uses_the_configured_policy_loss():
    logp, old, adv, mask = inputs(3, 6, 8)
    sub = Experience(input_ids=torch.ones(3, 8, dtype=torch.long), attention_mask=torch.ones(3, 8, dtype=torch.long),
                     response_mask=mask, prompt_index=torch.arange(3), old_logprobs=old, advantages=adv)
    counts = {"num_tokens": float(mask.sum()), "num_seqs": 2.0}
    a = ActorConfig(policy_loss="cispo", clip_ratio_low=1.0, clip_ratio_high=2.0)
    loss, stats = actor_loss(a, logp, torch.zeros_like(logp), sub, counts)
    expected = agg_loss(cispo_tokens(logp, old, adv, mask, 1.0, 2.0)[0], mask, "token-mean", **counts)
    # actor_loss computes in float32
    assert float(loss) == pytest.approx(float(expected), rel=1e-6) and "clipfrac" in stats
    # statistics stay on the device (0-d tensors, read once the whole update is queued)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_bad_names_and_temperatures():
    logp, old, adv, mask = inputs(2, 3, 9)
    with pytest.raises(ValueError, match="actor.policy_loss must be one of"):
        policy_loss_tokens(ActorConfig(policy_loss="ppo2"), logp, old, adv, mask)
    with pytest.raises(ValueError, match="sapo temperatures must be > 0"):
        sapo_tokens(logp, old, adv, mask, 0.0, 1.0)
    from verl_fast import config as C

    with pytest.raises(ValueError, match=r"actor.policy_loss must be one of \['vanilla', 'gspo'"):
        C.from_dict({"actor": {"policy_loss": "ppo2"}})
    with pytest.raises(ValueError, match="actor.sapo_tau_neg must be > 0"):
        C.from_dict({"actor": {"policy_loss": "sapo", "sapo_tau_neg": 0.0}})
