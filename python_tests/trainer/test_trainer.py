"""RLTrainer end to end on tiny random-weight models with Hugging Face generate as the rollout."""


import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import save_tiny_model
from verl_fast.rollout.operator import RolloutOperator
from verl_fast.trainer.rl_trainer import RLTrainer


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", seed=1)


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path)


PROMPTS = [{"prompt": f"What is {a} + {b}?", "reward_model": {"ground_truth": str(a + b)}, "data_source": "toy"}
           for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]]


def base_config(tmp_path, **sections):
    cfg = {
        "actor": {"lr": 1e-3, "micro_batch_size": 8},
        "rollout": {"type": "hf", "n": 4, "max_new_tokens": 6, "temperature": 1.0},
        "reward_fn": {"type": "gsm8k"},
        "algorithm": {"type": "grpo"},
        "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path / "run"),
                    "progress_bar": False, "plot": False, "device": "cpu"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def starts_with(text):
    """1 when the response starts with ``text``: a learnable toy reward ("say a given token")."""
    return lambda solution_str: float(solution_str.startswith(text))


def test_grpo_changes_weights_and_lowers_loss_on_a_fixed_batch(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    cfg = base_config(tmp_path, actor={"ppo_epochs": 1, "lr": 3e-3})
    reward = lambda solution_str, ground_truth: float(len(solution_str) % 3 == 0)  # noqa: E731
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg)
    before = flat(model).clone()
    rows = trainer.processor.encode_all(PROMPTS[:2])
    metrics = {}
    exp = trainer.make_experience(rows, metrics)
    assert exp.advantages.abs().sum() > 0, "the toy reward must vary within a group"
    exp.old_logprobs = trainer._old_logprobs(exp)
    losses = [trainer.update_actor(exp)["actor/pg_loss"] for _ in range(4)]
    assert not torch.equal(before, flat(model))
    assert losses[-1] < losses[0] - 1e-4, losses


def test_learnable_reward_rises(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    # the target: the model's second most likely first answer token, so it is sampled sometimes
    row = RLTrainer(actor_model=model, tokenizer=tok, config=base_config(tmp_path)).processor.encode(PROMPTS[0])
    with torch.no_grad():
        logits = model(torch.tensor([row.prompt_ids])).logits[0, -1]
    candidates = [tok.decode([int(i)]) for i in logits.topk(12).indices[1:]]
    target = next(t for t in candidates if t.strip() and t not in tok.all_special_tokens)
    cfg = base_config(tmp_path, rollout={"n": 8, "max_new_tokens": 2},
                      actor={"lr": 5e-3, "micro_batch_size": 16},
                      trainer={"total_steps": 20, "train_batch_size": 2})
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=starts_with(target), config=cfg)
    history = trainer.fit(PROMPTS)
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.3 and last > 0.6, rewards  # ~0.2 -> ~0.9 seen


def test_ppo_updates_actor_and_critic(tiny_path, llama_path, tmp_path):
    model, tok = load(tiny_path)
    critic_base, _ = load(llama_path)  # a different family than the actor
    cfg = base_config(tmp_path, algorithm={"type": "ppo", "gamma": 1.0, "lam": 0.95},
                      critic={"lr": 1e-3}, actor={"ppo_epochs": 2, "ppo_mini_batch_size": 4},
                      trainer={"total_steps": 1})
    reward = lambda solution_str: float(len(solution_str) > 3)  # noqa: E731
    trainer = RLTrainer(actor_model=model, tokenizer=tok, critic_model=critic_base, reward_fn=reward, config=cfg)
    actor_before, critic_before = flat(model).clone(), flat(trainer.strategy.critic.model).clone()
    history = trainer.fit(PROMPTS)
    assert not torch.equal(actor_before, flat(model))
    assert not torch.equal(critic_before, flat(trainer.strategy.critic.model))
    assert "critic/vf_loss" in history[-1] and "actor/clipfrac" in history[-1]


def test_kl_in_loss_and_in_reward(tiny_path, tmp_path):
    for i, extra in enumerate([{"actor": {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k3+"}},
                               {"algorithm": {"type": "rloo", "use_kl_in_reward": True, "kl_penalty": "k1",
                                              "kl_coef": 0.1}}]):
        model, tok = load(tiny_path)
        cfg = base_config(tmp_path, trainer={"total_steps": 2, "output_dir": str(tmp_path / f"run{i}")}, **extra)
        reward = lambda solution_str: float(len(solution_str) % 2)  # noqa: E731
        history = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg).fit(PROMPTS)
        assert len(history) == 2
        if "actor" in extra:
            assert "actor/kl" in history[-1]
        else:  # the first step's KL is 0 (actor = reference; up to the last bits: the two copies' weights
            # sit at other addresses, and the CPU GEMM's blocking may differ with alignment); the second's is not
            assert abs(history[0]["reward/kl_penalty"]) < 1e-6 and abs(history[-1]["reward/kl_penalty"]) > 1e-4


def test_dpo_increases_margin(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    pairs = [{"prompt": f"What is {a} + {a}?", "chosen": f"the answer is {2 * a}", "rejected": "please minus"}
             for a in range(8)]
    cfg = {"actor": {"lr": 2e-3, "micro_batch_size": 16}, "reward_fn": {"type": "pairwise_ranking"},
           "algorithm": {"type": "dpo", "beta": 0.5},
           "trainer": {"total_steps": 6, "train_batch_size": 8, "output_dir": str(tmp_path / "dpo"),
                       "progress_bar": False, "plot": False}}
    history = RLTrainer(actor_model=model, tokenizer=tok, config=cfg).fit(pairs)
    margins = [m["dpo/reward_margin"] for m in history]
    assert margins[-1] > margins[0] + 0.5 and history[-1]["dpo/reward_accuracy"] == 1.0, margins


class Killed(BaseException):
    """The process dying mid-step (a KeyboardInterrupt raised in a reward is a stop request now: the
    trainer checkpoints and returns, so it no longer stands for a crash)."""


def test_resume_after_kill_matches_uninterrupted(tiny_path, tmp_path):
    def run(output, total, crash_at=None):
        model, tok = load(tiny_path)
        calls = {"n": 0}

        def reward(solution_str):
            calls["n"] += 1
            if crash_at is not None and calls["n"] > crash_at * 8:  # 2 prompts x 4 samples per step
                raise Killed("killed")
            return float(len(solution_str) % 2)

        cfg = base_config(tmp_path, trainer={"total_steps": total, "save_freq": 2, "output_dir": str(output)})
        trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=reward, config=cfg)
        return trainer, model

    straight, m1 = run(tmp_path / "a", 4)
    straight.fit(PROMPTS)
    killed, _ = run(tmp_path / "b", 4, crash_at=3)
    with pytest.raises(Killed):
        killed.fit(PROMPTS)  # dies in step 4, after the checkpoint of step 2
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert ckpts == ["step_000002"], ckpts
    resumed, m2 = run(tmp_path / "b", 4)
    history = resumed.fit(PROMPTS)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert torch.equal(flat(m1), flat(m2))
    assert [h["reward/mean"] for h in history] == [h["reward/mean"] for h in straight.history]
    # the checkpoint is an HF folder transformers loads directly
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "checkpoints" / "step_000004")
    assert torch.equal(flat(reloaded), flat(m2))


def test_reward_hot_swap_takes_effect_next_step(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    cfg = base_config(tmp_path, trainer={"total_steps": 1})
    trainer = RLTrainer(actor_model=model, tokenizer=tok, reward_fn=lambda solution_str: 0.0, config=cfg)
    trainer.fit(PROMPTS)
    trainer.update_reward_fn(lambda solution_str: 1.0)
    trainer.cfg.trainer.total_steps = 2
    history = trainer.fit(PROMPTS)
    assert [h["reward/mean"] for h in history] == [0.0, 1.0]


def test_rollout_operator_per_batch_kwargs(tiny_path, tmp_path):
    model, tok = load(tiny_path)

    class Greedy(RolloutOperator):
        def get_generation_kwargs(self, batch):
            return [{"temperature": 0.0, "max_new_tokens": 3} if row.data_source == "exact" else {} for row in batch]

    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=base_config(tmp_path))
    op = Greedy(trainer.engine, trainer.rollout.default)
    rows = trainer.processor.encode_all([dict(PROMPTS[0], data_source="exact"), PROMPTS[1]])
    out = op.rollout(rows, seed=1)
    greedy = out.response_ids[out.prompt_index == 0]
    assert (greedy == greedy[0]).all(), "greedy samples of one prompt are identical"
    assert int(out.response_mask[out.prompt_index == 0].sum(-1).max()) <= 3


def test_length_bucketed_waves_keep_prompt_order(tiny_path, tmp_path):
    model, tok = load(tiny_path)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=base_config(tmp_path))
    rows = trainer.processor.encode_all(
        [{"prompt": "What is 1 + 1?"}, {"prompt": " ".join(["please compute the total sum"] * 12)},
         {"prompt": "What is 2 + 2?"}, {"prompt": " ".join(["add the number"] * 20)}])
    waves = RolloutOperator(trainer.engine, trainer.rollout.default, max_num_seqs=8, max_batch_tokens=400)
    single = RolloutOperator(trainer.engine, trainer.rollout.default)
    greedy = {"temperature": 0.0}
    waves.get_generation_kwargs = single.get_generation_kwargs = lambda batch: greedy
    a, b = waves.rollout(rows, seed=0), single.rollout(rows, seed=0)
    assert a.prompt_index.tolist() == b.prompt_index.tolist() == [i for i in range(4) for _ in range(4)]
    assert a.texts == b.texts  # greedy: the same responses whichever wave a prompt went in


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_actor_on_two_ranks(tiny_path, tmp_path, lora):
    """An FSDP2-sharded actor (gloo, 2 processes) trains as it is: rollout on every rank, sequences
    balanced over the ranks by tokens, token-budget micro-batches, metrics averaged, HF checkpoints.
    With LoRA adapters and the sharding from the config (the HF rollout's ``generate`` runs before
    any training pass: FSDP2's root must see it)."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).resolve().parents[1] / "support" / "trainer_dist_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), "2", str(port), str(tiny_path), str(tmp_path)]
                              + (["lora"] if lora else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    result = json.loads((tmp_path / "rank0.json").read_text())
    history = result["history"]
    assert [h["step"] for h in history] == [1, 2] and result["changed"]
    assert all(h["dp/imbalance_after"] <= h["dp/imbalance_before"] + 1e-9 for h in history)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step_000002")
    assert sum(p.numel() for p in reloaded.parameters()) > 0
