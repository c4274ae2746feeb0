"""Strategies ``fsdp2``, ``fsdp1`` and ``none`` (``auto``: fsdp2 under torchrun, none in one process):
the Hugging Face actor, its reference and a PPO critic trained by torch, each laid out over the
data-parallel ranks as ``sharding.py`` says (a model the user wrapped is used as it is).

- Forward passes: the actor's and the reference's log-probs through ``models/shared_prefix`` (the
  fused lm_head + log-prob kernels with ``actor.fused_logprobs``; a group's prompt run once with
  ``actor.share_prompt_forward``; the rows packed without padding with ``actor.use_remove_padding``,
  ``models/packed``), the critic's values through ``models/value``, under ``actor.autocast``, with
  the norms and MLPs compiled under ``actor.compile_blocks`` (``models/compiled_blocks``); an
  unsharded actor's passes on bf16 copies of its fp32 weights under ``actor.mixed_precision``
  (``bf16_compute``). Training passes take the rollout temperature, the others temperature 1.
- Updates: a mini-batch's micro-batches accumulate gradients (FSDP2 with ``unsharded_accumulation``
  gathers the parameters once per step), then the gradient norm is clipped and AdamW steps (fused
  for plain parameters); a step whose norm is not finite is skipped.
- Checkpoints: torch DCP shards of the models and optimizers plus the HF export (``checkpoint.py``).
- Rollout: engines read the actor itself (HF generate), or sync from it (vLLM).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from verl_fast import distributed
from verl_fast.checkpoint import sharded as checkpoint
from verl_fast.config import Config
from verl_fast.records.experience import Experience
from verl_fast.models import compiled_blocks, lora, lora_linear, packed, routing, vision, vision_attention
from verl_fast.models.response_logprobs import accepts, response_logprobs
from verl_fast.models.shared_prefix import experience_logprobs, packed_layout
from verl_fast.models.value import ValueModel, response_values
from verl_fast.models.wrapping import hf_module, is_sharded
from verl_fast.rollout.base import RolloutEngine
from verl_fast.strategies import memory_plan, sharding
from verl_fast.strategies.bf16_compute import BF16Compute, freeze_in_bf16
from verl_fast.strategies.protocol import LossFn
from verl_fast.strategies.sharding import Sharding
from verl_fast.models.lora import is_peft

AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED = {"auto": None, "on": True, "off": False}  # actor.fused_logprobs


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW (``actor.optimizer``): torch's, the fused kernel (one pass over all parameters, faster on
    the CPU than the default per-tensor loop) for plain CPU / CUDA parameters, torch's default for
    sharded (DTensor) ones; ``adamw_8bit``: torchao's AdamW8bit over the trained parameters (its
    moments block-quantised to 8 bits, dequantised inside each step: a quarter of fp32 AdamW's memory)."""
    if kind == "adamw_8bit":
        from torchao.optim import AdamW8bit  # the extra torchao (checked at start-up: extras.py)

        return AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    params = list(model.parameters())
    fused = not is_sharded(model) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                                          and type(p.data) is torch.Tensor for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Clips the accumulated gradient to ``max_norm`` (0: no clipping), steps when its norm is finite,
    zeroes it; returns the norm."""
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


def autocast_dtype(name: Optional[str], device: torch.device) -> Optional[torch.dtype]:
    """``actor.autocast`` on ``device``. Null (the default): bfloat16 on a GPU that computes it (TRL's
    default too; several times faster than fp32 there, docs/benchmarks.md), none on the CPU.
    ``auto``: bfloat16 wherever the device multiplies it natively (a GPU with bf16, a CPU with
    AVX512-BF16 or AMX), else none. On a CPU without them a bf16 matmul takes many times an fp32
    one (docs/benchmarks.md, "CPU"), so fp32 is faster there."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if name != "auto":
        return AUTOCAST.get(name)
    if device.type == "cuda":
        fast = torch.cuda.is_bf16_supported()
    else:
        fast = device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return torch.bfloat16 if fast else None


