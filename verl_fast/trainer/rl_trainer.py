"""RLTrainer: rollout -> reward -> advantages -> updates -> checkpoint and metrics, step by step.

Algorithms, chosen once from ``config.algorithm.type``:
- grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline: the outcome reward sits on each
  response's last token; advantages come from the named estimator (group baselines over the
  ``rollout.n`` samples of a prompt); PPO-clip policy loss; no critic.
- remax: one greedy response per prompt is scored too; its reward is the baseline of the prompt's
  samples (algos/remax.py); PPO-clip policy loss; no critic.
- ppo: a critic (value head) estimates values; GAE advantages; clipped policy and value losses.
- dpo: offline chosen/rejected pairs, no rollout (algos/dpo.py).
- online_dpo: ``rollout.n >= 2`` samples per prompt, scored by the reward; each prompt's best and
  worst sample train DPO in the same step (algos/online_dpo.py).
KL against the reference model goes either into the reward (``algorithm.use_kl_in_reward``,
``kl_penalty``, ``kl_coef``) or into the loss (``actor.use_kl_loss``, ``kl_loss_type``,
``kl_loss_coef``). Losses aggregate with ``actor.loss_agg_mode`` over the whole mini-batch
(trainer/batching.py: micro-batches, DP balancing, the normalisers).

Run it with ``verl-fast train --config c.yaml`` or ``RLTrainer(actor_model=..., tokenizer=...,
reward_fn=..., config=...).fit(dataset)``.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from verl_fast import checkpoint, distributed
from verl_fast import config as config_mod
from verl_fast.algos import dpo, online_dpo, remax
from verl_fast.algos.actor_loss import actor_loss
from verl_fast.algos.advantage import BATCH_WHITENED, AdvantageInput, get_estimator
from verl_fast.algos.losses import kl_penalty, value_loss
from verl_fast.config import Config
from verl_fast.data import PreferencePair, PromptRow, RLDataProcessor
from verl_fast.experience import Experience, build_experience, last_token_rewards
from verl_fast.metrics import MetricsLogger
from verl_fast.models.shared_prefix import experience_logprobs
from verl_fast.models.value import ValueModel, response_values
from verl_fast.models.wrapping import hf_module, is_sharded
from verl_fast.rewards import RewardInput, build_reward
from verl_fast.rollout.base import RolloutEngine, SamplingSpec
from verl_fast.rollout.factory import build_engine
from verl_fast.rollout.hf_engine import HFGenerateEngine
from verl_fast.rollout.operator import RolloutOperator
from verl_fast.strategies import sharding
from verl_fast.strategies.megatron import run_checkpoint as megatron_checkpoint
from verl_fast.strategies.megatron.shared_rollout import megatron_rollout
from verl_fast.strategies.sharding import Sharding
from verl_fast.trainer import perf, run_dir
from verl_fast.trainer.batching import balance_across_ranks, loss_normalisers, micro_batches

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
        re-wrapped); plain models are sharded as ``actor.strategy`` / ``critic.strategy`` say
        (FSDP2 under torchrun). ``ref_model`` / ``critic_model`` may be of other families; without a
        ``ref_model`` a frozen copy of the actor, laid out as the actor is, is the reference when KL
        is used. ``reward_fn``: a callable with verl's ``compute_score`` signature or a
        RewardFunction (else the config's).
        ``generation_config``: default sampling (SamplingSpec fields or HF names). ``model_path``:
        the actor's folder, which a vLLM engine loads (else the actor is saved to a temporary one)."""
        self.cfg = config_mod.checked(config) if isinstance(config, Config) else config_mod.from_dict(config or {})
        cfg = self.cfg
        self.algorithm = cfg.algorithm.type
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self.is_main = self.rank == 0
        self.dp_group = dist.group.WORLD if self.world > 1 else None  # the ranks that split the data
        self.megatron = None
        if cfg.actor.strategy == "megatron":  # a Megatron copy trains; the plain HF actor rolls out
            actor_sharding = Sharding("none")
        else:
            actor_sharding = Sharding.from_config(cfg.actor, "actor", self.world)
        self.device = sharding.compute_device(actor_sharding, cfg.trainer.device, actor_model)
        self.actor = sharding.shard(actor_model, actor_sharding, self.device)
        if cfg.actor.strategy == "megatron":
            from verl_fast.strategies.megatron.actor import MegatronActor

            self.megatron = MegatronActor(self.actor, cfg)
            self.rank, self.world = self.megatron.dp_rank, self.megatron.dp_size  # data splits over DP only
            self.dp_group = self.megatron.dp_group if self.world > 1 else None
        if self.algorithm in ("dpo", "online_dpo"):
            if self.algorithm == "online_dpo" and self.world > 1:
                raise ValueError("algorithm.type=online_dpo is not supported with several processes (ranks would "
                                 "keep different numbers of pairs); use one process, or dpo with a pairs dataset")
            dpo.configure(cfg, self.world)
        self._step = {"dpo": self._dpo_step, "online_dpo": self._online_dpo_step}.get(self.algorithm, self._rl_step)
        self.autocast_dtype = AUTOCAST.get(cfg.actor.autocast)
        self.ref = self._reference(ref_model, actor_sharding) if cfg.needs_reference else None
        self.critic = None
        if self.algorithm == "ppo":
            if critic_model is None:
                raise ValueError("algorithm.type=ppo needs a critic: pass critic_model (or critic.model_name)")
            critic = critic_model if isinstance(critic_model, ValueModel) else ValueModel(critic_model)
            if cfg.critic.strategy == "megatron":  # trained in Megatron's layout; the HF copy is not kept
                from verl_fast.strategies.megatron.critic import MegatronCritic

                self.critic = MegatronCritic(critic.to(self.device), cfg)
            else:
                self.critic = sharding.shard(critic, Sharding.from_config(cfg.critic, "critic", self.world),
                                             self.device)
        self.reward = build_reward(cfg.reward_fn, reward_fn)
        self.estimator = get_estimator(cfg.advantage_estimator) if cfg.advantage_estimator else None
        self.optimizer = self.megatron.optimizer if self.megatron else _adamw(self.actor, cfg.actor.lr,
                                                                                cfg.actor.weight_decay)
        self.critic_optimizer = None if self.critic is None else self.critic.optimizer if self._megatron_critic else \
            _adamw(self.critic, cfg.critic.lr, cfg.critic.weight_decay)
        self.processor = RLDataProcessor(tokenizer, cfg.trainer.max_prompt_length, cfg.rollout.max_new_tokens,
                                         system_prompt=cfg.trainer.system_prompt,
                                         overlong_prompts=cfg.trainer.overlong_prompts)
        self.engine = rollout_engine
        self._engine_fresh = rollout_engine is None and rollout_operator is None  # built below from the actor
        if rollout_operator is not None:
            self.rollout, self.engine = rollout_operator, rollout_operator.engine
        elif self.algorithm != "dpo":
            self.engine = rollout_engine or build_engine(cfg, self.actor, tokenizer, model_path, self.autocast_dtype,
                                                         source=self.megatron)
            if self.megatron is not None and self.engine.owns_weights:
                self.engine = megatron_rollout(self.engine, self.megatron, self.actor)
            r = cfg.rollout
            waves = r.length_buckets == "on" or (r.length_buckets == "auto" and isinstance(self.engine, HFGenerateEngine))
            waves = waves and not self.engine.collective  # ranks would make different numbers of calls
            budget = r.max_batch_tokens or r.max_num_seqs * (cfg.trainer.max_prompt_length + r.max_new_tokens)
            self.rollout = RolloutOperator(self.engine, self._sampling_defaults(generation_config),
                                           max_num_seqs=r.max_num_seqs, max_batch_tokens=budget if waves else None)
        self.step = 0
        self.stopped = False  # set when a signal ended fit() early (after a checkpoint)
        self.history: List[Dict[str, Any]] = []
        self.perf = perf.StepPerf(self.actor, self.device)

    # ------------------------------------------------------------------ setup helpers

    def _reference(self, ref_model: Optional[torch.nn.Module], actor_sharding: Sharding) -> torch.nn.Module:
        """The given reference laid out as the actor is, else a frozen copy of the actor's weights."""
        if ref_model is None:
            return sharding.reference_from(self.actor, actor_sharding, self.device)
        layout = replace(actor_sharding, gradient_checkpointing=False)
        return sharding.freeze(sharding.shard(ref_model, layout, self.device))

    def _sampling_defaults(self, generation_config: Optional[Dict[str, Any]]) -> SamplingSpec:
        r = self.cfg.rollout
        # logprobs off: the trainer recomputes them with the actor, and asking vLLM for them costs a
        # top-k per sampled token (and on vLLM-CPU a torch.compile in the first step: ~2 s)
        base = SamplingSpec(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_tokens=r.max_new_tokens, logprobs=False)
        return SamplingSpec.from_kwargs(base, dict(generation_config or {}))

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def update_reward_fn(self, reward_fn: Any) -> None:
        """Swaps the reward without a restart; the next step scores with it."""
        self.reward = build_reward(self.cfg.reward_fn, reward_fn)

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
        want = PreferencePair if self.algorithm == "dpo" else PromptRow
        if not isinstance(items[0], want):
            raise ValueError(f"algorithm.type={self.algorithm} trains on {want.__name__} items, but the dataset "
                             f"holds {type(items[0]).__name__}")
        if cfg.train_batch_size % self.world:
            raise ValueError(f"trainer.train_batch_size={cfg.train_batch_size} must be a multiple of the "
                             f"number of processes ({self.world}) so that every rank gets the same share")
        per_epoch = max(1, len(items) // cfg.train_batch_size)
        total = cfg.total_steps or cfg.num_epochs * per_epoch
        run_dir.claim(cfg)  # one writer per output_dir; an older run there is resumed, refused or cleared
        logger = None
        try:
            logger = MetricsLogger(cfg.output_dir, total, cfg.progress_bar, cfg.metrics_port, enabled=self.is_main,
                                   host=cfg.metrics_host, loggers=cfg.loggers, run_config=self.cfg.to_dict())
            with run_dir.StopSignals() as stop:  # SIGTERM / Ctrl-C: finish the step, checkpoint, return
                self._resume(logger)
                self._loop(items, per_epoch, total, logger, stop)
        finally:
            if logger is not None:
                logger.close()
            run_dir.release(cfg)
        return self.history

    def _loop(self, items: Sequence[Any], per_epoch: int, total: int, logger: MetricsLogger,
              stop: "run_dir.StopSignals") -> None:
        cfg = self.cfg.trainer
        first = self.step
        if self.engine is not None and (not self._engine_fresh or self.step > 0):  # given, or resumed
            self._sync_engine({})
        while self.step < total:
            metrics = self.train_step(self._batch(items, self.step, per_epoch))
            stopping = stop.requested()
            if cfg.save_freq and self.step % cfg.save_freq == 0 and self.step < total and not stopping:
                self.history = logger.history + [metrics]  # the checkpoint holds this step's metrics
                checkpoint_start = time.perf_counter()
                self.save(export_hf=cfg.hf_export == "every")
                metrics["time/checkpoint"] = time.perf_counter() - checkpoint_start
            logger.log(metrics)
            self.history = logger.history
            if stopping:
                self.stopped = True
                break
        if self.step > first or checkpoint.latest_valid(cfg.output_dir, warn=lambda m: None) is None:
            self.save(export_hf=cfg.hf_export == "every" or (cfg.hf_export == "final" and self.step >= total))
        if self.stopped and self.is_main:
            print(f"stopped after step {self.step} of {total}; the checkpoint is in "
                  f"{checkpoint.checkpoint_root(cfg.output_dir)} (run again to resume)", flush=True)
        elif cfg.plot:
            logger.plot()

    def train_step(self, batch: List[Any]) -> Dict[str, Any]:
        """One optimiser step on this rank's share of a batch (encoded prompts, or preference pairs
        for DPO): its metrics, with the time of each phase."""
        start = time.perf_counter()
        self.perf.begin()
        metrics = self._step(batch)
        self.step += 1
        metrics.update(step=self.step, **{"time/step": time.perf_counter() - start})
        metrics.update(perf.throughput(metrics))
        return metrics

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
            exp, balance = balance_across_ranks(exp, self.dp_group)
            metrics.update(balance)
        with self.perf.phase("update_actor"):
            metrics.update(self.update_actor(exp))
        if self.critic is not None:
            with self.perf.phase("update_critic"):
                metrics.update(self.update_critic(exp))
        if self.engine is not None and self.engine.owns_weights:
            with self.perf.phase("weight_sync"):
                self._sync_engine(metrics)
        metrics.update(self.perf.figures())
        return _reduce(metrics, self.world, self.dp_group)

    def _sync_engine(self, metrics: Dict[str, Any]) -> None:
        """The engine generates with the actor's current weights from now on (collective); the bytes
        this rank moved go into ``metrics`` (the step's phase timer times the call)."""
        moved = self.engine.sync_from(self._rollout_source)
        if self.engine.owns_weights:
            metrics["sync/bytes_per_rank"] = float(moved.get("bytes", 0))

    # ------------------------------------------------------------------ experience

    def make_experience(self, batch: List[PromptRow], metrics: Dict[str, Any]) -> Experience:
        """Rollout, rewards, old / reference log-probs and values, advantages."""
        cfg = self.cfg
        timed = self.perf.phase
        with timed("generation"):
            self.engine.wake_up()
            seed = cfg.rollout.seed * 1_000_003 + self.step * 997 + self.rank * 7919
            with self._autocast():
                gen = self.rollout.rollout(batch, seed=seed)
                greedy = remax.greedy_rollout(self.rollout, batch) if self.algorithm == "remax" else None
            self.engine.sleep()
        metrics.update({f"rollout/{k}": v for k, v in self.engine.metrics().items()})
        exp = build_experience(batch, gen, self.tokenizer.pad_token_id).to(self.device)
        self.perf.count_step_tokens(exp.attention_mask)
        with timed("reward"):
            exp.scores = self._score(batch, gen)
            baselines = None
            if greedy is not None:  # ReMax: each sample's baseline is its prompt's greedy reward
                greedy_scores = self._score(batch, greedy)  # [P]: one per prompt, in prompt order
                baselines = greedy_scores[exp.prompt_index]
                metrics["reward/greedy_baseline"] = greedy_scores.mean().item()
            exp.token_level_rewards = last_token_rewards(exp.scores, exp.response_mask)
        metrics["reward/errors"] = float(getattr(self.reward, "last_errors", 0))  # zeroed by reward_fn.on_error
        metrics["data/skipped_overlong"] = float(self.processor.skipped_overlong)
        a = cfg.actor
        needs_old = a.ppo_epochs > 1 or (a.ppo_mini_batch_size or exp.num_sequences) < exp.num_sequences \
            or cfg.algorithm.use_kl_in_reward
        if needs_old:
            with timed("old_logprob"):
                exp.old_logprobs = self._logprobs(self.actor, exp)
        if self.ref is not None and self.algorithm != "dpo":
            with timed("ref"):
                exp.ref_logprobs = self._logprobs(self.ref, exp)
        if self.critic is not None:
            with timed("values"):
                exp.values = self._values(exp)
        with timed("advantages"):
            if cfg.algorithm.use_kl_in_reward:
                kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, cfg.algorithm.kl_penalty) * exp.response_mask
                exp.token_level_rewards = exp.token_level_rewards - cfg.algorithm.kl_coef * kl
                metrics["reward/kl_penalty"] = float((kl.sum() / exp.response_mask.sum().clamp(min=1)).item())
            whiten_over_ranks = self.world > 1 and cfg.advantage_estimator in BATCH_WHITENED
            exp.advantages, exp.returns = self.estimator(AdvantageInput(
                token_level_rewards=exp.token_level_rewards, response_mask=exp.response_mask,
                index=exp.prompt_index, values=exp.values, reward_baselines=baselines, gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam, epsilon=cfg.algorithm.epsilon, whiten=not whiten_over_ranks))
            if whiten_over_ranks:
                exp.advantages = _whiten_over_ranks(exp.advantages, exp.response_mask, self.dp_group)
        lengths = exp.response_mask.sum(-1).float()
        metrics.update({
            "reward/mean": exp.scores.mean().item(),
            "reward/std": exp.scores.std().item() if exp.num_sequences > 1 else 0.0,
            "response/length": lengths.mean().item(),
            "response/truncated": sum(r == "length" for r in gen.finish_reasons) / max(1, len(gen.finish_reasons)),
            "advantages/abs_mean": exp.advantages.abs().mean().item(),
        })
        return exp

    def _score(self, batch: List[PromptRow], gen: Any) -> torch.Tensor:
        """The reward of each generated sample, ``[N]`` float32 on the trainer's device."""
        samples = [RewardInput(prompt=batch[i].prompt_text, response=text, ground_truth=batch[i].ground_truth,
                               data_source=batch[i].data_source, extra_info=batch[i].extra_info)
                   for i, text in zip(gen.prompt_index.tolist(), gen.texts)]
        return torch.tensor(self.reward(samples), dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, exp: Experience) -> torch.Tensor:
        if self.megatron is not None and model is self.actor:
            return self.megatron.logprobs(exp, self._micro(exp, torch.arange(exp.num_sequences), for_update=False))
        out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=self.device)
        micro = self._micro(exp, torch.arange(exp.num_sequences, device=self.device), for_update=False)
        with sharding.gathered_for_passes(model, len(micro)):
            for idx in micro:
                sub = exp.select(idx)
                with self._autocast():
                    logp, _ = experience_logprobs(model, sub.input_ids, sub.attention_mask, sub.response_length,
                                                  sub.prompt_index, fused=self._fused(),
                                                  share=self.cfg.actor.share_prompt_forward)
                out[idx, : sub.response_length] = logp.float()
        return out

    @property
    def _rollout_source(self) -> Any:
        """What the engine's weights come from: the Megatron shards when the engine holds its own
        weights (vLLM), else the actor."""
        owns = self.engine is not None and self.engine.owns_weights
        return self.megatron if self.megatron is not None and owns else self.actor

    @property
    def _megatron_critic(self) -> bool:
        return self.critic is not None and self.cfg.critic.strategy == "megatron"

    @torch.no_grad()
    def _values(self, exp: Experience) -> torch.Tensor:
        micro = self._micro(exp, torch.arange(exp.num_sequences, device=self.device), for_update=False,
                            size=self.cfg.critic.micro_batch_size)
        if self._megatron_critic:
            return self.critic.values(exp, micro) * exp.response_mask
        out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=self.device)
        with sharding.gathered_for_passes(self.critic, len(micro)):
            for idx in micro:
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
        if a.use_dynamic_bsz:
            return micro_batches(rows, exp.attention_mask.sum(-1), max_tokens=a.max_token_len_per_gpu,
                                 group=self.dp_group)
        return micro_batches(rows, size=size or (a.micro_batch_size if for_update else max(a.micro_batch_size, 16)))

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
        weight, norms = 0.0, 0.0
        self.actor.train()
        for epoch in range(a.ppo_epochs):
            order = rows
            if a.ppo_epochs > 1 or mini < N:
                g = torch.Generator().manual_seed(self.cfg.trainer.seed * 7 + self.step * 131 + epoch)
                order = rows[torch.randperm(N, generator=g).to(self.device)]
            for start in range(0, N, mini):
                mb = order[start : start + mini]
                counts = loss_normalisers(exp.response_mask[mb], self.dp_group)
                micro = self._micro(exp, mb[active[mb]])
                for idx in micro:
                    self.perf.count_update(exp.attention_mask[idx])
                stats, norm = self._train_mini_batch(exp, micro, counts)
                for idx, st in zip(micro, stats):
                    w = float(exp.response_mask[idx].sum())
                    for k, v in st.items():
                        totals[k] = totals.get(k, 0.0) + v * w
                    weight += w
                norms += norm
        if self.world > 1:  # weighted by every rank's tokens, as one process would weight them
            keys = sorted(totals)
            summed = distributed.all_reduce_numbers([totals[k] for k in keys] + [weight], group=self.dp_group)
            totals, weight = dict(zip(keys, summed[:-1])), summed[-1]
        steps = a.ppo_epochs * math.ceil(N / mini)
        out = {f"actor/{k}": v / max(weight, 1e-9) for k, v in totals.items()}
        out.setdefault("actor/pg_loss", 0.0)  # every advantage 0: the policy loss is exactly 0
        out["actor/grad_norm"] = norms / steps
        out["actor/active_fraction"] = float(active.float().mean())
        if self._rollout_source is self.actor and self.megatron is not None:  # HF rollout runs the HF actor
            self.megatron.export_to(hf_module(self.actor))
        return out

    def _train_mini_batch(self, exp: Experience, micro: List[torch.Tensor], counts: Dict[str, float]):
        """One optimiser step over the micro-batches: each one's stats, and the gradient norm."""
        if self.megatron is not None:
            return self.megatron.train_mini_batch(
                exp, micro, lambda logp, entropy, sub: actor_loss(self.cfg.actor, logp, entropy, sub, counts))
        stats = [self._actor_micro_step(exp.select(idx), counts) for idx in sharding.micro_steps(self.actor, micro)]
        return stats, self._optimizer_step(self.actor, self.optimizer, self.cfg.actor.max_grad_norm)

    def _actor_micro_step(self, sub: Experience, counts: Dict[str, float]) -> Dict[str, float]:
        with self._autocast():
            logp, entropy = experience_logprobs(self.actor, sub.input_ids, sub.attention_mask, sub.response_length,
                                                sub.prompt_index, temperature=self.cfg.rollout.temperature or 1.0,
                                                with_entropy=True, fused=self._fused(),
                                                share=self.cfg.actor.share_prompt_forward)
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
        counts = loss_normalisers(exp.response_mask, self.dp_group)
        totals: Dict[str, float] = {"vf_loss": 0.0, "vf_clipfrac": 0.0}

        def loss_fn(values: torch.Tensor, sub: Experience):
            loss, stats = value_loss(values.float(), sub.values, sub.returns, sub.response_mask,
                                     c.cliprange_value, c.loss_agg_mode, **counts)
            return loss, {"vf_loss": loss.item(), "vf_clipfrac": float(stats["vf_clipfrac"]) * sub.num_sequences / N}

        for _ in range(self.cfg.actor.ppo_epochs):
            micro = self._micro(exp, rows, size=c.micro_batch_size)
            if self._megatron_critic:
                results, _ = self.critic.train_mini_batch(exp, micro, loss_fn)
            else:
                self.critic.train()
                results = []
                for idx in sharding.micro_steps(self.critic, micro):
                    sub = exp.select(idx)
                    with self._autocast():
                        values = response_values(self.critic, sub.input_ids, sub.attention_mask, sub.response_length)
                    loss, stats = loss_fn(values, sub)
                    loss.backward()
                    results.append(stats)
                self._optimizer_step(self.critic, self.critic_optimizer, c.max_grad_norm)
            for stats in results:
                totals["vf_loss"] += stats["vf_loss"]
                totals["vf_clipfrac"] += stats["vf_clipfrac"]
        epochs = self.cfg.actor.ppo_epochs
        return {"critic/vf_loss": totals["vf_loss"] / epochs, "critic/vf_clipfrac": totals["vf_clipfrac"] / epochs,
                "critic/values_mean": float((exp.values * exp.response_mask).sum() / exp.response_mask.sum())}

    def _dpo_step(self, batch: List[Any]) -> Dict[str, Any]:
        self.actor.train()
        with self.perf.phase("update_actor"):
            metrics = dpo.step(self.actor, self.ref, batch, pad_id=self.tokenizer.pad_token_id, device=self.device,
                               autocast=self._autocast, algorithm=self.cfg.algorithm,
                               pairs_per_micro_batch=dpo.pairs_per_micro_batch(self.cfg))
            metrics["actor/grad_norm"] = self._optimizer_step(self.actor, self.optimizer,
                                                              self.cfg.actor.max_grad_norm)
        metrics.update(self.perf.figures())
        return _reduce(metrics, self.world, self.dp_group)

    def _online_dpo_step(self, batch: List[PromptRow]) -> Dict[str, Any]:
        """Sample, score, pair each prompt's best with its worst sample, one DPO update."""
        start = time.perf_counter()
        self.engine.wake_up()
        with self._autocast():
            gen = self.rollout.rollout(batch, seed=self.cfg.rollout.seed * 1_000_003 + self.step * 997)
        self.engine.sleep()
        scores = self._score(batch, gen)
        pairs = online_dpo.best_worst_pairs(batch, gen, scores)
        metrics: Dict[str, Any] = {"time/generation": time.perf_counter() - start, "reward/mean": scores.mean().item(),
                                   "dpo/pairs": len(pairs)}
        if pairs:  # no pair (every prompt's samples tied): no update, the engine keeps its weights
            metrics.update(self._dpo_step(pairs))
            self._sync_engine(metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def save(self, export_hf: bool = False) -> None:
        """A sharded checkpoint of this step (every rank writes its shards); ``export_hf`` adds the
        HF safetensors folder that transformers and vLLM load."""
        state = {"history": self.history, "config": self.cfg.to_dict(), "torch_rng": torch.get_rng_state().tolist()}
        if self.megatron is not None:  # a Megatron distributed checkpoint, and always the HF export
            megatron_checkpoint.save(self.cfg.trainer.output_dir, self.step, self.megatron, self.actor,
                                     self.tokenizer, state, self.critic)
        else:
            checkpoint.save(self.cfg.trainer.output_dir, self.step, self.actor, self.tokenizer, self.optimizer, state,
                            self.critic, self.critic_optimizer, export_hf=export_hf)

    def _resume(self, logger: MetricsLogger) -> None:
        """Restores the newest complete checkpoint (a damaged newer one is named and skipped) and
        rewrites the metrics from its history, so re-run steps are not logged twice."""
        path = None
        if self.cfg.trainer.resume:
            if self.is_main:
                checkpoint.clean_partial(self.cfg.trainer.output_dir)
            path = checkpoint.latest_valid(self.cfg.trainer.output_dir)
        if path is not None:
            if self.megatron is not None:
                state = megatron_checkpoint.load(path, self.megatron, self.actor, self.critic)
            else:
                state = checkpoint.load(path, self.actor, self.optimizer, self.critic, self.critic_optimizer)
            self.step = int(state["step"])
            self.history = list(state.get("history", []))
            torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        logger.resume(self.history)


def _adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; the fused kernel (one pass over all parameters, ~5x faster on the CPU than the default
    per-tensor loop) for plain CPU / CUDA parameters; sharded (DTensor) ones keep torch's default."""
    params = list(model.parameters())
    fused = not is_sharded(model) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                                          and type(p.data) is torch.Tensor for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def _is_prepared(items: Any) -> bool:
    return isinstance(items, list) and bool(items) and not isinstance(items[0], dict)


def _reduce(metrics: Dict[str, Any], world: int, group=None) -> Dict[str, Any]:
    """Means of the numeric metrics over the ranks (what rank 0 logs)."""
    if world == 1:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    values = distributed.all_reduce_numbers([float(metrics[k]) for k in keys], group=group)
    return {**metrics, **{k: v / world for k, v in zip(keys, values)}}


def _whiten_over_ranks(values: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """``values`` whitened with the masked mean and unbiased variance of every rank's tokens (what
    one process whitening the whole batch computes), ``(v - mean) * rsqrt(var + 1e-8)``; zero where
    ``mask`` is 0 (no loss reads those positions)."""
    m = mask.to(torch.float64)
    v = values.to(torch.float64) * m
    n, s, s2 = distributed.all_reduce_numbers([float(m.sum()), float(v.sum()), float((v * v).sum())], group=group)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 response tokens over all ranks, got {int(n)}")
    mean = s / n
    var = max((s2 - s * mean) / (n - 1), 0.0)
    return ((values - mean) * (var + 1e-8) ** -0.5 * mask).to(values.dtype)
