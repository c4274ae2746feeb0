"""verl's configuration keys (``verl/trainer/config/ppo_trainer.yaml`` and the keys its examples and
recipes add) and what each one is here: the single table that ``verl_config`` translates with and
that docs/verl_and_trl.md prints (``python -m verl_fast.config.verl_config --markdown``; a test keeps them equal).

An entry is mapped (``ours``: our key, or several, with ``convert`` for verl's units) or noted
(``ours`` empty: accepted, with one line saying why it means nothing here). A ``subtree`` entry covers
every key under it (profilers, engine internals). ``convert(value, given)`` receives the other verl
keys of the run through ``given(key, default)``; it returns SKIP to set nothing, and raises
ValueError (one line) for a value that cannot run here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

SKIP = object()  # convert's "sets nothing"
Given = Callable[[str, Any], Any]


@dataclass(frozen=True)
class VerlKey:
    verl: str
    ours: Tuple[str, ...]  # empty: noted (no meaning here)
    how: str
    convert: Optional[Callable[[Any, Given], Any]] = None
    subtree: bool = False


AR = "actor_rollout_ref"
A, R, REF, MODEL = f"{AR}.actor", f"{AR}.rollout", f"{AR}.ref", f"{AR}.model"


def world() -> int:
    """The number of processes the run trains on (torchrun's WORLD_SIZE; 1 in one process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# ----------------------------------------------------------------------------- conversions


def _per_rank(value: int, what: str) -> int:
    w = world()
    if value % w:
        raise ValueError(f"{what}={value} must divide over the {w} processes (WORLD_SIZE)")
    return value // w


def mini_batch(value: Any, given: Given) -> Any:
    """verl counts prompts per mini-batch (all GPUs); ours counts sequences on each rank."""
    if value is None:
        return SKIP
    n = given(f"{R}.n", 1)
    return _per_rank(int(value) * int(n), f"{A}.ppo_mini_batch_size x rollout.n")


def global_micro(value: Any, given: Given) -> Any:
    return SKIP if value is None else _per_rank(int(value), "ppo_micro_batch_size (all GPUs)")


ESTIMATORS = {"gae": "ppo", "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp",
              "reinforce_plus_plus_baseline": "reinforce_pp_baseline", "remax": "remax"}


def estimator(value: Any, given: Given) -> Any:
    if value not in ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={value} is not available here; one of {sorted(ESTIMATORS)}")
    ours = ESTIMATORS[value]
    if ours == "grpo" and given("algorithm.norm_adv_by_std_in_grpo", True) is False:
        return "drgrpo"
    return ours


def std_in_grpo(value: Any, given: Given) -> Any:
    return estimator(given("algorithm.adv_estimator", "gae"), given) if given("algorithm.adv_estimator", "gae") \
        == "grpo" else SKIP


def rollout_name(value: Any, given: Given) -> Any:
    """An engine's name, as the engines registered it (``rollout.type``'s choices but auto)."""
    from verl_fast.config import ENGINES

    engines = [name for name in ENGINES if name != "auto"]
    if engines and value not in engines:
        raise ValueError(f"{R}.name={value} is not available here; one of {engines}")
    return value


def strategy(value: Any, given: Given) -> Any:
    """verl's fsdp / fsdp2 -> auto (FSDP2 under torchrun); anything else as our own value."""
    return "auto" if value in ("fsdp", "fsdp2") else value


DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


def dtype(value: Any, given: Given) -> Any:
    if value not in DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {sorted(DTYPES)}")
    return DTYPES[value]


def unset_if_negative(value: Any, given: Given) -> Any:
    return SKIP if value is None or value < 0 else value


def never(value: Any, given: Given) -> Any:
    """verl's -1 (never) and ours; null: our default."""
    return SKIP if value is None else (-1 if value < 0 else value)


def scheduler(value: Any, given: Given) -> Any:
    if value is None:
        return SKIP
    if value not in ("constant", "cosine", "linear"):
        raise ValueError(f"lr_scheduler_type={value} is not available here; constant, linear or cosine")
    return value


LOGGERS = ("console", "wandb", "tensorboard")


def logger(value: Any, given: Given) -> Any:
    names = [value] if isinstance(value, str) else list(value or [])
    other = [n for n in names if n not in LOGGERS]
    if other:
        raise ValueError(f"trainer.logger has {', '.join(map(str, other))}, which verl_fast does not log to; "
                         f"{', '.join(LOGGERS)}")
    return ["console", "jsonl"] + [n for n in names if n != "console"]  # jsonl: metrics.jsonl, always


def resume_mode(value: Any, given: Given) -> Any:
    if value not in ("auto", "disable", "resume_path"):
        raise ValueError(f"trainer.resume_mode={value} must be auto, disable or resume_path")
    return value != "disable"


def files(value: Any, given: Given) -> Any:
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) != 1 else value[0]
    return value


def truncation(given: Given) -> str:
    if given("data.filter_overlong_prompts", False) is True:
        return "skip"
    side = given("data.truncation", "error")
    mapped = {"error": "error", "left": "truncate_left"}
    if side not in mapped:
        raise ValueError(f"data.truncation={side} is not available here; error or left (or "
                         "data.filter_overlong_prompts=true: skipped)")
    return mapped[side]


def lora(value: Any, given: Given) -> Any:
    rank = given(f"{MODEL}.lora_rank", 0)
    if not rank:
        return SKIP
    spec = {"r": int(rank), "alpha": given(f"{MODEL}.lora_alpha", 16)}
    targets = given(f"{MODEL}.target_modules", "all-linear")
    spec["target_modules"] = targets if targets == "all-linear" else list(targets)
    return spec


def offload(prefix: str) -> Callable[[Any, Given], Any]:
    """FSDP's offload of the sharded state; in one process nothing is sharded (unset)."""
    def convert(value: Any, given: Given) -> Any:
        if world() == 1:
            return SKIP
        return bool(given(f"{prefix}.param_offload", False) or given(f"{prefix}.optimizer_offload", False))
    return convert


