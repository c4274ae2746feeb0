"""The config's schema: ``option()`` (a field with its checks and doc) and the section dataclasses,
``Config`` holding one of each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from verl_fast.config.choices import (ALGORITHMS, DPO_LOSSES, ENGINES, KL_ESTIMATORS, LOGGERS, LOSS_AGG_MODES,
                                      OVERLONG_PROMPTS, POLICY_LOSSES, REWARD_ERRORS, REWARD_MANAGERS, REWARDS,
                                      STRATEGIES)


def option(default, *, choices=None, min=None, max=None, above=None, doc: str = ""):
    """A config field with validation metadata (``above``: an exclusive lower bound); the sections of other
    modules (``rollout.multi_turn``'s) declare theirs with it too."""
    kwargs = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"choices": choices, "min": min, "max": max, "above": above, "doc": doc}, **kwargs)


_f = option  # the short name the fields below are written with


DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa", "flash_attention_2", "flex_attention")


@dataclass
class ModelLayoutConfig:
    """How a trained model (actor or critic) is laid out over the ranks: the fields both sections share."""

    # how the model trains over the ranks (verl_fast/strategies/): auto is fsdp2 with several processes,
    # none (a plain module) in one; megatron is the Megatron-core backend
    strategy: str = _f("auto", choices=STRATEGIES, doc="auto: fsdp2 under torchrun, none in one process")
    mixed_precision: str = _f("auto", choices=("auto", "none", "bfloat16"),
                              doc="bf16 parameters in forward/backward, fp32 weights in the optimizer: FSDP with "
                                  "fp32 gradient reduction; an unsharded actor (strategy none) for its policy-gradient "
                                  "log-prob and training passes (strategies/bf16_compute.py). auto: bfloat16 for an "
                                  "unsharded, non-PEFT fp32 actor on a GPU under bf16 autocast (the faster there: "
                                  "docs/benchmarks.md); for a LoRA actor there (and under "
                                  "bfloat16) the frozen base weights are kept in bf16 and the adapters' passes run "
                                  "on bf16 copies of their fp32 weights; otherwise none")
    cpu_offload: bool = _f(False, doc="FSDP: sharded parameters, gradients and optimizer state on the CPU")
    unsharded_accumulation: str = _f("auto", choices=("auto", "on", "off"),
                                     doc="FSDP2: parameters gathered once per step and gradients reduced once, "
                                     "not per micro-batch; costs the whole model's parameters and gradients in "
                                     "memory (auto: on when they fit in a quarter of the device's)")


@dataclass
class ScheduleConfig:
    """The learning-rate schedule of a trained model (actor or critic): verl_fast/trainer/lr_schedule.py."""

    lr_scheduler: str = _f("constant", choices=("constant", "linear", "cosine"),
                           doc="the rate over the run's steps after the warm-up: constant, linear or cosine "
                           "decay towards min_lr_ratio * lr")
    warmup_steps: Optional[int] = _f(None, min=0, doc="steps of linear warm-up to lr (null: warmup_ratio)")
    warmup_ratio: float = _f(0.0, min=0.0, max=1.0, doc="warm-up as a fraction of the run's steps (rounded up)")
    min_lr_ratio: float = _f(0.0, min=0.0, max=1.0, doc="linear / cosine: the final rate as a fraction of lr")


LORA_MAX_RANK = 512  # vLLM's largest LoRA rank


@dataclass
class LoraConfig:
    """``actor.lora``: LoRA adapters through peft (``actor.lora: {r: 16, alpha: 32}``); the base stays
    frozen, the export is the merged model plus the adapter folder."""

    r: Optional[int] = _f(None, min=1, doc="the adapters' rank (required)")
    alpha: Optional[float] = _f(None, min=0.0, doc="the scale's numerator (adapters scaled by alpha / r); null: 2r")
    dropout: float = _f(0.0, min=0.0, max=0.999, doc="dropout on the adapters' input")
    target_modules: Union[str, List[str]] = _f("all-linear", doc="all-linear (every Linear but the output head; a "
                                                "vision-language model's vision tower never) or a list of module "
                                                "names, e.g. [q_proj, v_proj]")

    @property
    def scale_alpha(self) -> float:
        return 2.0 * self.r if self.alpha is None else self.alpha


