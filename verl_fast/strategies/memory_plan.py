"""What a run keeps on its GPU, counted before it starts: the defaults that depend on memory.

Bytes that stay for the whole run (``static``), per parameter of the actor:
- its weights in ``actor.dtype`` (4 bytes in float32); a frozen reference copy when KL needs one
  (none for a LoRA actor whose adapters start at zero: its base, adapters disabled, is the reference);
- the trained parameters' gradients (their own dtype) and the optimizer's states: AdamW keeps two
  fp32 moments (8 bytes), torchao's AdamW8bit two block-quantised ones (about 2 bytes);
- bf16 copies of fp32 weights (2 bytes each): the training passes' (``actor.mixed_precision`` auto,
  ``strategies/bf16_compute.py``) and the compiled decode's (``rollout/hf_decode.CompiledForward``);
  under autocast without those copies, autocast's own cast cache holds the same 2 bytes during a pass.
  A LoRA actor's frozen base is kept in bf16 instead (2 bytes, no copies for the passes).
- the asynchronous modes' rollout copies, in the autocast dtype (``async_rl/``): ``one_step``'s copy of
  the trained parameters (an HF engine's; a LoRA base is shared); ``full`` with its workers on this GPU
  (one GPU on the host), the pushed buffer and, per worker, its model and staging copy of every parameter.

What is left holds the activations of the micro-batches (``ACTIVATION_BYTES`` per token, layer and
unit of width without checkpointing; with it, one bf16 hidden state per token and
layer plus one layer's full activations). ``gradient_checkpointing``'s auto turns it on when the rest
cannot hold, without it, the activations of one prompt group (``rollout.n`` sequences of the longest
length) or of a micro-batch large enough to be worth splitting the update into, whichever is fewer
tokens (never less than one sequence): a micro-batch more costs ``MICRO_BATCH_S`` beyond its tokens'
work, checkpointing costs one more forward of every token, so micro-batches of at least
``MICRO_BATCH_S`` x ``UPDATE_FLOPS_PER_S`` / (2 x parameters) tokens are cheaper than recomputing
(~38k tokens at the 0.5B shape, where a group decides; ~2.5k at 7B). The run is refused before the
weights load when it cannot hold one sequence's even with it.

The rollout's compiled HF decode holds its KV cache in the same room while it runs (the update's
activations are gone by then): ``decode_prompts_per_call`` counts how many of a step's prompts one
decode call takes at ``rollout.max_new_tokens`` (``hf_decode.prompts_per_call``), the rest decoding in
further calls, and ``check_before_loading`` logs it where that is fewer than the step's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Tuple

import torch

from verl_fast.config import Config, LoraConfig
from verl_fast.distributed import MEMORY_FRACTION, allocatable_bytes
from verl_fast.models.lora import is_peft
from verl_fast.rollout import engines as rollout_engines
from verl_fast.rollout import hf_decode

logger = logging.getLogger(__name__)

GIB = 2**30
# Activation bytes a training pass keeps for its backward, per token, per layer and per unit of
# (hidden + intermediate) width, packed rows under bf16 autocast with compiled norms and MLPs:
# 8 rounds up what the 0.5B and 1.5B shapes keep (docs/benchmarks.md, "Measurements behind the code's
# choices"); eager norms and MLPs keep ~1.3x as much, no autocast (float32 activations) ~2x.
ACTIVATION_BYTES = 8.0
EAGER_FACTOR = 1.3  # eager norms and MLPs' activations against compiled ones'
# LoRA's passes keep more per token than the model alone (each adapted layer's input cast again for
# lora_A, the base + adapter sum kept by the next operation, the residual stream in float32 beside
# frozen float32 weights): more than ACTIVATION_BYTES x 1.3 counts at the Qwen2.5-7B shape with r 64 on
# every linear layer (its SFT ran out of memory with that count; docs/benchmarks.md). Counted per unit of
# the adapted layers' (in + out) width.
ADAPTER_ACTIVATION_BYTES = 1.0
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adamw_8bit": 2.0}  # per trained parameter (8-bit: + block scales)
# What one micro-batch more costs an update beyond its tokens' work (launches, the passes' weight reads,
# the per-micro-batch bookkeeping), at the 0.5B shape (docs/benchmarks.md).
MICRO_BATCH_S = 0.075
# The update's bf16 rate at the 7B shape (about half a Hopper GPU's dense peak: the LoRA update's 4 and
# the full fine-tune's 6 FLOPs a parameter and token over their times), for what recomputing
# a token's forward costs.
UPDATE_FLOPS_PER_S = 5e14
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class DoesNotFit(ValueError):
    """The run's weights, gradients and optimizer states leave no room for one sequence's activations."""


def checkpointed_per_token(per_token: float, layers: int, hidden: int, element: int = 2) -> float:
    """Activation bytes per token under gradient checkpointing, from ``per_token`` without it: each
    layer's input kept (``element`` bytes: bf16 under autocast, 4 in float32), one layer's full
    activations at a time in the recompute."""
    return float(element) * layers * hidden + per_token / max(layers, 1)


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: parameter counts and the layers' widths."""

    parameters: int
    trained: int
    layers: int
    width: int  # hidden + intermediate
    hidden: int
    adapted: int = 0  # the (in + out) widths of the linear layers carrying LoRA adapters, summed
    vocab: int = 0  # the output head's rows