def custom_reward(value: Any, given: Given) -> Any:
    path = given("custom_reward_function.path", None)
    if not path:
        return SKIP
    return "callable", f"{path}:{given('custom_reward_function.name', 'compute_score') or 'compute_score'}"


def reward_model(value: Any, given: Given) -> Any:
    if not given("reward_model.enable", False):
        return SKIP
    path = given("reward_model.model.path", None)
    if not path:
        raise ValueError("reward_model.enable=true needs reward_model.model.path")
    return "reward_model", path


def overlong(prefix: str) -> Callable[[Any, Given], Any]:
    def convert(value: Any, given: Given) -> Any:
        if not given(f"{prefix}.enable", False):
            return 0
        size = given(f"{prefix}.len", None)
        if size is None:
            raise ValueError(f"{prefix}.enable=true needs {prefix}.len")
        return int(size)
    return convert


MANAGERS = ("naive", "dapo", "batch", "prime")


def manager(value: Any, given: Given) -> Any:
    """verl's reward manager: how the custom function is called, and prime's failures scored 0."""
    if value is None:
        return SKIP
    if value not in MANAGERS:
        raise ValueError(f"reward manager {value} is not available here; one of {', '.join(MANAGERS)}")
    return value, ("zero" if value == "prime" else None)


VERL_TOOLS = "verl_fast.agents.verl_tools:VerlToolEnvironment"


def multi_turn(value: Any, given: Given) -> Any:
    """verl's multi_turn section as rollout.multi_turn: its tools as the environment of verl_tools."""
    mt = f"{R}.multi_turn"
    if not given(f"{mt}.enable", False):
        return SKIP
    path = given(f"{mt}.tool_config_path", None)
    if not path:
        raise ValueError(f"{mt}.enable=true needs {mt}.tool_config_path here (verl's interactions and tool-less "
                         "multi-turn are not available; write an Environment: rollout.multi_turn.environment)")
    fmt = given(f"{mt}.format", "hermes")
    if fmt != "hermes":
        raise ValueError(f"{mt}.format={fmt} is not available here; hermes")
    out = {"environment": VERL_TOOLS, "tool_format": "hermes",
           "environment_kwargs": {"tool_config_path": str(path), "tool_format": "hermes",
                                  "max_parallel_calls": int(given(f"{mt}.max_parallel_calls", 1)),
                                  "max_response_chars": int(given(f"{mt}.max_tool_response_length", 256)),
                                  "truncate_side": given(f"{mt}.tool_response_truncate_side", "middle")}}
    turns = given(f"{mt}.max_assistant_turns", None)
    if turns is not None:
        out["max_turns"] = int(turns)
    return out


def kl_ctrl(value: Any, given: Given) -> Any:
    if value != "fixed":
        raise ValueError(f"algorithm.kl_ctrl.type={value} is not available here; fixed")
    return SKIP


def draws(value: Any, given: Given) -> Any:
    return SKIP if value is None or value <= 0 else int(value) - 1


def rollout_is(value: Any, given: Given) -> Any:
    if value in (None, "null"):
        return False
    if value != "token":
        raise ValueError(f"algorithm.rollout_correction.rollout_is={value} is not available here; token (or null)")
    return True


def val_temperature(value: Any, given: Given) -> Any:
    if given(f"{R}.val_kwargs.do_sample", False) is False:
        return 0.0
    return given(f"{R}.val_kwargs.temperature", 1.0)


def fused(value: Any, given: Given) -> Any:
    return "on" if value else "off"


def betas(value: Any, given: Given) -> Any:
    if value is not None and [float(b) for b in value] != [0.9, 0.999]:
        raise ValueError(f"optim.betas={list(value)}: AdamW's betas are (0.9, 0.999) here, not configurable")
    return SKIP


def only(key: str, allowed: Tuple[Any, ...], why: str) -> Callable[[Any, Given], Any]:
    """A noted key whose other values would change the run: refused, naming what is accepted."""
    def check(value: Any, given: Given) -> Any:
        if value not in allowed:
            raise ValueError(f"{key}={value} is not available here ({why}); use "
                             f"{' or '.join(str(a) for a in allowed if a is not None)}")
        return SKIP
    return check


def refused(key: str, why: str) -> Callable[[Any, Given], Any]:
    """A key of a verl recipe whose algorithm is not available here: any value but off is refused."""
    def check(value: Any, given: Given) -> Any:
        if value not in (None, False):
            raise ValueError(f"{key}={value}: {why}")
        return SKIP
    return check


def fsdp_only(value: Any, given: Given) -> Any:
    """A setting of the FSDP actor's forward; under strategy megatron, Megatron's own (its defaults here)."""
    return SKIP if given(f"{A}.strategy", "fsdp") == "megatron" else value


def seed(value: Any, given: Given) -> Any:
    return SKIP if value is None else value


# ----------------------------------------------------------------------------- the table


def M(verl: str, ours: str, how: str = "same meaning", convert=None) -> VerlKey:
    return VerlKey(verl, tuple(ours.split("+")), how, convert)


def N(verl: str, how: str, check=None) -> VerlKey:
    return VerlKey(verl, (), how, check)


def T(verl: str, how: str) -> VerlKey:
    return VerlKey(verl, (), how, None, subtree=True)