def use_tf32(setting: Optional[bool], device: torch.device) -> None:
    """``trainer.tf32`` (null: on for a GPU run): float32 matmuls and convolutions outside autocast on
    TF32 tensor cores (a 10-bit mantissa for the products, fp32 accumulation). Process-wide."""
    on = device.type == "cuda" if setting is None else setting
    if device.type == "cuda" or setting is not None:
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def autocast_of(dtype: Optional[torch.dtype], device: torch.device) -> Callable[[], ContextManager[Any]]:
    """Autocast to ``dtype`` (None: none) as a context factory for forward passes on ``device``."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def reference_model(actor: torch.nn.Module, ref_model: Optional[torch.nn.Module], layout: Sharding,
                    device: torch.device) -> torch.nn.Module:
    """The given reference laid out as the actor is, else a frozen copy of the actor's weights."""
    if ref_model is None:
        return sharding.reference_from(actor, layout, device)
    return sharding.freeze(sharding.shard(ref_model, replace(layout, gradient_checkpointing=False), device))


@torch.no_grad()
def routed(model: torch.nn.Module, sub: Experience, cfg: Config) -> ContextManager[Optional[routing.Agreement]]:
    """An actor forward over ``sub`` with the rollout's experts (``actor.routing_replay``), or only compared
    with them, where the rollout recorded routing (models.routing.follow); else a null context."""
    if sub.routed_experts is None:
        return contextlib.nullcontext()
    return routing.follow(hf_module(model), sub.routed_experts, cfg.actor.routing_replay)


def compiles_blocks(actor: torch.nn.Module, cfg: Config, device: torch.device, counted: bool = False) -> bool:
    """``actor.compile_blocks`` resolved for ``actor`` (``memory_plan.blocks_compiled``: off for a family
    whose norms and MLPs ``compiled_blocks`` leaves eager); ``counted``: as the token budget counts them."""
    return memory_plan.blocks_compiled(cfg, device, is_sharded(actor), is_peft(actor),
                                       memory_plan.family_of(hf_module(actor)), counted)


def keeps_base_in_bf16(actor: torch.nn.Module, cfg: Config, layout: Sharding, device: torch.device,
                       autocast: Optional[torch.dtype]) -> bool:
    """Whether an unsharded LoRA actor's frozen base is kept in bf16 (``actor.mixed_precision``: its auto
    on a GPU under bf16 autocast, or bfloat16; ``bf16_compute.freeze_in_bf16``)."""
    if layout.strategy != "none" or is_sharded(actor) or not is_peft(actor):
        return False
    if cfg.actor.mixed_precision != "auto":
        return cfg.actor.mixed_precision == "bfloat16"
    return device.type == "cuda" and autocast == torch.bfloat16


def computes_in_bf16(actor: torch.nn.Module, cfg: Config, layout: Sharding, device: torch.device,
                     autocast: Optional[torch.dtype]) -> bool:
    """``actor.mixed_precision`` for an unsharded actor resolved (its auto, as the config's doc says);
    a sharded one's is FSDP's (``sharding``)."""
    if layout.strategy != "none" or is_sharded(actor):
        return False
    if cfg.actor.mixed_precision != "auto":
        return cfg.actor.mixed_precision == "bfloat16"
    if device.type != "cuda" or autocast != torch.bfloat16:
        return False
    floats = [p for p in actor.parameters() if p.is_floating_point()]
    if is_peft(actor):
        # the fp32 adapters (the frozen base is kept in bf16: keeps_base_in_bf16). peft casts each adapted
        # layer's input to the adapters' dtype, so fp32 adapters cost an fp32 copy of every such input per
        # pass, which autocast then casts back to bf16 for the GEMM; bf16 copies compute the same products
        return any(p.dtype == torch.float32 for p in floats if p.requires_grad)
    return all(p.dtype == torch.float32 for p in floats)