def adapter_per_token(adapted: int, half: bool) -> float:
    """Activation bytes per token that LoRA adapters on linear layers of ``adapted`` summed (in + out)
    width add (``ADAPTER_ACTIVATION_BYTES``; twice as much without bf16 / fp16 autocast)."""
    return ADAPTER_ACTIVATION_BYTES * adapted * (1.0 if half else 2.0)


def adapted_width(model: torch.nn.Module) -> int:
    """The summed (in + out) widths of ``model``'s linear layers that carry peft LoRA adapters."""
    return sum(int(m.in_features) + int(m.out_features) for m in model.modules()
               if hasattr(m, "lora_A") and hasattr(m, "in_features") and hasattr(m, "out_features"))


def shape_of(model: torch.nn.Module) -> Shape:
    """The ``Shape`` of a built model (on any device, ``meta`` included)."""
    cfg = getattr(getattr(model, "module", model), "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    params = list(model.parameters())
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p in params]
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    return Shape(sum(t.numel() for t in local), sum(t.numel() for p, t in zip(params, local) if p.requires_grad),
                 int(getattr(cfg, "num_hidden_layers", 0) or 0),
                 hidden + int(getattr(cfg, "intermediate_size", 0) or 0), hidden, adapted_width(model),
                 int(getattr(cfg, "vocab_size", 0) or 0))


def shape_from_folder(folder: str, lora: Optional[LoraConfig], trust_remote_code: bool = False) -> Shape:
    """The ``Shape`` of the model in ``folder`` without loading its weights (``shape_from_config``)."""
    from transformers import AutoConfig

    return shape_from_config(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code), lora,
                             trust_remote_code)


