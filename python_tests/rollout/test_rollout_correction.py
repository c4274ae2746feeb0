"""algorithm.rollout_correction: truncated importance weights min(exp(old - rollout), cap) from the
rollout engine's own log-probs (HF generate and vLLM-CPU), applied to the policy loss, with the
weights' spread in the step metrics. References written here: w from its formula in float64, and
the PPO loss at ratio 1 (lr 0: old = current), -sum(w A) / tokens. At temperature 0.9 the engine's
log-probs equal the trainer's old log-probs only because both are taken at the sampling temperature."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_refs import ENGINE_DTYPE
from tiny_models import save_tiny_model
from verl_fast.algos.rollout_correction import truncated_is_weights
from verl_fast.trainer.rl_trainer import RLTrainer

PROMPTS = [{"prompt": f"What is {a} + {b}?", "data_source": "toy"} for a, b in [(1, 2), (3, 4)]]


@pytest.mark.parametrize("B, L, cap", [(1, 1, 2.0), (3, 7, 1.5), (6, 20, 1.05)])
def test_weights_against_the_formula(B, L, cap):
    g = torch.Generator().manual_seed(B * L)
    old = -torch.rand(B, L, generator=g, dtype=torch.float64) * 4
    rollout = old + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.5
    mask = (torch.rand(B, L, generator=g) < 0.7).long()
    mask[0, 0] = 1
    w, stats = truncated_is_weights(old, rollout, mask, cap)
    ref, capped, n, top = [], 0, 0, 0.0
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                assert float(w[b, t]) == 0.0
                continue
            raw = math.exp(float(old[b, t] - rollout[b, t]))
            ref.append(min(raw, cap))
            capped += raw >= cap
            n += 1
            assert float(w[b, t]) == pytest.approx(min(raw, cap), rel=1e-6)
    assert float(stats["is_weight_mean"]) == pytest.approx(sum(ref) / n, rel=1e-6)
    assert float(stats["is_weight_max"]) == pytest.approx(max(ref), rel=1e-6)
    assert float(stats["is_capped_fraction"]) == pytest.approx(capped / n, abs=1e-6)
    assert not w.requires_grad


def test_extreme_and_bad_inputs():
    old = torch.tensor([[0.0, -90.0]])
    w, stats = truncated_is_weights(old, torch.tensor([[-90.0, 0.0]]), torch.ones(1, 2), 3.0)
    assert torch.isfinite(w).all() and w.tolist() == [[3.0, pytest.approx(math.exp(-20.0))]]
    assert float(stats["is_capped_fraction"]) == 0.5
    with pytest.raises(ValueError, match="rollout_correction_cap must be > 0"):
        truncated_is_weights(old, old, torch.ones(1, 2), 0.0)
    with pytest.raises(ValueError, match=r"rollout_logprobs \(1, 3\) and old_logprobs \(1, 2\)"):
        truncated_is_weights(old, torch.zeros(1, 3), torch.ones(1, 2), 2.0)
    from verl_fast import config as C

    with pytest.raises(ValueError, match="algorithm.rollout_correction_cap must be > 0"):
        C.from_dict({"algorithm": {"rollout_correction": True, "rollout_correction_cap": 0.0}})


def corrected_trainer(tmp_path, engine, **rollout):
    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = {"actor": {"lr": 0.0, "micro_batch_size": 3},
           "rollout": {"type": engine, "n": 4, "max_new_tokens": 5, "temperature": 0.9, **rollout},
           "algorithm": {"type": "grpo", "rollout_correction": True, "rollout_correction_cap": 1.2},
           "trainer": {"train_batch_size": 2, "output_dir": str(tmp_path / "run"), "progress_bar": False,
                       "plot": False, "device": "cpu", "max_prompt_length": 64}}
    reward = lambda solution_str: float(len(solution_str) % 2)  # noqa: E731
    return RLTrainer(actor_model=model, tokenizer=tok, config=cfg, model_path=str(path), reward_fn=reward)


def check_correction(trainer, atol):
    """The engine's log-probs are the actor's (same weights, same temperature) to ``atol``; the loss
    the update reports is the weighted one, for the engine's weights and for perturbed ones. One epoch
    and one mini-batch: no old-log-prob pass runs, the weights come from the update's forward, and
    they and their spread equal what the weights from an old-log-prob pass give."""
    metrics = {}
    exp = trainer.make_experience(trainer.processor.encode_all(PROMPTS), metrics)
    assert exp.old_logprobs is None and exp.rollout_is_weights is None
    assert not any(k.startswith("rollout_correction/") for k in metrics)
    old = trainer._old_logprobs(exp)  # what the update's forward computes (lr 0: every update's)
    mask = exp.response_mask.bool()
    assert exp.rollout_logprobs is not None and exp.rollout_logprobs.shape == old.shape
    assert (exp.rollout_logprobs[mask] - old[mask]).abs().max() < atol
    assert float(exp.rollout_logprobs[~mask].abs().sum()) == 0.0
    assert exp.advantages.abs().sum() > 0, "the toy reward must vary within a group"
    out = trainer.update_actor(exp)
    assert out["rollout_correction/is_weight_mean"] == pytest.approx(1.0, abs=10 * atol)
    # a rollout engine off the trainer's distribution: the weights spread, some are capped
    g = torch.Generator().manual_seed(0)
    exp.rollout_logprobs = old + 0.4 * torch.randn(old.shape, generator=g) * mask
    raw = torch.exp(old.double() - exp.rollout_logprobs.double())
    w = torch.clamp(raw, max=1.2) * mask
    expected = -(w * exp.advantages.double() * mask).sum() / mask.sum()  # PPO at ratio 1: -A per token
    out = trainer.update_actor(exp)
    assert out["actor/pg_loss"] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    # the spread over the tokens the update trained on (samples whose advantage is 0 are left out)
    on = mask & (exp.advantages.abs().sum(-1, keepdim=True) > 0)
    assert out["rollout_correction/is_weight_mean"] == pytest.approx(float(w[on].mean()), rel=1e-4)
    assert out["rollout_correction/is_weight_max"] == pytest.approx(float(w[on].max()), rel=1e-5)
    assert out["rollout_correction/is_capped_fraction"] == pytest.approx(float((raw[on] >= 1.2).double().mean()),
                                                                         abs=1e-6)
    assert 0 < out["rollout_correction/is_capped_fraction"] < 1
    # the same step with an old-log-prob pass's weights (as several mini-batches or the KL in the reward need)
    exp.old_logprobs, metrics = old, {}
    trainer.algorithm.correct_rollout(exp, metrics, "engine")
    torch.testing.assert_close(exp.rollout_is_weights.double(), w, rtol=1e-5, atol=1e-6)
    assert metrics["rollout_correction/is_weight_max"] == pytest.approx(1.2)
    assert trainer.update_actor(exp)["actor/pg_loss"] == pytest.approx(out["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_hf_engine(tmp_path):
    trainer = corrected_trainer(tmp_path, "hf")
    check_correction(trainer, atol=1e-4)


def test_vllm_engine(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from verl_fast.rollout.vllm_env import configure_vllm_env

    configure_vllm_env()
    trainer = corrected_trainer(tmp_path, "vllm", dtype=ENGINE_DTYPE, max_model_len=128, max_num_seqs=8)
    try:
        # vLLM's own kernels: fp32 on the CPU agrees closely, bf16 on a GPU within its rounding
        check_correction(trainer, atol=1e-3 if ENGINE_DTYPE == "float32" else 0.2)
    finally:
        trainer.engine.close()