def removes_padding(actor: torch.nn.Module, cfg: Config, device: torch.device,
                    autocast: Optional[torch.dtype]) -> bool:
    """``actor.use_remove_padding`` resolved (its null: auto, as the config's doc says); off for a
    model whose forward cannot run the packed layout (no ``logits_to_keep``), whose passes run padded,
    so that the micro-batches are cut by their padded size."""
    if not accepts(actor, "logits_to_keep"):
        return False
    if cfg.actor.use_remove_padding is not None:
        return cfg.actor.use_remove_padding
    return packed.flash_available(device, autocast or next(actor.parameters()).dtype)


def passes(model: torch.nn.Module, compiled: bool, packs: bool) -> ContextManager[Any]:
    """Around a pass's micro-batches, forward and backward: LoRA layers as GEMMs only where
    ``lora_linear.FUSED`` is on, the compiled norms and MLPs (``compiled_blocks``), the varlen attention
    of packed rows (``packed``), a vision tower's batched segment attention (``vision_attention``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(vision_attention.batched(model))
    stack.enter_context(lora_linear.fused(hf_module(model), lora_linear.FUSED))
    stack.enter_context(compiled_blocks.compiled(hf_module(model), compiled))
    if packs:
        stack.enter_context(packed.attention_switched(hf_module(model)))
    return stack


def prepared(model: torch.nn.Module, exp: Experience, micro: List[torch.Tensor], cfg: Config,
             packs: bool) -> List[Tuple[Experience, Optional[packed.PackedLayout]]]:
    """Each micro-batch's rows and, where packed, its layout, made before any pass runs: both read
    small tensors back to the host, which inside the loop would stall it until the GPU had finished
    the previous micro-batch (no queued work to overlap with the next one's launches)."""
    out = []
    for idx in micro:
        sub = exp.select(idx)
        lay = None
        if packs and sub.routed_experts is None and sub.vision is None:  # images: padded rows
            lay = packed_layout(model, sub.input_ids, sub.attention_mask, sub.response_length, sub.prompt_index,
                                cfg.actor.share_prompt_forward)
        out.append((sub, lay))
    return out


def run_cost(batches: List[Tuple[Experience, Optional[packed.PackedLayout]]]) -> Tuple[float, float]:
    """(tokens, causal query-key pairs) the passes over ``prepared`` batches run: a packed layout's
    own count, else the rows' real tokens (the padding's work is not counted)."""
    tokens, pairs = 0.0, 0.0
    for sub, lay in batches:
        if lay is not None:
            tokens, pairs = tokens + lay.tokens, pairs + lay.pairs
        else:
            lens = sub.attention_mask.sum(-1)
            tokens, pairs = tokens + float(lens.sum()), pairs + packed.causal_pairs(lens)
    return tokens, pairs


def micro_logprobs(model: torch.nn.Module, sub: Experience, cfg: Config, lay: Optional[packed.PackedLayout],
                   with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One micro-batch's response log-probs (and entropy) as the actor section configures them, at the
    sampling temperature (else the PPO ratio of an unchanged actor is not 1 when ``rollout.temperature``
    is not 1); packed by ``lay`` when there is one (``prepared``). Recorded routing maps one-to-one
    onto the plain forward's tokens: no shared prompt pass then. Rows with images run padded, each with
    its own prompt, each distinct prompt's images once through the vision tower (``models/vision``)."""
    if sub.vision is not None:
        with vision.images_once(model, sub.input_ids, sub.attention_mask, sub.vision) as inputs:
            return response_logprobs(model, sub.input_ids, sub.attention_mask, sub.response_length,
                                     cfg.rollout.temperature or 1.0, with_entropy,
                                     fused=FUSED[cfg.actor.fused_logprobs], model_inputs=inputs)
    return experience_logprobs(model, sub.input_ids, sub.attention_mask, sub.response_length, sub.prompt_index,
                               temperature=cfg.rollout.temperature or 1.0, with_entropy=with_entropy,
                               fused=FUSED[cfg.actor.fused_logprobs],
                               share=cfg.actor.share_prompt_forward and sub.routed_experts is None, layout=lay)


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, exp: Experience, micro: List[torch.Tensor], cfg: Config,
                autocast: Callable[[], ContextManager[Any]], device: torch.device,
                replay: bool = False, compiled: bool = False, packs: bool = False) -> torch.Tensor:
    """[N, L] float32 response log-probs of an HF model (actor or reference), micro-batch by micro-batch
    (``micro_logprobs``), without a graph: whoever calls it, no micro-batch's activations outlive its
    pass (``out`` would otherwise hold every micro-batch's graph until the last);
    ``replay``: the actor, whose routers follow the rollout's routing where it was recorded;
    ``compiled`` / ``packs``: as ``passes`` says."""
    out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=device)
    batches = prepared(model, exp, micro, cfg, packs)
    with sharding.gathered_for_passes(model, len(micro)), passes(model, compiled, packs):
        for idx, (sub, lay) in zip(micro, batches):
            with autocast(), (routed(model, sub, cfg) if replay else contextlib.nullcontext()):
                logp, _ = micro_logprobs(model, sub, cfg, lay)
            out[idx, : sub.response_length] = logp.float()
    return out


