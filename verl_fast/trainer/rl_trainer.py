"""RLTrainer: rollout -> reward -> advantages -> updates -> checkpoint and metrics, step by step.

What varies is chosen once, when the trainer is built, and called phase by phase:
- the algorithm (``algorithm.type``; ``verl_fast/algos/``, one module each): its extra rollout
  (ReMax), the rows it trains on (DAPO's dynamic sampling), the rollout correction's weights, reward
  shaping (KL in the reward), advantage estimator and whitening scope, actor and critic losses. Preference algorithms (dpo, online_dpo, kto, orpo, simpo, cpo) step through their
  pairs or labelled completions instead, SFT through one update on the rows (``trainer/supervised.py``)
  (``algos/algorithm.Step``).
- the training strategy (``actor.strategy``; ``verl_fast/strategies/``): where the models live and how
  their forward passes and optimiser steps run (FSDP2 / FSDP1 / one process, Megatron-core), what
  the rollout engine syncs its weights from, the checkpoints.
- the rollout engine (``rollout.type``; ``verl_fast/rollout/factory.py``).
- when the samples are generated (``trainer.async_mode``; ``verl_fast/async_rl/``): in the step, or
  ahead of it, beside the update (hooks marked "async hook").
The reward scores through ``verl_fast/rewards/scoring.py`` (here or beside the model passes; the ranks
agree on a stop). Losses aggregate with ``actor.loss_agg_mode`` over the whole mini-batch (trainer/batching.py:
micro-batches, DP balancing, the normalisers).

Run it with ``verl-fast train --config c.yaml`` or ``RLTrainer(actor_model=..., tokenizer=...,
reward_fn=..., config=...).fit(dataset)``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch

from verl_fast import agents, distributed, extras
from verl_fast.agents import agent_rollout
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast import config as config_mod
from verl_fast.algos import registry as algorithms
from verl_fast.algos import rollout_correction
from verl_fast.algos.algorithm import MorePrompts, Step
from verl_fast.async_rl import modes as async_modes
from verl_fast.config import Config
from verl_fast.config import verl_config as config_verl
from verl_fast.files import hub
from verl_fast.data import RLDataProcessor
from verl_fast.data.images import ImageLimits
from verl_fast.data.sft_data import SFTExample
from verl_fast.models.vision_processor import VisionProcessor
from verl_fast.records.prompts import PreferencePair, PromptRow
from verl_fast.trainer import preflight
from verl_fast.records.experience import Experience, build_experience, last_token_rewards
from verl_fast.metrics.logger import MetricsLogger
from verl_fast.models import checks, lora
from verl_fast.models import vision as vision_model
from verl_fast.models.value import ValueModel
from verl_fast.rewards import RewardStopped, RewardTimeout, bind_judge_engine, build_reward, scoring
from verl_fast.records.generation import GenerationOutput, SamplingSpec
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout import engines as rollout_engines
from verl_fast.rollout.factory import build_engine
from verl_fast.rollout.operator import RolloutOperator
from verl_fast.strategies import backends as strategies
from verl_fast.trainer import catalog, lr_schedule, partial_checks, perf, run_dir, supervised
from verl_fast.trainer.validation import Validation
from verl_fast.trainer.batching import balance_across_ranks
from verl_fast.trainer.guardrails import Guardrails
from verl_fast.trainer.watchdog import Watchdog
from verl_fast.trainer.updates import Updates

logger = logging.getLogger(__name__)


def _from_mapping(config: Optional[Dict[str, Any]]) -> Config:
    """Our sections or verl's tree (``config_verl``); its notes logged."""
    cfg, notes = config_verl.from_dict(config or {})
    for note in notes:
        logger.info("config note: %s", note)
    return cfg


def _load_actor(cfg: Config, name: str, tokenizer: Any, model_path: Optional[str]) -> tuple:
    """The actor (and its tokenizer, unless one is given) by Hub name or folder; its folder for vLLM."""
    from verl_fast.models.loading import attention_kwargs, load_causal_lm, load_dtype, resolve

    cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    model, own = load_causal_lm(name, load_dtype(cfg.actor.dtype, not cuda, "actor.dtype"), "actor_model",
                                **attention_kwargs(cfg.actor, "actor", cuda))
    return model, tokenizer if tokenizer is not None else own, model_path or resolve(name)


