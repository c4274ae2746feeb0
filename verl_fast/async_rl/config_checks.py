"""Start-up checks of ``trainer.async_mode`` (registered in the config; ``verl_fast.trainer.catalog`` imports
this module): the combinations asynchronous RL cannot serve, each named with what to use instead."""

from __future__ import annotations

from verl_fast import config


def check(cfg: config.Config) -> None:
    t = cfg.trainer
    mode = t.async_mode
    if mode == "off":
        return
    from verl_fast.algos.policy_gradient import NoBaseline, PolicyGradientSpec
    from verl_fast.algos.registry import SPECS

    key = f"trainer.async_mode={mode}"
    spec = SPECS[cfg.algorithm.type]
    if not isinstance(spec, PolicyGradientSpec):
        raise ValueError(f"{key} is not supported with algorithm.type={cfg.algorithm.type} (its pairs are sampled "
                         "and ranked inside the step); use a policy-gradient algorithm (grpo, rloo, ppo, ...) or "
                         "trainer.async_mode=off")
    if not isinstance(spec.baseline, NoBaseline):
        raise ValueError(f"{key} is not supported with algorithm.type={cfg.algorithm.type} (its greedy baseline "
                         "rollout runs inside the step, on the current weights); use grpo or rloo, or "
                         "trainer.async_mode=off")
    if not cfg.algorithm.rollout_correction:
        raise ValueError(f"{key} needs algorithm.rollout_correction=true: samples of an older policy are "
                         "weighted by exp(old_logprob - behaviour_logprob) per token; set it")
    if cfg.algorithm.dynamic_sampling:
        raise ValueError(f"{key} is not supported with algorithm.dynamic_sampling (its extra draws are sampled "
                         "inside the step); use trainer.async_mode=off")
    for name, on in (("rollout.record_routing", cfg.rollout.record_routing),
                     ("actor.routing_replay", cfg.actor.routing_replay)):
        if on:
            raise ValueError(f"{key} is not supported with {name}=true (the rollout copies record no routes, and "
                             "an older policy's would not be the ones to replay); use trainer.async_mode=off")
    if mode != "full" and t.async_workers != 1:
        raise ValueError(f"trainer.async_workers={t.async_workers} is not supported with {key} (one rollout "
                         "thread); use trainer.async_mode=full or async_workers=1")
    if mode == "one_step" and t.max_staleness != 1:
        raise ValueError(f"trainer.max_staleness={t.max_staleness} is not supported with {key}, whose samples are "
                         "always exactly one version old; use trainer.async_mode=full for more")


config.register_check(check)
