"""Every loss_agg_mode is exact under micro-batching and token-budget packing, actor and critic: the
loss the trainer reports and the gradient the optimiser step sees are those of one batch in one
piece, at every micro-batch size and token budget, whatever the policy loss (issue 27's Dr.GRPO bug: each micro-batch used to
divide seq-mean-token-sum-norm by its own width)."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.algos.policy_losses import actor_loss
from verl_fast.config import ActorConfig
from verl_fast.records.experience import Experience
from verl_fast.strategies import fsdp_strategy
from verl_fast.trainer.batching import loss_normalisers, micro_batches
from verl_fast.trainer.rl_trainer import RLTrainer

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def two_sequences():
    """The issue's example: masks [1,1,1,1] and [1,1,0,0], log-prob = old = -1, advantage +1."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    ids = torch.ones(2, 6, dtype=torch.long)
    attention = torch.cat([torch.ones(2, 2, dtype=torch.long), mask], 1)
    logp = torch.full((2, 4), -1.0)
    return Experience(input_ids=ids, attention_mask=attention, response_mask=mask, prompt_index=torch.arange(2),
                      old_logprobs=logp.clone(), advantages=torch.ones(2, 4)), logp


@pytest.mark.parametrize("size, expected", [(2, -0.75), (1, -0.75)])
def test_dr_grpo_two_sequence_example(size, expected):
    exp, logp = two_sequences()
    a = ActorConfig(loss_agg_mode="seq-mean-token-sum-norm")
    counts = loss_normalisers(exp.response_mask, norm_length=4)
    total = 0.0
    for idx in micro_batches(torch.arange(2), size=size):
        sub = exp.select(idx)  # cut to the micro-batch's longest response, as the strategies do
        loss, _ = actor_loss(a, logp[idx, : sub.response_length], torch.zeros_like(sub.old_logprobs), sub, counts)
        total += float(loss)
    assert total == pytest.approx(expected, abs=1e-7)  # TRL's dr_grpo: -(4 + 2) / 4 / 2


# ---------------------------------------------------------------- the trainer, end to end


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4), (5, 6)]]


@pytest.fixture(scope="module")
def ppo(tiny_path, tmp_path_factory):
    """A PPO trainer at lr 0 (updates leave the weights as they are), with entropy and KL-in-loss
    terms, and one fixed experience whose old log-probs differ from the current ones (so ratios clip)."""
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)  # noqa: E731
    tok = AutoTokenizer.from_pretrained(tiny_path)
    cfg = {"actor": {"lr": 0.0, "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_type": "k3",
                     "max_grad_norm": 0.0},
           "critic": {"lr": 0.0, "max_grad_norm": 0.0},
           "rollout": {"type": "hf", "n": 3, "max_new_tokens": 10, "temperature": 1.0},
           "algorithm": {"type": "ppo", "lam": 0.9},
           "trainer": {"train_batch_size": 3, "output_dir": str(tmp_path_factory.mktemp("run")),
                       "progress_bar": False, "plot": False, "device": "cpu"}}
    reward = lambda solution_str: float(len(solution_str) % 3)  # noqa: E731
    trainer = RLTrainer(actor_model=load(), tokenizer=tok, critic_model=load(), reward_fn=reward, config=cfg)
    exp = trainer.make_experience(trainer.processor.encode_all(PROMPTS), {})
    g = torch.Generator().manual_seed(0)
    exp.old_logprobs = (trainer._old_logprobs(exp) + 0.3 * torch.randn(exp.response_mask.shape, generator=g)) \
        * exp.response_mask
    # responses of different lengths (a random model seldom ends one early): every width then differs
    L = exp.response_length
    lengths = torch.tensor([L, 3, 7, 1, L - 1, 5, 2, L, 4])
    keep = (torch.arange(L)[None, :] < lengths[:, None]).to(exp.response_mask.dtype)
    exp.response_mask = exp.response_mask * keep
    exp.attention_mask[:, -L:] = exp.attention_mask[:, -L:] * keep
    return trainer, exp


def recorded_update(trainer, exp, monkeypatch, update):
    """``update(exp)``'s metrics and the gradient each optimiser step saw."""
    grads = []
    step = fsdp_strategy.optimizer_step

    def record(model, optimizer, max_norm):
        grads.append(torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None]))
        return step(model, optimizer, max_norm)

    monkeypatch.setattr(fsdp_strategy, "optimizer_step", record)
    metrics = update(exp)
    monkeypatch.setattr(fsdp_strategy, "optimizer_step", step)
    return metrics, torch.cat(grads)