def shape_from_config(hf_cfg: Any, lora: Optional[LoraConfig], trust_remote_code: bool = False) -> Shape:
    """The ``Shape`` of a model built from the HF config ``hf_cfg`` on the meta device (no weights), with
    LoRA's trained parameters when ``lora`` is set (rank r on every linear layer it targets)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg, trust_remote_code=trust_remote_code)
    shape = shape_of(model)
    if lora is None:
        return shape
    rank = lora.r
    trained = lora_parameters(model.named_modules(), rank, lora.target_modules)
    return replace(shape, parameters=shape.parameters + trained, trained=trained, adapted=trained // rank)


def lora_parameters(modules: Iterable[Tuple[str, torch.nn.Module]], r: int, targets: Any) -> int:
    """Adapter parameters of rank ``r`` on the linear layers ``targets`` names (peft's ``all-linear``:
    every linear layer but the output head; or a list of module-name suffixes)."""
    total = 0
    for name, module in modules:
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        hit = leaf != "lm_head" if targets == "all-linear" else leaf in targets
        if hit:
            total += r * (module.in_features + module.out_features)
    return total


@dataclass(frozen=True)
class Plan:
    static_bytes: float
    free_bytes: float
    per_token: float  # activation bytes per token without checkpointing
    per_token_checkpointed: float
    group_tokens: int  # one prompt group's tokens at the longest length
    sequence_tokens: int
    worthwhile_tokens: float  # the micro-batch from which splitting costs less than recomputing

    @property
    def room(self) -> float:
        return MEMORY_FRACTION * (self.free_bytes - self.static_bytes)

    @property
    def checkpointing(self) -> bool:
        """Whether activations need recomputing to fit (the auto setting): the room holds neither one
        prompt group's nor a worthwhile micro-batch's without it (module docstring)."""
        needed = max(self.sequence_tokens, min(self.group_tokens, self.worthwhile_tokens))
        return self.room < needed * self.per_token

    def fits(self) -> bool:
        return self.room >= self.sequence_tokens * self.per_token_checkpointed


def plan(cfg: Config, shape: Shape, free_bytes: float, needs_reference: bool, peft: bool) -> Plan:
    """The memory of a run of ``cfg`` on a GPU with ``free_bytes`` free (module docstring)."""
    a, r = cfg.actor, cfg.rollout
    weight = DTYPE_BYTES[a.dtype]
    trained_weight = 4 if peft else weight  # peft's adapters train in float32
    bf16_autocast = a.autocast in (None, "auto", "bfloat16")
    # a LoRA actor's frozen base kept in bf16 (bf16_compute.freeze_in_bf16): no master, no per-pass casts
    base_bf16 = peft and weight == 4 and (a.mixed_precision == "bfloat16"
                                          or (a.mixed_precision == "auto" and bf16_autocast))
    frozen = shape.parameters - shape.trained
    static = frozen * (2 if base_bf16 else weight) + shape.trained * weight
    static += shape.trained * (trained_weight + OPTIMIZER_STATE_BYTES[a.optimizer])
    if needs_reference:
        static += frozen * (2 if base_bf16 else weight) if peft else shape.parameters * weight
    if base_bf16:  # the decode's bf16 copies (adapters merged), the passes' bf16 copies of the adapters
        static += 2 * shape.parameters + 2 * shape.trained
    elif weight == 4 and bf16_autocast:  # the passes' bf16 copies (or autocast's casts) and the decode's
        static += 2 * 2 * shape.parameters
    static += async_copies(cfg, shape, 2 if bf16_autocast else weight)
    half = bf16_autocast or weight == 2
    per_token = ACTIVATION_BYTES * shape.layers * shape.width * (1.0 if half else 2.0)
    per_token += adapter_per_token(shape.adapted, half)
    checkpointed = checkpointed_per_token(per_token, shape.layers, shape.hidden, 2 if half else 4)
    sequence = cfg.trainer.max_prompt_length + r.max_new_tokens
    worthwhile = MICRO_BATCH_S * UPDATE_FLOPS_PER_S / (2.0 * shape.parameters) if shape.parameters else float("inf")
    return Plan(static, free_bytes, per_token, checkpointed, r.n * sequence, sequence, worthwhile)


def async_copies(cfg: Config, shape: Shape, nbytes: int) -> float:
    """Bytes the asynchronous mode keeps on the trainer's GPU besides the trainer's own (module docstring),
    at ``nbytes`` per element. Without a GPU of their own (a host of one) ``full``'s workers share it."""
    t = cfg.trainer
    if t.async_mode == "one_step" and not rollout_engines.owns_weights(cfg):  # an engine's own copy serves it
        return nbytes * shape.trained
    if t.async_mode == "full" and torch.cuda.device_count() <= 1:
        return nbytes * shape.parameters * (1 + 2 * t.async_workers)
    return 0.0


