"""verl's SFT trainer keys (``torchrun -m verl.trainer.fsdp_sft_trainer``, ``verl/trainer/config/
sft_trainer.yaml``) and what each one is here, where the run is ``algorithm.type: sft``
(``verl-fast sft key=value ...``). The same kinds of entries as ``verl_keys`` (mapped, noted, refused).
"""

from __future__ import annotations

from typing import Any, List

from verl_fast.config.verl_keys import (SKIP, VerlKey, Given, M, N, T, betas, dtype, files, global_micro, logger, never, only,
                                        resume_mode, scheduler, strategy)


def _path(key: str, value: Any, given: Given) -> str:
    """A column (``data.prompt_key``) and the keys into its mappings (``prompt_dict_keys``), dotted."""
    nested = given(f"{key}_dict_keys", None) or []
    if isinstance(nested, str):
        nested = [nested]
    return ".".join([str(given(f"{key}_key", value))] + [str(k) for k in nested])


def columns(value: Any, given: Given) -> Any:
    """The SFT rows' columns: verl's messages column (data.multiturn.enable), or its prompt and response
    columns (with their dict keys)."""
    if given("data.multiturn.enable", False):
        return {"messages": str(given("data.multiturn.messages_key", "messages"))}
    return {"prompt": _path("data.prompt", "question", given), "completion": _path("data.response", "answer", given)}


def sft_truncation(value: Any, given: Given) -> Any:
    if value not in ("error", "right"):
        raise ValueError(f"data.truncation={value} is not available for SFT here; error or right")
    return value


def lora(value: Any, given: Given) -> Any:
    rank = given("model.lora_rank", 0)
    if not rank:
        return SKIP
    targets = given("model.target_modules", "all-linear")
    return {"r": int(rank), "alpha": given("model.lora_alpha", 16),
            "target_modules": targets if targets == "all-linear" else list(targets)}


def per_gpu_batch(value: Any, given: Given) -> Any:
    return SKIP if value is None else value


SFT_COLUMNS = "data.prompt_key / response_key (+ *_dict_keys) or data.multiturn.messages_key"

