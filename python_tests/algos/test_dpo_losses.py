"""algorithm.loss_type: every DPO loss against a float64 reference written here, pair by pair with
Python floats, from its paper's formula (c, r: the chosen / rejected log-ratios to the reference,
m = c - r), on random pairs of several batch sizes and at the edges; and algorithm.sft_weight
(RPO's NLL term) through the trainer, exact under gradient accumulation."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast import config as C
from verl_fast.algos.preference_losses import dpo_loss, dpo_loss_names

DPO_LOSSES = dpo_loss_names()
from verl_fast.trainer.rl_trainer import RLTrainer


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return math.exp(logsig(x))


def reference(loss_type, c, r, beta, eps):
    """One pair's loss, from the papers."""
    m = c - r
    return {
        "sigmoid": -(1 - eps) * logsig(beta * m) - eps * logsig(-beta * m),  # Rafailov et al. 2023, eq. 7
        "ipo": (m - 1 / (2 * beta)) ** 2,  # Azar et al. 2023, eq. 17
        "hinge": max(0.0, 1 - beta * m),  # SLiC-HF
        # Chowdhury et al. 2024 (rDPO), eq. 8
        "robust": ((1 - eps) * -logsig(beta * m) - eps * -logsig(-beta * m)) / (1 - 2 * eps),
        # Ji et al. 2024 (EXO), eq. 16 for K = 2: KL(q_theta || p_label), q = softmax over (chosen, rejected)
        "exo_pair": sum(q * (math.log(q) - math.log(p))
                        for q, p in ((sig(beta * m), 1 - eps), (sig(-beta * m), eps))),
        # Chen et al. 2024 (NCA), eq. 12 for one pair
        "nca_pair": -logsig(beta * c) - 0.5 * logsig(-beta * c) - 0.5 * logsig(-beta * r),
        # Jung et al. 2024 (BCO) with the reward shift at 0
        "bco_pair": -logsig(beta * c) - logsig(-beta * r),
        # Wu et al. 2024 (SPPO), eq. 4.7 with P(chosen wins) = 1, P(rejected wins) = 0; eta = 1 / beta
        "sppo_hard": (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
        # D'Oosterlinck et al. 2024 (APO), eq. 7 and 8
        "apo_zero": (1 - sig(beta * c)) + sig(beta * r),
        "apo_down": sig(beta * c) + (1 - sig(beta * m)),
        # Chris Lu et al. 2024 (DiscoPOP), eq. 5 with tau = 0.05
        "discopop": (1 - sig(beta * m / 0.05)) * -logsig(beta * m) + sig(beta * m / 0.05) * math.exp(-beta * m),
    }[loss_type]


def pairs(B, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, generator=g, dtype=torch.float64) * scale - 20 for _ in range(4)]


@pytest.mark.parametrize("loss_type", DPO_LOSSES)
@pytest.mark.parametrize("B, beta, eps", [(1, 0.1, 0.001), (5, 0.5, 0.2), (64, 2.0, 0.05)])
def test_dpo_losses_against_the_papers(loss_type, B, beta, eps):
    pc, pr, rc, rr = pairs(B, seed=B)
    loss, stats = dpo_loss(pc, pr, rc, rr, beta, loss_type, eps)
    c, r = (pc - rc).tolist(), (pr - rr).tolist()
    ref = sum(reference(loss_type, ci, ri, beta, eps) for ci, ri in zip(c, r)) / B
    assert float(loss) == pytest.approx(ref, rel=1e-10, abs=1e-12)
    assert float(stats["reward_accuracy"]) == pytest.approx(sum(ci > ri for ci, ri in zip(c, r)) / B)
    # gradients flow to the policy's log-probs only
    pc = pc.clone().requires_grad_(True)
    dpo_loss(pc, pr, rc, rr, beta, loss_type, eps)[0].backward()
    assert torch.isfinite(pc.grad).all()


