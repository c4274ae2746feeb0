"""RLTrainer: rollout -> reward -> advantages -> updates -> checkpoint and metrics, step by step.

Algorithms, chosen once from ``config.algorithm.type``:
- grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline: the outcome reward sits on each
  response's last token; advantages come from the named estimator (group baselines over the
  ``rollout.n`` samples of a prompt); PPO-clip policy loss; no critic.
- ppo: a critic (value head) estimates values; GAE advantages; clipped policy and value losses.
- dpo: offline chosen/rejected pairs, no rollout (trainer/dpo.py).
KL against the reference model goes either into the reward (``algorithm.use_kl_in_reward``,
``kl_penalty``, ``kl_coef``) or into the loss (``actor.use_kl_loss``, ``kl_loss_type``,
``kl_loss_coef``). Losses aggregate with ``actor.loss_agg_mode`` over the whole mini-batch:
micro-batches are scaled by its token (or sequence) count, so accumulation is exact.

Run it with ``verl-fast train --config c.yaml`` or ``RLTrainer(actor_model=..., tokenizer=...,
reward_fn=..., config=...).fit(dataset)``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from verl_fast import config as config_mod
from verl_fast.algos.advantage import AdvantageInput, get_estimator
from verl_fast.algos.losses import kl_penalty, value_loss
from verl_fast.config import Config
from verl_fast.data import PromptRow, RLDataProcessor
from verl_fast.metrics import MetricsLogger
from verl_fast.trainer.batching import make_micro_batches
from verl_fast.models.logprobs import response_logprobs
from verl_fast.models.value import ValueModel, response_values
from verl_fast.models.wrapping import hf_module, is_sharded
from verl_fast.rewards import RewardInput, as_reward_function, build_reward
from verl_fast.rollout.base import RolloutEngine, SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.rollout.operator import RolloutOperator
from verl_fast.trainer import checkpoint, dpo, megatron_checkpoint
from verl_fast.trainer.actor_loss import actor_loss
from verl_fast.ops.schedule import balance_partitions
from verl_fast.trainer.experience import Experience, build_experience, concat, last_token_rewards, micro_batches

AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class RLTrainer:
    def __init__(
        self,
        actor_model: torch.nn.Module,
        tokenizer: Any,
        ref_model: Optional[torch.nn.Module] = None,
        critic_model: Optional[torch.nn.Module] = None,
        reward_fn: Optional[Any] = None,
        config: Union[Config, Dict[str, Any], None] = None,
        generation_config: Optional[Dict[str, Any]] = None,
        rollout_operator: Optional[RolloutOperator] = None,
        rollout_engine: Optional[RolloutEngine] = None,
        model_path: Optional[str] = None,
    ):
        """``actor_model``: any PreTrainedModel, or an FSDP-wrapped one (used as it is, never
        re-wrapped). ``ref_model`` / ``critic_model`` may be of other families; without a
        ``ref_model`` a frozen copy of the actor is the reference when KL is used. ``reward_fn``:
        a callable with verl's ``compute_score`` signature or a RewardFunction (else the config's).
        ``generation_config``: default sampling (SamplingSpec fields or HF names). ``model_path``:
        the actor's folder, which a vLLM engine loads (else the actor is saved to a temporary one)."""
        self.cfg = config if isinstance(config, Config) else config_mod.from_dict(config or {})
        cfg = self.cfg
        self.algorithm = cfg.algorithm.type
        self.actor = actor_model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.is_main = self.rank == 0
        self.dp_group = None  # the data-parallel group (None: the world)
        self.megatron = None
        if cfg.actor.strategy == "megatron":  # a Megatron copy trains; the HF actor rolls out
            from verl_fast.trainer.megatron_actor import MegatronActor

            self.megatron = MegatronActor(actor_model, cfg)
            self.rank, self.world, self.dp_group = self.megatron.dp_rank, self.megatron.dp_size, self.megatron.dp_group
        elif self.world > 1 and not is_sharded(actor_model):
            raise ValueError("with several processes the actor must be FSDP-wrapped (fully_shard or "
                             "FullyShardedDataParallel) so that gradients are reduced across ranks")
        self.device = self._place(actor_model)
        self.autocast_dtype = AUTOCAST.get(cfg.actor.autocast)
        if cfg.actor.gradient_checkpointing:
            hf_module(actor_model).gradient_checkpointing_enable()
        self.uses_kl = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward or (
            self.algorithm == "dpo" and not cfg.reward_fn.reference_free)
        self.ref = self._reference(ref_model) if self.uses_kl else None
        self.critic = None
        if self.algorithm == "ppo":
            if critic_model is None:
                raise ValueError("algorithm.type=ppo needs a critic: pass critic_model (or critic.model_name)")
            self.critic = critic_model if isinstance(critic_model, ValueModel) else ValueModel(critic_model)
            self.critic.to(self.device)
        self.reward = build_reward(cfg.reward_fn, reward_fn)
        self.estimator = get_estimator(cfg.advantage_estimator) if cfg.advantage_estimator else None
        self.optimizer = self.megatron.optimizer if self.megatron else torch.optim.AdamW(
            actor_model.parameters(), lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay)
        self.critic_optimizer = (torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr,
                                                   weight_decay=cfg.critic.weight_decay) if self.critic else None)
        self.processor = RLDataProcessor(tokenizer, cfg.trainer.max_prompt_length, cfg.rollout.max_new_tokens,
                                         system_prompt=cfg.trainer.system_prompt)
        self.engine = rollout_engine
        self._engine_synced = rollout_engine is None and rollout_operator is None  # built from the actor below
        if rollout_operator is not None:
            self.rollout, self.engine = rollout_operator, rollout_operator.engine
        elif self.algorithm != "dpo":
            self.engine = rollout_engine or self._build_engine(model_path)
            r = cfg.rollout
            waves = r.length_buckets == "on" or (r.length_buckets == "auto" and isinstance(self.engine, HFGenerateEngine))
            budget = r.max_batch_tokens or r.max_num_seqs * (cfg.trainer.max_prompt_length + r.max_new_tokens)
            self.rollout = RolloutOperator(self.engine, self._sampling_defaults(generation_config),
                                           max_num_seqs=r.max_num_seqs, max_batch_tokens=budget if waves else None)
        self.step = 0
        self.history: List[Dict[str, Any]] = []

    # ------------------------------------------------------------------ setup helpers

    def _place(self, model: torch.nn.Module) -> torch.device:
        want = self.cfg.trainer.device
        current = next(model.parameters()).device
        if want == "auto" or is_sharded(model):
            return current
        target = torch.device(want)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is visible")
        if current.type != target.type:
            model.to(target)
        return next(model.parameters()).device

    def _reference(self, ref_model: Optional[torch.nn.Module]) -> torch.nn.Module:
        if ref_model is None:
            if is_sharded(self.actor):
                raise ValueError("KL against a reference needs ref_model when the actor is FSDP-wrapped")
            ref_model = copy.deepcopy(hf_module(self.actor))
        if not is_sharded(ref_model):
            ref_model.to(self.device)
        ref_model.eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
        return ref_model

    def _sampling_defaults(self, generation_config: Optional[Dict[str, Any]]) -> SamplingSpec:
        r = self.cfg.rollout
        base = SamplingSpec(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_tokens=r.max_new_tokens)
        return SamplingSpec.from_kwargs(base, dict(generation_config or {}))

    def _build_engine(self, model_path: Optional[str]) -> RolloutEngine:
        kind = self.cfg.rollout.type
        if kind == "auto":  # vLLM when installed and set up for this process (the CLI does that)
            from verl_fast.rollout import vllm_available
            from verl_fast.rollout.vllm_compat import in_process_mode

            kind = "vllm" if vllm_available() and in_process_mode() and not is_sharded(self.actor) else "hf"
        if kind == "hf":
            return HFGenerateEngine(self.actor, self.tokenizer, autocast_dtype=self.autocast_dtype)
        from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

        r = self.cfg.rollout
        peft = hasattr(self.actor, "peft_config")
        self._engine_synced = self._engine_synced and not peft  # the adapter goes in at the first step
        if peft and model_path is None:
            raise ValueError("a PEFT actor with rollout.type=vllm needs model_path (the base model's folder); "
                             "the adapter is pushed to the engine after each update")
        if model_path is None:  # vLLM loads a folder: write the actor's current weights to one
            self._engine_dir = tempfile.TemporaryDirectory(prefix="verl_fast_actor_")
            model_path = self._engine_dir.name
            hf_module(self.actor).save_pretrained(model_path, state_dict=checkpoint.full_state_dict(
                self.actor), safe_serialization=True)
            self.tokenizer.save_pretrained(model_path)
        dtype = r.dtype if r.dtype != "auto" else (self.cfg.actor.autocast if self.autocast_dtype else
                                                    self.cfg.actor.dtype)
        max_len = r.max_model_len or (self.cfg.trainer.max_prompt_length + r.max_new_tokens)
        return VLLMInferenceEngine(
            str(model_path), tensor_parallel_size=r.tensor_parallel_size, dtype=dtype,
            gpu_memory_utilization=r.gpu_memory_utilization, enable_prefix_caching=r.enable_prefix_caching,
            max_num_seqs=r.max_num_seqs, max_model_len=max_len, enable_chunked_prefill=r.enable_chunked_prefill,
            seed=r.seed, enable_sleep_mode=None if r.enable_sleep_mode else False, enable_lora=peft)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def update_reward_fn(self, reward_fn: Any) -> None:
        """Swaps the reward without a restart; the next step scores with it."""
        self.reward = as_reward_function(reward_fn)

    # ------------------------------------------------------------------ the loop

    def fit(self, dataset: Any, **dataset_kwargs: Any) -> List[Dict[str, Any]]:
        """Trains on ``dataset`` (rows in verl format, a path, a datasets.Dataset, or
        ``reasoning_gym:<task>``; preference pairs for DPO). Returns the per-step metrics."""
        cfg = self.cfg.trainer
        rows = self.processor.load(dataset, **dataset_kwargs) if not _is_prepared(dataset) else dataset
        if self.algorithm == "dpo":
            items: Sequence[Any] = rows if _is_prepared(rows) else self.processor.build_dpo_dataset(rows)
        else:
            items = rows if _is_prepared(rows) else self.processor.encode_all(rows)
        if not items:
            raise ValueError("the dataset is empty")
        if cfg.train_batch_size % self.world:
            raise ValueError(f"trainer.train_batch_size={cfg.train_batch_size} must be a multiple of the "
                             f"number of processes ({self.world}) so that every rank gets the same share")
        per_epoch = max(1, len(items) // cfg.train_batch_size)
        total = cfg.total_steps or cfg.num_epochs * per_epoch
        is_main = self.is_main
        logger = MetricsLogger(cfg.output_dir, total, cfg.progress_bar, cfg.metrics_port, enabled=is_main)
        self._resume(logger)
        if not self._engine_synced or self.step > 0:  # a given engine, or weights restored from a checkpoint
            self._sync_engine()
        try:
            while self.step < total:
                batch = self._batch(items, self.step, per_epoch)
                start = time.perf_counter()
                metrics = self._dpo_step(batch) if self.algorithm == "dpo" else self._rl_step(batch)
                self.step += 1
                metrics.update(step=self.step, **{"time/step": time.perf_counter() - start})
                logger.log(metrics)
                self.history = logger.history
                if cfg.save_freq and self.step % cfg.save_freq == 0 and self.step < total:
                    self.save()
            self.save()
            if cfg.plot:
                logger.plot()
        finally:
            logger.close()
        return self.history

    def _batch(self, items: Sequence[Any], step: int, per_epoch: int) -> List[Any]:
        """This rank's share of the step's batch: a fixed permutation per epoch (seeded), so a resumed
        run sees the same data in the same order."""
        cfg = self.cfg.trainer
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(items), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        take = order[i * cfg.train_batch_size : (i + 1) * cfg.train_batch_size].tolist()
        if len(take) < cfg.train_batch_size:  # fewer items than one batch: wrap around
            take = [order[j % len(items)].item() for j in range(i * cfg.train_batch_size,
                                                                  (i + 1) * cfg.train_batch_size)]
        return [items[j] for j in take[self.rank :: self.world]]

    def _rl_step(self, batch: List[PromptRow]) -> Dict[str, Any]:
        metrics: Dict[str, Any] = {}
        exp = self.make_experience(batch, metrics)
        if self.world > 1 and self.cfg.actor.balance_dp:
            exp = self._balance_across_ranks(exp, metrics)
        metrics.update(self.update_actor(exp))
        if self.critic is not None:
            metrics.update(self.update_critic(exp))
        start = time.perf_counter()
        if self._sync_engine():
            metrics["time/weight_sync"] = time.perf_counter() - start
        return _reduce(metrics, self.world, self.dp_group)

    def _sync_engine(self) -> bool:
        """Pushes the actor's weights into an engine that keeps its own copy (in place)."""
        self._engine_synced = True
        if self.engine is None or not self.engine.owns_weights:
            return False
        if hasattr(self.actor, "peft_config") and hasattr(self.engine, "update_lora"):
            self.engine.update_lora(self.actor)  # PEFT actor: only the adapter moves
        else:
            self.engine.update_weights(checkpoint.full_state_dict(self.actor).items())
        return True

    def _balance_across_ranks(self, exp: Experience, metrics: Dict[str, Any]) -> Experience:
        """Redistributes the step's sequences over the data-parallel ranks so that each trains on a
        nearly equal token count (Karmarkar-Karp on the sequences' lengths, equal counts). Advantages
        were computed before, where each rank held whole prompt groups."""
        local = exp.to(torch.device("cpu"))
        parts: List[Experience] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(parts, local, group=self.dp_group)
        everything = concat(parts)
        lengths = everything.attention_mask.sum(-1)
        plan = balance_partitions(lengths, self.world, equal_size=True)  # same plan on every rank
        before = torch.stack([p.attention_mask.sum() for p in parts]).float()
        metrics["dp/imbalance_before"] = float(before.max() / before.mean())
        metrics["dp/imbalance_after"] = plan.report.imbalance
        return everything.select(torch.as_tensor(plan[self.rank], dtype=torch.long)).to(self.device)

    # ------------------------------------------------------------------ experience

    def make_experience(self, batch: List[PromptRow], metrics: Dict[str, Any]) -> Experience:
        """Rollout, rewards, old / reference log-probs and values, advantages."""
        cfg = self.cfg
        start = time.perf_counter()
        self.engine.wake_up()
        seed = cfg.rollout.seed * 1_000_003 + self.step * 997 + self.rank * 7919
        with self._autocast():
            gen = self.rollout.rollout(batch, seed=seed)
        self.engine.sleep()
        metrics["time/generation"] = time.perf_counter() - start
        metrics.update({f"rollout/{k}": v for k, v in self.engine.metrics().items()})
        exp = build_experience(batch, gen, self.tokenizer.pad_token_id).to(self.device)
        samples = [RewardInput(prompt=batch[i].prompt_text, response=text, ground_truth=batch[i].ground_truth,
                               data_source=batch[i].data_source, extra_info=batch[i].extra_info)
                   for i, text in zip(gen.prompt_index.tolist(), gen.texts)]
        exp.scores = torch.tensor(self.reward(samples), dtype=torch.float32, device=self.device)
        exp.token_level_rewards = last_token_rewards(exp.scores, exp.response_mask)
        a = cfg.actor
        needs_old = a.ppo_epochs > 1 or (a.ppo_mini_batch_size or exp.num_sequences) < exp.num_sequences \
            or cfg.algorithm.use_kl_in_reward
        if needs_old:
            exp.old_logprobs = self._logprobs(self.actor, exp)
        if self.ref is not None and self.algorithm != "dpo":
            exp.ref_logprobs = self._logprobs(self.ref, exp)
        if cfg.algorithm.use_kl_in_reward:
            kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, cfg.algorithm.kl_penalty) * exp.response_mask
            exp.token_level_rewards = exp.token_level_rewards - cfg.algorithm.kl_coef * kl
            metrics["reward/kl_penalty"] = float((kl.sum() / exp.response_mask.sum().clamp(min=1)).item())
        if self.critic is not None:
            exp.values = self._values(exp)
        exp.advantages, exp.returns = self.estimator(AdvantageInput(
            token_level_rewards=exp.token_level_rewards, response_mask=exp.response_mask,
            index=exp.prompt_index, values=exp.values, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
            epsilon=cfg.algorithm.epsilon))
        lengths = exp.response_mask.sum(-1).float()
        metrics.update({
            "reward/mean": exp.scores.mean().item(),
            "reward/std": exp.scores.std().item() if exp.num_sequences > 1 else 0.0,
            "response/length": lengths.mean().item(),
            "response/truncated": sum(r == "length" for r in gen.finish_reasons) / max(1, len(gen.finish_reasons)),
            "advantages/abs_mean": exp.advantages.abs().mean().item(),
        })
        return exp

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, exp: Experience) -> torch.Tensor:
        if self.megatron is not None and model is self.actor:
            return self.megatron.logprobs(exp, self._micro(exp, torch.arange(exp.num_sequences), for_update=False))
        out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=self.device)
        for idx in self._micro(exp, torch.arange(exp.num_sequences, device=self.device), for_update=False):
            sub = exp.select(idx)
            with self._autocast():
                logp, _ = response_logprobs(model, sub.input_ids, sub.attention_mask, sub.response_length,
                                            fused=self._fused())
            out[idx, : sub.response_length] = logp.float()
        return out

    @torch.no_grad()
    def _values(self, exp: Experience) -> torch.Tensor:
        out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=self.device)
        for idx in self._micro(exp, torch.arange(exp.num_sequences, device=self.device), for_update=False,
                               size=self.cfg.critic.micro_batch_size):
            sub = exp.select(idx)
            with self._autocast():
                out[idx, : sub.response_length] = response_values(self.critic, sub.input_ids, sub.attention_mask,
                                                                   sub.response_length).float()
        return out * exp.response_mask

    def _fused(self) -> Optional[bool]:
        return {"auto": None, "on": True, "off": False}[self.cfg.actor.fused_logprobs]

    def _micro(self, exp: Experience, rows: torch.Tensor, for_update: bool = True,
               size: Optional[int] = None) -> List[torch.Tensor]:
        """Micro-batches of ``rows``: by count, or under a token budget (``use_dynamic_bsz``)."""
        a = self.cfg.actor
        if not a.use_dynamic_bsz:
            size = size or (a.micro_batch_size if for_update else max(a.micro_batch_size, 16))
            return micro_batches(rows, size)
        if rows.numel() == 0:
            return []
        tokens = exp.attention_mask[rows].sum(-1).tolist()
        # under FSDP every rank must run the same number of forwards: agree on one count
        group = dist.group.WORLD if self.world > 1 else None
        plan = make_micro_batches(tokens, a.max_token_len_per_gpu, layout="padded", dp_group=group)
        return [rows[idx.to(rows.device)] for idx in plan.indices]

    # ------------------------------------------------------------------ updates

    def update_actor(self, exp: Experience) -> Dict[str, float]:
        a = self.cfg.actor
        N = exp.num_sequences
        rows = torch.arange(N, device=self.device)
        # Samples whose advantage is 0 everywhere add exactly nothing to the policy gradient: leave
        # them out of the backward (normalisers still count them, so the loss is unchanged).
        # (single process only: FSDP ranks must run the same number of forward/backward passes)
        skip = a.skip_zero_advantage and not a.use_kl_loss and a.entropy_coeff == 0 and self.world == 1 \
            and self.megatron is None
        active = exp.advantages.abs().sum(-1) > 0 if skip else torch.ones(N, dtype=torch.bool, device=self.device)
        mini = a.ppo_mini_batch_size or N
        totals: Dict[str, float] = {}
        weight = 0.0
        self.actor.train()
        for epoch in range(a.ppo_epochs):
            order = rows
            if a.ppo_epochs > 1 or mini < N:
                g = torch.Generator().manual_seed(self.cfg.trainer.seed * 7 + self.step * 131 + epoch)
                order = rows[torch.randperm(N, generator=g).to(self.device)]
            for start in range(0, N, mini):
                mb = order[start : start + mini]
                counts = self._counts(exp.response_mask[mb])
                micro = self._micro(exp, mb[active[mb]])
                stats, norm = self._train_mini_batch(exp, micro, counts)
                for idx, st in zip(micro, stats):
                    w = float(exp.response_mask[idx].sum())
                    for k, v in st.items():
                        totals[k] = totals.get(k, 0.0) + v * w
                    weight += w
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm
        steps = a.ppo_epochs * math.ceil(N / mini)
        out = {f"actor/{k}": v / max(weight, 1e-9) for k, v in totals.items() if k != "grad_norm"}
        out.setdefault("actor/pg_loss", 0.0)  # every advantage 0: the policy loss is exactly 0
        out["actor/grad_norm"] = totals["grad_norm"] / steps
        out["actor/active_fraction"] = float(active.float().mean())
        if self.megatron is not None:  # the rollout model gets the new weights
            self.megatron.export_to(hf_module(self.actor))
        return out

    def _train_mini_batch(self, exp: Experience, micro: List[torch.Tensor], counts: Dict[str, float]):
        """One optimiser step over the micro-batches: each one's stats, and the gradient norm."""
        if self.megatron is not None:
            return self.megatron.train_mini_batch(
                exp, micro, lambda logp, entropy, sub: actor_loss(self.cfg.actor, logp, entropy, sub, counts))
        stats = [self._actor_micro_step(exp.select(idx), counts) for idx in micro]
        return stats, self._optimizer_step(self.actor, self.optimizer, self.cfg.actor.max_grad_norm)

    def _counts(self, response_mask: torch.Tensor) -> Dict[str, float]:
        """The normalisers of a (mini-)batch's loss. With several ranks, the global counts divided by
        the number of ranks: FSDP averages gradients over ranks, so each rank's sum over its tokens
        divided by this gives the gradient of the global token (or sequence) mean exactly."""
        counts = torch.tensor([float(response_mask.sum()), float(response_mask.shape[0])], dtype=torch.float64)
        if self.world > 1:
            counts = counts.to(self.device)
            dist.all_reduce(counts, group=self.dp_group)
            counts = counts.cpu() / self.world
        return {"num_tokens": float(counts[0]), "num_seqs": float(counts[1])}

    def _actor_micro_step(self, sub: Experience, counts: Dict[str, float]) -> Dict[str, float]:
        with self._autocast():
            logp, entropy = response_logprobs(self.actor, sub.input_ids, sub.attention_mask, sub.response_length,
                                              temperature=self.cfg.rollout.temperature or 1.0, with_entropy=True,
                                              fused=self._fused())
        loss, stats = actor_loss(self.cfg.actor, logp, entropy, sub, counts)
        loss.backward()
        return stats

    def _optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # parameters no micro-batch touched still take their (zero-gradient) step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if hasattr(model, "clip_grad_norm_"):  # FSDP1 knows its shards
            norm = model.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def update_critic(self, exp: Experience) -> Dict[str, float]:
        c = self.cfg.critic
        N = exp.num_sequences
        rows = torch.arange(N, device=self.device)
        counts = self._counts(exp.response_mask)
        totals: Dict[str, float] = {"vf_loss": 0.0, "vf_clipfrac": 0.0}
        self.critic.train()
        for _ in range(self.cfg.actor.ppo_epochs):
            for idx in self._micro(exp, rows, size=c.micro_batch_size):
                sub = exp.select(idx)
                with self._autocast():
                    values = response_values(self.critic, sub.input_ids, sub.attention_mask, sub.response_length)
                loss, stats = value_loss(values.float(), sub.values, sub.returns, sub.response_mask,
                                         c.cliprange_value, c.loss_agg_mode, **counts)
                loss.backward()
                totals["vf_loss"] += loss.item()
                totals["vf_clipfrac"] += float(stats["vf_clipfrac"]) * idx.numel() / N
            self._optimizer_step(self.critic, self.critic_optimizer, c.max_grad_norm)
        epochs = self.cfg.actor.ppo_epochs
        return {"critic/vf_loss": totals["vf_loss"] / epochs, "critic/vf_clipfrac": totals["vf_clipfrac"] / epochs,
                "critic/values_mean": float((exp.values * exp.response_mask).sum() / exp.response_mask.sum())}

    def _dpo_step(self, batch: List[Any]) -> Dict[str, Any]:
        self.actor.train()
        metrics = dpo.step(self, batch)
        metrics["actor/grad_norm"] = self._optimizer_step(self.actor, self.optimizer, self.cfg.actor.max_grad_norm)
        return _reduce(metrics, self.world, self.dp_group)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        state = {"history": self.history, "config": self.cfg.to_dict(), "torch_rng": torch.get_rng_state().tolist()}
        if self.megatron is not None:
            megatron_checkpoint.save(self.cfg.trainer.output_dir, self.step, self.megatron, self.actor, self.tokenizer,
                                     state, is_main=self.is_main)
        else:
            checkpoint.save(self.cfg.trainer.output_dir, self.step, self.actor, self.tokenizer, self.optimizer, state,
                            self.critic, self.critic_optimizer, is_main=self.is_main)
        if self.world > 1:
            dist.barrier()

    def _resume(self, logger: MetricsLogger) -> None:
        if not self.cfg.trainer.resume:
            return
        if self.is_main:
            checkpoint.clean_partial(self.cfg.trainer.output_dir)
        path = checkpoint.latest(self.cfg.trainer.output_dir)
        if path is None:
            return
        state = (megatron_checkpoint.load(path, self.megatron, self.actor) if self.megatron is not None else
                 checkpoint.load(path, self.actor, self.optimizer, self.critic, self.critic_optimizer))
        self.step = int(state["step"])
        self.history = list(state.get("history", []))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        logger.resume(self.history)


def _is_prepared(items: Any) -> bool:
    return isinstance(items, list) and bool(items) and not isinstance(items[0], dict)


def _reduce(metrics: Dict[str, Any], world: int, group=None) -> Dict[str, Any]:
    """Means of the numeric metrics over the ranks (what rank 0 logs)."""
    if world == 1:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, group=group)
    return {**metrics, **{k: v / world for k, v in zip(keys, values.tolist())}}