KEYS: List[VerlKey] = [
    M("model.partial_pretrain", "actor.model_name", "the model to fine-tune: Hub name or local folder"),
    M("model.enable_gradient_checkpointing", "actor.gradient_checkpointing"),
    M("model.trust_remote_code", "actor.trust_remote_code"),
    M("model.lora_rank", "actor.lora", "> 0: LoRA {r, alpha, target_modules}", lora),
    M("model.lora_alpha", "actor.lora", "with lora_rank > 0", lora),
    M("model.target_modules", "actor.lora", "with lora_rank > 0", lora),
    M("model.strategy", "actor.strategy", "fsdp / fsdp2 -> auto (FSDP2 under torchrun)", strategy),
    M("model.fsdp_config.model_dtype", "actor.dtype", "fp32 / bf16 / fp16", dtype),
    N("model.fsdp_config.cpu_offload", "FSDP offload under torchrun: actor.cpu_offload"),
    N("model.fsdp_config.offload_params", "FSDP offload under torchrun: actor.cpu_offload"),
    T("model.fsdp_config", "FSDP internals (wrap policy): FSDP2 wraps each decoder layer"),
    N("model.use_shm", "models load from disk"),
    N("model.external_lib", "import custom model code yourself"),
    N("model.use_liger", "the fused log-prob kernels are ours"),
    N("model.lora_adapter_path", "LoRA starts from fresh adapters here"),
    M("data.train_files", "trainer.dataset", "a file or a list of files", files),
    M("data.val_files", "trainer.val_dataset", "a file or a list of files", files),
    M("data.train_batch_size", "trainer.train_batch_size", "rows per optimiser step"),
    M("data.micro_batch_size_per_gpu", "actor.micro_batch_size", "rows per forward/backward on each rank",
      per_gpu_batch),
    M("data.micro_batch_size", "actor.micro_batch_size", "deprecated (all GPUs): / WORLD_SIZE", global_micro),
    M("data.prompt_key", "algorithm.sft_columns", SFT_COLUMNS, columns),
    M("data.response_key", "algorithm.sft_columns", SFT_COLUMNS, columns),
    M("data.prompt_dict_keys", "algorithm.sft_columns", "keys into the prompt column's mappings", columns),
    M("data.response_dict_keys", "algorithm.sft_columns", "keys into the response column's mappings", columns),
    M("data.multiturn.enable", "algorithm.sft_columns", "true: the messages column (chat turns)", columns),
    M("data.multiturn.messages_key", "algorithm.sft_columns", "the messages column", columns),
    N("data.multiturn.tools_key", "tools in the chat template: not passed to SFT rows here",
      only("data.multiturn.tools_key", (None, "tools"), "SFT rows carry no tools here")),
    N("data.multiturn.enable_thinking_key", "the chat template's defaults",
      only("data.multiturn.enable_thinking_key", (None, "enable_thinking"), "the chat template's defaults")),
    M("data.max_length", "algorithm.sft_max_length", "tokens per row"),
    M("data.truncation", "algorithm.sft_truncation", "error (refused naming the row) or right (cut)",
      sft_truncation),
    N("data.train_max_samples", "-1: all rows", only("data.train_max_samples", (None, -1), "every row is used")),
    N("data.val_max_samples", "-1: all rows", only("data.val_max_samples", (None, -1), "every row is used")),
    N("data.balance_dp_token", "rows are spread over ranks by count"),
    N("data.chat_template", "the tokenizer's own chat template",
      only("data.chat_template", (None,), "the tokenizer's own chat template is used")),
    T("data.custom_cls", "rows are read in TRL's formats (messages, prompt / completion, text)"),
    T("data.apply_chat_template_kwargs", "the chat template's defaults"),
    N("data.use_shm", "data loads from disk"),
    M("optim.lr", "actor.lr", "peak rate"),
    M("optim.weight_decay", "actor.weight_decay"),
    M("optim.clip_grad", "actor.max_grad_norm"),
    M("optim.lr_warmup_steps_ratio", "actor.warmup_ratio"),
    M("optim.lr_scheduler", "actor.lr_scheduler", "cosine, constant (linear too)", scheduler),
    M("optim.warmup_style", "actor.lr_scheduler", "older name of lr_scheduler", scheduler),
    N("optim.betas", "AdamW's betas are (0.9, 0.999) here (verl's SFT default [0.9, 0.95] is not applied); other "
      "values are refused", betas),
    T("optim", "AdamW (torch.optim) is the optimiser here"),
    N("ulysses_sequence_parallel_size", "no sequence parallelism here (1)",
      only("ulysses_sequence_parallel_size", (None, 1), "no sequence parallelism")),
    M("use_remove_padding", "actor.use_remove_padding", "true: packed rows"),
    M("trainer.total_epochs", "trainer.num_epochs", "passes over the data (total_training_steps wins)"),
    M("trainer.total_training_steps", "trainer.total_steps", "optimiser steps (null: from total_epochs)"),
    M("trainer.project_name", "trainer.wandb_project"),
    M("trainer.experiment_name", "trainer.run_name"),
    M("trainer.logger", "trainer.loggers", "console, wandb, tensorboard (+ jsonl, always)", logger),
    M("trainer.seed", "trainer.seed"),
    M("trainer.save_freq", "trainer.save_freq", "every N steps; -1: never (verl's default)", never),
    M("trainer.test_freq", "trainer.val_freq", "every N steps; -1: never (verl's default)", never),
    M("trainer.default_local_dir", "trainer.output_dir", "checkpoints and metrics"),
    M("trainer.max_ckpt_to_keep", "trainer.save_total_limit", "null: all"),
    M("trainer.resume_mode", "trainer.resume", "auto / resume_path: true; disable: false", resume_mode),
    M("trainer.resume_from_path", "trainer.resume_from", "a checkpoints/step_N folder"),
    M("trainer.device", "trainer.device", "cuda, cpu"),
    N("trainer.nnodes", "torchrun --nnodes decides"),
    N("trainer.n_gpus_per_node", "torchrun --nproc_per_node decides"),
    N("trainer.default_hdfs_dir", "checkpoints are written to trainer.default_local_dir only"),
    T("trainer.checkpoint", "checkpoints hold model, optimizer and trainer state"),
    T("hydra", "Hydra's own settings (output folders, logging): no Hydra here"),
]