@pytest.mark.parametrize("loss_type", DPO_LOSSES)
def test_large_margins_stay_finite(loss_type):
    pc = torch.tensor([-1.0, -400.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-400.0, -1.0], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    loss, _ = dpo_loss(pc, pr, zero, zero, 1.0, loss_type, 0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pc.grad).all()


def test_bad_label_smoothing_is_named():
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="exo_pair needs 0 < label_smoothing"):
        dpo_loss(x, x, x, x, 0.1, "exo_pair", 0.0)
    with pytest.raises(ValueError, match="robust needs 0 <= label_smoothing < 0.5"):
        dpo_loss(x, x, x, x, 0.1, "robust", 0.5)
    with pytest.raises(ValueError, match="discopop needs discopop_tau > 0"):
        dpo_loss(x, x, x, x, 0.1, "discopop", 0.0, 0.0)
    with pytest.raises(ValueError, match="dpo loss_type must be one of"):
        dpo_loss(x, x, x, x, 0.1, "kto", 0.0)
    dpo = {"reward_fn": {"type": "pairwise_ranking"}}
    with pytest.raises(ValueError, match="loss_type=exo_pair needs algorithm.label_smoothing > 0"):
        C.from_dict({**dpo, "algorithm": {"type": "dpo", "loss_type": "exo_pair"}})
    with pytest.raises(ValueError, match="loss_type=robust needs algorithm.label_smoothing < 0.5"):
        C.from_dict({**dpo, "algorithm": {"type": "dpo", "loss_type": "robust", "label_smoothing": 0.5}})
    with pytest.raises(ValueError, match="loss_type=discopop needs algorithm.discopop_tau > 0"):
        C.from_dict({**dpo, "algorithm": {"type": "dpo", "loss_type": "discopop", "discopop_tau": 0.0}})
    with pytest.raises(ValueError, match="algorithm.sft_weight must be >= 0"):
        C.from_dict({**dpo, "algorithm": {"type": "dpo", "sft_weight": -1.0}})


# ---------------------------------------------------------------- the SFT term, through the trainer

PAIRS = [{"prompt": f"Q{i}: what is {i} + {i}?", "chosen": f"{2 * i} is the sum" + " indeed" * (i % 3),
          "rejected": f"{i} plus"} for i in range(6)]


def test_sft_weight_adds_the_chosen_tokens_mean_nll(tmp_path):
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    results = {}
    for name, per_device, steps, weight in (("ga3", 2, 3, 0.7), ("ga1", 6, 1, 0.7), ("plain", 6, 1, 0.0)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path)
        cfg = {"actor": {"lr": 0.0}, "reward_fn": {"type": "pairwise_ranking"},
               "algorithm": {"type": "dpo", "loss_type": "apo_zero", "sft_weight": weight},
               "trainer": {"total_steps": 1, "output_dir": str(tmp_path / name), "progress_bar": False, "plot": False,
                           "device": "cpu", "per_device_train_batch_size": per_device,
                           "gradient_accumulation_steps": steps}}
        trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg)
        grads, step = [], trainer.strategy.optimizer_step

        def record(trainer=trainer, grads=grads, step=step):
            grads.append(torch.cat([p.grad.flatten() for p in trainer.strategy.actor.parameters()
                                    if p.grad is not None]))
            return step()

        trainer.strategy.optimizer_step = record
        history = trainer.fit(PAIRS)
        # the reference: the chosen responses' tokens, their mean NLL under the (unchanged) actor
        rows = trainer.algorithm.encode(trainer.processor, PAIRS)
        nll, count = 0.0, 0
        with torch.no_grad():
            for p in rows:
                ids = torch.tensor([p.prompt_ids + p.chosen_ids])
                logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
                targets = ids[0, 1:]
                lp = logp[torch.arange(len(targets)), targets][-len(p.chosen_ids):]
                nll, count = nll - float(lp.sum()), count + len(p.chosen_ids)
        results[name] = (history[-1], grads[0], nll / count)
    ga3, ga1, plain = results["ga3"], results["ga1"], results["plain"]
    assert ga3[0]["dpo/sft_nll"] == pytest.approx(ga3[2], rel=1e-5)
    assert ga1[0]["dpo/sft_nll"] == pytest.approx(ga1[2], rel=1e-5)
    scale = ga1[1].abs().max()
    assert (ga3[1] - ga1[1]).abs().max() <= 1e-5 * scale  # exact under gradient accumulation
    assert (ga1[1] - plain[1]).abs().max() > 1e-3 * scale  # and the term changes the gradient
    assert "dpo/sft_nll" not in plain[0]