@dataclass
class ActorConfig(ModelLayoutConfig, ScheduleConfig):
    model_name: Optional[str] = _f(None, doc="Hub name (org/name, from the HF cache or the Hub), local HF "
                                   "folder, or the demo name 'smollm2-135m-instruct'")
    type: str = _f("hf", choices=("hf", "hf_transformers", "vllm"), doc="older spelling: vllm sets rollout.type")
    dtype: str = _f("float32", choices=DTYPES,
                    doc="the dtype a model loaded by name is loaded in; a 16-bit one on a CPU without its matrix "
                        "instructions loads float32, with a one-line notice (torch emulates 16-bit products there, "
                        "tens of times slower)")
    autocast: Optional[str] = _f(None, choices=(None, "none", "auto", "bfloat16", "float16"),
                                 doc="autocast for forward passes and the decode. null (the default): bfloat16 on a "
                                     "GPU that computes it, none on the CPU; auto: bfloat16 wherever the device "
                                     "computes it natively (a GPU, a CPU with AVX512-BF16 / AMX: about half the CPU "
                                     "step), else none")
    lr: float = _f(1e-6, min=0.0, doc="peak rate (lr_scheduler shapes it over the run)")
    weight_decay: float = _f(0.0, min=0.0, doc="AdamW's decoupled weight decay")
    max_grad_norm: float = _f(1.0, min=0.0, doc="0 = no clipping")
    ppo_epochs: int = _f(1, min=1)
    ppo_mini_batch_size: Optional[int] = _f(None, min=1, doc="sequences per optimiser step on each rank (None: the batch)")
    micro_batch_size: int = _f(8, min=1, doc="sequences per forward/backward (when not by token budget)")
    use_dynamic_bsz: Optional[bool] = _f(None, doc="micro-batches by token budget (max_token_len_per_gpu) "
                                         "instead of by count; null (auto): on a GPU (the faster there: fewer, "
                                         "fuller passes), off on the CPU and under strategy megatron")
    max_token_len_per_gpu: Optional[int] = _f(None, min=1, doc="the token budget of a micro-batch (use_dynamic_bsz); "
                                              "null (auto): on a GPU the largest the free memory holds by "
                                              "trainer/batching.token_budget's estimate, at most the step's tokens "
                                              "(one micro-batch: the fastest measured at 0.5B and 1.5B); 16384 "
                                              "on the CPU")
    balance_dp: bool = _f(True, doc="spread each step's sequences over DP ranks by token count")
    clip_ratio: Optional[float] = _f(None, min=0.0, doc="sets clip_ratio_low and clip_ratio_high")
    clip_ratio_low: float = _f(0.2, min=0.0)
    clip_ratio_high: float = _f(0.2, min=0.0)
    clip_ratio_c: float = _f(3.0, min=1.0, doc="dual-clip bound for negative advantages (> 1)")
    policy_loss: str = _f("vanilla", choices=POLICY_LOSSES, doc="vanilla (PPO-clip), gspo (sequence-level "
                          "ratio and clip), gspo_token, cispo (clipped IS weight, stop-gradient, times log-prob: "
                          "clip_ratio_low/high bound the weight), sapo (soft gate, sapo_tau_pos / sapo_tau_neg)")
    sapo_tau_pos: float = _f(1.0, min=0.0, doc="policy_loss sapo: the gate's temperature for positive advantages (> 0)")
    sapo_tau_neg: float = _f(1.05, min=0.0, doc="policy_loss sapo: the gate's temperature for other advantages (> 0)")
    loss_agg_mode: str = _f("token-mean", choices=LOSS_AGG_MODES)
    loss_scale_factor: Optional[float] = _f(None, doc="seq-mean-token-sum-norm: the constant each sequence's "
                                            "token sum is divided by (null: rollout.max_new_tokens)")
    entropy_coeff: float = _f(0.0, min=-1.0, max=1.0, doc="entropy bonus coefficient (typically 0 to 0.01)")
    use_kl_loss: bool = _f(False)
    kl_loss_coef: float = _f(0.001, min=0.0, max=100.0)
    kl_loss_type: str = _f("low_var_kl", choices=KL_ESTIMATORS)
    fused_logprobs: str = _f("auto", choices=("auto", "on", "off"), doc="fused lm_head + log-prob kernels")
    use_remove_padding: Optional[bool] = _f(None, doc="log-prob and training passes on the rows packed without "
                                            "padding (torch's varlen flash attention; a group's prompt once with "
                                            "share_prompt_forward); null (auto): on for an HF actor on a GPU under "
                                            "bf16 / fp16 where torch has varlen_attn (elsewhere a per-sequence loop)")
    gradient_checkpointing: Optional[bool] = _f(None, doc="recompute each layer's activations in the backward "
                                                "(null, auto: on when the free memory left after the weights, "
                                                "gradients and optimizer states cannot hold, unrecomputed, one "
                                                "prompt group's activations or a micro-batch large enough that "
                                                "splitting the update costs less than recomputing, "
                                                "strategies/memory_plan.py)")
    optimizer: str = _f("adamw", choices=("adamw", "adamw_8bit"),
                        doc="adamw: torch's, fp32 states (8 bytes a trained parameter); adamw_8bit: torchao's "
                            "AdamW8bit, block-quantised states (2 bytes: a quarter of adamw's; pip install "
                            "torchao)")
    compile_blocks: Optional[bool] = _f(None, doc="torch.compile the norms and MLPs of the training and log-prob "
                                        "passes (llama / mistral / qwen2 / qwen3; the language model of qwen2_vl / "
                                        "qwen2_5_vl); null (auto): on for an unsharded, non-PEFT actor on a GPU "
                                        "(gradient_checkpointing's recompute runs them compiled too)")
    trust_remote_code: bool = _f(False, doc="actor and reference: let transformers run the model folder's own code")
    attn_implementation: Optional[str] = _f(None, choices=ATTN_IMPLEMENTATIONS,
                                            doc="None: transformers' default; flash_attention_2 needs flash-attn")
    lora: Optional[LoraConfig] = _f(None, doc="LoRA adapters through peft: {r, alpha, dropout, target_modules} "
                                    "(the keys below, under actor.lora); null: every weight trains")
    skip_zero_advantage: bool = _f(True, doc="leave samples whose advantages are all 0 out of the backward")
    freeze_vision_tower: bool = _f(True, doc="a vision-language actor (Qwen2-VL / Qwen2.5-VL): its vision tower "
                                   "(and merger) stays frozen; LoRA adapts the language model only either way")
    tensor_model_parallel_size: int = _f(1, min=1, doc="strategy megatron: TP size")
    pipeline_model_parallel_size: int = _f(1, min=1, doc="strategy megatron: PP size")
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, min=1, doc="strategy megatron: model chunks "
                                                             "per PP rank")
    expert_model_parallel_size: int = _f(1, min=1, doc="strategy megatron: EP size (MoE families)")
    share_prompt_forward: bool = _f(True, doc="log-prob passes run each prompt once for all its samples "
                                              "(same log-probs and gradients, fewer tokens; with fused_logprobs "
                                              "only under use_remove_padding)")
    routing_replay: bool = _f(False, doc="MoE (Qwen2-MoE / Qwen3-MoE, HF or Megatron actor): the old-log-prob "
                                         "and training forwards route each token to the experts the rollout "
                                         "chose (the gate's softmax weights on them stay differentiable); sets "
                                         "rollout.record_routing")
    # older spelling: rollout-engine settings written in the actor section (copied to rollout)
    model_path: Optional[str] = _f(None, doc="alias of model_name")
    tensor_parallel_size: Optional[int] = _f(None, min=1)
    enable_prefix_caching: Optional[bool] = _f(None)
    max_num_seqs: Optional[int] = _f(None, min=1)
    gpu_memory_utilization: Optional[float] = _f(None, min=0.0, max=1.0)
    max_model_len: Optional[int] = _f(None, min=1)
    enable_chunked_prefill: Optional[bool] = _f(None)