class HFCritic:
    """A PPO critic (``ValueModel``: a value head on a causal LM, or a token-classification model) laid
    out as ``critic.strategy`` says, trained with AdamW."""

    def __init__(self, critic: torch.nn.Module, cfg: Config, world: int, device: torch.device,
                 autocast: Callable[[], ContextManager[Any]]):
        self.cfg, self.device, self.autocast = cfg, device, autocast
        self.model = sharding.shard(critic, Sharding.from_config(cfg.critic, "critic", world), device)
        self.optimizer = adamw(self.model, cfg.critic.lr, cfg.critic.weight_decay)

    @torch.no_grad()
    def values(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(exp.response_mask.shape, dtype=torch.float32, device=self.device)
        with sharding.gathered_for_passes(self.model, len(micro)):
            for idx in micro:
                sub = exp.select(idx)
                with self.autocast():
                    out[idx, : sub.response_length] = response_values(self.model, sub.input_ids, sub.attention_mask,
                                                                       sub.response_length, sub.vision).float()
        return out

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn: LossFn) -> List[Dict[str, Any]]:
        self.model.train()
        results = []
        for idx in sharding.micro_steps(self.model, micro):
            sub = exp.select(idx)
            with self.autocast():
                values = response_values(self.model, sub.input_ids, sub.attention_mask, sub.response_length,
                                         sub.vision)
            loss, stats = loss_fn(values, sub)
            loss.backward()
            results.append(stats)
        return results

    def optimizer_step(self) -> float:
        return optimizer_step(self.model, self.optimizer, self.cfg.critic.max_grad_norm)


def critic_model(critic: torch.nn.Module) -> ValueModel:
    """The critic as a ``ValueModel`` (a causal LM gets a value head)."""
    return critic if isinstance(critic, ValueModel) else ValueModel(critic)