BATCHINGS = [{"micro_batch_size": 9}, {"micro_batch_size": 4}, {"micro_batch_size": 1},
             {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64},
             {"use_dynamic_bsz": True, "max_token_len_per_gpu": 120},
             # rows packed without padding (actor.use_remove_padding; a group's prompt once), by count and by budget
             {"micro_batch_size": 4, "packed": True},
             {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64, "packed": True}]


CASES = [(mode, "vanilla") for mode in MODES] + [
    ("seq-mean-token-mean", "gspo"), ("token-mean", "gspo_token"), ("token-mean", "cispo"),
    ("seq-mean-token-sum-norm", "sapo")]


@pytest.mark.parametrize("mode, policy_loss", CASES)
def test_actor_and_critic_exact_under_any_batching(ppo, mode, policy_loss, monkeypatch):
    trainer, exp = ppo
    a, c = trainer.cfg.actor, trainer.cfg.critic
    a.loss_agg_mode = c.loss_agg_mode = mode
    a.policy_loss = policy_loss
    results = []
    for batching in BATCHINGS:
        a.micro_batch_size, c.micro_batch_size = batching.get("micro_batch_size", 9), batching.get("micro_batch_size", 9)
        a.use_dynamic_bsz = batching.get("use_dynamic_bsz", False)
        a.max_token_len_per_gpu = batching.get("max_token_len_per_gpu", 16384)
        trainer.strategy.packs_sequences = batching.get("packed", False)
        if a.use_dynamic_bsz:  # the budget really splits the batch
            assert len(trainer.updates.micro(exp)) > 1
        actor, actor_grad = recorded_update(trainer, exp, monkeypatch, trainer.update_actor)
        critic, critic_grad = recorded_update(trainer, exp, monkeypatch, trainer.update_critic)
        results.append((actor, actor_grad, critic, critic_grad))
    a.use_dynamic_bsz, a.micro_batch_size, a.policy_loss = False, 8, "vanilla"
    trainer.strategy.packs_sequences = False
    ref_actor, ref_grad, ref_critic, ref_critic_grad = results[0]
    assert ref_grad.abs().max() > 0 and ref_critic_grad.abs().max() > 0
    for actor, grad, critic, critic_grad in results[1:]:
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl"):
            assert actor[key] == pytest.approx(ref_actor[key], rel=1e-5, abs=1e-7), key
        assert critic["critic/vf_loss"] == pytest.approx(ref_critic["critic/vf_loss"], rel=1e-5, abs=1e-7)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5 * float(ref_grad.abs().max()))
        torch.testing.assert_close(critic_grad, ref_critic_grad, rtol=1e-4,
                                   atol=1e-5 * float(ref_critic_grad.abs().max()))



def test_samples_left_out_of_the_backward_change_neither_the_gradient_nor_the_reported_loss(ppo, monkeypatch):
    """Samples whose advantages are all 0 (no entropy or KL term in the loss) add nothing: leaving them
    out of the backward gives the same gradient and the same ``pg_loss`` (their tokens still count
    in its mean, as in the loss the gradient is of)."""
    trainer, exp = ppo
    a = trainer.cfg.actor
    saved = a.entropy_coeff, a.use_kl_loss, a.micro_batch_size
    a.entropy_coeff, a.use_kl_loss, a.micro_batch_size = 0.0, False, 2
    idle = replace(exp, ref_logprobs=None, advantages=exp.advantages.clone())
    idle.advantages[::3] = 0  # rows 0, 3 and 6
    try:
        runs = [recorded_update(trainer, idle, monkeypatch,
                                lambda e, skip=skip: trainer.updates.actor(e, trainer.algorithm.actor_loss, skip, 0))
                for skip in (False, True)]
    finally:
        a.entropy_coeff, a.use_kl_loss, a.micro_batch_size = saved
    (every, every_grad), (skipped, skipped_grad) = runs
    assert every["actor/active_fraction"] == 1.0 and skipped["actor/active_fraction"] == pytest.approx(6 / 9)
    assert abs(every["actor/pg_loss"]) > 1e-4
    assert skipped["actor/pg_loss"] == pytest.approx(every["actor/pg_loss"], rel=1e-5)
    assert every_grad.abs().max() > 0
    torch.testing.assert_close(skipped_grad, every_grad, rtol=1e-5, atol=1e-6 * float(every_grad.abs().max()))