@dataclass
class CriticConfig(ModelLayoutConfig, ScheduleConfig):
    model_name: Optional[str] = _f(None, doc="Hub name or local HF folder of the critic's base model (PPO)")
    type: str = _f("hf_transformers", choices=("hf", "hf_transformers"))
    dtype: str = _f("float32", choices=DTYPES, doc="as actor.dtype")
    lr: float = _f(1e-5, min=0.0, doc="peak rate (lr_scheduler shapes it over the run)")
    weight_decay: float = _f(0.0, min=0.0, doc="AdamW's decoupled weight decay")
    max_grad_norm: float = _f(1.0, min=0.0)
    micro_batch_size: int = _f(8, min=1)
    cliprange_value: float = _f(0.5, min=0.0)
    loss_agg_mode: str = _f("token-mean", choices=LOSS_AGG_MODES)
    loss_scale_factor: Optional[float] = _f(None, doc="seq-mean-token-sum-norm: the constant each sequence's "
                                            "token sum is divided by (null: rollout.max_new_tokens)")
    use_flash_attention: bool = _f(False, doc="flash_attention_2 where flash-attn and CUDA are there, else sdpa")
    trust_remote_code: bool = _f(False, doc="let transformers run the model folder's own code")
    attn_implementation: Optional[str] = _f(None, choices=ATTN_IMPLEMENTATIONS,
                                            doc="None: transformers' default; flash_attention_2 needs flash-attn")
    gradient_checkpointing: bool = _f(False)