def head_bytes(tokens: int, hidden: int, vocab: int, fused: bool) -> float:
    """Device bytes the log-prob head holds for a micro-batch of ``tokens`` at its peak (its backward).
    Fused (``linear_logprobs``): the bf16 hidden states it keeps, their fp32 gradient accumulator and one
    d_logits chunk; the [tokens, vocab] logits never exist. Plain: the bf16 logits kept for the backward
    and their fp32 gradient."""
    if fused:
        from verl_fast.kernels.linear_logprobs import LinearConfig

        return tokens * hidden * (2 + 4) + LinearConfig.chunk_bytes
    return tokens * vocab * (2 + 4)


@dataclass(frozen=True)
class Estimate:
    """A run's peak device bytes by phase: what stays (``static``), then either the update's micro-batch
    (its saved activations as ``mode`` keeps them, and the log-prob head) or the rollout's decode (its
    KV cache and sampling rows), which never hold memory at the same time."""

    static: float
    mode: str  # "plain" | "checkpointed": how the update keeps its activations
    micro_tokens: int  # the update's micro-batch, in tokens
    activations: float
    head: float
    rollout: float
    rollout_prompts: int  # the prompts one decode call takes

    @property
    def update_peak(self) -> float:
        return self.static + self.activations + self.head

    @property
    def rollout_peak(self) -> float:
        return self.static + self.rollout

    @property
    def peak(self) -> float:
        return max(self.update_peak, self.rollout_peak)

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {**out, "update_peak": self.update_peak, "rollout_peak": self.rollout_peak, "peak": self.peak}


