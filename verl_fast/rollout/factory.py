"""The rollout engine a run's config asks for, built beside its actor.

- ``rollout.type: hf``: ``generate`` on the actor itself (no second copy of the weights).
- ``rollout.type: vllm``: vLLM's ``LLM`` in this process. Under torchrun every rank runs one
  (``external_launcher``: TP groups of ``rollout.tensor_parallel_size`` consecutive ranks, the
  groups serving the world's prompts data-parallel, see ``data_parallel.py``); the actor may be
  sharded (FSDP1 / FSDP2), its weights move with ``engine.sync_from(actor)``.
- ``rollout.type: auto``: vLLM when it is installed and the process is set up to run it in process
  (``configure_vllm_env()``, which the CLI calls), else HF.

The engine comes back generating with the actor's weights: loaded from ``model_path`` (which must
hold them), or, without it, from a folder holding only the actor's config and tokenizer with
placeholder weights (vLLM's ``load_format="dummy"``) overwritten at once by ``sync_from(actor)``,
so no full copy of a sharded actor is ever gathered.
"""

from __future__ import annotations

import tempfile
from typing import Any, Optional

import torch

from verl_fast import distributed
from verl_fast.config import Config
from verl_fast.models.wrapping import hf_module
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.hf_engine import HFGenerateEngine


def resolve_type(kind: str) -> str:
    """``auto`` -> ``vllm`` when vLLM is installed and set up to run in this process, else ``hf``."""
    if kind != "auto":
        return kind
    from verl_fast.rollout import vllm_available

    if not vllm_available():
        return "hf"
    from verl_fast.rollout.vllm_compat import in_process_mode

    return "vllm" if in_process_mode() else "hf"


def build_engine(cfg: Config, actor: torch.nn.Module, tokenizer: Any, model_path: Optional[str] = None,
                 autocast_dtype: Optional[torch.dtype] = None, source: Any = None) -> RolloutEngine:
    """The engine for ``cfg.rollout`` (see the module docstring); collective under torchrun. ``source``:
    what a vLLM engine takes its weights from, when not the actor itself (the Megatron actor)."""
    kind, quantization = resolve_type(cfg.rollout.type), cfg.rollout.quantization
    if quantization and (kind == "hf" or not hasattr(actor, "peft_config")):
        raise ValueError(f"rollout.quantization={quantization} is not supported with " + (
            "HF generate rollout (it runs the actor's own weights); use rollout.type=vllm" if kind == "hf" else
            "a full-weight actor: the engine's quantized weights cannot take the trainer's updates; train a "
            "LoRA (PEFT) actor on the quantized base, whose adapter is what moves, or drop rollout.quantization"))
    if kind == "hf":
        return HFGenerateEngine(actor, tokenizer, autocast_dtype=autocast_dtype, fast_decode=cfg.rollout.hf_fast_decode)
    from verl_fast.rollout.data_parallel import DataParallelEngine
    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

    r = cfg.rollout
    world = distributed.world_size()
    peft = hasattr(actor, "peft_config")
    if peft and model_path is None:
        raise ValueError("a PEFT actor with rollout.type=vllm needs model_path (the base model's folder); "
                         "the adapter is pushed to the engine after each update")
    if world > 1 and world % r.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the number of "
                         f"processes ({world}): each group of that many consecutive ranks runs one engine")
    kwargs = {"quantization": r.quantization} if r.quantization else {}
    folder = None
    if model_path is None:
        folder = tempfile.TemporaryDirectory(prefix="verl_fast_actor_")
        model_path = folder.name
        hf_module(actor).config.save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
        kwargs["load_format"] = "dummy"
    if world > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    dtype = r.dtype if r.dtype != "auto" else (cfg.actor.autocast if autocast_dtype else cfg.actor.dtype)
    max_len = r.max_model_len or (cfg.trainer.max_prompt_length + r.max_new_tokens)
    engine = VLLMInferenceEngine(
        str(model_path), tensor_parallel_size=r.tensor_parallel_size, dtype=dtype,
        gpu_memory_utilization=r.gpu_memory_utilization, enable_prefix_caching=r.enable_prefix_caching,
        max_num_seqs=r.max_num_seqs, max_model_len=max_len, enable_chunked_prefill=r.enable_chunked_prefill,
        seed=r.seed, enable_sleep_mode=None if r.enable_sleep_mode else False, sleep_level=r.sleep_level,
        enable_lora=peft, **kwargs)
    engine.folder = folder  # lives as long as the engine
    if folder is not None or peft:  # placeholder weights, or the adapter still to push
        engine.sync_from(actor if source is None or peft else source)
    if world > 1:
        return DataParallelEngine(engine, r.tensor_parallel_size, engine.pad_token_id)
    return engine