@dataclass
class RolloutConfig:
    type: str = _f("auto", choices=ENGINES,
                   doc="auto: hf for a whole dense actor (unsharded; LoRA adapters merged for the decode) on one "
                       "GPU, its decode compiled (the faster there: docs/benchmarks.md); otherwise vllm when "
                       "installed and configure_vllm_env() has run (the CLI runs it), else hf")
    n: int = _f(8, min=1, doc="samples per prompt")
    temperature: float = _f(1.0, min=0.0)
    top_p: float = _f(1.0, above=0.0, max=1.0, doc="nucleus sampling: the probability mass kept, in (0, 1]")
    top_k: int = _f(-1, min=-1)
    max_new_tokens: int = _f(64, min=1, doc="response length")
    seed: int = _f(0)
    dtype: str = _f("auto", choices=("auto",) + DTYPES)
    tensor_parallel_size: int = _f(1, min=1)
    gpu_memory_utilization: float = _f(0.5, min=0.0, max=1.0, doc="vLLM's share of the GPU it checks for at start "
                                       "(and sizes the KV cache by when kv_cache_gib is 0)")
    kv_cache_gib: Optional[float] = _f(None, min=0.0, doc="vLLM's KV cache on a GPU (null: what one step's sequences "
                                       "need at max_model_len, x1.25, which keeps sleep and wake cheap; 0: "
                                       "gpu_memory_utilization's share)")
    enable_prefix_caching: bool = _f(True)
    max_num_seqs: int = _f(256, min=1)
    max_model_len: Optional[int] = _f(None, min=1)
    enable_chunked_prefill: Optional[bool] = _f(None)
    enable_sleep_mode: bool = _f(True, doc="free the engine's GPU memory during training")
    sleep_level: Optional[int] = _f(None, choices=(0, 1, 2), doc="during training (GPU): 0 frees the KV cache, "
                                    "1 also offloads the weights to the host, 2 discards them (the next sync "
                                    "refills them); null (auto): 0 when the weights take at most 1/8 of the GPU, else 2; 1 for a "
                                    "LoRA actor (base weights kept)")
    enforce_eager: Optional[bool] = _f(None, doc="vLLM without torch.compile and CUDA graphs (null: on the CPU "
                                       "only); faster to start, slower to decode")
    compilation_config: Optional[Dict[str, Any]] = _f(None, doc="vLLM's compilation_config as is (null: CUDA "
                                                      "graphs for the batch sizes the trainer sends only)")
    length_buckets: str = _f("auto", choices=("auto", "on", "off"),
                             doc="send prompts in length-bucketed waves (auto: on for hf, off for vllm, "
                                 "whose own scheduler batches continuously)")
    max_batch_tokens: Optional[int] = _f(None, min=1, doc="worst-case tokens per wave (default: "
                                         "max_num_seqs * (max_prompt_length + max_new_tokens))")
    record_routing: bool = _f(False, doc="MoE: the rollout records each token's top-k experts per layer; the "
                                         "update reports actor/routing_changed_frac, the share of tokens whose "
                                         "experts its forward would change (replayed with actor.routing_replay)")
    partial_step_tokens: int = _f(0, min=0, doc="synchronous partial rollouts (0: off): the most new tokens a "
                                  "sample gets in one step; the samples still running then are carried into the "
                                  "next step with their tokens and behaviour log-probs (needs "
                                  "algorithm.rollout_correction; verl_fast/rollout/partial.py, docs/rollout.md)")
    partial_round_tokens: Optional[int] = _f(None, min=1, doc="partial rollouts: the rollout decodes in rounds of "
                                             "this many tokens and stops after the round that completes as many "
                                             "prompts' groups as the step trains (null: one round of "
                                             "partial_step_tokens)")
    partial_max_carry: Optional[int] = _f(None, min=1, doc="partial rollouts: a group carried this many steps is "
                                          "finished in the step whatever the budget (no token trained more than "
                                          "this many versions old); null: the steps a sample needs to reach "
                                          "max_new_tokens on the step budgets alone, ceil(max_new_tokens / "
                                          "partial_step_tokens) - 1, at least 1 and at most 4")
    hf_fast_decode: str = _f("auto", choices=("auto", "on", "off"),
                             doc="type hf: static-KV-cache decoding of the whole batch, CUDA graphs on a GPU "
                                 "(auto: on a GPU); off: model.generate")
    hf_compile_decode: Optional[bool] = _f(None, doc="type hf, fast decode: the decode steps' forward compiled "
                                           "by torch.compile (fewer, fused kernels per token; a Llama-family "
                                           "layer's q/k/v and gate/up products merged into one each; compiled "
                                           "at the first rollout (docs/benchmarks.md gives the time), and once more, "
                                           "lengths symbolic, at the first of another prompt width); null: on a "
                                           "GPU for an unsharded actor")
    hf_compact_rows: str = _f("auto", choices=("auto", "on", "off"),
                              doc="type hf, fast decode: finished rows leave the batch as the rest fit a smaller "
                                  "one (the KV cache shrinks with it; a new graph capture per batch size); auto: "
                                  "off on a GPU, where the step's time barely falls with its rows "
                                  "(docs/hotpaths.md), on elsewhere")
    hf_fused_kernels: str = _f("off", choices=("auto", "on", "off"),
                               doc="type hf, fast decode: the decode steps' fused Triton kernels (a Llama-family "
                                   "layer's rotary embedding and KV-cache write in one kernel; the sampling, its "
                                   "log-prob and the rows' bookkeeping in one where no top-k / top-p is set); "
                                   "auto: on a GPU; off (the default until they are measured on one): the "
                                   "torch / Inductor forms (docs/hotpaths.md)")
    quantization: Optional[str] = _f(None, doc="fp8: the engine's linear layers in FP8 e4m3, written by every "
                                     "weight sync (vllm: block-FP8 layers, 128x128 scales, a GPU; hf: per-channel "
                                     "scales, torch._scaled_mm on a GPU of compute capability 8.9+, emulated "
                                     "elsewhere); algorithm.rollout_correction then defaults to on. Other values "
                                     "(awq, gptq, ...): vLLM's quantized base under a PEFT actor only")
    kv_cache_dtype: str = _f("auto", choices=("auto", "fp8"), doc="vLLM's KV cache dtype (fp8: e4m3, half the "
                             "bytes of bf16); rollout.type vllm only")
    multi_turn: Optional[Dict[str, Any]] = _f(None, doc="multi-turn rollouts with tools or an environment: {tools: "
                                              "[module:function, ...], environment, max_turns, ...}; the keys: "
                                              "verl_fast/agents/settings.py, docs/agents.md")
    server: Optional[Dict[str, Any]] = _f(None, doc="an agent program drives the rollout through an OpenAI-compatible "
                                          "endpoint on this engine: {agent: module:function, concurrency, timeout_s, "
                                          "...}; the keys: verl_fast/agents/server_settings.py, docs/agents.md")
    speculative_config: Optional[Dict[str, Any]] = _f(None, doc="rejected: RL must sample from the policy")
    guided_decoding: Optional[Dict[str, Any]] = _f(None, doc="rejected: RL must sample from the policy")