class RLTrainer:
    def __init__(
        self,
        actor_model: Union[torch.nn.Module, str],
        tokenizer: Any = None,
        ref_model: Optional[torch.nn.Module] = None,
        critic_model: Optional[torch.nn.Module] = None,
        reward_fn: Optional[Any] = None,
        config: Union[Config, Dict[str, Any], None] = None,
        generation_config: Optional[Dict[str, Any]] = None,
        rollout_operator: Optional[RolloutOperator] = None,
        rollout_engine: Optional[RolloutEngine] = None,
        model_path: Optional[str] = None,
        tools: Sequence[Callable[..., Any]] = (),
        agent: Optional[Callable[..., Any]] = None,
    ):
        """``actor_model``: any PreTrainedModel, or an FSDP-wrapped one (used as it is, never
        re-wrapped), or a name (Hub ``org/name`` or a local folder), loaded with its tokenizer
        (``actor.dtype``; ``tokenizer`` then defaults to the model's); plain models are sharded as ``actor.strategy`` / ``critic.strategy`` say
        (FSDP2 under torchrun). ``ref_model`` / ``critic_model`` may be of other families; without a
        ``ref_model`` a frozen copy of the actor, laid out as the actor is, is the reference when KL
        is used. ``reward_fn``: a callable with verl's ``compute_score`` signature or TRL's
        ``f(prompts, completions, **kwargs)``, a RewardFunction, a transformers sequence-classification
        model, or a list of them (each may be ``{"fn": f, "weight": w, "name": n}``; the weighted sum is
        the reward) (else the config's).
        ``generation_config``: default sampling (SamplingSpec fields or HF names). ``model_path``:
        the actor's folder, which a vLLM engine loads (else the actor is saved to a temporary one).
        ``tools``: functions the model may call (a multi-turn rollout, ``verl_fast/agents/``; with
        ``rollout.multi_turn.tools`` too). ``agent``: an agent program, ``agent(row, base_url)``, run per
        sample against an OpenAI-compatible endpoint on the rollout engine (``rollout.server``;
        ``verl_fast/agents/agent_rollout.py``)."""
        catalog.register()
        self.cfg = config_mod.checked(config) if isinstance(config, Config) else _from_mapping(config)
        cfg = self.cfg
        if isinstance(actor_model, str):
            actor_model, tokenizer, model_path = _load_actor(cfg, actor_model, tokenizer, model_path)
        if tokenizer is None:
            raise ValueError("tokenizer is needed with a model object as actor_model (or pass actor_model by name)")
        # a vision-language actor's processor (TRL's processing_class): images and text; None for a tokenizer
        self.vision = VisionProcessor.of(tokenizer)
        if self.vision is not None:
            tokenizer = self.vision.tokenizer
            vision_model.check_run(cfg, actor_model)
            engine = rollout_engines.named(cfg)
            if engine is not None and not engine.takes_images:
                raise ValueError(f"a vision-language actor is not supported with rollout.type={cfg.rollout.type}; "
                                 "use rollout.type: hf")
        critic_inner = critic_model.model if isinstance(critic_model, ValueModel) else critic_model
        for model in (actor_model, critic_inner):  # a vision-language critic's tower as the actor's
            if model is not None and vision_model.is_vision_model(model) and cfg.actor.freeze_vision_tower:
                vision_model.freeze_vision_tower(model)
        self.algorithm = algorithms.build(cfg)
        # with images: the policy gradient (PPO's critic too), SFT, and the dataset's preference pairs
        if self.vision is not None and self.algorithm.step is not Step.POLICY_GRADIENT and (
                self.algorithm.samples or self.algorithm.item_type not in (PreferencePair, SFTExample)):
            raise ValueError(f"algorithm.type={self.algorithm.name} is not supported with a vision-language actor; "
                             "use a policy-gradient algorithm (grpo, ppo, rloo, ...), sft, or dpo (orpo, simpo, cpo)")
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.is_main = distributed.rank() == 0
        if self.algorithm.needs_critic and critic_model is None:
            raise ValueError(f"algorithm.type={self.algorithm.name} needs a critic: pass critic_model "
                             "(or critic.model_name)")
        if cfg.actor.lora is not None:
            if lora.is_peft(actor_model):
                raise ValueError("actor.lora is set, but the actor given already has PEFT adapters; remove one")
            actor_model = lora.apply(actor_model, cfg.actor.lora)  # the base frozen, the adapters train
        if ref_model is not None:
            checks.same_vocab(actor_model, ref_model)
        self.strategy = strategies.build(cfg, actor_model, ref_model, critic_model if self.algorithm.needs_critic
                                         else None, self.algorithm.needs_reference)
        s = self.strategy
        self.device, self.rank, self.world, self.dp_group = s.device, s.dp_rank, s.dp_size, s.dp_group
        self.algorithm.configure(self.world)
        self._step = {Step.POLICY_GRADIENT: self._policy_gradient_step,
                      Step.PREFERENCE: self._preference_step,
                      Step.SUPERVISED: self._supervised_step}[self.algorithm.step]
        self.reward = build_reward(cfg.reward_fn, reward_fn, tokenizer)
        t = cfg.trainer
        self.processor = RLDataProcessor(self.vision or tokenizer, t.max_prompt_length, cfg.rollout.max_new_tokens,
                                         system_prompt=t.system_prompt, overlong_prompts=t.overlong_prompts,
                                         image_limits=ImageLimits(t.image_min_pixels, t.image_max_pixels,
                                                                  t.image_max_input_pixels))
        self.engine, self.rollout = rollout_engine, rollout_operator
        self._tools = tuple(tools)
        self._agent = agent
        self._engine_fresh = rollout_engine is None and rollout_operator is None  # built below from the actor
        if rollout_operator is not None:
            self.engine = rollout_operator.engine
        elif self.algorithm.samples:
            self.engine = s.rollout_engine(rollout_engine or build_engine(
                cfg, s.actor, self.vision or tokenizer, model_path, s.autocast_dtype, source=s.weight_source(owns_weights=True),
                hf_decode_by_default=s.hf_decode_by_default))
            self.rollout = self._operator(generation_config)
        elif rollout_engines.unused(cfg, self.algorithm.name):
            warnings.warn(rollout_engines.unused(cfg, self.algorithm.name), UserWarning, stacklevel=2)
        self.step = 0
        self._items: Sequence[Any] = ()  # what fit() trains on
        self.total_steps: Optional[int] = None  # the run's length, set by fit (the schedules read it)
        self.stopped = False  # set when a signal ended fit() early (after a checkpoint)
        self.exit_code = 0  # what the CLI exits with: a reward's sys.exit(n) makes it n (see RewardStopped)
        self._stop_event = None  # fit's StopSignals event: a reward still scoring watches it
        self.history: List[Dict[str, Any]] = []
        self.validation: Optional[Validation] = None  # fit's, with a validation set
        self.generations: List[Dict[str, Any]] = []  # the latest step's first trainer.log_generations samples
        self.perf = perf.StepPerf(s.actor, self.device)
        self.updates = Updates(cfg, s, self.perf)  # the optimiser steps (trainer/updates.py)
        self.guardrails = Guardrails(cfg.guardrails, self.is_main, self.dp_group)  # checks against silent failure
        g = cfg.guardrails
        self.watchdog = Watchdog(g.watchdog, g.watchdog_factor, g.watchdog_min_s, g.watchdog_first_s, self.rank)
        self.perf.watch = self.watchdog.phase
        # trainer.async_mode: where the samples come from when not generated in the step (None: off)
        self.async_rollout = async_modes.build(self)
        if self.async_rollout is None:  # the sync guardrail where the update's forward is the policy sampled from
            self.updates.sync_gap_check = lambda diff: self.guardrails.check_sync(
                self.step + 1, diff, self._weight_differences, {})
        # rollout.partial_step_tokens: a step's unfinished samples carried into the next (None: off)
        self.partial = partial_checks.build(cfg, self.engine, tokenizer, self.world) if self.rollout else None
        self._bind_judge()
        if self.is_main:  # what the defaults became here, once (the token budget: at the first update)
            settings = dict(s.resolved())
            if self.engine is not None:
                settings["rollout.type"] = self.engine.name or type(self.engine).__name__
            print(f"verl-fast: on {self.device}: " + ", ".join(f"{k}={v}" for k, v in settings.items()), flush=True)

    @property
    def actor(self) -> torch.nn.Module:
        """The Hugging Face actor (as the strategy laid it out)."""
        return self.strategy.actor

    @property
    def ref(self) -> Optional[torch.nn.Module]:
        """The frozen reference copy, or None (no KL; or a LoRA actor's base, adapters disabled, serves
        as the reference: ``strategy.has_reference``)."""
        return self.strategy.ref

    # ------------------------------------------------------------------ setup helpers

    def _operator(self, generation_config: Optional[Dict[str, Any]]) -> RolloutOperator:
        """The rollout operator over ``self.engine``: length-bucketed waves where they pay (``waves_by_default``)."""
        cfg, r = self.cfg, self.cfg.rollout
        waves = r.length_buckets == "on" or (r.length_buckets == "auto" and self.engine.waves_by_default)
        waves = waves and not self.engine.collective  # ranks would make different numbers of calls
        budget = r.max_batch_tokens or r.max_num_seqs * (cfg.trainer.max_prompt_length + r.max_new_tokens)
        agent = agent_rollout.build_operator(cfg, self.engine, self.tokenizer,
                                             self._sampling_defaults(generation_config), self._agent)
        if agent is not None:  # an agent program through the endpoint (verl_fast/agents/agent_rollout.py)
            return agent
        multi_turn = agents.build_operator(cfg, self.engine, self.tokenizer, self._sampling_defaults(generation_config),
                                           self._tools)
        if multi_turn is not None:  # tools / environments: trajectories of turns (verl_fast/agents/rollout.py)
            return multi_turn
        return RolloutOperator(self.engine, self._sampling_defaults(generation_config), max_num_seqs=r.max_num_seqs,
                               max_batch_tokens=budget if waves else None)

    def _sampling_defaults(self, generation_config: Optional[Dict[str, Any]]) -> SamplingSpec:
        r = self.cfg.rollout
        base = SamplingSpec(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_tokens=r.max_new_tokens,
                            logprobs=rollout_correction.engine_logprobs(self.cfg) or self.cfg.guardrails.sync_check)
        return SamplingSpec.from_kwargs(base, dict(generation_config or {}))

    def update_reward_fn(self, reward_fn: Any) -> None:
        """Swaps the reward without a restart; the next step scores with it."""
        self.reward = build_reward(self.cfg.reward_fn, reward_fn, self.tokenizer)
        self._bind_judge()

    def _bind_judge(self) -> None:
        """A judge that scores on the rollout engine (``reward_fn.judge.engine: rollout``) gets it; the engine
        then stays awake from the rollout to the reward's end (``_judge_on_engine``)."""
        self._judge_on_engine = bind_judge_engine(self.reward, self.engine, self.tokenizer)
        if self._judge_on_engine and self.async_rollout is not None:
            raise ValueError("reward_fn.judge.engine=rollout is not supported with trainer.async_mode (the engine "
                             "generates ahead while the judge would score); use reward_fn.judge.model_name or url")

    # ------------------------------------------------------------------ the loop

    def fit(self, dataset: Any, val_dataset: Any = None, **dataset_kwargs: Any) -> List[Dict[str, Any]]:
        """Trains on ``dataset`` (rows in verl format, a path, a datasets.Dataset, ``reasoning_gym:<task>``
        or ``verifiers:<env>``; preference pairs for DPO), validating on ``val_dataset`` (the same
        forms; default ``trainer.val_dataset``) as ``trainer.val_freq`` says. Returns the per-step
        metrics (a validation before training, ``trainer.val_before_train``, is the record of step 0)."""
        cfg = self.cfg.trainer
        if self.is_main:  # the trainer's own optional package (the CLI checks every one a config needs)
            extras.check(self.cfg, modules=("matplotlib",))
        self.validation = self._validation(val_dataset if val_dataset is not None else cfg.val_dataset)
        rows = self.processor.load(dataset, **dataset_kwargs) if not _is_prepared(dataset) else dataset
        if not _is_prepared(rows):  # the rows' form and the reward's fit, before the first rollout
            preflight.check(self.cfg, rows, dataset if isinstance(dataset, (str, list)) else None,
                            self.reward if self.algorithm.samples else None)
        items: Sequence[Any] = rows if _is_prepared(rows) else self.algorithm.encode(self.processor, rows)
        if not items:
            raise ValueError("the dataset is empty")
        want = self.algorithm.item_type
        if not isinstance(items[0], want):
            raise ValueError(f"algorithm.type={self.algorithm.name} trains on {want.__name__} items, but the dataset "
                             f"holds {type(items[0]).__name__}")
        if cfg.train_batch_size % self.world:
            raise ValueError(f"trainer.train_batch_size={cfg.train_batch_size} must be a multiple of the "
                             f"number of processes ({self.world}) so that every rank gets the same share")
        if self.vision is not None:
            vision_model.check_rows(items, self.world)
        self._items = items  # an algorithm's select_experience may draw extra prompts from them
        per_epoch = max(1, len(items) // cfg.train_batch_size)
        total = cfg.total_steps or cfg.num_epochs * per_epoch
        self.total_steps = total
        run_dir.claim(cfg)  # one writer per output_dir; an older run there is resumed, refused or cleared
        logger = None
        try:
            logger = MetricsLogger(cfg.output_dir, total, cfg.progress_bar, cfg.metrics_port, enabled=self.is_main,
                                   host=cfg.metrics_host, loggers=cfg.loggers, run_config=self.cfg.to_dict(),
                                   project=cfg.wandb_project, run_name=cfg.run_name)
            with run_dir.StopSignals() as stop:  # SIGTERM / Ctrl-C: finish the step, checkpoint, return
                self._stop_event = stop.event
                self._resume(logger)
                if self.async_rollout is not None:  # async hook: it generates ahead in the data's order
                    self.async_rollout.begin(lambda s: self._batch(items, s, per_epoch), total)
                with self.watchdog:  # a phase far past its expected time is named, with its stack
                    self._loop(items, per_epoch, total, logger, stop)
        finally:
            if self.async_rollout is not None:  # async hook: its thread / workers stop, an engine on the final weights
                self.async_rollout.close(self.step)
            self._stop_event = None
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
        if self.validation is not None and cfg.val_before_train and self.step == 0:
            logger.log({"step": 0, **self._validate(logger)})
        abandoned: Optional[str] = None  # why a step was given up in its reward (the run then stops)
        timeout: Optional[RewardTimeout] = None
        while self.step < total:
            try:
                metrics = self.train_step(self._batch(items, self.step, per_epoch))
            except RewardStopped as e:  # a signal, or SystemExit / KeyboardInterrupt inside the reward
                abandoned, self.stopped, self.exit_code = str(e), True, e.exit_code
                break
            except RewardTimeout as e:
                abandoned, timeout = str(e), e
                break
            stopping = stop.requested()
            if self.is_main and self.generations:
                logger.log_generations(self.step, "train", self.generations)
            if self.validation is not None and not stopping and (
                    (self.step == total and cfg.val_freq >= 0) or (cfg.val_freq > 0 and self.step % cfg.val_freq == 0)):
                metrics.update(self._validate(logger))
            if cfg.save_freq > 0 and self.step % cfg.save_freq == 0 and self.step < total and not stopping:
                self.history = logger.history + [metrics]  # the checkpoint holds this step's metrics
                checkpoint_start = time.perf_counter()
                with self.watchdog.phase("checkpoint"):
                    self.save(export_hf=cfg.hf_export == "every")
                metrics["time/checkpoint"] = time.perf_counter() - checkpoint_start
            logger.log(metrics)
            self.history = logger.history
            if stopping:
                self.stopped = True
                break
        if self.engine is not None:  # the engine leaves fit() generating with the final weights
            self.engine.wake_up()
        # save_freq -1 (verl's never): no checkpoint after a run that completed; a stopped one still saves
        never = cfg.save_freq < 0 and self.step >= total and not self.stopped and abandoned is None
        if not never and (self.step > first or checkpoint.latest_valid(cfg.output_dir, warn=lambda m: None) is None):
            self.save(export_hf=cfg.hf_export == "every" or (cfg.hf_export == "final" and self.step >= total))
        if cfg.hub_model_id and self.step >= total and abandoned is None and not self.stopped:
            self.push_to_hub()
        if abandoned is not None and self.is_main:
            print(f"step {self.step + 1} stopped in its reward: {abandoned}", flush=True)
        if timeout is not None:
            raise RewardTimeout(f"{timeout}; the run stopped after step {self.step}, whose checkpoint is in "
                                f"{checkpoint.checkpoint_root(cfg.output_dir)} (run again to resume)") from None
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
        rates = self._set_rates()
        metrics = self._step(batch)
        metrics.update(rates)
        self.step += 1
        metrics.update(step=self.step, **{"time/step": time.perf_counter() - start,
                                          "perf/guardrails_s": self.guardrails.take_seconds()})
        metrics.update(perf.throughput(metrics))
        return metrics

    def _validation(self, source: Any) -> Optional[Validation]:
        """The run's validation set, encoded as the training prompts are (None: no validation)."""
        t = self.cfg.trainer
        if source is None:
            if t.val_before_train or t.val_freq > 0:
                raise ValueError("trainer.val_freq / trainer.val_before_train need a validation set: set "
                                 "trainer.val_dataset (or pass val_dataset to fit)")
            return None
        if self.algorithm.step is Step.SUPERVISED:  # the validation set's loss
            rows = source if _is_prepared(source) else self.algorithm.encode(self.processor, self.processor.load(
                source, **(t.val_dataset_kwargs if isinstance(source, str) else {})))
            return supervised.LossValidation(self, rows)
        if self.rollout is None:
            raise ValueError(f"trainer.val_dataset is not supported with algorithm.type={self.algorithm.name}, which "
                             "samples nothing; remove it")
        skipped = self.processor.skipped_overlong  # the training set's count stays the one logged
        rows = source if _is_prepared(source) else self.processor.encode_all(
            self.processor.load(source, **(t.val_dataset_kwargs if isinstance(source, str) and source == t.val_dataset
                                         else {})))
        self.processor.skipped_overlong = skipped
        if not rows:
            raise ValueError("the validation set (trainer.val_dataset) is empty")
        if not isinstance(rows[0], PromptRow):
            raise ValueError(f"trainer.val_dataset must hold prompts, got {type(rows[0]).__name__} items")
        multi_turn = self.rollout.with_sampling if isinstance(self.rollout, agents.MultiTurnRolloutOperator) else None
        return Validation(self.cfg, rows, self.engine, self.rank, self.world, self.dp_group, operator_for=multi_turn)

    def _validate(self, logger: MetricsLogger) -> Dict[str, float]:
        """The validation metrics of the current weights; the first samples logged as generations."""
        start = time.perf_counter()
        if self.async_rollout is not None:  # async hook: nothing in flight, the engine on the current weights
            self.async_rollout.quiesce(self.step)
        seed = self.cfg.rollout.seed * 1_000_003 + self.rank * 7919 + 1  # the same prompts' seeds every time
        with self._engine_awake() if self.engine is not None else contextlib.nullcontext():
            metrics, samples = self.validation.run(self._score, self.reward, seed)
        if self.is_main and self.cfg.trainer.log_generations:
            logger.log_generations(self.step, "val", samples[: self.cfg.trainer.log_generations])
        metrics["time/validation"] = time.perf_counter() - start
        return metrics

    def _set_rates(self) -> Dict[str, float]:
        """The actor's (and critic's) learning rate for this step, from its schedule; as metrics."""
        total = self.total_steps or self.cfg.trainer.total_steps
        a = self.cfg.actor
        rates = {"actor/lr": a.lr * lr_schedule.factor(self.step, total, a)}
        lr_schedule.set_rate(self.strategy.optimizer, rates["actor/lr"])
        critic = self.strategy.critic
        if critic is not None:
            c = self.cfg.critic
            rates["critic/lr"] = c.lr * lr_schedule.factor(self.step, total, c)
            lr_schedule.set_rate(critic.optimizer, rates["critic/lr"])
        return rates

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

    def _policy_gradient_step(self, batch: List[PromptRow]) -> Dict[str, Any]:
        metrics: Dict[str, Any] = {}
        exp = self.make_experience(batch, metrics)
        if self.world > 1 and self.cfg.actor.balance_dp:
            exp, balance = balance_across_ranks(exp, self.dp_group)
            metrics.update(balance)
        with self.perf.phase("update_actor"):
            metrics.update(self.update_actor(exp))
        if self.strategy.critic is not None:
            with self.perf.phase("update_critic"):
                metrics.update(self.update_critic(exp))
        if self.engine is not None and self.engine.owns_weights and self.async_rollout is None:
            with self.perf.phase("weight_sync"):
                self._sync_engine(metrics)
        metrics.update(self.perf.figures())
        return _reduce(metrics, self.world, self.dp_group)

    def _preference_step(self, batch: List[Any]) -> Dict[str, Any]:
        """Chosen / rejected pairs (the dataset's, or sampled and ranked by the reward), one DPO update."""
        metrics: Dict[str, Any] = {}
        pairs = self.algorithm.pairs(batch, self._sample, self._score, metrics)
        if self._judge_on_engine and self.engine is not None:  # the judge has ranked the samples
            self.engine.sleep()
        if pairs:  # no pair (every prompt's samples tied): no update
            metrics.update(self._update_on_pairs(pairs))
        self._sync_engine(metrics)  # also without an update: a sleep may have discarded the engine's weights
        return metrics

    def _supervised_step(self, batch: List[Any]) -> Dict[str, Any]:
        """One actor update on the batch's rows (SFT: ``trainer/supervised.py``)."""
        with self.perf.phase("update_actor"):
            metrics = supervised.update(self, batch)
        metrics.update(self.perf.figures())
        return _reduce(metrics, self.world, self.dp_group)

    def _sync_engine(self, metrics: Dict[str, Any]) -> None:
        """The engine generates with the actor's current weights from now on (collective); the bytes
        this rank moved go into ``metrics`` (the step's phase timer times the call)."""
        if self.engine is None:
            return
        owns = self.engine.owns_weights
        moved = self.engine.sync_from(self.strategy.weight_source(owns))
        if owns:
            metrics["sync/bytes_per_rank"] = float(moved.get("bytes", 0))

    # ------------------------------------------------------------------ experience

    @contextlib.contextmanager
    def _engine_awake(self, judged: bool = False) -> Iterator[None]:
        """The engine holds its generation memory while inside; forwards run under the actor's autocast.
        ``judged``: the rollout's reward may judge on the engine, which then sleeps after it (``make_experience``)."""
        self.engine.wake_up()
        with self.strategy.autocast():
            yield
        if not (judged and self._judge_on_engine):
            self.engine.sleep()

    def _seed(self, step: Optional[int] = None) -> int:
        step = self.step if step is None else step
        return self.cfg.rollout.seed * 1_000_003 + step * 997 + self.rank * 7919

    def _sample(self, batch: List[PromptRow]) -> GenerationOutput:
        """The step's samples of ``batch`` (a judge on the engine ranks them before it sleeps)."""
        with self._engine_awake(judged=True):
            return self.rollout.rollout(batch, seed=self._seed())

    def make_experience(self, batch: List[PromptRow], metrics: Dict[str, Any]) -> Experience:
        """The step's phases before its updates: generation and rewards (the model passes beside the
        reward where they may run), the algorithm's choice of rows, old / reference log-probs and
        values, the rollout correction's weights, shaped rewards and advantages."""
        timed, algorithm = self.perf.phase, self.algorithm
        early = not algorithm.scores_decide_rows and not self._judge_on_engine and scoring.beside_passes(
            self.cfg.reward_fn.launch_reward_fn_async, self.device, self.reward)
        exp, extra, batch = self._scored_rollout(batch, metrics, self._model_passes if early else None)
        self.guardrails.after_rewards(self.step + 1, exp, metrics["response/truncated"],
                                      getattr(self.reward, "last_not_applicable", 0), metrics)
        # the batch's own figures, before the algorithm chooses its rows
        lengths = exp.response_mask.sum(-1).float()
        metrics.update({
            "reward/mean": exp.scores.mean().item(),
            "reward/std": exp.scores.std().item() if exp.num_sequences > 1 else 0.0,
            "response/length": lengths.mean().item(),
        })
        with timed("reward"):
            baselines = algorithm.reward_baselines(batch, extra, self._score, exp, metrics)
        more = MorePrompts(self._items, self.step, lambda prompts: self._scored_rollout(prompts, {})[0])
        exp = algorithm.select_experience(exp, more, metrics)
        if self._judge_on_engine:  # the judge has scored (baselines and more prompts too): the engine sleeps now
            self.engine.sleep()
        if not early:
            self._model_passes(exp)
        if self.async_rollout is None:  # samples of the weights the actor has now (async: of an older version)
            self.guardrails.check_sync(self.step + 1, self.guardrails.sync_gap(exp), self._weight_differences, metrics)
        algorithm.correct_rollout(exp, metrics, type(self.engine).__name__)
        with timed("advantages"):
            algorithm.shape_rewards(exp, metrics)
            exp.advantages, exp.returns = algorithm.advantages(exp, baselines, self.dp_group)
        metrics["advantages/abs_mean"] = exp.advantages.abs().mean().item()
        return exp

    def _model_passes(self, exp: Experience) -> None:
        """The passes over the step's experience that need no rewards: old log-probs (where the
        algorithm reads them), reference log-probs, values."""
        timed = self.perf.phase
        if self.algorithm.needs_old_logprobs(exp):
            with timed("old_logprob"):
                exp.old_logprobs = self._old_logprobs(exp)
        if self.strategy.has_reference:
            with timed("ref"):
                exp.ref_logprobs = self._ref_logprobs(exp)
        if self.strategy.critic is not None:
            with timed("values"):
                exp.values = self._values(exp)

    def _scored_rollout(self, batch: List[PromptRow], metrics: Dict[str, Any],
                        beside: Optional[Callable[[Experience], None]] = None) -> tuple:
        """Generation and rewards of ``batch``: ``(experience with scores and outcome rewards, the
        algorithm's extra rollout or None, the prompts it answers)``: ``batch``, or with partial rollouts the
        groups completed; ``beside(exp)`` runs while the reward scores."""
        timed = self.perf.phase
        if self.async_rollout is not None:  # async hook: generated ahead (no extra rollout: checks.py)
            with timed("generation"):
                gen, extra = self.async_rollout.take(self.step, batch, metrics), None
        elif self.partial is not None:  # partial hook: the groups this step completed, the rest carried
            with timed("generation"), self._engine_awake(judged=True):
                seed = self._seed()
                batch, gen = self.partial.rollout(batch, self.rollout.specs(batch, seed), self.step, seed, metrics)
            extra = None
        else:
            with timed("generation"), self._engine_awake(judged=True):
                gen = self.rollout.rollout(batch, seed=self._seed())
                extra = self.algorithm.extra_rollout(self.rollout.generate, batch)
        metrics.update({f"rollout/{k}": v for k, v in self.engine.metrics().items()})
        metrics.update(self.rollout.metrics())
        exp = build_experience(batch, gen, self.tokenizer.pad_token_id).to(self.device)
        self.perf.count_step_tokens(exp.attention_mask)
        started = None
        if beside is not None:  # time/reward is then the wait left after the passes
            started = scoring.start(self.reward, scoring.reward_inputs(batch, gen, self.step, self.total_steps),
                                    self._stop_event)
            beside(exp)
        with timed("reward"):
            exp.scores = self._score(batch, gen, started)
            metrics.update(self.reward.last_metrics)  # each reward function's mean and extra keys
            self.generations = _samples(batch, gen, exp.scores, self.cfg.trainer.log_generations)
            exp.token_level_rewards = last_token_rewards(exp.scores, exp.response_mask)
            if gen.token_rewards is not None:  # an environment's per-turn rewards, on each turn's last token
                exp.token_level_rewards += gen.token_rewards.to(self.device)
                exp.scores = exp.scores + gen.token_rewards.to(self.device).sum(-1)
        metrics["reward/errors"] = metrics.get("reward/errors", 0.0) + float(getattr(self.reward, "last_errors", 0))
        metrics["data/skipped_overlong"] = float(self.processor.skipped_overlong)
        metrics["response/truncated"] = (sum(r == "length" for r in gen.finish_reasons)
                                         / max(1, len(gen.finish_reasons)))
        return exp, extra, batch

    def _score(self, batch: List[PromptRow], gen: Any,
               started: Optional[concurrent.futures.Future] = None) -> torch.Tensor:
        """The reward of each generated sample, ``[N]`` float32 on the trainer's device, on this thread
        (or ``started`` beside the passes); every rank raises on a stop or timeout (rewards/scoring.py)."""
        if started is not None:
            return scoring.wait(started, self.device)
        samples = scoring.reward_inputs(batch, gen, self.step, self.total_steps)
        return scoring.score(self.reward, samples, self._stop_event, self.device)

    @torch.no_grad()
    def _old_logprobs(self, exp: Experience) -> torch.Tensor:
        return self.strategy.actor_logprobs(exp, self.updates.micro(exp, for_update=False))

    def _weight_differences(self) -> Optional[List[str]]:
        """The engine's parameter groups that differ from the actor's (None: the engine cannot tell)."""
        return self.engine.weight_differences(self.strategy.weight_source(self.engine.owns_weights))

    @torch.no_grad()
    def _ref_logprobs(self, exp: Experience) -> torch.Tensor:
        return self.strategy.ref_logprobs(exp, self.updates.micro(exp, for_update=False))

    @torch.no_grad()
    def _values(self, exp: Experience) -> torch.Tensor:
        micro = self.updates.micro(exp, for_update=False, size=self.cfg.critic.micro_batch_size)
        return self.strategy.critic.values(exp, micro) * exp.response_mask

    # ------------------------------------------------------------------ updates

    def update_actor(self, exp: Experience) -> Dict[str, float]:
        """The actor's optimiser steps on ``exp`` with the algorithm's loss (``updates.Updates.actor``)."""
        out = self.updates.actor(exp, self.algorithm.actor_loss, self.algorithm.zero_advantage_is_idle, self.step)
        self.guardrails.after_update(self.step + 1, self.updates.skipped, out)
        self.strategy.actor_updated(self.engine is not None and self.engine.owns_weights)
        return out

    def update_critic(self, exp: Experience) -> Dict[str, float]:
        return self.updates.critic(exp, self.algorithm.critic_loss)

    def _update_on_pairs(self, pairs: List[PreferencePair]) -> Dict[str, Any]:
        self.strategy.actor.train()
        with self.perf.phase("update_actor"):
            metrics = self.algorithm.update(self.updates, pairs, self.tokenizer.pad_token_id)
        self.strategy.actor_updated(self.engine is not None and self.engine.owns_weights)
        metrics.update(self.perf.figures())
        return _reduce(metrics, self.world, self.dp_group)

    # ------------------------------------------------------------------ checkpoints

    def save(self, export_hf: bool = False) -> None:
        """A sharded checkpoint of this step (every rank writes its shards); ``export_hf`` adds the
        HF safetensors folder that transformers and vLLM load (a Megatron run always writes it)."""
        t = self.cfg.trainer
        state = {"history": self.history, "config": self.cfg.to_dict(), "torch_rng": torch.get_rng_state().tolist()}
        if self.async_rollout is not None:  # async hook: the samples in flight, finished
            state["async_rollout"] = self.async_rollout.state_dict()
        if self.partial is not None:  # partial hook: the carried samples, continued after a resume
            state["partial_rollout"] = self.partial.state_dict()
        self.strategy.save(t.output_dir, self.step, self.vision or self.tokenizer, state, export_hf)
        if t.save_total_limit:  # the new one is complete (renamed into place): the oldest beyond the limit go
            distributed.on_main(lambda: checkpoint.prune(t.output_dir, t.save_total_limit))

    def push_to_hub(self) -> None:
        """Uploads the newest checkpoint's HF export (weights, config, tokenizer, model card; not the
        sharded state) to ``trainer.hub_model_id`` through huggingface_hub (rank 0)."""
        t = self.cfg.trainer
        folder = checkpoint.step_dirs(t.output_dir)[0]

        def push() -> None:
            if not any(checkpoint.is_weights(p.name) for p in folder.iterdir()):
                raise checkpoint.CheckpointError(f"trainer.hub_model_id: {folder} holds no HF export to upload (it "
                                                 f"was written without one); run verl-fast export on it, then upload")
            url = hub.upload(folder, t.hub_model_id, private=t.hub_private, ignore=checkpoint.not_exported(folder),
                             message=f"verl_fast: step {self.step}")
            print(f"uploaded {folder} to {url}", flush=True)

        distributed.on_main(push)

    def _resume(self, logger: MetricsLogger) -> None:
        """Restores the newest complete checkpoint (a damaged newer one is named and skipped) and
        rewrites the metrics from its history, so re-run steps are not logged twice."""
        path, t = None, self.cfg.trainer
        if (t.resume or t.resume_from) and self.is_main:
            checkpoint.clean_partial(t.output_dir)
        if t.resume_from:  # named: it wins over output_dir's own (refused when that one is newer)
            path = checkpoint.resolve_start(t.resume_from, t.output_dir)
        elif t.resume:
            path = checkpoint.latest_valid(t.output_dir)
        if path is not None:
            state = self.strategy.load(path)
            self.step = int(state["step"])
            self.history = list(state.get("history", []))
            torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
            if self.async_rollout is not None:  # async hook: the samples that were in flight
                self.async_rollout.load_state_dict(state.get("async_rollout", {}))
            if self.partial is not None:  # partial hook: the samples carried at the checkpoint
                self.partial.load_state_dict(state.get("partial_rollout", {}))
        logger.resume(self.history)


def _samples(batch: List[PromptRow], gen: GenerationOutput, scores: torch.Tensor, count: int) -> List[Dict[str, Any]]:
    """The first ``count`` samples of a step as logged generations."""
    return [{"prompt": batch[i].prompt_text, "response": text, "reward": float(r), "data_source": batch[i].data_source}
            for i, text, r in zip(gen.prompt_index.tolist()[:count], gen.texts[:count], scores[:count].tolist())]


def _is_prepared(items: Any) -> bool:
    """Encoded items (PromptRow / PreferencePair), not rows nor a list of files (verl's train_files)."""
    return isinstance(items, list) and bool(items) and not isinstance(items[0], (dict, str))


def _reduce(metrics: Dict[str, Any], world: int, group=None) -> Dict[str, Any]:
    """Means of the numeric metrics over the ranks (what rank 0 logs)."""
    if world == 1:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    values = distributed.all_reduce_numbers([float(metrics[k]) for k in keys], group=group)
    return {**metrics, **{k: v / world for k, v in zip(keys, values)}}


