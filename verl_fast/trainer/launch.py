"""A run assembled from its config, as ``verl-fast train`` runs it: the engine's process set-up, the
strategy's machine checks, the process group, the run folder and the dataset checked (``run_dir``,
``preflight``) and whether the run fits, all before any model loads; then the models, the trainer, and
``fit``. The CLI parses and prints; what it cannot check before a model loads is refused here in one line
(``LaunchRefused``)."""

from __future__ import annotations

import gc
import os
from typing import Any, Callable, Dict, List, Tuple

from verl_fast.algos import registry as algorithms
from verl_fast.config import Config
from verl_fast.rollout import engines


class LaunchRefused(ValueError):
    """An expected failure found while assembling the run (the CLI prints it in one line, exit 2)."""


_GROUP: List[Any] = []  # the process group launch() started, for finish()


def _distributed(cfg: Config):
    """Under torchrun (WORLD_SIZE > 1): the process group, NCCL for CUDA tensors with CUDA (plus gloo
    for the CPU tensors of offloaded shards), else gloo. Multi-node is the same call: torchrun sets
    RANK / WORLD_SIZE / LOCAL_RANK and the rendezvous address."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    import torch.distributed as dist

    cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    return dist


def _load_models(cfg: Config, device: Any):
    """The actor, its tokenizer and (PPO) the critic, by name, on ``device``."""
    from verl_fast.models.loading import attention_kwargs, load_causal_lm, load_dtype

    cuda = device is not None and device.type == "cuda"
    actor, tokenizer = load_causal_lm(cfg.actor.model_name, load_dtype(cfg.actor.dtype, not cuda, "actor.dtype"),
                                      **attention_kwargs(cfg.actor, "actor", cuda))
    actor.to(device)
    critic = None  # the reference, when KL needs one, is built from the actor's weights
    if algorithms.spec(cfg).needs_critic:
        if not cfg.critic.model_name:
            raise LaunchRefused(f"algorithm.type={cfg.algorithm.type} needs critic.model_name")
        critic, _ = load_causal_lm(cfg.critic.model_name, load_dtype(cfg.critic.dtype, not cuda, "critic.dtype"),
                                   "critic.model_name",
                                   **attention_kwargs(cfg.critic, "critic", cuda))
        critic.to(device)
    return actor, tokenizer, critic


def _check_model_folders(cfg: Config) -> None:
    """The model folders' files before anything reads them (links out, FIFOs, damaged headers, the
    context length against rollout.max_new_tokens: ``models.checks``)."""
    from verl_fast.models import checks
    from verl_fast.models.loading import local_folder

    if cfg.actor.model_name is None:
        raise LaunchRefused("actor.model_name is not set")
    critic = cfg.critic.model_name if algorithms.spec(cfg).needs_critic else None
    for key, name, new_tokens in (("actor.model_name", cfg.actor.model_name, cfg.rollout.max_new_tokens),
                                  ("critic.model_name", critic, None)):
        folder = local_folder(name)
        if folder is not None:
            checks.check_folder(folder, key, new_tokens)


def auto_settings(cfg: Config) -> Dict[str, Any]:
    """What the actor's null / auto keys resolve to on this machine, as far as known before a model
    loads (the trainer prints the rest, resolved, at start-up)."""
    import torch

    from verl_fast.strategies import backends

    cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    return backends.strategy_class(cfg).planned(cfg, torch.device("cuda" if cuda else "cpu"))


def launch(cfg: Config, quiet: Callable[[], None] = lambda: None) -> Tuple[Any, List[Dict[str, Any]]]:
    """The trainer for ``cfg`` after every check that needs no model, and its ``fit`` history; ``quiet``:
    silences the libraries' set-up notes before they are imported. Call ``finish()`` once done."""
    engines.prepare_process(cfg)  # the launcher's job, not a constructor's: before the engine's libraries
    from verl_fast.strategies import backends

    strategy = backends.strategy_class(cfg)
    try:
        strategy.check_machine(cfg)  # before any process group or model: one line, not a library's traceback
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    quiet()
    dist = _distributed(cfg)
    if dist is not None:
        _GROUP.append(dist)
    rows = _checked_rows(cfg)
    import torch

    from verl_fast.models.loading import resolve
    from verl_fast.trainer import run_dir
    from verl_fast.trainer.rl_trainer import RLTrainer

    if cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    else:
        device = torch.device("cpu")
    try:
        _check_model_folders(cfg)
        if device is not None:
            from verl_fast.strategies import memory_plan

            try:  # one line naming what would fit, not an out-of-memory error mid-step
                strategy.check_fits(cfg, algorithms.build(cfg).needs_reference, device)
            except memory_plan.DoesNotFit as e:
                raise LaunchRefused(str(e)) from None
        actor, tokenizer, critic = _load_models(cfg, device)
    except BaseException:
        run_dir.release(cfg.trainer)
        raise
    # the trainer shards the models as actor.strategy / critic.strategy say (FSDP2 under torchrun)
    gc.freeze()  # what exists so far: not swept again by the engine's own collections at start
    trainer = RLTrainer(actor_model=actor, tokenizer=tokenizer, critic_model=critic, config=cfg,
                        model_path=resolve(cfg.actor.model_name))
    gc.freeze()  # start-up's objects (the collector is off until here: see cli.main._train)
    gc.enable()
    history = trainer.fit(rows)  # a RewardTimeout (checkpointed already): one line, exit 2 (verl_fast.errors)
    run_dir.release(cfg.trainer)
    return trainer, history


def _checked_rows(cfg: Config) -> Any:
    """The run folder, lock, port, loggers and dataset (``run_dir.precheck``, the lock held to the end),
    then the rows' form, the reward and their fit on the first rows (``preflight``): one line each."""
    from verl_fast.trainer import preflight, run_dir

    try:
        rows = run_dir.precheck(cfg)  # releases the lock itself when it fails
    except (ValueError, FileNotFoundError) as e:  # a dataset that is not there or cannot be read: one line
        raise LaunchRefused(" ".join(str(e).split())) from None
    try:
        preflight.check(cfg, rows, cfg.trainer.dataset)
    except ValueError as e:
        run_dir.release(cfg.trainer)
        raise LaunchRefused(" ".join(str(e).split())) from None
    return rows


def finish() -> None:
    """Every rank done with its collectives before any tears the process group down."""
    while _GROUP:
        dist = _GROUP.pop()
        dist.barrier()
        dist.destroy_process_group()