@dataclass
class RewardConfig:
    type: str = _f("auto", choices=REWARDS, doc="auto: each row scored as its data_source names (verl's routing: "
                   "openai/gsm8k, the MATH family, math_dapo / aime*, searchR1_*; reasoning_gym/<task>); reasoning_gym, "
                   "gsm8k, callable, reward_model, code (the response's program against the row's tests, "
                   "sandboxed), judge (a generative model's verdict), pairwise_ranking (DPO), weighted (a list)")
    path: Optional[str] = _f(None, doc="'module:function' for type callable")
    kwargs: Dict[str, Any] = _f(dict, doc="type callable: keyword arguments given to the function on every call "
                                "(verl's custom_reward_function.reward_kwargs)")
    manager: str = _f("naive", choices=REWARD_MANAGERS, doc="type callable: how the function is called, as verl's "
                      "reward_model.reward_manager: naive / dapo (per sample), batch (once per batch: data_sources, "
                      "solution_strs, ground_truths, extra_infos), prime (per sample, a failure scores 0)")
    model_name: Optional[str] = _f(None, doc="sequence-classification model (Hub name or local folder) for "
                                   "type reward_model")
    reference_free: bool = _f(False, doc="dpo / online_dpo: DPO without a reference model")
    trust_remote_code: bool = _f(False, doc="reward model: let transformers run the model folder's own code")
    attn_implementation: Optional[str] = _f(None, choices=ATTN_IMPLEMENTATIONS,
                                            doc="None: transformers' default; flash_attention_2 needs flash-attn")
    on_error: str = _f("raise", choices=REWARD_ERRORS, doc="a sample whose scoring fails: raise, or score 0 "
                       "(counted as reward/errors)")
    timeout_s: Optional[float] = _f(300.0, min=0.0, doc="seconds one batch's scoring may take; past that the run "
                                    "checkpoints its last complete step and stops (null: no limit, scored in the "
                                    "trainer's own thread)")
    launch_reward_fn_async: Optional[bool] = _f(None, doc="score a step's samples in a thread while the old-log-prob, "
                                                "reference and value passes run (verl's name; the section's own "
                                                "setting, not a list entry's): where the step has such a pass, no "
                                                "dynamic sampling, and every reward function scores in a worker "
                                                "thread anyway (timeout_s set, not a reward model); null (auto): on "
                                                "when the trainer runs on a GPU (on a CPU a reward that computes in "
                                                "Python takes cores from the passes; one that waits, e.g. on a "
                                                "sandbox, gains: docs/data-and-rewards.md)")
    weight: float = _f(1.0, doc="in a list of reward functions: this one's weight in the sample's reward "
                       "(the weighted sum)")
    name: Optional[str] = _f(None, doc="in a list of reward functions: this one's metric reward/<name>/mean "
                             "(default: the function's name, or the type)")
    judge: Optional[Dict[str, Any]] = _f(None, doc="type judge: the judge {engine (rollout: the run's own "
                                         "rollout engine, the default; model_name; url), prompt_template, parser, "
                                         "max_score, verdicts, ...}; the keys: verl_fast/rewards/judge.py, "
                                         "docs/agents.md")
    sandbox: Optional[Dict[str, Any]] = _f(None, doc="type code: the sandbox of the model's programs {isolation, "
                                           "cpu_s, wall_s, memory_mb, output_bytes, processes, file_mb, workers, "
                                           "tests_key}; the keys: verl_fast/rewards/code.py, docs/agents.md")
    functions: List[Dict[str, Any]] = _f(list, doc="type weighted: the reward functions, each a reward_fn "
                                         "mapping of its own (type, path, weight, name, on_error, ...; on_error "
                                         "and timeout_s default to this section's); written as a list, "
                                         "reward_fn: [...] means type weighted")


