"""The rollout engine a run's config asks for, built beside its actor by its class (``engines.py``), and
the vLLM engine's sizing from the config.

- ``rollout.type: hf``: ``generate`` on the actor itself (no second copy of the weights).
- ``rollout.type: vllm``: vLLM's ``LLM`` in this process. Under torchrun every rank runs one
  (``external_launcher``: TP groups of ``rollout.tensor_parallel_size`` consecutive ranks, the
  groups serving the world's prompts data-parallel, see ``data_parallel.py``); the actor may be
  sharded (FSDP1 / FSDP2), its weights move with ``engine.sync_from(actor)``.
- ``rollout.type: auto``: HF, decoding compiled, for a whole actor on one GPU (``resolve_type``: the
  faster there, docs/benchmarks.md); otherwise vLLM when it is installed and the process is set up to run it in
  process (``configure_vllm_env()``, which the CLI calls), else HF.

The engine comes back generating with the actor's weights: loaded from ``model_path`` (which must
hold them), or, without it, from a folder holding only the actor's config and tokenizer with
placeholder weights (vLLM's ``load_format="dummy"``) overwritten at once by ``sync_from(actor)``,
so no full copy of a sharded actor is ever gathered. That folder is named by its contents
(``engine_folder``), so a later run of the same model finds vLLM's compile cache, which vLLM keys
on the model's path among other things.

Engine start on a GPU: CUDA graphs are captured only for the decode batch sizes this trainer sends
(``cudagraph_batch``: up to the sequences one engine generates per step), not vLLM's default list
up to 512; ``rollout.enforce_eager`` and ``rollout.compilation_config`` go to vLLM as they are.
The KV cache on a GPU is sized for one step's sequences at ``max_model_len`` (``step_kv_cache_bytes``;
``rollout.kv_cache_gib`` overrides it), not vLLM's half of the GPU. Sleep during the update
(``rollout.sleep_level``, ``resolve_sleep_level``): the KV cache only when the weights are small
beside the GPU (0), else the weights discarded too (2: the sync after the update rewrites every byte
of them), or offloaded to the host where no sync rewrites them (a LoRA actor's base: 1).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from verl_fast import distributed
from verl_fast.config import Config, LoraConfig
from verl_fast.models.checks import context_length
from verl_fast.models.vision import is_vision_model
from verl_fast.models.vision_processor import VisionProcessor
from verl_fast.models.wrapping import hf_module, is_sharded
from verl_fast.ops.reshard.spec import MOE_FAMILIES
from verl_fast.rollout import decode_memory, engines, hf_decode
from verl_fast.rollout.base import RolloutEngine
from verl_fast.rollout.fp8_sync import QUANTIZATION_CONFIG


def resolve_type(kind: str, actor: Optional[torch.nn.Module] = None) -> str:
    """``auto`` -> ``hf`` for a whole (unsharded, dense) ``actor`` on a GPU in one process whose model
    the HF fast decode runs (it decodes compiled there, a LoRA actor's adapters merged into its copies of
    the weights: the faster of the two there, docs/benchmarks.md); otherwise ``vllm`` when vLLM is installed and set up to run in this process,
    else ``hf``."""
    if kind != "auto":
        return kind
    if actor is not None and is_vision_model(actor):
        return "hf"  # images through the prefill of generate (vLLM takes them when asked: rollout.type vllm)
    whole = actor is not None and distributed.world_size() == 1
    if whole and compiles_decode(actor) and getattr(hf_module(actor).config, "model_type", None) not in MOE_FAMILIES \
            and hf_decode.unsupported(hf_module(actor)) is None:
        return "hf"  # dense models; a mixture of experts goes to vLLM's fused expert kernels
    from verl_fast.rollout import vllm_available

    if not vllm_available():
        return "hf"
    from verl_fast.rollout.vllm_compat import in_process_mode

    return "vllm" if in_process_mode() else "hf"


def compiles_decode(actor: torch.nn.Module, setting: Optional[bool] = None) -> bool:
    """``rollout.hf_compile_decode``: null (auto) compiles the decode steps of an unsharded actor on a GPU."""
    if setting is not None:
        return setting
    return not is_sharded(actor) and next(actor.parameters()).device.type == "cuda"


def build_engine(cfg: Config, actor: torch.nn.Module, tokenizer: Any, model_path: Optional[str] = None,
                 autocast_dtype: Optional[torch.dtype] = None, source: Any = None,
                 hf_decode_by_default: bool = True) -> RolloutEngine:
    """The engine for ``cfg.rollout`` (``rollout.type``, ``auto`` resolved here, see the module docstring),
    built by its class (``engines.py``); collective under torchrun. ``tokenizer``: a vision-language
    actor's ``VisionProcessor`` (an engine that owns weights saves it in its folder) or a tokenizer. ``source``: what an engine that owns
    weights takes them from, when not the actor itself (a strategy's own copy). ``hf_decode_by_default``:
    whether ``rollout.type: auto`` may pick HF decode for ``actor`` (not where the strategy trains another
    copy and only exports into it after each update)."""
    kind = resolve_type(cfg.rollout.type, actor if hf_decode_by_default else None)
    cls = engines.engine_class(kind)
    if isinstance(tokenizer, VisionProcessor) and not cls.owns_weights:
        tokenizer = tokenizer.tokenizer  # the processor goes to engines that load a folder of their own
    return cls.build(cfg, actor, tokenizer, model_path=model_path, autocast_dtype=autocast_dtype, source=source)


def build_vllm(cls: type, cfg: Config, actor: torch.nn.Module, tokenizer: Any, model_path: Optional[str],
               autocast_dtype: Optional[torch.dtype], source: Any) -> RolloutEngine:
    """``cls`` (the vLLM engine) for ``cfg.rollout`` beside ``actor``: sized from the config and the actor
    (KV cache, CUDA-graph batch sizes, sleep level, LoRA rank), loaded from ``model_path`` or placeholder
    weights synced from the actor; one engine a tensor-parallel group under torchrun."""
    from verl_fast.models.lora import is_peft
    from verl_fast.rollout.data_parallel import DataParallelEngine

    r = cfg.rollout
    peft = is_peft(actor)
    if r.quantization and r.quantization != "fp8" and not peft:
        raise ValueError(f"rollout.quantization={r.quantization} is not supported with a full-weight actor: the "
                         "engine's quantized weights cannot take the trainer's updates; train a LoRA (PEFT) actor on "
                         "the quantized base, whose adapter is what moves, or drop rollout.quantization")
    world = distributed.world_size()
    vision = is_vision_model(actor)
    if vision:
        images_per_prompt = check_vision_engine(world, peft, r.quantization == "fp8", tokenizer)
    if peft and model_path is None:
        raise ValueError("a PEFT actor with rollout.type=vllm needs model_path (the base model's folder); "
                         "the adapter is pushed to the engine after each update")
    if world > 1 and world % r.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the number of "
                         f"processes ({world}): each group of that many consecutive ranks runs one engine")
    kwargs: Dict[str, Any] = {"quantization": r.quantization} if r.quantization else {}
    fp8_weights = r.quantization == "fp8" and not peft  # block-FP8 layers the sync writes (rollout/fp8_sync.py)
    if fp8_weights:
        check_fp8_engine(world)
    if r.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = r.kv_cache_dtype
    if vision:
        kwargs["limit_mm_per_prompt"] = images_per_prompt
    placeholder = model_path is None or fp8_weights or vision  # a VLM: the folder's image processor is the run's
    if placeholder:
        model_path = engine_folder(actor, engine_processor(tokenizer) if vision else tokenizer,
                                   {"quantization_config": QUANTIZATION_CONFIG} if fp8_weights else None)
        kwargs["load_format"] = "dummy"
    if world > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    dtype = r.dtype if r.dtype != "auto" else (str(autocast_dtype).removeprefix("torch.") if autocast_dtype
                                               else cfg.actor.dtype)
    max_len = r.max_model_len or derived_max_len(cfg, actor)
    if r.compilation_config is not None:
        kwargs["compilation_config"] = r.compilation_config
    per_engine = max(1, cfg.trainer.train_batch_size * r.n // max(1, world // r.tensor_parallel_size))
    if r.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(r.kv_cache_gib * 2**30)
    elif r.kv_cache_gib is None and torch.cuda.is_available():
        kwargs["kv_cache_memory_bytes"] = step_kv_cache_bytes(hf_module(actor).config, min(r.max_num_seqs, per_engine),
                                                              max_len, dtype, r.tensor_parallel_size)
    engine = cls(
        str(model_path), tensor_parallel_size=r.tensor_parallel_size, dtype=dtype,
        gpu_memory_utilization=r.gpu_memory_utilization, enable_prefix_caching=r.enable_prefix_caching,
        max_num_seqs=r.max_num_seqs, max_model_len=max_len, enable_chunked_prefill=r.enable_chunked_prefill,
        seed=r.seed, enable_sleep_mode=None if r.enable_sleep_mode else False,
        sleep_level=resolve_sleep_level(r.sleep_level, peft, engine_weight_bytes(actor, dtype)), enable_lora=peft, enforce_eager=r.enforce_eager,
        **({"max_lora_rank": lora_rank(actor, cfg.actor.lora)} if peft else {}),
        cudagraph_batch=min(r.max_num_seqs, per_engine),
        record_routing=r.record_routing or cfg.actor.routing_replay, fp8_weights=fp8_weights, **kwargs)
    if placeholder or peft:  # placeholder weights, or the adapter still to push
        engine.sync_from(actor if source is None or peft else source)
    if world > 1:
        return DataParallelEngine(engine, r.tensor_parallel_size, engine.pad_token_id)
    return engine


#: images one prompt may hold in a vLLM request (vLLM sizes its multimodal profiling by it); no videos
MAX_IMAGES_PER_PROMPT = 8


def derived_max_len(cfg: Config, actor: torch.nn.Module) -> int:
    """The engine's sequence length when ``rollout.max_model_len`` is unset: the longest prompt plus the new
    tokens, held to the model's positions (vLLM refuses a length past them; a row cannot use more anyway)."""
    wanted = cfg.trainer.max_prompt_length + cfg.rollout.max_new_tokens
    positions = context_length(hf_module(actor).config.to_dict())
    return min(wanted, positions) if positions else wanted


def check_vision_engine(world: int, peft: bool, fp8: bool, processor: Any) -> Dict[str, int]:
    """A vLLM engine for a vision-language actor: one process, full weights in the actor's dtype, the run's
    processor (each refusal one line); returns vLLM's ``limit_mm_per_prompt``."""
    refused = [(world > 1, f"{world} processes", "run one process"),
               (peft, "a LoRA (PEFT) actor", "drop actor.lora"),
               (fp8, "rollout.quantization=fp8", "drop rollout.quantization")]
    for bad, what, use in refused:
        if bad:
            raise ValueError(f"rollout.type=vllm with a vision-language actor is not supported with {what}; {use} "
                             "or use rollout.type: hf")
    if not isinstance(processor, VisionProcessor):
        raise ValueError("rollout.type=vllm with a vision-language actor needs its processor (AutoProcessor or "
                         "verl_fast.data.images.VisionProcessor) as the tokenizer: vLLM reads the images with it")
    return {"image": MAX_IMAGES_PER_PROMPT, "video": 0}


def engine_processor(processor: VisionProcessor) -> VisionProcessor:
    """``processor`` with its resize bounds (``trainer.image_min_pixels`` / ``image_max_pixels``) written into
    its image processor, so that vLLM, which reads the saved one, resizes each picture as the trainer did."""
    image = copy.deepcopy(processor.image_processor)
    if processor.size:
        own = image.size
        image.size = {"shortest_edge": processor.size.get("shortest_edge", own["shortest_edge"]),
                      "longest_edge": processor.size.get("longest_edge", own["longest_edge"])}
        for key, bound in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if getattr(image, key, None) is not None:  # older processors keep the bounds twice
                setattr(image, key, image.size[bound])
    return VisionProcessor(image, processor.tokenizer, processor.chat_template, processor.image_token)


def check_fp8_engine(world: int) -> None:
    """A vLLM engine of FP8 weights synced from a full-weight actor: a GPU's vLLM, one process."""
    from verl_fast.rollout import vllm_compat

    if vllm_compat.is_cpu_platform():
        raise ValueError("rollout.quantization=fp8 with rollout.type=vllm needs a GPU (vLLM-CPU has no FP8 linear "
                         "layers); on the CPU use rollout.type=hf, whose FP8 layers are emulated")
    if world > 1:
        raise ValueError("rollout.quantization=fp8 with rollout.type=vllm syncs from a whole actor in one process; "
                         "run one process, or drop rollout.quantization")


# the LoRA ranks vLLM's max_lora_rank takes
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank(actor: Any, spec: Optional[LoraConfig]) -> int:
    """vLLM's max_lora_rank for a PEFT actor: the smallest rank vLLM takes that holds the adapter's
    (``actor.lora.r``; a PEFT model handed over as it is: the largest rank of its adapters)."""
    r = spec.r if spec is not None else max(int(c.r) for c in actor.peft_config.values())
    fits = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fits:
        raise ValueError(f"the actor's LoRA rank {r} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
    return fits[0]


def step_kv_cache_bytes(hf_config: Any, sequences: int, max_len: int, dtype: str, tensor_parallel_size: int) -> Optional[int]:
    """The KV cache one engine needs for ``sequences`` sequences of ``max_len`` tokens (in 16-token
    blocks, x1.25), from the model's config; None where the config does not say (vLLM then sizes it by
    ``gpu_memory_utilization``). vLLM's own default fills half the GPU, of which a small model's step uses
    a sliver, and every sleep / wake unmaps / maps all of it."""
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = decode_memory.kv_bytes_per_token(hf_config, element, tensor_parallel_size)
    if per_token is None:
        return None
    tokens = sequences * -(-max_len // 16) * 16
    return int(1.25 * tokens * per_token)


def engine_weight_bytes(actor: torch.nn.Module, dtype: str) -> int:
    """The bytes of the whole actor's weights in the engine's dtype (DTensors report their global shape;
    an FSDP1 flat parameter its unsharded size)."""
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    numel = 0
    for p in hf_module(actor).parameters():
        unsharded = getattr(p, "_unpadded_unsharded_size", None)
        numel += unsharded.numel() if unsharded is not None else p.numel()
    return numel * element


def resolve_sleep_level(level: Optional[int], keeps_base_weights: bool, weight_bytes: int = 0) -> int:
    """``rollout.sleep_level`` (None: auto, see the module docstring): 1 where the base weights must
    survive (LoRA), else 0 when the engine's weights take at most an eighth of the GPU (keeping them
    resident costs little, and the sync then writes into them without a wake: at sleep level 2 the
    sync spent most of its time mapping and refilling the discarded memory), else 2."""
    if level is not None:
        return level
    if keeps_base_weights:
        return 1
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if torch.cuda.is_available() else 0
    return 0 if total and weight_bytes <= total // 8 else 2


def engine_folder(actor: torch.nn.Module, tokenizer: Any, extra_config: Optional[Dict[str, Any]] = None) -> str:
    """A folder with the actor's config and tokenizer (no weights) for a placeholder-weight engine,
    named by a hash of those files under ``$VERL_FAST_CACHE`` (default ``~/.cache/verl_fast``), so
    the same model gets the same path on every run."""
    with tempfile.TemporaryDirectory(prefix="verl_fast_actor_") as tmp:
        hf_module(actor).config.save_pretrained(tmp)
        if extra_config:  # e.g. the quantization_config of an FP8 engine
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **extra_config}, indent=2))
        tokenizer.save_pretrained(tmp)
        digest = hashlib.sha256()
        for f in sorted(Path(tmp).iterdir()):
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        root = Path(os.environ.get("VERL_FAST_CACHE") or Path.home() / ".cache" / "verl_fast") / "engine_models"
        folder = root / digest.hexdigest()[:20]
        if not (folder / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
            for f in Path(tmp).iterdir():
                (staging / f.name).write_bytes(f.read_bytes())
            try:
                os.replace(staging, folder)  # atomic: another process may have just written the same
            except OSError:
                for f in staging.iterdir():
                    f.unlink()
                staging.rmdir()
    return str(folder)
