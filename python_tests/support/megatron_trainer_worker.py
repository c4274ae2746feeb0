"""RLTrainer with ``actor.strategy: megatron`` on CPU (gloo), run by test_megatron_trainer.py under
torch.multiprocessing; ``run_updates`` is also the single-process HF reference."""

import os

import torch
import torch.distributed as dist

from tiny_models import build_tokenizer, tiny_model

VOCAB = 320  # the tokenizer's size (build_tokenizer(vocab_size=320))
# Qwen3-MoE's released configs renormalise the top-k routing weights (transformers' default does not)
OVERRIDES = {"qwen3_moe": {"norm_topk_prob": True}}


def actor_model(family: str):
    return tiny_model(family, seed=3, vocab_size=VOCAB, **OVERRIDES.get(family, {}))


def experiences(vocab: int, steps: int = 3, n: int = 8, prompt: int = 7, response: int = 5):
    """Fixed GRPO-like batches: left-padded prompts of mixed lengths, responses with trailing padding."""
    from verl_fast.records.experience import Experience

    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (n, prompt + response), generator=g)
        attn = torch.ones_like(ids)
        pads = torch.randint(0, prompt - 1, (n,), generator=g)
        ends = torch.randint(1, response + 1, (n,), generator=g)
        for i in range(n):
            attn[i, : pads[i]] = 0
            attn[i, prompt + ends[i]:] = 0
        ids = ids.masked_fill(attn == 0, 0)
        resp = attn[:, prompt:].float()
        adv = torch.randn(n, 1, generator=g).expand(n, response) * resp
        out.append(Experience(input_ids=ids, attention_mask=attn, response_mask=resp,
                              prompt_index=torch.arange(n) // 4, advantages=adv.contiguous(),
                              returns=adv.contiguous()))
    return out


def config(strategy: str, tp: int = 1, pp: int = 1, out_dir: str = "unused", device: str = "auto", ep: int = 1,
           corrected: bool = False):
    """``corrected``: the rollout correction on, one mini-batch (its weights from the update's forward)."""
    return {"actor": {"lr": 5e-3, "max_grad_norm": 0.5, "micro_batch_size": 3,
                      "ppo_mini_batch_size": None if corrected else 4,
                      "strategy": strategy, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                      "expert_model_parallel_size": ep},
            "rollout": {"type": "hf", "n": 4, "max_new_tokens": 5},
            "reward_fn": {"type": "gsm8k"}, "algorithm": {"type": "grpo", "rollout_correction": corrected},
            "trainer": {"output_dir": out_dir, "progress_bar": False, "plot": False, "device": device}}


def run_updates(family: str, cfg: dict):
    """Each step: old log-probs, then the update. Returns (per-step metrics, old log-probs, HF weights).
    With the rollout correction on, the old log-probs are only compared: the update takes its weights
    from its own forward, against behaviour log-probs 0.3 nats of noise off them (the same on every rank)."""
    from verl_fast.trainer.rl_trainer import RLTrainer

    tok = build_tokenizer(vocab_size=320)
    assert len(tok) == VOCAB, len(tok)
    model = actor_model(family)
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, reward_fn=lambda solution_str: 0.0)
    corrected = cfg["algorithm"]["rollout_correction"]
    noise = torch.Generator().manual_seed(5)
    metrics, old = [], []
    for exp in experiences(len(tok)):
        exp = exp.to(trainer.device)
        logprobs = trainer._old_logprobs(exp)
        old.append(logprobs.cpu())
        if corrected:
            shift = 0.3 * torch.randn(logprobs.shape, generator=noise).to(logprobs.device)
            exp.rollout_logprobs = (logprobs + shift) * exp.response_mask
        else:
            exp.old_logprobs = logprobs
        metrics.append(trainer.update_actor(exp))
    return metrics, old, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def user_parallel_state(tp: int, pp: int):
    """Initialises megatron-core's groups as a user would; the trainer must take them as they are (and
    refuse a config that disagrees with them). Returns a check to run after training."""
    from megatron.core import parallel_state as ps

    from verl_fast.strategies.megatron.gpt_model import Parallel, init_parallel_state

    ps.initialize_model_parallel(tp, pp)
    groups = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group())
    try:
        init_parallel_state(Parallel(tp, pp + 1))
        raise AssertionError("a pipeline size that disagrees with parallel_state was accepted")
    except ValueError as e:
        assert "actor.pipeline_model_parallel_size" in str(e), e

    def check():
        assert (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()) == groups

    return check


def worker(rank, world, port, family, tp, pp, out_path, device="cpu", user_init=False, ep=1, corrected=False):
    init_worker(rank, world, port, device)
    check = user_parallel_state(tp, pp) if user_init else (lambda: None)
    metrics, old, weights = run_updates(family, config("megatron", tp, pp, device="auto" if device == "cpu" else device,
                                                       ep=ep, corrected=corrected))
    check()
    if rank == 0:
        torch.save({"metrics": metrics, "old": old, "weights": weights}, out_path)
    dist.barrier()
    dist.destroy_process_group()