@dataclass
class AlgorithmConfig:
    type: str = _f("grpo", choices=ALGORITHMS)
    gamma: float = _f(1.0, min=0.0, max=1.0)
    lam: float = _f(1.0, min=0.0, max=1.0)
    epsilon: float = _f(1e-6, min=0.0)
    use_kl_in_reward: bool = _f(False)
    kl_penalty: str = _f("kl", choices=KL_ESTIMATORS)
    kl_coef: float = _f(0.001, min=0.0, max=100.0)
    rollout_correction: Optional[bool] = _f(None, doc="weight each token's policy loss by min(exp(old_logprob - "
                                            "rollout_logprob), rollout_correction_cap), the rollout engine's own "
                                            "log-probs (null: on with rollout.quantization fp8, else off)")
    rollout_correction_cap: float = _f(2.0, min=0.0, doc="rollout_correction: the truncation of the weights (> 0)")
    dynamic_sampling: bool = _f(False, doc="DAPO: drop prompts whose samples all score the same and draw more "
                                "(group-baseline algorithms, one process)")
    max_extra_draws: int = _f(3, min=0, doc="dynamic_sampling: extra draws of train_batch_size prompts per step, at most")
    overlong_buffer: int = _f(0, min=0, doc="DAPO: responses longer than max_new_tokens - this many tokens lose up to "
                              "overlong_penalty_factor of reward, linearly (0: off)")
    overlong_penalty_factor: float = _f(1.0, min=0.0, doc="overlong_buffer: the penalty at max_new_tokens")
    beta: Optional[float] = _f(None, min=0.0, doc="dpo / online_dpo / kto / orpo / simpo / cpo: the loss's temperature (null: 0.1); the "
                               "policy-gradient algorithms: TRL's KL coefficient, as actor.use_kl_loss with "
                               "kl_loss_coef=beta and kl_loss_type=k3 (TRL's estimator; 0: no KL)")
    loss_type: str = _f("sigmoid", choices=DPO_LOSSES, doc="DPO loss (preference_losses.py names each one's paper)")
    label_smoothing: float = _f(0.0, min=0.0, max=0.5, doc="DPO: sigmoid's conservative smoothing, robust's "
                                "flip rate (< 0.5), exo_pair's target eps (> 0)")
    discopop_tau: float = _f(0.05, min=0.0, doc="DPO loss_type discopop: the temperature of its mixing weight (> 0)")
    sft_weight: float = _f(0.0, min=0.0, doc="DPO: weight of the chosen responses' mean token NLL added to the "
                           "loss (RPO)")
    simpo_gamma: float = _f(0.5, doc="SimPO: the target reward margin gamma (algorithm.type=simpo)")
    cpo_alpha: Optional[float] = _f(None, min=0.0, doc="CPO / SimPO: weight of the chosen responses' mean token "
                                    "NLL (null: 1 for cpo, 0 for simpo, as their papers)")
    sft_max_length: int = _f(2048, min=2, doc="SFT: tokens a row is cut to (algorithm.type=sft)")
    sft_truncation: str = _f("right", choices=("right", "error"), doc="SFT: a row longer than sft_max_length is cut "
                             "(right) or refused naming the row (error, verl's default)")
    sft_columns: Dict[str, str] = _f(dict, doc="SFT: the columns read as prompt / completion / messages, each a "
                                     "column or a dotted path into one (verl's data.prompt_key + prompt_dict_keys); "
                                     "a string prompt read so is the user's message, through the chat template")
    kto_desirable_weight: float = _f(1.0, min=0.0, doc="KTO: lambda_D, the weight of desirable (label true) "
                                     "completions' losses")
    kto_undesirable_weight: float = _f(1.0, min=0.0, doc="KTO: lambda_U, the weight of undesirable (label false) "
                                       "completions' losses")


