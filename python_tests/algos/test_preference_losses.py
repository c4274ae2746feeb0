"""SimPO, CPO, ORPO, IPO (averaged log-probs) and KTO against float64 references written here from
each paper's formula, example by example with Python floats (values and gradients, random inputs and
edges), and against TRL's own loss methods on the same batch where trl is installed."""

import math
import types

import pytest
import torch

from verl_fast.algos import preference_losses as P


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return math.exp(logsig(x))


def smoothed(z, eps):
    return -(1 - eps) * logsig(z) - eps * logsig(-z)


def ref_simpo(ac, ar, beta, gamma, eps):  # Meng et al. 2024, eq. 6 (+ conservative smoothing)
    return smoothed(beta * ac - beta * ar - gamma, eps)


def ref_cpo(sc, sr, beta, eps):  # Xu et al. 2024, eq. 3 (the preference term)
    return smoothed(beta * (sc - sr), eps)


def ref_orpo(ac, ar, lam):  # Hong et al. 2024, eq. 4-7: odds(y|x) = P / (1 - P), P = exp(mean log-prob)
    def odds(a):
        p = math.exp(a)
        return p / (1 - p)
    return -lam * logsig(math.log(odds(ac) / odds(ar)))


def ref_ipo(c, r, beta):  # Azar et al. 2023, eq. 17, on per-token log-ratios
    return (c - r - 1 / (2 * beta)) ** 2


def ref_kto(r, desirable, z0, beta, wd, wu):  # Ethayarajh et al. 2024, eq. 7 (loss = w (1 - v))
    return wd * (1 - sig(beta * (r - z0))) if desirable else wu * (1 - sig(beta * (z0 - r)))


def draws(B, seed, n=4, scale=1.0, shift=-2.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, generator=g, dtype=torch.float64) * scale + shift).requires_grad_(True) for _ in range(n)]


def numeric_grad(f, xs, i, h=1e-6):
    """d f / d xs[i] by central differences, f over Python floats."""
    up, down = list(xs), list(xs)
    up[i] += h
    down[i] -= h
    return (f(up) - f(down)) / (2 * h)


def check(loss, inputs, per_example, B):
    """loss == mean of per_example over the batch, and its gradients match finite differences of it."""
    values = [[float(v) for v in x.detach()] for x in inputs]
    ref = sum(per_example(*[v[i] for v in values]) for i in range(B)) / B
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-9, abs=1e-12)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    for k, g in enumerate(grads):
        for i in range(B):
            args = [v[i] for v in values]
            want = numeric_grad(lambda a: per_example(*a), args, k) / B
            got = 0.0 if g is None else float(g[i])
            assert got == pytest.approx(want, rel=1e-5, abs=1e-8), (k, i)


SIZES = [(1, 0), (7, 1), (33, 2)]


@pytest.mark.parametrize("B, seed", SIZES)
@pytest.mark.parametrize("beta, gamma, eps", [(2.0, 0.5, 0.0), (10.0, 1.6, 0.1), (0.5, 0.0, 0.3)])
def test_simpo(B, seed, beta, gamma, eps):
    ac, ar = draws(B, seed, 2)
    loss, stats = P.simpo_loss(ac, ar, beta, gamma, eps)
    check(loss, [ac, ar], lambda a, b: ref_simpo(a, b, beta, gamma, eps), B)
    assert float(stats["reward_accuracy"]) == pytest.approx(float((ac > ar).double().mean()))


@pytest.mark.parametrize("B, seed", SIZES)
@pytest.mark.parametrize("beta, eps", [(0.1, 0.0), (0.5, 0.2)])
def test_cpo(B, seed, beta, eps):
    sc, sr = draws(B, seed, 2, scale=20.0, shift=-60.0)
    loss, _ = P.cpo_loss(sc, sr, beta, eps)
    check(loss, [sc, sr], lambda a, b: ref_cpo(a, b, beta, eps), B)


@pytest.mark.parametrize("B, seed", SIZES)
@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo(B, seed, lam):
    ac, ar = [x.detach().clamp(max=-1e-3).requires_grad_(True) for x in draws(B, seed, 2, shift=-1.5)]
    loss, _ = P.orpo_loss(ac, ar, lam)
    check(loss, [ac, ar], lambda a, b: ref_orpo(a, b, lam), B)