def _optim(verl: str, ours: str) -> List[VerlKey]:
    return [
        M(f"{verl}.lr", f"{ours}.lr", "peak rate"),
        M(f"{verl}.weight_decay", f"{ours}.weight_decay", "AdamW's decoupled decay (verl's default 0.01; ours 0)"),
        M(f"{verl}.clip_grad", f"{ours}.max_grad_norm"),
        M(f"{verl}.lr_warmup_steps", f"{ours}.warmup_steps", "-1 (unset): lr_warmup_steps_ratio", unset_if_negative),
        M(f"{verl}.lr_warmup_steps_ratio", f"{ours}.warmup_ratio"),
        M(f"{verl}.lr_scheduler_type", f"{ours}.lr_scheduler", "constant, cosine (linear too)", scheduler),
        M(f"{verl}.warmup_style", f"{ours}.lr_scheduler", "older name of lr_scheduler_type", scheduler),
        M(f"{verl}.min_lr_ratio", f"{ours}.min_lr_ratio"),
        N(f"{verl}.betas", "AdamW's betas are (0.9, 0.999) here; other values are refused", betas),
        N(f"{verl}.num_cycles", "cosine decays over half a cycle, to min_lr_ratio"),
        N(f"{verl}.optimizer", "AdamW (torch.optim) is the optimiser here"),
        N(f"{verl}.optimizer_impl", "AdamW (torch.optim) is the optimiser here"),
        N(f"{verl}.override_optimizer_config", "AdamW (torch.optim) is the optimiser here"),
        N(f"{verl}.total_training_steps", "set by the trainer from trainer.total_epochs / total_training_steps"),
        # ppo_megatron_trainer.yaml's optimiser keys
        M(f"{verl}.lr_decay_style", f"{ours}.lr_scheduler", "Megatron's name: constant, linear, cosine", scheduler),
        N(f"{verl}.lr_decay_steps", "the decay spans the run's steps after the warm-up"),
        N(f"{verl}.lr_warmup_init", "the warm-up starts from 0"),
        N(f"{verl}.min_lr", "min_lr_ratio sets the final rate"),
        N(f"{verl}.weight_decay_incr_style", "constant weight decay"),
        N(f"{verl}.lr_wsd_decay_style", "no warmup-stable-decay schedule here"),
        N(f"{verl}.lr_wsd_decay_steps", "no warmup-stable-decay schedule here"),
        N(f"{verl}.use_checkpoint_opt_param_scheduler", "the schedule resumes from the checkpoint's step"),
    ]


def _worker_internals(prefix: str) -> List[VerlKey]:
    """The engine settings of an actor / ref / critic worker that no key here corresponds to."""
    return [
        T(f"{prefix}.profiler", "profiling: time/* metrics and verl-fast bench here"),
        T(f"{prefix}.checkpoint", "checkpoints hold model, optimizer and trainer state, written atomically"),
        T(f"{prefix}.router_replay", "MoE routing replay: actor.routing_replay here"),
        N(f"{prefix}.rollout_n", "derived from rollout.n"),
        N(f"{prefix}.ulysses_sequence_parallel_size", "no sequence parallelism here (1)",
          only(f"{prefix}.ulysses_sequence_parallel_size", (None, 1), "no sequence parallelism")),
        N(f"{prefix}.entropy_from_logits_with_chunking", "the fused log-prob kernels never hold the full logits"),
        N(f"{prefix}.entropy_checkpointing", "the fused log-prob kernels never hold the full logits"),
        N(f"{prefix}.use_torch_compile", "actor.compile_blocks decides what is compiled"),
        N(f"{prefix}.strategy", "the reference is laid out as the actor is") if prefix == REF else
        M(f"{prefix}.strategy", ("actor" if prefix == A else "critic") + ".strategy",
          "fsdp / fsdp2 -> auto (FSDP2 under torchrun, one module in one process); megatron", strategy),
    ]


def _fsdp(prefix: str, ours: Optional[str]) -> List[VerlKey]:
    keys = []
    if ours is not None:
        keys += [M(f"{prefix}.param_offload", f"{ours}.cpu_offload", "under torchrun: parameters, gradients and "
                   "optimizer state offloaded together; one process: unset (nothing sharded)", offload(prefix)),
                 M(f"{prefix}.optimizer_offload", f"{ours}.cpu_offload", "as param_offload", offload(prefix)),
                 M(f"{prefix}.model_dtype", f"{ours}.dtype", "fp32 / bf16 / fp16", dtype)]
    else:
        keys += [N(f"{prefix}.param_offload", "the reference is laid out (and offloaded) as the actor is"),
                 N(f"{prefix}.optimizer_offload", "the reference has no optimizer")]
    return keys + [T(prefix, "FSDP internals (wrap policy, prefetch, reshard, mixed precision: "
                             "actor.mixed_precision decides)")]


def _megatron(prefix: str, ours: Optional[str]) -> List[VerlKey]:
    """verl's Megatron section (ppo_megatron_trainer.yaml): the parallel sizes of the actor map to ours."""
    keys = []
    if ours is not None:
        keys += [M(f"{prefix}.{size}", f"{ours}.{size}", "strategy megatron")
                 for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                              "virtual_pipeline_model_parallel_size", "expert_model_parallel_size")]
    return keys + [T(prefix, "Megatron internals (offload, sequence / context parallelism, dist checkpointing, "
                             "mbridge): the Megatron backend's defaults here" + ("" if ours else
                             "; the parallel sizes are the actor's"))]