@dataclass
class TrainerConfig:
    total_steps: Optional[int] = _f(None, min=1, doc="optimiser steps (None: num_epochs over the data)")
    num_epochs: int = _f(1, min=1)
    train_batch_size: int = _f(4, min=1, doc="prompts (or preference pairs) per step")
    seed: int = _f(0)
    device: str = _f("auto", choices=("auto", "cpu", "cuda"))
    tf32: Optional[bool] = _f(None, doc="TF32 tensor cores for float32 matmuls and convolutions left outside "
                              "autocast (null: on for a GPU run)")
    output_dir: str = _f("runs/verl_fast")
    save_freq: int = _f(0, min=-1, doc="checkpoint every N steps (0: only at the end; -1: never, verl's -1, though "
                        "a run stopped by a signal still saves)")
    resume: bool = _f(True, doc="continue from the latest complete checkpoint in output_dir (trainer.resume_from, "
                      "when set, names the checkpoint instead)")
    overwrite: bool = _f(False, doc="clear an older run's checkpoints and metrics from output_dir at start "
                                                "(at every start: unset it to resume later)")
    hf_export: str = _f("final", choices=("final", "every", "none"),
                        doc="HF safetensors beside which checkpoints (the sharded state is always written)")
    dataset: Optional[Union[str, List[str]]] = _f(None, doc="parquet/jsonl/json path, datasets folder, Hub dataset "
                                                  "name (org/name or org/name:split, through datasets.load_dataset), "
                                                  "reasoning_gym:<task>, or verifiers:<env> (a verifiers environment's "
                                                  "dataset, dataset_kwargs its arguments); a list of files: their rows "
                                                  "in turn")
    dataset_kwargs: Dict[str, Any] = _f(dict)
    val_dataset: Optional[Union[str, List[str]]] = _f(None, doc="validation prompts, in the formats of trainer.dataset (null: no "
                                    "validation)")
    val_dataset_kwargs: Dict[str, Any] = _f(dict, doc="as dataset_kwargs, for val_dataset")
    val_freq: int = _f(0, min=-1, doc="validate after every N-th step and after the last one (0: after the last "
                       "one only; -1: never after a step, verl's -1)")
    val_before_train: bool = _f(False, doc="validate before the first step too (logged as step 0)")
    val_n: int = _f(1, min=1, doc="validation samples per prompt")
    val_temperature: float = _f(0.0, min=0.0, doc="validation sampling temperature (0: greedy)")
    val_top_p: float = _f(1.0, above=0.0, max=1.0, doc="validation nucleus sampling")
    val_max_new_tokens: Optional[int] = _f(None, min=1, doc="validation response length (null: "
                                           "rollout.max_new_tokens)")
    log_generations: int = _f(0, min=0, doc="log the first N prompts / responses / rewards of every step and "
                              "validation (generations.jsonl, TensorBoard text, a wandb table)")
    system_prompt: Optional[str] = _f(None)
    max_prompt_length: int = _f(512, min=1)
    overlong_prompts: str = _f("skip", choices=OVERLONG_PROMPTS, doc="prompts over max_prompt_length: skip "
                               "(counted as data/skipped_overlong), error, or truncate_left (the reward sees the "
                               "kept text)")
    image_min_pixels: Optional[int] = _f(None, min=1, doc="prompts with images: each image is resized to at "
                                         "least this many pixels (null: the processor's own bound)")
    image_max_pixels: Optional[int] = _f(None, min=1, doc="prompts with images: each image is resized to at "
                                         "most this many pixels (its tokens: pixels / 784 for Qwen2-VL; null: the "
                                         "processor's own bound)")
    image_max_input_pixels: int = _f(64 * 1024 * 1024, min=1, doc="a dataset image larger than this (width x "
                                     "height, before resizing) is refused, naming its row")
    progress_bar: bool = _f(True)
    metrics_port: Optional[int] = _f(None, min=0, max=65535)
    metrics_host: str = _f("127.0.0.1", doc="address the metrics endpoint binds (0.0.0.0: every interface)")
    loggers: List[str] = _f(lambda: ["console", "jsonl"], choices=LOGGERS,
                            doc="where step metrics go (tensorboard and wandb need their packages)")
    plot: bool = _f(True, doc="reward-curve PNG at the end (needs matplotlib: the plot extra)")
    wandb_project: str = _f("verl_fast", doc="the wandb project of the run (loggers: [wandb])")
    run_name: Optional[str] = _f(None, doc="the run's name in wandb and in the model card (None: output_dir's "
                                 "folder name)")
    save_total_limit: Optional[int] = _f(None, min=1, doc="complete checkpoints kept in output_dir, the "
                                         "newest (older ones removed after each save; None: all)")
    resume_from: Optional[str] = _f(None, doc="a checkpoint folder (checkpoints/step_N, of this run or another) "
                                    "to start from instead of output_dir's newest")
    hub_model_id: Optional[str] = _f(None, doc="Hub repository (org/name) the final HF export is uploaded to "
                                     "(huggingface_hub; the token from HF_TOKEN or huggingface-cli login)")
    hub_private: bool = _f(True, doc="create hub_model_id as a private repository when it does not exist")
    # asynchronous RL (verl_fast/async_rl/; docs/async.md)
    async_mode: str = _f("off", choices=("off", "one_step", "full"),
                         doc="off: generate, then update, step by step; one_step: step t+1's rollout runs in a "
                             "thread while step t updates, on a copy of the weights at version t; full: rollout "
                             "workers in processes of their own fill a bounded queue, weights pushed by version")
    max_staleness: int = _f(1, min=1, doc="async_mode: no token sampled by a policy more than this many versions "
                            "(optimiser steps) older than the one that trains on it is ever trained on")
    async_workers: int = _f(1, min=1, max=64, doc="async_mode full: rollout worker processes (on the GPUs the "
                            "trainer leaves free when there are several; sharing the one otherwise)")
    partial_rollouts: bool = _f(True, doc="async_mode full: a weight push mid-generation reaches the sequences in "
                                "flight, which continue under the new weights, each token tagged with its version")
    # older spellings of actor settings (copied to the actor section)
    per_device_train_batch_size: Optional[int] = _f(None, min=1, doc="alias: actor.micro_batch_size")
    gradient_accumulation_steps: Optional[int] = _f(None, min=1)
    learning_rate: Optional[float] = _f(None, min=0.0, doc="alias: actor.lr")
    max_grad_norm: Optional[float] = _f(None, min=0.0, doc="alias: actor.max_grad_norm")