@pytest.mark.parametrize("B, seed", SIZES)
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo(B, seed, beta):
    pc, pr, rc, rr = draws(B, seed)
    loss, _ = P.ipo_loss(pc, pr, rc, rr, beta)
    check(loss, [pc, pr, rc, rr], lambda a, b, c, d: ref_ipo(a - c, b - d, beta), B)


@pytest.mark.parametrize("B, seed", SIZES)
@pytest.mark.parametrize("beta, wd, wu, kl", [(0.1, 1.0, 1.0, 0.3), (0.5, 1.33, 0.8, -0.2), (2.0, 1.0, 1.5, 4.0)])
def test_kto(B, seed, beta, wd, wu, kl):
    pol, ref = draws(B, seed, 2, scale=5.0, shift=-30.0)
    desirable = torch.arange(B) % 3 != 1
    z0 = max(kl, 0.0)  # the reference point: the KL estimate, clamped at 0
    loss, stats = P.kto_loss(pol, ref, desirable, torch.tensor(kl, dtype=torch.float64), beta, wd, wu)
    labels = desirable.tolist()
    values = [[float(v) for v in x.detach()] for x in (pol, ref)]
    want = sum(ref_kto(values[0][i] - values[1][i], labels[i], z0, beta, wd, wu) for i in range(B)) / B
    assert float(loss.detach()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    g = torch.autograd.grad(loss, pol)[0]
    for i in range(B):
        f = lambda a: ref_kto(a[0] - values[1][i], labels[i], z0, beta, wd, wu)  # noqa: E731
        assert float(g[i]) == pytest.approx(numeric_grad(f, [values[0][i]], 0) / B, rel=1e-5, abs=1e-9)
    assert float(stats["kl"]) == z0


def test_kto_kl_is_a_constant():
    pol = torch.tensor([-3.0, -4.0], dtype=torch.float64, requires_grad=True)
    kl = pol.sum() * 0 + 0.5  # depends on pol, but the reference point is held constant
    P.kto_loss(pol, torch.zeros(2, dtype=torch.float64), torch.tensor([True, False]), kl)[0].backward()
    expect = [-0.1 * sig(0.1 * (-3.0 - 0.5)) * (1 - sig(0.1 * (-3.0 - 0.5))) / 2,
              0.1 * sig(0.1 * (0.5 + 4.0)) * (1 - sig(0.1 * (0.5 + 4.0))) / 2]
    assert pol.grad.tolist() == pytest.approx(expect, rel=1e-9)


def test_orpo_at_the_edges_stays_finite():
    # a sequence the model is certain of (mean log-prob 0) and one it never makes
    ac = torch.tensor([0.0, -1e-9, -200.0], requires_grad=True)
    ar = torch.tensor([-200.0, -1e-9, 0.0], requires_grad=True)
    loss, _ = P.orpo_loss(ac, ar, 0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(ac.grad).all() and torch.isfinite(ar.grad).all()
    assert float(P.log_odds(torch.tensor([-1e-9]))) > 10  # near-certain: large odds


@pytest.mark.parametrize("fn", [P.simpo_loss, P.cpo_loss])
def test_smoothing_out_of_range_is_refused(fn):
    with pytest.raises(ValueError, match="label_smoothing"):
        fn(torch.zeros(2), torch.zeros(2), 1.0, **({"gamma": 0.5} if fn is P.simpo_loss else {}), label_smoothing=0.5)


def test_large_margins_stay_finite():
    big = torch.tensor([-1.0, -4000.0], requires_grad=True)
    small = torch.tensor([-4000.0, -1.0], requires_grad=True)
    for loss, _ in (P.simpo_loss(big, small, 10.0), P.cpo_loss(big, small, 1.0),
                    P.kto_loss(big, small, torch.tensor([True, False]), torch.tensor(1e4))):
        g = torch.autograd.grad(loss, big)[0]
        assert torch.isfinite(loss) and torch.isfinite(g).all()


# ---------------------------------------------------------------- TRL's own losses on the same batch


def _trl_self(**fields):
    accel = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    return types.SimpleNamespace(accelerator=accel, alpha=0.0, **fields)


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_cpo_and_simpo_equal_trl(loss_type):
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    beta, gamma, eps = 2.0, 0.7, 0.1
    ac, ar = draws(9, 5, 2, shift=-3.0)
    fake = _trl_self(beta=beta, simpo_gamma=gamma, label_smoothing=eps, loss_type=loss_type)
    theirs = CPOTrainer.cpo_loss(fake, ac, ar)[0].mean()
    ours = P.simpo_loss(ac, ar, beta, gamma, eps)[0] if loss_type == "simpo" else P.cpo_loss(ac, ar, beta, eps)[0]
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    for a, b in zip(torch.autograd.grad(ours, [ac, ar]), torch.autograd.grad(theirs, [ac, ar])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_orpo_equals_trl():
    pytest.importorskip("trl")
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    ac, ar = [x.detach().clamp(max=-1e-3).requires_grad_(True) for x in draws(9, 6, 2, shift=-1.0)]
    theirs = -ORPOTrainer.odds_ratio_loss(_trl_self(beta=0.25), ac, ar)[0].mean()  # TRL subtracts it from the NLL
    ours = P.orpo_loss(ac, ar, 0.25)[0]
    # TRL runs it in fp32 (.float()); ours keeps float64
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    for a, b in zip(torch.autograd.grad(ours, [ac, ar]), torch.autograd.grad(theirs, [ac, ar])):
        torch.testing.assert_close(a, b.double(), rtol=1e-5, atol=1e-7)


def _trl_trainer_self(**fields):
    """What TRL's ``_compute_loss`` reads of its trainer, for the loss on given log-probs (no model)."""
    import collections

    accel = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    return types.SimpleNamespace(
        accelerator=accel, model=types.SimpleNamespace(training=True), aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl",
        **fields)


def _trl_model(per_token):
    """A stand-in for the model TRL calls: its fused head's per-token log-probs are ``per_token``."""
    def model(**kwargs):
        zero = torch.zeros_like(per_token)
        return types.SimpleNamespace(log_probs=per_token, entropy=zero, mean_logits=zero, aux_loss=None,
                                     is_top1=torch.zeros_like(per_token, dtype=torch.bool))
    return model


def _completion(rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) > 0.3).long()
    mask[:, 0], mask[:, 1] = 0, 1  # a prompt token, then at least one completion token
    logp = (-torch.rand(rows, width - 1, generator=g, dtype=torch.float64) * 3 * mask[:, 1:]).requires_grad_(True)
    return mask, logp


def test_ipo_on_averaged_logprobs_equals_trl():
    pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DPOTrainer

    B, beta = 4, 0.3
    mask, logp = _completion(2 * B, 9, 7)
    ref = torch.randn(2 * B, dtype=torch.float64) * 4 - 10
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    fake = _trl_trainer_self(beta=beta, loss_types=["ipo"], loss_weights=[1.0], label_smoothing=0.0,
                             use_weighting=False, rpo_alpha=None)
    theirs = DPOTrainer._compute_loss(fake, _trl_model(logp), inputs, False)
    sums, lengths = logp.sum(1), mask.sum(1).double()
    avg, ref_avg = sums / lengths, ref / lengths
    ours = P.ipo_loss(avg[:B], avg[B:], ref_avg[:B], ref_avg[B:], beta)[0]
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-10, atol=1e-14)


def test_kto_equals_trl():
    pytest.importorskip("trl")
    from trl.trainer.kto_trainer import KTOTrainer

    N, beta = 6, 0.2
    mask, logp = _completion(N, 9, 8)
    labels = torch.tensor([True, False, True, True, False, False])
    kl_policy, kl_ref = torch.randn(N, dtype=torch.float64) - 5, torch.randn(N, dtype=torch.float64) - 6
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "label": labels, "ref_logps": torch.randn(N, dtype=torch.float64) * 3 - 10, "ref_KL_logps": kl_ref}
    fake = _trl_trainer_self(beta=beta, loss_type="kto", desirable_weight=1.3, undesirable_weight=0.7,
                             calculate_KL=True, _compute_kl_logps=lambda model, batch: kl_policy)
    theirs = KTOTrainer._compute_loss(fake, _trl_model(logp), inputs, False)
    ours = P.kto_loss(logp.sum(1), inputs["ref_logps"], labels, (kl_policy - kl_ref).mean(), beta, 1.3, 0.7)[0]
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-10, atol=1e-14)
