"""RLTrainer at any world size on the same data: ``python trainer_scale_worker.py OUT_DIR ACTOR_DIR
CRITIC_DIR SCENARIO...`` alone (world 1) or under torchrun (gloo). The models go in as plain Hugging
Face models; the trainer shards them as the config says. The rollout is scripted: each response
depends only on its prompt and sample number, never on the rank or on how the batch was split, so
world sizes 1 and 2 train on the same sequences. Each rank writes ``<scenario>.rank<R>.pt`` with the
step metrics and the whole (gathered) actor and critic weights, plus how each model was wrapped."""

import os
import sys
from typing import List

import torch
import torch.distributed as dist

from verl_fast.records.generation import pad_completions
from verl_fast.rollout.base import RolloutEngine

STEPS = 3
PROMPTS = [{"prompt": f"What is {a} + {b}?" + " please" * (a % 3)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


class ScriptedEngine(RolloutEngine):
    """Responses drawn from a generator seeded by the prompt's tokens and the sample's number; with
    ``logprobs``, behaviour log-probs drawn from it too (spread so that some weights hit the cap)."""

    def __init__(self, tokenizer, logprobs=False):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.logprobs = logprobs

    def generate(self, prompts, sampling):
        specs = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        completions, index, texts, logprobs = [], [], [], []
        for i, (prompt, spec) in enumerate(zip(prompts, specs)):
            key = 0
            for t in prompt:
                key = (key * 1_000_003 + int(t) + 1) % (2**31)
            for j in range(spec.n):
                g = torch.Generator().manual_seed(key * 97 + j)
                length = int(torch.randint(2, spec.max_tokens + 1, (1,), generator=g))
                tokens = torch.randint(3, self.vocab, (length,), generator=g).tolist()  # no special tokens
                completions.append(tokens)
                logprobs.append((-4.0 - 6.0 * torch.rand(length, generator=g)).tolist())
                index.append(i)
                texts.append(self.tokenizer.decode(tokens))
        return pad_completions(completions, logprobs if self.logprobs else None, index, self.tokenizer.pad_token_id,
                               texts, ["length"] * len(completions))


def config(scenario: str, world: int, out_dir: str) -> dict:
    sharded = world > 1
    cfg = {"actor": {"lr": 1e-3, "micro_batch_size": 4},
           "rollout": {"n": 4, "max_new_tokens": 6},
           "reward_fn": {"type": "gsm8k"},
           "algorithm": {"type": "grpo"},
           "trainer": {"train_batch_size": 4, "output_dir": os.path.join(out_dir, scenario), "device": "cpu",
                       "progress_bar": False, "plot": False},
           # the scripted behaviour log-probs come from no policy: the sync guardrail would stop the run
           "guardrails": {"sync_check": False}}
    # KL: a reference built from the actor
    if scenario in ("grpo", "grpo_fsdp1", "grpo_options", "grpo_resharded", "grpo_packed"):
        cfg["actor"].update(use_kl_loss=True, kl_loss_coef=0.1, use_dynamic_bsz=True, max_token_len_per_gpu=64)
    if scenario == "grpo_resharded":  # "grpo" gathers once per step (auto: a tiny model); this one per micro-batch
        cfg["actor"]["unsharded_accumulation"] = "off"
    if scenario == "grpo_packed":  # rows packed without padding (the varlen path's per-sequence reference on the CPU)
        cfg["actor"]["use_remove_padding"] = True
    if scenario == "grpo_fsdp1" and sharded:
        cfg["actor"]["strategy"] = "fsdp1"
    if scenario == "grpo_options" and sharded:
        cfg["actor"].update(mixed_precision="bfloat16", gradient_checkpointing=True)  # cpu_offload: CUDA only
    if scenario == "grpo_corrected":  # the rollout correction's weights from the update's forward, per micro-batch
        cfg["algorithm"].update(rollout_correction=True, rollout_correction_cap=3.0)
        # FSDP ranks train every sample: so does world 1 here (the weights' spread is over the samples trained on)
        cfg["actor"].update(micro_batch_size=3, skip_zero_advantage=False)
    if scenario in ("ppo", "ppo_prewrapped"):
        cfg["algorithm"] = {"type": "ppo", "gamma": 1.0, "lam": 0.95}
        cfg["critic"] = {"lr": 1e-3, "micro_batch_size": 4}
    return cfg


def full_weights(model) -> dict:
    """Whole parameters on the CPU (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from verl_fast.models.wrapping import wrapper_kind

    if wrapper_kind(model) is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def run(scenario: str, actor_dir: str, critic_dir: str, out_dir: str, rank: int, world: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.models.wrapping import wrapper_kind
    from verl_fast.strategies import sharding
    from verl_fast.trainer.rl_trainer import RLTrainer

    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(actor_dir)
    critic = AutoModelForCausalLM.from_pretrained(critic_dir, dtype=torch.float32) if "ppo" in scenario else None
    if scenario == "ppo_prewrapped" and world > 1:  # the user's own FSDP2 wrapping, kept as it is
        from torch.distributed.fsdp import fully_shard

        for model in (actor, critic):
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
    trainer = RLTrainer(actor_model=actor, tokenizer=tok, critic_model=critic, config=config(scenario, world, out_dir),
                        rollout_engine=ScriptedEngine(tok, logprobs=scenario == "grpo_corrected"),
                        reward_fn=lambda solution_str: float(len(solution_str) % 2))
    items = trainer.processor.encode_all(PROMPTS)
    history: List[dict] = []
    update_micro = []  # how many micro-batches each actor update ran
    plain_micro = trainer.updates.micro

    def counted_micro(exp, rows=None, for_update=True, size=None):
        batches = plain_micro(exp, rows, for_update, size)
        if for_update and size is None:
            update_micro.append(len(batches))
        return batches

    trainer.updates.micro = counted_micro
    for step in range(STEPS):
        trainer.step = step
        history.append(trainer._policy_gradient_step(trainer._batch(items, step, per_epoch=1)))
        history[-1]["micro_batches"] = update_micro.pop()
    critic = trainer.strategy.critic
    result = {"history": history, "actor": full_weights(trainer.actor), "same_actor": trainer.actor is actor,
              "gathered_once": trainer.actor in sharding._GATHER_ONCE, "packs": trainer.strategy.packs_sequences,
              "kinds": {"actor": wrapper_kind(trainer.actor), "ref": wrapper_kind(trainer.ref) if trainer.ref else None,
                        "critic": wrapper_kind(critic.model) if critic else None}}
    if critic is not None:
        # ValueModel also lists its backbone under "backbone." (the same tensors as "model.model.")
        result["critic"] = {k: v for k, v in full_weights(critic.model).items() if not k.startswith("backbone.")}
    torch.save(result, os.path.join(out_dir, f"{scenario}.rank{rank}.pt"))


def main(out_dir: str, actor_dir: str, critic_dir: str, scenarios: List[str]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    for scenario in scenarios:
        run(scenario, actor_dir, critic_dir, out_dir, rank, world)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