@dataclass
class GuardrailsConfig:
    """Checks against silent failure, on by default: each writes ``guardrails/*`` metrics and warns in one
    line or stops the run naming what it found (``trainer/guardrails.py``, docs/faults.md#guardrails)."""

    sync_check: bool = _f(True, doc="at every rollout (the first after each weight sync), the engine's "
                          "log-probs of its sampled tokens against the actor's, at no extra pass (the step's old "
                          "log-probs, else the update's own forward); past sync_logprob_tolerance the run stops "
                          "naming the parameter groups that differ")
    sync_logprob_tolerance: float = _f(0.5, above=0.0, doc="sync_check: the largest mean |engine - actor| "
                                       "log-prob per response token (nats) of the checked samples")
    truncation_threshold: float = _f(0.5, min=0.0, max=1.0, doc="warn when response/truncated is above this "
                                     "for truncation_steps steps in a row")
    truncation_steps: int = _f(3, min=1, doc="truncation_threshold's steps in a row")
    flat_groups_threshold: float = _f(0.9, min=0.0, max=1.0, doc="warn when more than this share of the "
                                      "step's prompt groups score all their samples the same (no signal), or "
                                      "every sample of the batch scores the same, for flat_groups_steps in a row")
    flat_groups_steps: int = _f(3, min=1, doc="flat_groups_threshold's steps in a row")
    all_none_rewards: str = _f("error", choices=("error", "warn"), doc="a batch every reward function "
                               "answered None (not applicable) for: error stops the run (it would train on 0.0); "
                               "warn trains on 0.0")
    max_nonfinite_steps: int = _f(3, min=0, doc="optimiser steps in a row skipped for a NaN / inf gradient "
                                  "(each named in a warning) before the run stops (0: never)")
    watchdog: str = _f("warn", choices=("off", "warn", "stop"), doc="a phase (generation, reward, update, "
                       "sync, checkpoint) past its expected time prints the phase, the rank and its Python stack; "
                       "stop also ends the run: SIGTERM (the step finishes, checkpoints, exits), then after as "
                       "long again exit 124, the last complete checkpoint intact")
    watchdog_factor: float = _f(10.0, min=1.0, doc="watchdog: a phase's expected time is this times its "
                                "longest earlier run (and at least watchdog_min_s)")
    watchdog_min_s: float = _f(600.0, above=0.0, doc="watchdog: the shortest expected time of any phase")
    watchdog_first_s: float = _f(3600.0, above=0.0, doc="watchdog: a phase's expected time at its first run")


@dataclass
class Config:
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward_fn: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    guardrails: GuardrailsConfig = field(default_factory=GuardrailsConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)
