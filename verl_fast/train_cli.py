"""`verl-fast train`: load the config (or the embedded default), the models by name, and run."""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List

from verl_fast import config as config_mod


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: the embedded GRPO SmolLM2 chain_sum run)")
    p.add_argument("--dataset_path", help="parquet / jsonl / json / .pt file, a datasets folder, or reasoning_gym:<task>")
    p.add_argument("--metrics_port", type=int, help="serve OpenMetrics (Prometheus) on this port")
    p.add_argument("--output_dir", help="where checkpoints, metrics.jsonl and the reward curve go")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set actor.lr=1e-5")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def resolve_config(args: argparse.Namespace) -> config_mod.Config:
    overrides: List[str] = list(args.overrides)
    if args.dataset_path:
        overrides.append(f"trainer.dataset={args.dataset_path}")
    if args.metrics_port is not None:
        overrides.append(f"trainer.metrics_port={args.metrics_port}")
    if args.output_dir:
        overrides.append(f"trainer.output_dir={args.output_dir}")
    return config_mod.load(args.config or config_mod.default_config_path(), overrides)


def _distributed(cfg: config_mod.Config):
    """Under torchrun (WORLD_SIZE > 1): the process group, on NCCL with CUDA else gloo."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    import torch.distributed as dist

    cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist


def _shard(model):
    """FSDP2 over the decoder layers, then the whole model (the CLI's multi-process runs)."""
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if cfg.trainer.dataset is None:
        raise SystemExit("no dataset: set trainer.dataset in the config or pass --dataset_path")
    if cfg.rollout.type in ("auto", "vllm"):
        from verl_fast.rollout import vllm_env

        vllm_env.configure_vllm_env()  # the launcher's job (STYLE.md): before vLLM is imported
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its per-step INFO lines drown the progress bar
    dist = _distributed(cfg)
    import torch

    from verl_fast.models.loading import load_causal_lm, resolve
    from verl_fast.trainer.rl_trainer import RLTrainer

    if cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    else:
        device = torch.device("cpu")
    if cfg.actor.model_name is None:
        raise SystemExit("actor.model_name is not set")
    attn = "flash_attention_2" if cfg.critic.use_flash_attention and device is not None and device.type == "cuda" else "sdpa"
    actor, tokenizer = load_causal_lm(cfg.actor.model_name, cfg.actor.dtype)
    actor.to(device)
    ref = critic = None
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward or (cfg.algorithm.type == "dpo"
                                                                   and not cfg.reward_fn.reference_free):
        ref, _ = load_causal_lm(cfg.actor.model_name, cfg.actor.dtype)
        ref.to(device)
    if cfg.algorithm.type == "ppo":
        if not cfg.critic.model_name:
            raise SystemExit("algorithm.type=ppo needs critic.model_name")
        critic, _ = load_causal_lm(cfg.critic.model_name, cfg.critic.dtype, attn_implementation=attn)
        critic.to(device)
    if dist is not None and cfg.actor.strategy != "megatron":  # megatron builds its own sharded copy
        actor = _shard(actor)
        if ref is not None:
            ref = _shard(ref)
    trainer = RLTrainer(actor_model=actor, tokenizer=tokenizer, ref_model=ref, critic_model=critic, config=cfg,
                        model_path=resolve(cfg.actor.model_name))
    kwargs: Dict[str, Any] = dict(cfg.trainer.dataset_kwargs)
    history = trainer.fit(cfg.trainer.dataset, **kwargs)
    if trainer.is_main:
        summarize(history, cfg.trainer.output_dir)
    if dist is not None:
        dist.destroy_process_group()
    return 0


def summarize(history: List[Dict[str, Any]], output_dir: str) -> None:
    key = "reward/mean" if history and "reward/mean" in history[0] else "dpo/reward_margin"
    values = [h[key] for h in history if key in h]
    k = max(1, min(5, len(values) // 2))
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    print(f"\n{key}: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({len(values)} steps)")
    print(f"metrics: {os.path.join(output_dir, 'metrics.jsonl')}; reward curve: "
          f"{os.path.join(output_dir, 'reward_curve.png')}; checkpoints: {os.path.join(output_dir, 'checkpoints')}")