def fit_worker(rank, world, port, model_dir, cfg, result_path, dataset=None):
    """``RLTrainer.fit`` with the Megatron actor (resuming from the output folder's checkpoints)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import megatron_worker
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    megatron_worker.neutralise_cuda_for_training()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    critic = None  # PPO: a critic on the same base model, as the CLI builds it
    if cfg.get("algorithm", {}).get("type") == "ppo":
        critic = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if dataset is None:
        dataset = [{"prompt": f"What is {i} + {i + 1}?" + " please" * i} for i in range(4)]
        trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, critic_model=critic,
                            reward_fn=lambda solution_str: float(len(solution_str) % 3 == 0))
    else:
        trainer = RLTrainer(actor_model=model, tokenizer=tok, config=cfg, critic_model=critic)
    history = trainer.fit(dataset, **cfg["trainer"].get("dataset_kwargs", {}))
    if rank == 0:
        torch.save({"history": history, "weights": {k: v.clone() for k, v in model.state_dict().items()}},
                   result_path)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the PPO critic (critic.strategy: megatron)


def critic_config(strategy: str, tp: int = 1, pp: int = 1, device: str = "auto"):
    cfg = config(strategy, tp, pp, device=device)
    cfg["algorithm"] = {"type": "ppo"}
    cfg["critic"] = {"strategy": strategy, "lr": 5e-3, "max_grad_norm": 0.5, "micro_batch_size": 3}
    return cfg


def tiny_critic(family: str, head: str):
    """A ValueModel with every weight drawn: on a causal LM (the linear head the trainer adds) or a
    token-classification model (its ``score``; no dropout)."""
    import transformers

    from tiny_models import tiny_config
    from verl_fast.models.value import ValueModel

    torch.manual_seed(5)
    if head == "causal_lm":
        model = tiny_model(family, seed=5, vocab_size=VOCAB)
    else:
        model = transformers.AutoModelForTokenClassification.from_config(
            tiny_config(family, vocab_size=VOCAB, num_labels=1, classifier_dropout=0.0))
    critic = ValueModel(model)
    with torch.no_grad():
        for p in critic.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.1)
    return critic.eval()


def hf_critic_weights(critic):
    from verl_fast.strategies.megatron.critic import hf_critic_state

    return {k: v.detach().cpu().clone() for k, v in hf_critic_state(critic)[0].items()}


def run_critic_updates(family: str, head: str, cfg: dict, resume_dir=None):
    """Each step: values, then the critic's update. Returns (per-step metrics, values, critic weights
    under HF names); with ``resume_dir`` (Megatron only) also the weights of a second critic that
    resumed from the checkpoint written before the last step and ran that step."""
    from verl_fast.strategies.megatron import dist_checkpoint
    from verl_fast.trainer.rl_trainer import RLTrainer

    critic = tiny_critic(family, head)
    trainer = RLTrainer(actor_model=actor_model(family), tokenizer=build_tokenizer(vocab_size=320),
                        critic_model=critic, config=cfg, reward_fn=lambda solution_str: 0.0)
    metrics, values = [], []
    batches = [exp.to(trainer.device) for exp in experiences(VOCAB)]
    for step, exp in enumerate(batches):
        if resume_dir is not None and step == len(batches) - 1:
            dist_checkpoint.save(trainer.strategy.critic, resume_dir)
        exp.values = trainer._values(exp)
        values.append(exp.values.cpu())
        metrics.append(trainer.update_critic(exp))
    if resume_dir is None:
        return metrics, values, hf_critic_weights(critic)
    final = {k: v.cpu().clone() for k, v in trainer.strategy.critic.to_hf().items()}
    from verl_fast.strategies.megatron.critic import MegatronCritic

    critic = MegatronCritic(tiny_critic(family, head).to(trainer.device), trainer.cfg)  # fresh weights, optimizer
    trainer.strategy.critic = critic
    dist_checkpoint.load(critic, resume_dir)
    trainer.update_critic(batches[-1])
    resumed = {k: v.cpu().clone() for k, v in critic.to_hf().items()}
    return metrics, values, final, resumed


def init_worker(rank, world, port, device):
    """The process group (NCCL on GPUs, else gloo with megatron-core's CUDA calls neutralised)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import megatron_worker

        megatron_worker.neutralise_cuda_for_training()


def critic_worker(rank, world, port, family, head, tp, pp, out_path, resume_dir, device="cpu"):
    init_worker(rank, world, port, device)
    cfg = critic_config("megatron", tp, pp, device="auto" if device == "cpu" else device)
    metrics, values, weights, resumed = run_critic_updates(family, head, cfg, resume_dir)
    if rank == 0:
        torch.save({"metrics": metrics, "values": values, "weights": weights, "resumed": resumed}, out_path)
    dist.barrier()
    dist.destroy_process_group()