class FSDPStrategy:
    """The ``Strategy`` of Hugging Face models trained by torch (module docstring)."""

    budgets_tokens = True
    hf_decode_by_default = True  # the actor it trains is the one HF decode runs

    # ---- start-up, before any model loads (the CLI)

    @staticmethod
    def check_machine(cfg: Config) -> None:
        """Torch trains on whatever device ``trainer.device`` resolves to: nothing to refuse here."""

    @staticmethod
    def check_fits(cfg: Config, needs_reference: bool, device: torch.device) -> None:
        """On a GPU, a run that cannot hold one sequence's activations is refused in one line
        (``memory_plan.DoesNotFit``), counted from the model's config.json (its folder found then: on
        the CPU a Hub name is left to the loader)."""
        if device.type == "cuda":
            from verl_fast.models.loading import resolve

            memory_plan.check_before_loading(cfg, resolve(cfg.actor.model_name), needs_reference, device)

    @staticmethod
    def planned(cfg: Config, device: torch.device) -> Dict[str, Any]:
        """What the actor's null / auto keys resolve to on ``device``, as far as known before a model
        loads (the strategy prints the rest, ``resolved``, once built)."""
        cuda, a = device.type == "cuda", cfg.actor
        autocast = autocast_dtype(a.autocast, device)
        out: Dict[str, Any] = {"resolved on": device.type,
                               "actor.autocast": str(autocast).removeprefix("torch.") if autocast else "none",
                               "trainer.tf32": cuda if cfg.trainer.tf32 is None else cfg.trainer.tf32,
                               "actor.use_dynamic_bsz": cuda if a.use_dynamic_bsz is None else a.use_dynamic_bsz}
        if a.gradient_checkpointing is None:
            out["actor.gradient_checkpointing"] = "from the free memory, when the actor is built" if cuda else False
        if a.max_token_len_per_gpu is None and out["actor.use_dynamic_bsz"]:
            out["actor.max_token_len_per_gpu"] = "from the free memory, at the first update" if cuda else 16384
        if a.mixed_precision == "auto":
            out["actor.mixed_precision"] = ("bfloat16 for an unsharded fp32 actor (with LoRA: its frozen base, and "
                                            "bf16 copies of the adapters)"
                                            if cuda and autocast == torch.bfloat16 else "none")
        return out

    def __init__(self, cfg: Config, actor: torch.nn.Module, ref: Optional[torch.nn.Module],
                 critic: Optional[torch.nn.Module], needs_reference: bool):
        """``critic``: the PPO critic's model, when the algorithm trains one."""
        self.cfg = cfg
        self.dp_rank, self.dp_size = distributed.rank(), distributed.world_size()
        self.dp_group = dist.group.WORLD if self.dp_size > 1 else None
        self.uneven_micro_batches = self.dp_size == 1  # FSDP ranks must run the same passes
        layout = Sharding.from_config(cfg.actor, "actor", self.dp_size)
        self.device = sharding.compute_device(layout, cfg.trainer.device, actor)
        # a LoRA actor whose adapters start at zero: its base (adapters disabled) is the reference, as TRL
        # and verl take it, with no copy of the base
        self.has_reference = needs_reference
        self.ref_is_base = needs_reference and ref is None and lora.starts_as_base(hf_module(actor))
        copies_reference = needs_reference and ref is None and not self.ref_is_base
        if cfg.actor.gradient_checkpointing is None:  # auto: when the memory left needs it (memory_plan)
            layout = replace(layout, gradient_checkpointing=memory_plan.wants_checkpointing(
                cfg, actor, self.device, copies_reference, layout.strategy != "none"))
        self.layout, self.checkpointing = layout, layout.gradient_checkpointing
        use_tf32(cfg.trainer.tf32, self.device)
        self.actor = sharding.shard(actor, layout, self.device)
        self.autocast_dtype = autocast_dtype(cfg.actor.autocast, self.device)
        self.autocast = autocast_of(self.autocast_dtype, self.device)
        self.base_in_bf16 = keeps_base_in_bf16(self.actor, cfg, layout, self.device, self.autocast_dtype)
        if self.base_in_bf16:  # before bf16 copies are made: the adapters stay fp32 masters
            freeze_in_bf16(self.actor)
        self.ref = (reference_model(self.actor, ref, layout, self.device)
                    if needs_reference and not self.ref_is_base else None)
        self.critic = None if critic is None else HFCritic(critic_model(critic), cfg, self.dp_size, self.device,
                                                           self.autocast)
        self.optimizer = adamw(self.actor, cfg.actor.lr, cfg.actor.weight_decay, cfg.actor.optimizer)
        bf16 = computes_in_bf16(self.actor, cfg, layout, self.device, self.autocast_dtype)
        self.bf16 = BF16Compute(self.actor) if bf16 else None
        self.compiled = compiles_blocks(self.actor, cfg, self.device)
        self.compiled_counted = compiles_blocks(self.actor, cfg, self.device, counted=True)  # the token budget's
        self.packs_sequences = removes_padding(self.actor, cfg, self.device, self.autocast_dtype)

    def resolved(self) -> Dict[str, Any]:
        dtype = self.autocast_dtype
        precision = "bfloat16" if self.bf16 is not None or self.layout.mixed_precision else "none"
        if self.base_in_bf16:
            precision = "bfloat16 (the frozen LoRA base" + ("; the adapters on bf16 copies)" if self.bf16 is not None else ")")
        return {"actor.autocast": str(dtype).removeprefix("torch.") if dtype else "none",
                "actor.mixed_precision": precision,
                "actor.gradient_checkpointing": self.checkpointing, "actor.compile_blocks": self.compiled,
                "actor.use_remove_padding": self.packs_sequences,
                "trainer.tf32": self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32}

    # ---- forward passes and updates

    def actor_logprobs(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        with self._bf16_passes():
            return hf_logprobs(self.actor, exp, micro, self.cfg, self.autocast, self.device, replay=True,
                               compiled=self.compiled, packs=self.packs_sequences)

    def ref_logprobs(self, exp: Experience, micro: List[torch.Tensor]) -> torch.Tensor:
        if self.ref_is_base:
            with hf_module(self.actor).disable_adapter(), self._bf16_passes():
                return hf_logprobs(self.actor, exp, micro, self.cfg, self.autocast, self.device,
                                   compiled=self.compiled, packs=self.packs_sequences)
        return hf_logprobs(self.ref, exp, micro, self.cfg, self.autocast, self.device, compiled=self.compiled,
                           packs=self.packs_sequences)

    def forward_backward(self, exp: Experience, micro: List[torch.Tensor], loss_fn: LossFn,
                         entropy: bool = True) -> Tuple[List[Dict[str, Any]], Tuple[float, float]]:
        batches = prepared(self.actor, exp, micro, self.cfg, self.packs_sequences)
        # once for all micro-batches; bf16 gradients become the fp32 masters' before the step
        with self._bf16_passes(), passes(self.actor, self.compiled, self.packs_sequences):
            stats = [self._actor_micro_step(sub, lay, loss_fn, entropy)
                     for sub, lay in sharding.micro_steps(self.actor, batches)]
        return stats, run_cost(batches)

    def _actor_micro_step(self, sub: Experience, lay: Optional[packed.PackedLayout], loss_fn: LossFn,
                          entropy: bool) -> Dict:
        # the backward inside the routing too: gradient checkpointing recomputes the forward there, and a
        # recompute with the routers' own choice saves other tensors (torch's CheckpointError)
        with routed(self.actor, sub, self.cfg) as agreement:
            with self.autocast():
                logp, ent = micro_logprobs(self.actor, sub, self.cfg, lay, with_entropy=entropy)
            loss, stats = loss_fn(logp, ent, sub)
            if agreement is not None:  # tokens whose experts the training forward would have changed
                stats = {**stats, "routing_changed_frac": agreement.fraction(sub.attention_mask)}
            loss.backward()
        if self.bf16 is not None:
            self.bf16.accumulate()
        return stats

    def recompute_activations(self) -> bool:
        """Gradient checkpointing on for the rest of the run (the update's re-plan after running out of
        memory, ``trainer/updates.py``); False where it is on already."""
        if self.checkpointing:
            return False
        sharding.enable_checkpointing(hf_module(self.actor))
        self.layout = replace(self.layout, gradient_checkpointing=True)
        self.checkpointing = True
        return True

    def _bf16_passes(self) -> ContextManager[None]:
        return self.bf16.active() if self.bf16 is not None else contextlib.nullcontext()

    def optimizer_step(self) -> float:
        return optimizer_step(self.actor, self.optimizer, self.cfg.actor.max_grad_norm)

    # ---- rollout

    def weight_source(self, owns_weights: bool) -> torch.nn.Module:
        return self.actor

    def rollout_engine(self, engine: RolloutEngine) -> RolloutEngine:
        return engine

    def actor_updated(self, engine_owns_weights: bool) -> None:
        pass

    # ---- checkpoints

    def save(self, output_dir: str, step: int, tokenizer: Any, state: Dict[str, Any], export_hf: bool) -> None:
        critic = self.critic
        checkpoint.save(output_dir, step, self.actor, tokenizer, self.optimizer, state,
                        critic and critic.model, critic and critic.optimizer, export_hf=export_hf)

    def load(self, path: Path) -> Dict[str, Any]:
        critic = self.critic
        return checkpoint.load(path, self.actor, self.optimizer, critic and critic.model, critic and critic.optimizer)