KEYS: List[VerlKey] = [
    # ------------------------------------------------------------------ the model
    M(f"{MODEL}.path", "actor.model_name", "Hub name or local folder"),
    M(f"{MODEL}.enable_gradient_checkpointing", "actor.gradient_checkpointing", "under strategy megatron: "
      "Megatron's own recompute, unset", fsdp_only),
    M(f"{MODEL}.use_remove_padding", "actor.use_remove_padding", "true: packed rows (varlen attention on a GPU; "
      "under strategy megatron: Megatron's own, unset)", fsdp_only),
    M(f"{MODEL}.trust_remote_code", "actor.trust_remote_code"),
    M(f"{MODEL}.lora_rank", "actor.lora", "> 0: LoRA {r, alpha, target_modules}; 0: none", lora),
    M(f"{MODEL}.lora_alpha", "actor.lora", "actor.lora.alpha (with lora_rank > 0)", lora),
    M(f"{MODEL}.target_modules", "actor.lora", "actor.lora.target_modules (with lora_rank > 0)", lora),
    M(f"{MODEL}.use_fused_kernels", "actor.fused_logprobs", "true: on; false: off", fused),
    N(f"{MODEL}.use_liger", "the fused log-prob kernels are ours (actor.fused_logprobs)"),
    T(f"{MODEL}.fused_kernel_options", "the fused kernels pick their backend (Triton on a GPU)"),
    N(f"{MODEL}.tokenizer_path", "the tokenizer is the model folder's"),
    N(f"{MODEL}.hf_config_path", "the config is the model folder's"),
    N(f"{MODEL}.custom_chat_template", "the tokenizer's own chat template is used"),
    N(f"{MODEL}.external_lib", "import custom model code yourself (actor.trust_remote_code for Hub code)"),
    T(f"{MODEL}.override_config", "the model folder's config is used as it is"),
    N(f"{MODEL}.use_shm", "models load from disk"),
    N(f"{MODEL}.enable_activation_offload", "gradient checkpointing only (actor.gradient_checkpointing)"),
    N(f"{MODEL}.exclude_modules", "LoRA targets: actor.lora.target_modules"),
    N(f"{MODEL}.lora_adapter_path", "LoRA starts from fresh adapters here"),
    T(f"{MODEL}.tiled_mlp", "no tiled MLP here"),
    T(f"{MODEL}.mtp", "no multi-token prediction here"),
    N(f"{AR}.hybrid_engine", "rollout and training always share the process here"),
    N(f"{AR}.nccl_timeout", "torch.distributed's default timeout"),
    # ------------------------------------------------------------------ the actor
    M(f"{A}.ppo_mini_batch_size", "actor.ppo_mini_batch_size", "prompts (all GPUs) x rollout.n / WORLD_SIZE = "
      "sequences per optimiser step on each rank", mini_batch),
    M(f"{A}.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size", "sequences per forward/backward on each rank"),
    M(f"{A}.ppo_micro_batch_size", "actor.micro_batch_size", "deprecated (all GPUs): / WORLD_SIZE", global_micro),
    M(f"{A}.use_dynamic_bsz", "actor.use_dynamic_bsz", "micro-batches by token budget"),
    M(f"{A}.ppo_max_token_len_per_gpu", "actor.max_token_len_per_gpu", "the token budget (use_dynamic_bsz)"),
    M(f"{A}.ppo_epochs", "actor.ppo_epochs"),
    M(f"{A}.clip_ratio", "actor.clip_ratio", "sets clip_ratio_low and clip_ratio_high"),
    M(f"{A}.clip_ratio_low", "actor.clip_ratio_low"),
    M(f"{A}.clip_ratio_high", "actor.clip_ratio_high"),
    M(f"{A}.clip_ratio_c", "actor.clip_ratio_c", "dual-clip bound"),
    M(f"{A}.policy_loss.loss_mode", "actor.policy_loss", "vanilla, gspo, gspo_token, cispo, sapo"),
    T(f"{A}.policy_loss", "parameters of clip_cov / kl_cov (not available here)"),
    M(f"{A}.tau_pos", "actor.sapo_tau_pos", "SAPO's gate temperature, positive advantages"),
    M(f"{A}.tau_neg", "actor.sapo_tau_neg", "SAPO's gate temperature, other advantages"),
    M(f"{A}.loss_agg_mode", "actor.loss_agg_mode"),
    M(f"{A}.loss_scale_factor", "actor.loss_scale_factor"),
    M(f"{A}.entropy_coeff", "actor.entropy_coeff"),
    M(f"{A}.use_kl_loss", "actor.use_kl_loss"),
    M(f"{A}.kl_loss_coef", "actor.kl_loss_coef"),
    M(f"{A}.kl_loss_type", "actor.kl_loss_type", "k1 / kl, k2 / mse, k3 / low_var_kl, abs, and the + forms"),
    M(f"{A}.grad_clip", "actor.max_grad_norm"),
    M(f"{A}.use_fused_kernels", "actor.fused_logprobs", "true: on; false: off", fused),
    M(f"{A}.use_remove_padding", "actor.use_remove_padding", "as model.use_remove_padding", fsdp_only),
    N(f"{A}.shuffle", "the step's sequences are split into mini-batches in order"),
    N(f"{A}.data_loader_seed", "trainer.seed sets the run's randomness"),
    N(f"{A}.calculate_entropy", "actor/entropy is always logged"),
    M(f"{A}.freeze_vision_tower", "actor.freeze_vision_tower"),
    N(f"{A}.use_prefix_grouper", "actor.share_prompt_forward runs a group's prompt once"),
    N(f"{A}.calculate_sum_pi_squared", "not computed here"),
    N(f"{A}.sum_pi_squared_checkpointing", "not computed here"),
    *_optim(f"{A}.optim", "actor"),
    *_fsdp(f"{A}.fsdp_config", "actor"),
    *_megatron(f"{A}.megatron", "actor"),
    N(f"{A}.load_weight", "the actor loads its weights from model.path"),
    N(f"{REF}.load_weight", "the reference starts from the actor's weights"),
    N(f"{MODEL}.lora.rank", "Megatron-bridge LoRA: use model.lora_rank / lora_alpha / target_modules",
      only(f"{MODEL}.lora.rank", (None, 0), "LoRA is set by model.lora_rank / lora_alpha / target_modules")),
    T(f"{MODEL}.lora", "Megatron-bridge LoRA settings: LoRA is set by model.lora_rank / lora_alpha / target_modules"),
    *_worker_internals(A),
    # ------------------------------------------------------------------ the rollout
    M(f"{R}.name", "rollout.type", "vllm or hf (HF generate)", rollout_name),
    M(f"{R}.n", "rollout.n", "samples per prompt (verl's default 1)"),
    M(f"{R}.temperature", "rollout.temperature"),
    M(f"{R}.top_p", "rollout.top_p"),
    M(f"{R}.top_k", "rollout.top_k", "-1: off"),
    M(f"{R}.response_length", "rollout.max_new_tokens", "as data.max_response_length"),
    M(f"{R}.prompt_length", "trainer.max_prompt_length", "as data.max_prompt_length"),
    M(f"{R}.dtype", "rollout.dtype", "bf16 / fp16 / fp32", dtype),
    M(f"{R}.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    M(f"{R}.tensor_model_parallel_size", "rollout.tensor_parallel_size", "vLLM's TP"),
    M(f"{R}.max_num_seqs", "rollout.max_num_seqs"),
    M(f"{R}.max_model_len", "rollout.max_model_len"),
    M(f"{R}.enable_chunked_prefill", "rollout.enable_chunked_prefill"),
    M(f"{R}.enable_prefix_caching", "rollout.enable_prefix_caching"),
    M(f"{R}.enforce_eager", "rollout.enforce_eager"),
    M(f"{R}.free_cache_engine", "rollout.enable_sleep_mode", "free the engine's memory during training"),
    M(f"{R}.quantization", "rollout.quantization"),
    N(f"{R}.calculate_log_probs", "the engine's log-probs are asked for where algorithm.rollout_correction reads them"),
    M(f"{R}.enable_rollout_routing_replay", "actor.routing_replay", "MoE: training routes as the rollout did"),
    M(f"{R}.val_kwargs.temperature", "trainer.val_temperature", "with do_sample=false: 0 (greedy)", val_temperature),
    M(f"{R}.val_kwargs.do_sample", "trainer.val_temperature", "false: greedy (0)", val_temperature),
    M(f"{R}.val_kwargs.top_p", "trainer.val_top_p"),
    M(f"{R}.val_kwargs.n", "trainer.val_n"),
    N(f"{R}.val_kwargs.top_k", "validation samples with rollout.top_k"),
    N(f"{R}.log_prob_micro_batch_size_per_gpu", "log-prob passes use actor.micro_batch_size (or the token budget)"),
    N(f"{R}.log_prob_micro_batch_size", "log-prob passes use actor.micro_batch_size (or the token budget)"),
    N(f"{R}.log_prob_use_dynamic_bsz", "log-prob passes follow actor.use_dynamic_bsz"),
    N(f"{R}.log_prob_max_token_len_per_gpu", "log-prob passes use actor.max_token_len_per_gpu"),
    N(f"{R}.mode", "the engine runs in the trainer's process (sync and async alike)"),
    N(f"{R}.do_sample", "rollout sampling follows temperature / top_p / top_k"),
    N(f"{R}.ignore_eos", "responses end at EOS"),
    N(f"{R}.cudagraph_capture_sizes", "rollout.compilation_config (null: the batch sizes the trainer sends)"),
    N(f"{R}.data_parallel_size", "one engine per process"),
    N(f"{R}.expert_parallel_size", "vLLM's defaults for MoE"),
    N(f"{R}.pipeline_model_parallel_size", "vLLM runs without pipeline parallelism here"),
    N(f"{R}.max_num_batched_tokens", "vLLM's default (rollout.max_batch_tokens sizes HF waves)"),
    N(f"{R}.logprobs_mode", "the engine's sampled-token log-probs"),
    N(f"{R}.scheduling_policy", "vLLM's fcfs"),
    N(f"{R}.load_format", "weights sync from the actor at start"),
    N(f"{R}.disable_log_stats", "vLLM's statistics are read for rollout/* metrics"),
    N(f"{R}.over_sample_rate", "every sample is waited for"),
    N(f"{R}.multi_stage_wake_up", "rollout.sleep_level decides what is freed"),
    N(f"{R}.skip_rollout", "every step generates"),
    N(f"{R}.skip_dump_dir", "every step generates"),
    N(f"{R}.skip_tokenizer_init", "the engine gets token ids"),
    N(f"{R}.layered_summon", "weights sync through the resharding engine"),
    N(f"{R}.quantization_config_file", "rollout.quantization names the method"),
    N(f"{R}.mtp", "no multi-token prediction here"),
    T(f"{R}.engine_kwargs", "vLLM's own options beyond the rollout keys are not passed"),
    M(f"{R}.multi_turn.enable", "rollout.multi_turn", "true: verl's tools (tool_config_path) as the environment "
      "verl_fast.agents.verl_tools:VerlToolEnvironment", multi_turn),
    M(f"{R}.multi_turn.tool_config_path", "rollout.multi_turn", "verl's tool YAML (class_name, config, tool_schema)",
      multi_turn),
    M(f"{R}.multi_turn.max_assistant_turns", "rollout.multi_turn", "rollout.multi_turn.max_turns", multi_turn),
    M(f"{R}.multi_turn.max_parallel_calls", "rollout.multi_turn", "the calls of one turn that run", multi_turn),
    M(f"{R}.multi_turn.max_tool_response_length", "rollout.multi_turn", "characters of a tool's reply", multi_turn),
    M(f"{R}.multi_turn.tool_response_truncate_side", "rollout.multi_turn", "left, middle, right", multi_turn),
    M(f"{R}.multi_turn.format", "rollout.multi_turn", "hermes (rollout.multi_turn.tool_format)", multi_turn),
    N(f"{R}.multi_turn.interaction_config_path", "verl's interactions are refused: write an Environment "
      "(rollout.multi_turn.environment)", only(f"{R}.multi_turn.interaction_config_path", (None,),
                                                "verl's interactions do not run here; write an Environment")),
    N(f"{R}.multi_turn.max_user_turns", "tool turns follow the assistant's (max_assistant_turns)",
      only(f"{R}.multi_turn.max_user_turns", (None,), "tool turns follow the assistant's; set max_assistant_turns")),
    N(f"{R}.multi_turn.use_inference_chat_template", "the model's chat template renders every turn"),
    N(f"{R}.multi_turn.tokenization_sanity_check_mode", "the turns are tokenized once, as rendered"),
    N(f"{R}.multi_turn.num_repeat_rollouts", "rollout.n samples per prompt",
      only(f"{R}.multi_turn.num_repeat_rollouts", (None,), "rollout.n sets the samples per prompt")),
    T(f"{R}.multi_turn", "verl's multi-turn settings beyond the keys above are not available here"),
    T(f"{R}.agent", "the agent loop is the agents API here"),
    T(f"{R}.checkpoint_engine", "weights sync through the resharding engine"),
    T(f"{R}.trace", "no rollout tracing here"),
    T(f"{R}.layer_name_map", "weights sync by the resharding engine's own name maps"),
    T(f"{R}.prometheus", "trainer.metrics_port serves OpenMetrics"),
    T(f"{R}.profiler", "profiling: time/* metrics"),
    # ------------------------------------------------------------------ the reference
    N(f"{REF}.log_prob_micro_batch_size_per_gpu", "reference passes use actor.micro_batch_size (or the token budget)"),
    N(f"{REF}.log_prob_micro_batch_size", "reference passes use actor.micro_batch_size (or the token budget)"),
    N(f"{REF}.log_prob_use_dynamic_bsz", "reference passes follow actor.use_dynamic_bsz"),
    N(f"{REF}.log_prob_max_token_len_per_gpu", "reference passes use actor.max_token_len_per_gpu"),
    *_fsdp(f"{REF}.fsdp_config", None),
    *_megatron(f"{REF}.megatron", None),
    *_worker_internals(REF),
    # ------------------------------------------------------------------ data
    M("data.train_files", "trainer.dataset", "a file, or a list of files (concatenated)", files),
    M("data.val_files", "trainer.val_dataset", "a file, or a list of files", files),
    M("data.train_batch_size", "trainer.train_batch_size", "prompts per step"),
    M("data.max_prompt_length", "trainer.max_prompt_length", "tokens, after the chat template"),
    M("data.max_response_length", "rollout.max_new_tokens", "tokens per response"),
    M("data.filter_overlong_prompts", "trainer.overlong_prompts", "true: skip; false: data.truncation decides",
      lambda v, g: truncation(g)),
    M("data.truncation", "trainer.overlong_prompts", "error -> error, left -> truncate_left (unless filtered)",
      lambda v, g: truncation(g)),
    M("data.seed", "trainer.seed", "null: trainer.seed's default", seed),
    N("data.prompt_key", "the prompt column is 'prompt'",
      only("data.prompt_key", ("prompt",), "the prompt column must be named prompt")),
    N("data.reward_fn_key", "rows are routed by 'data_source'",
      only("data.reward_fn_key", ("data_source",), "rows are routed by their data_source column")),
    N("data.shuffle", "the prompts are shuffled each epoch with trainer.seed"),
    N("data.validation_shuffle", "validation prompts are taken in order"),
    N("data.gen_batch_size", "dynamic sampling draws train_batch_size prompts per extra draw"),
    N("data.val_batch_size", "validation runs all its prompts in waves of rollout.max_num_seqs"),
    N("data.train_max_samples", "-1: all rows (fewer rows: cut the file)",
      only("data.train_max_samples", (None, -1), "every row is used; cut the file instead")),
    N("data.val_max_samples", "-1: all rows (fewer rows: cut the file)",
      only("data.val_max_samples", (None, -1), "every row is used; cut the file instead")),
    N("data.tokenizer", "the tokenizer is the actor's"),
    N("data.use_shm", "data loads from disk"),
    N("data.trust_remote_code", "datasets load without remote code"),
    N("data.return_raw_chat", "the chat messages are kept with each row"),
    N("data.return_raw_input_ids", "the chat messages are kept with each row"),
    N("data.return_full_prompt", "the chat messages are kept with each row"),
    N("data.dataloader_num_workers", "rows are read in the trainer's process"),
    N("data.filter_overlong_prompts_workers", "rows are read in the trainer's process"),
    N("data.tool_config_path", "tools are configured by the agents API here"),
    N("data.image_key", "text models only here"),
    N("data.video_key", "text models only here"),
    N("data.image_patch_size", "text models only here"),
    N("data.return_multi_modal_inputs", "text models only here"),
    T("data.apply_chat_template_kwargs", "the tokenizer's chat template is applied with its defaults"),
    T("data.custom_cls", "rows are read by RLDataProcessor (parquet, JSONL, JSON, datasets)"),
    T("data.sampler", "prompts are drawn in shuffled epochs"),
    T("data.datagen", "no data generation here"),
    # ------------------------------------------------------------------ algorithm
    M("algorithm.adv_estimator", "algorithm.type", "gae -> ppo; grpo (no std -> drgrpo); rloo; "
      "reinforce_plus_plus(_baseline) -> reinforce_pp(_baseline); remax", estimator),
    M("algorithm.norm_adv_by_std_in_grpo", "algorithm.type", "false with grpo -> drgrpo", std_in_grpo),
    M("algorithm.gamma", "algorithm.gamma"),
    M("algorithm.lam", "algorithm.lam"),
    M("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    M("algorithm.kl_penalty", "algorithm.kl_penalty"),
    M("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    N("algorithm.kl_ctrl.type", "fixed (adaptive is refused)", kl_ctrl),
    N("algorithm.kl_ctrl.horizon", "adaptive KL control only"),
    N("algorithm.kl_ctrl.target_kl", "adaptive KL control only"),
    M("algorithm.filter_groups.enable", "algorithm.dynamic_sampling", "DAPO's group filter"),
    M("algorithm.filter_groups.max_num_gen_batches", "algorithm.max_extra_draws", "batches in all - 1 (<= 0: "
      "our default)", draws),
    N("algorithm.filter_groups.metric", "groups are compared on the samples' rewards"),
    M("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction", "token: truncated token-level IS "
      "weights; null: off", rollout_is),
    M("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction_cap"),
    T("algorithm.rollout_correction", "token-level truncated IS only (rejection sampling, bypass, batch "
                                      "normalisation are not available)"),
    N("algorithm.use_pf_ppo", "no preference-feedback reweighting here",
      only("algorithm.use_pf_ppo", (None, False), "no preference-feedback reweighting")),
    T("algorithm.pf_ppo", "no preference-feedback reweighting here"),
    # ------------------------------------------------------------------ critic
    M("critic.model.path", "critic.model_name", "Hub name or local folder"),
    M("critic.model.enable_gradient_checkpointing", "critic.gradient_checkpointing"),
    M("critic.model.trust_remote_code", "critic.trust_remote_code"),
    N("critic.model.use_remove_padding", "the critic runs padded rows"),
    N("critic.model.tokenizer_path", "the critic reads the actor's tokens"),
    N("critic.model.external_lib", "import custom model code yourself"),
    T("critic.model.override_config", "the model folder's config is used as it is"),
    N("critic.model.use_shm", "models load from disk"),
    N("critic.model.enable_activation_offload", "gradient checkpointing only"),
    N("critic.model.lora_rank", "the critic trains in full", only("critic.model.lora_rank", (None, 0), "the critic trains in full")),
    N("critic.model.lora_alpha", "the critic trains in full"),
    N("critic.model.target_modules", "the critic trains in full"),
    T("critic.model.tiled_mlp", "no tiled MLP here"),
    *_fsdp("critic.model.fsdp_config", "critic"),
    *_megatron("critic.megatron", None),
    N("critic.load_weight", "the critic loads its weights from model.path"),
    N("critic.nccl_timeout", "torch.distributed's default timeout"),
    N("critic.model.lora.rank", "the critic trains in full", only("critic.model.lora.rank", (None, 0),
                                                                   "the critic trains in full")),
    T("critic.model.lora", "the critic trains in full"),
    *_optim("critic.optim", "critic"),
    M("critic.grad_clip", "critic.max_grad_norm"),
    M("critic.ppo_micro_batch_size_per_gpu", "critic.micro_batch_size", "sequences per pass on each rank"),
    M("critic.ppo_micro_batch_size", "critic.micro_batch_size", "deprecated (all GPUs): / WORLD_SIZE", global_micro),
    M("critic.cliprange_value", "critic.cliprange_value"),
    M("critic.loss_agg_mode", "critic.loss_agg_mode"),
    N("critic.ppo_mini_batch_size", "the critic steps with the actor's mini-batches"),
    N("critic.ppo_epochs", "the critic steps with the actor's epochs"),
    N("critic.forward_micro_batch_size_per_gpu", "value passes use critic.micro_batch_size"),
    N("critic.forward_micro_batch_size", "value passes use critic.micro_batch_size"),
    N("critic.use_dynamic_bsz", "the critic's passes are by count (critic.micro_batch_size)"),
    N("critic.ppo_max_token_len_per_gpu", "the critic's passes are by count (critic.micro_batch_size)"),
    N("critic.forward_max_token_len_per_gpu", "the critic's passes are by count (critic.micro_batch_size)"),
    N("critic.shuffle", "the step's sequences are split in order"),
    N("critic.data_loader_seed", "trainer.seed sets the run's randomness"),
    N("critic.enable", "algorithm.type=ppo (adv_estimator gae) trains a critic"),
    *[k for k in _worker_internals("critic") if k.verl != "critic.strategy"],
    M("critic.strategy", "critic.strategy", "fsdp / fsdp2 -> auto; megatron", strategy),
    # ------------------------------------------------------------------ rewards
    M("custom_reward_function.path", "reward_fn.type+reward_fn.path", "callable, path:name (TRL- or verl-style "
      "function)", custom_reward),
    M("custom_reward_function.name", "reward_fn.type+reward_fn.path", "the function in path (compute_score)",
      custom_reward),
    M("reward_model.enable", "reward_fn.type+reward_fn.model_name", "true: reward_model with model.path",
      reward_model),
    M("reward_model.model.path", "reward_fn.type+reward_fn.model_name", "the sequence-classification model "
      "(with enable)", reward_model),
    M("reward_model.model.trust_remote_code", "reward_fn.trust_remote_code"),
    M("reward_model.launch_reward_fn_async", "reward_fn.launch_reward_fn_async"),
    M("reward_model.overlong_buffer.enable", "algorithm.overlong_buffer", "DAPO: true -> len tokens; false -> 0",
      overlong("reward_model.overlong_buffer")),
    M("reward_model.overlong_buffer.len", "algorithm.overlong_buffer", "DAPO: the buffer's tokens (with enable)",
      overlong("reward_model.overlong_buffer")),
    M("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_penalty_factor"),
    M("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer", "as overlong_buffer",
      overlong("reward_model.reward_kwargs.overlong_buffer_cfg")),
    M("reward_model.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer", "as overlong_buffer",
      overlong("reward_model.reward_kwargs.overlong_buffer_cfg")),
    M("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_penalty_factor"),
    N("reward_model.reward_kwargs.overlong_buffer_cfg.log", "the penalty is in the reward's metrics"),
    N("reward_model.reward_kwargs.max_resp_len", "the buffer ends at data.max_response_length"),
    M("reward_model.reward_manager", "reward_fn.manager+reward_fn.on_error", "naive / dapo: per sample (dapo's "
      "overlong buffer: algorithm.overlong_buffer); batch: one call per batch with verl's batched signature; "
      "prime: per sample, a failure scores 0", manager),
    M("reward_manager.name", "reward_fn.manager+reward_fn.on_error", "as reward_model.reward_manager", manager),
    M("custom_reward_function.reward_kwargs", "reward_fn.kwargs", "keyword arguments of every call of the custom "
      "function"),
    N("reward_model.model.update", "PRIME's implicit process reward model (trained online) is not available here",
      refused("reward_model.model.update", "PRIME's implicit process reward model (trained online) is not available "
              "here; score with a rule or a fixed reward model")),
    N("data.filter_accuracy", "PRIME's accuracy filter: algorithm.dynamic_sampling drops groups of one reward",
      refused("data.filter_accuracy", "PRIME's accuracy filter is not available here; DAPO's group filter is "
              "(algorithm.filter_groups.enable)")),
    N(f"{A}.sppo_eta", "SPPO's self-play loss is not available here",
      refused(f"{A}.sppo_eta", "SPPO's self-play preference loss is not available here")),
    T("reward_model.reward_kwargs", "the reward function's own arguments are its defaults"),
    T("reward_model.model", "the reward model loads with transformers' defaults"),
    T("reward_model.rollout", "a generative reward model's engine (not available here)"),
    T("reward_model.sandbox_fusion", "no code sandbox here"),
    T("reward_model.profiler", "profiling: time/* metrics"),
    T("reward_model.megatron", "the reward model runs unsharded"),
    N("reward_model.load_weight", "the reward model loads from model.path"),
    N("reward_model.nccl_timeout", "torch.distributed's default timeout"),
    N("reward_model.micro_batch_size_per_gpu", "the reward model scores a step's samples in one pass per wave"),
    N("reward_model.micro_batch_size", "the reward model scores a step's samples in one pass per wave"),
    N("reward_model.max_length", "the reward model reads the whole sequence"),
    N("reward_model.use_dynamic_bsz", "the reward model's passes are by count"),
    N("reward_model.forward_max_token_len_per_gpu", "the reward model's passes are by count"),
    N("reward_model.strategy", "the reward model runs unsharded"),
    N("reward_model.ulysses_sequence_parallel_size", "no sequence parallelism here"),
    N("reward_model.enable_resource_pool", "one process group"),
    N("reward_model.n_gpus_per_node", "one process group"),
    N("reward_model.nnodes", "one process group"),
    N("reward_model.use_reward_loop", "rewards score in the trainer (a worker thread)"),
    N("reward_model.num_workers", "rewards score in the trainer (a worker thread)"),
    N("reward_model.reward_loop_source", "rewards score in the trainer (a worker thread)"),
    N("reward_model.reward_loop_module_path", "rewards score in the trainer (a worker thread)"),
    N("reward_model.reward_loop_class_name", "rewards score in the trainer (a worker thread)"),
    T("reward_manager", "rows are scored one by one (reward_fn)"),
    # ------------------------------------------------------------------ trainer
    M("trainer.total_epochs", "trainer.num_epochs", "passes over the data (total_training_steps wins)"),
    M("trainer.total_training_steps", "trainer.total_steps", "optimiser steps (null: from total_epochs)"),
    M("trainer.project_name", "trainer.wandb_project"),
    M("trainer.experiment_name", "trainer.run_name"),
    M("trainer.logger", "trainer.loggers", "console, wandb, tensorboard (+ jsonl, always)", logger),
    M("trainer.log_val_generations", "trainer.log_generations"),
    M("trainer.save_freq", "trainer.save_freq", "every N steps; -1: never (verl's default)", never),
    M("trainer.test_freq", "trainer.val_freq", "every N steps; -1: never (verl's default)", never),
    M("trainer.val_before_train", "trainer.val_before_train"),
    M("trainer.default_local_dir", "trainer.output_dir", "checkpoints and metrics"),
    M("trainer.resume_mode", "trainer.resume", "auto / resume_path: true; disable: false", resume_mode),
    M("trainer.resume_from_path", "trainer.resume_from", "a checkpoints/step_N folder"),
    M("trainer.max_actor_ckpt_to_keep", "trainer.save_total_limit", "null: all"),
    M("trainer.device", "trainer.device", "cuda, cpu"),
    M("trainer.balance_batch", "actor.balance_dp", "spread sequences over DP ranks by tokens"),
    N("trainer.critic_warmup", "0 only: the actor updates from the first step",
      only("trainer.critic_warmup", (None, 0), "the actor updates from the first step")),
    N("trainer.val_only", "false only", only("trainer.val_only", (None, False), "validation runs beside training")),
    N("trainer.nnodes", "torchrun --nnodes decides"),
    N("trainer.n_gpus_per_node", "torchrun --nproc_per_node decides"),
    N("trainer.max_critic_ckpt_to_keep", "trainer.save_total_limit keeps whole checkpoints"),
    N("trainer.default_hdfs_dir", "checkpoints are written to trainer.default_local_dir only"),
    N("trainer.del_local_ckpt_after_load", "checkpoints are kept (trainer.save_total_limit)"),
    N("trainer.rollout_data_dir", "trainer.log_generations writes generations.jsonl"),
    N("trainer.validation_data_dir", "trainer.log_generations writes generations.jsonl"),
    N("trainer.esi_redundant_time", "SIGTERM finishes the step and checkpoints"),
    N("trainer.ray_wait_register_center_timeout", "no Ray here"),
    N("trainer.use_legacy_worker_impl", "one worker implementation here"),
    # ------------------------------------------------------------------ the rest of the tree
    T("global_profiler", "profiling: time/* metrics and verl-fast bench"),
    T("ray_kwargs", "no Ray here: torchrun starts the processes"),
    T("transfer_queue", "no transfer queue here"),
    T("hydra", "Hydra's own settings (output folders, logging): no Hydra here"),
]