def estimate(cfg: Config, shape: Shape, hf_config: Any, free_bytes: float, needs_reference: bool = False,
             peft: bool = False, compiled: bool = True, fused_head: bool = True) -> Estimate:
    """The peak of a run of ``cfg`` on a GPU with ``free_bytes`` free, phase by phase (``Estimate``).

    The update: the micro-batch is ``actor.max_token_len_per_gpu`` when set, else what the trainer's
    auto budget takes (``trainer/batching.token_budget``: the room over the per-token activations, at
    most the step's tokens), never less than one sequence; its activations are kept whole where the
    room holds them (``plan``'s ``checkpointing``, or ``actor.gradient_checkpointing`` when set), else
    checkpointed. ``compiled``: the norms and MLPs compiled (``actor.compile_blocks``; eager ones keep
    ``EAGER_FACTOR`` more); ``fused_head``: the fused log-prob head (``head_bytes``). The rollout: the
    compiled HF decode's prompts per call in the room (``decode_prompts_per_call``) at their cache."""
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    p = plan(cfg, shape, free_bytes, needs_reference, peft)
    whole = p.per_token * (1.0 if compiled else EAGER_FACTOR)
    checkpointing = p.checkpointing if a.gradient_checkpointing is None else a.gradient_checkpointing
    per_token = whole
    if checkpointing:
        half = a.autocast in (None, "auto", "bfloat16", "float16") or a.dtype != "float32"
        per_token = checkpointed_per_token(whole, shape.layers, shape.hidden, 2 if half else 4)
    # the backward of a layer holds its activations' gradients beside them: one layer's more
    per_token += whole / max(shape.layers, 1)
    step_tokens = t.train_batch_size * r.n * p.sequence_tokens
    budget = a.max_token_len_per_gpu or min(step_tokens, int(max(p.room, 0.0) // per_token))
    tokens = max(p.sequence_tokens, budget)
    step = hf_decode.CompiledForward.WIDTH
    width = -(-t.max_prompt_length // step) * step
    element = 2 if a.autocast in (None, "auto", "bfloat16", "float16") else DTYPE_BYTES[a.dtype]
    prompts = decode_prompts_per_call(p, cfg, hf_config)
    rollout = prompts * hf_decode.bytes_per_prompt(hf_config, width, r.max_new_tokens, r.n, element)
    return Estimate(p.static_bytes, "checkpointed" if checkpointing else "plain", tokens, tokens * per_token,
                    head_bytes(tokens, shape.hidden, shape.vocab, fused_head), rollout, prompts)


def refusal(p: Plan, cfg: Config) -> str:
    """The one line a run that does not fit ends with, naming what would make it fit."""
    options = ["actor.lora (adapters: the base model frozen)", "actor.optimizer=adamw_8bit" if
               cfg.actor.optimizer == "adamw" else None, "actor.dtype=bfloat16 with actor.optimizer=adamw_8bit"
               if cfg.actor.dtype == "float32" else None, "actor.cpu_offload under torchrun (fsdp2)",
               "fewer samples or tokens (rollout.n, rollout.max_new_tokens, trainer.max_prompt_length)"]
    return (f"the run does not fit this GPU: the actor's weights, gradients, optimizer states and bf16 copies "
            f"take {p.static_bytes / GIB:.1f} GiB of the {p.free_bytes / GIB:.1f} GiB free, leaving no room for "
            f"one sequence's activations ({p.sequence_tokens} tokens); use "
            + "; or ".join(o for o in options if o))


def decode_prompts_per_call(p: Plan, cfg: Config, hf_config: Any) -> int:
    """How many of a step's ``trainer.train_batch_size`` prompts one call of the HF decode takes in the
    room ``p`` leaves: each prompt's ``rollout.n`` rows at ``trainer.max_prompt_length`` (rounded up as
    the compiled decode pads it) and ``rollout.max_new_tokens``, keys and values in bf16 under bf16
    autocast (else in ``actor.dtype``)."""
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    step = hf_decode.CompiledForward.WIDTH
    width = -(-t.max_prompt_length // step) * step
    element = 2 if a.autocast in (None, "auto", "bfloat16", "float16") else DTYPE_BYTES[a.dtype]
    return hf_decode.prompts_per_call(hf_config, width, r.max_new_tokens, r.n, t.train_batch_size, max(p.room, 0.0),
                                      element)


def check_before_loading(cfg: Config, folder: str, needs_reference: bool, device: torch.device) -> Optional[Plan]:
    """On a GPU: the plan of the model in ``folder``, raising ``DoesNotFit`` (one line) when even
    checkpointed activations of one sequence find no room (and logging how many prompts a decode call
    takes where that is fewer than a step's). None elsewhere."""
    if device.type != "cuda":
        return None
    shape = shape_from_folder(folder, cfg.actor.lora, cfg.actor.trust_remote_code)
    free = allocatable_bytes(device)
    peft = cfg.actor.lora is not None  # fresh adapters: the reference is the base, no copy (fsdp_strategy)
    p = plan(cfg, shape, free, needs_reference and not peft, peft)
    if not p.fits():
        raise DoesNotFit(refusal(p, cfg))
    from transformers import AutoConfig

    per_call = decode_prompts_per_call(p, cfg, AutoConfig.from_pretrained(folder,
                                                                           trust_remote_code=cfg.actor.trust_remote_code))
    if per_call < cfg.trainer.train_batch_size:
        logger.info("memory plan: the HF decode takes %d of a step's %d prompts per call (KV cache at %d new tokens "
                    "in %.1f GiB of room)", per_call, cfg.trainer.train_batch_size, cfg.rollout.max_new_tokens,
                    p.room / GIB)
    return p


def wants_checkpointing(cfg: Config, model: torch.nn.Module, device: torch.device, needs_reference: bool) -> bool:
    """``actor.gradient_checkpointing``'s auto for ``model`` (on ``device``, not yet holding its
    gradients or optimizer states): off on the CPU, where memory is not the limit."""
    if device.type != "cuda":
        return False
    free = allocatable_bytes(device)
    shape = shape_of(model)
    here = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    peft = is_peft(model)
    return plan(cfg, shape, free + here, needs_reference, peft).checkpointing
