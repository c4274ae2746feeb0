"""Strategy ``megatron``: the actor trains as a Megatron-core ``GPTModel`` (``actor.py``; tensor /
pipeline / virtual-pipeline / expert parallel, data parallel over the rest of the world), and so does
a PPO critic with ``critic.strategy: megatron`` (``critic.py``, in the actor's layout); any other
critic strategy trains the critic as ``fsdp_strategy.HFCritic`` does. The Hugging Face actor rolls out:

- HF generate runs on it: the Megatron weights are written back into it after each update.
- An engine holding its own weights (vLLM) syncs straight from the Megatron shards and the HF
  actor's weights are released (``shared_rollout.py``); a model-parallel group shares one rollout.

The reference model, when KL needs one, is a frozen copy of the HF actor made before its weights
are released. Checkpoints: ``run_checkpoint.py`` (Megatron distributed checkpoints beside the HF
export). Nothing here imports megatron-core until the strategy is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from verl_fast.config import Config
from verl_fast.records.experience import Experience
from verl_fast.models.packed import causal_pairs
from verl_fast.models.wrapping import hf_module
from verl_fast.rollout.base import RolloutEngine
from verl_fast.strategies import fsdp_strategy, sharding
from verl_fast.strategies.megatron import run_checkpoint
from verl_fast.strategies.megatron.shared_rollout import megatron_rollout
from verl_fast.strategies.protocol import LossFn
from verl_fast.strategies.sharding import Sharding


class MegatronStrategy:
    """The ``Strategy`` of a Megatron-trained actor (module docstring); collective over the world."""

    uneven_micro_batches = False  # the pipeline schedule runs every rank's micro-batches together
    hf_decode_by_default = False  # its HF actor is an export target: rollout.type auto prefers vLLM
    packs_sequences = False  # Megatron's forward takes the padded rows
    budgets_tokens = False  # fixed-size micro-batches (check refuses actor.use_dynamic_bsz)

    def __init__(self, cfg: Config, actor: torch.nn.Module, ref: Optional[torch.nn.Module],
                 critic: Optional[torch.nn.Module], needs_reference: bool):
        from verl_fast.strategies.megatron.actor import MegatronActor

        check_device(cfg)
        self.cfg = cfg
        plain = Sharding("none")  # a Megatron copy trains; the plain HF actor rolls out
        self.device = sharding.compute_device(plain, cfg.trainer.device, actor)
        self.actor = sharding.shard(actor, plain, self.device)
        self.megatron = MegatronActor(self.actor, cfg)
        self.dp_rank, self.dp_size = self.megatron.dp_rank, self.megatron.dp_size  # data splits over DP only
        self.dp_group = self.megatron.dp_group if self.dp_size > 1 else None
        self.autocast_dtype = None  # the config refuses actor.autocast: bf16 weights instead
        self.autocast = fsdp_strategy.autocast_of(None, self.device)
        self.ref = fsdp_strategy.reference_model(self.actor, ref, plain, self.device) if needs_reference else None
        self.has_reference = self.ref is not None
        self.critic = None if critic is None else self._critic(fsdp_strategy.critic_model(critic))
        self.optimizer = self.megatron.optimizer

    # ---- start-up, before any model loads (the CLI)

    @staticmethod
    def check_machine(cfg: Config) -> None:
        check_device(cfg)

    @staticmethod
    def check_fits(cfg: Config, needs_reference: bool, device: torch.device) -> None:
        """No memory plan: megatron-core shards by the parallel sizes the config names."""

    @staticmethod
    def planned(cfg: Config, device: torch.device) -> Dict[str, Any]:
        return {"resolved on": f"{device.type}: actor.strategy=megatron trains in actor.dtype={cfg.actor.dtype}"}

    def _critic(self, critic: torch.nn.Module) -> Any:
        if self.cfg.critic.strategy != "megatron":
            return fsdp_strategy.HFCritic(critic, self.cfg, self.dp_size, self.device, self.autocast)
        from verl_fast.strategies.megatron.critic import MegatronCritic

        return MegatronCritic(critic.to(self.device), self.cfg)  # trained in Megatron's layout; no HF copy kept

    def resolved(self) -> Dict[str, Any]:
        return {"actor.autocast": "none", "actor.dtype": self.cfg.actor.dtype, "actor.strategy": "megatron"}

    # ---- forward passes and updates

    def actor_logprobs(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        return self.megatron.logprobs(exp, micro, self.cfg.rollout.temperature or 1.0)  # as the update's

    def ref_logprobs(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        return fsdp_strategy.hf_logprobs(self.ref, exp, micro, self.cfg, self.autocast, self.device)

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn: LossFn,
                         entropy: bool = True) -> Tuple[List[Dict], Tuple[float, float]]:
        # entropy: the fused log-prob head gives it in the same pass either way
        stats = self.megatron.forward_backward(exp, micro, loss_fn)
        lens = exp.attention_mask[torch.cat(micro)].sum(-1) if micro else exp.attention_mask.new_zeros(0)
        return stats, (float(lens.sum()), causal_pairs(lens))  # the rows' real tokens (padding not counted)

    def optimizer_step(self) -> float:
        return self.megatron.step()

    # ---- rollout

    def weight_source(self, owns_weights: bool) -> Any:
        return self.megatron if owns_weights else self.actor

    def rollout_engine(self, engine: RolloutEngine) -> RolloutEngine:
        return megatron_rollout(engine, self.megatron, self.actor) if engine.owns_weights else engine

    def actor_updated(self, engine_owns_weights: bool) -> None:
        if not engine_owns_weights:  # HF rollout runs the HF actor
            self.megatron.export_to(hf_module(self.actor))

    # ---- checkpoints

    def save(self, output_dir: str, step: int, tokenizer: Any, state: Dict[str, Any], export_hf: bool) -> None:
        """A Megatron distributed checkpoint, and always the HF export."""
        run_checkpoint.save(output_dir, step, self.megatron, self.actor, tokenizer, state, self.critic)

    def load(self, path: Path) -> Dict[str, Any]:
        return run_checkpoint.load(path, self.megatron, self.actor, self.critic)


def check(cfg: Config) -> None:
    """What the Megatron strategy cannot run, at config validation."""
    if cfg.critic.strategy == "megatron":
        if cfg.actor.strategy != "megatron":
            raise ValueError(f"critic.strategy=megatron is not supported with actor.strategy={cfg.actor.strategy}: "
                             "the critic takes the actor's Megatron layout; use actor.strategy=megatron")
        for key in ("gradient_checkpointing", "cpu_offload"):
            if getattr(cfg.critic, key):
                raise ValueError(f"critic.{key} is not supported with critic.strategy=megatron; leave it off")
        if cfg.critic.mixed_precision not in ("none", "auto"):
            raise ValueError("critic.mixed_precision is not supported with critic.strategy=megatron; use "
                             "critic.dtype=bfloat16 (bf16 weights, fp32 main weights in the optimizer)")
    if cfg.actor.strategy != "megatron":
        return
    if cfg.actor.lora is not None:
        raise ValueError("actor.lora is not supported with actor.strategy=megatron (the Megatron copy trains every "
                         "weight); use actor.strategy=auto")
    for key in ("use_dynamic_bsz", "gradient_checkpointing", "cpu_offload"):
        if getattr(cfg.actor, key):
            raise ValueError(f"actor.{key} is not supported with actor.strategy=megatron; use fixed-size "
                             "micro-batches (actor.micro_batch_size) on the accelerator")
    if cfg.actor.mixed_precision not in ("none", "auto") or cfg.actor.autocast not in (None, "none", "auto"):  # auto: none here
        raise ValueError("actor.mixed_precision / actor.autocast are not supported with actor.strategy=megatron; "
                         "use actor.dtype=bfloat16 (bf16 weights, fp32 main weights in the optimizer)")
    if cfg.actor.use_remove_padding:
        raise ValueError("actor.use_remove_padding=true is not supported with actor.strategy=megatron (Megatron runs "
                         "its own forward); leave it unset")
    if cfg.trainer.async_mode == "full":
        raise ValueError("trainer.async_mode=full is not supported with actor.strategy=megatron; use "
                         "actor.strategy=none or fsdp2")
    if cfg.actor.virtual_pipeline_model_parallel_size and cfg.actor.pipeline_model_parallel_size < 2:
        raise ValueError("actor.virtual_pipeline_model_parallel_size needs actor.pipeline_model_parallel_size >= 2")


def needs_megatron_core(cfg: Config) -> Optional[str]:
    """The key that makes a run need megatron-core (``extras.register``), or None: the actor's, since
    ``check`` refuses a Megatron critic beside any other actor."""
    return "actor.strategy=megatron" if cfg.actor.strategy == "megatron" else None


def check_device(cfg: Config) -> None:
    """Refuses, in one line, a Megatron-trained actor or critic where megatron-core cannot train: its
    DDP, distributed optimizer and pipeline schedules ask ``torch.cuda`` for the current device, so the
    probe asks the same question megatron-core will (a torch without CUDA, or no visible GPU, fails it)."""
    users = [key for key in ("actor", "critic") if getattr(cfg, key).strategy == "megatron"]
    if not users:
        return
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError) as e:
        raise RuntimeError(f"{users[0]}.strategy=megatron needs a CUDA device (megatron-core trains through "
                           f"torch.cuda) and this machine has none ({str(e).strip().splitlines()[0]}): run it on a "
                           "GPU machine, or use actor.strategy=fsdp2 / none on the CPU") from None
