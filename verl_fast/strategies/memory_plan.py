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

What is left holds the activations of the micro-batches: without checkpointing, what each decoder
layer's forward keeps for its backward, counted tensor by tensor (``layer_bytes``); with it, each
layer's input plus one layer's full activations for the recompute (``activation_bytes``).
``gradient_checkpointing``'s auto turns it on when the rest
cannot hold, without it, the activations of one prompt group (``rollout.n`` sequences of the longest
length) or of a micro-batch large enough to be worth splitting the update into, whichever is fewer
tokens (never less than one sequence): a micro-batch more costs ``MICRO_BATCH_S`` beyond its tokens'
work, checkpointing costs one more forward of every token, so micro-batches of at least
``MICRO_BATCH_S`` x ``UPDATE_FLOPS_PER_S`` / (2 x parameters) tokens are cheaper than recomputing
(~38k tokens at the 0.5B shape, where a group decides; ~2.5k at 7B). The run is refused before the
weights load when it cannot hold one sequence's even with it.

The rollout's compiled HF decode holds its KV cache in the same room while it runs (the update's
activations are gone by then): ``decode_prompts_per_call`` counts how many of a step's prompts one
decode call takes at ``rollout.max_new_tokens`` (``decode_memory.prompts_per_call``), the rest decoding in
further calls, and ``check_before_loading`` logs it where that is fewer than the step's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Tuple

import torch

from verl_fast.config import Config, LoraConfig
from verl_fast.distributed import MEMORY_FRACTION, allocatable_bytes
from verl_fast.models import compiled_blocks
from verl_fast.models.lora import is_peft
from verl_fast.rollout import engines as rollout_engines
from verl_fast.rollout import decode_memory, hf_decode

logger = logging.getLogger(__name__)

GIB = 2**30
FP32 = 4  # bytes of the norms' float32 upcast and of the attention's log-sum-exp
# LoRA's passes keep more per token than the model alone (each adapted layer's input cast again for
# lora_A, the base + adapter sum kept by the next operation, the residual stream in float32 beside
# frozen float32 weights): measured at the Qwen2.5-7B shape with r 64 on every linear layer
# (docs/benchmarks.md). Counted per unit of the adapted layers' (in + out) width.
ADAPTER_ACTIVATION_BYTES = 1.0
QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe"})  # per-head query / key norms
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
    attention: int = 0  # query heads x head_dim (0: hidden)
    kv: int = 0  # key / value heads x head_dim (0: hidden)
    heads: int = 0  # query heads
    qk_norm: bool = False  # RMSNorms on each head's queries and keys (Qwen3)

    @property
    def intermediate(self) -> int:
        return self.width - self.hidden


def layer_bytes(shape: Shape, element: int, compiled: bool, padded_width: int = 0) -> float:
    """Bytes one decoder layer's forward keeps for its backward, per token (a Qwen2 / Qwen3 / Llama layer,
    packed rows through the varlen flash attention, ``element`` bytes a value: 2 in bf16 passes, 4 in
    float32), as autograd saves them (``python_tests/strategies/test_activation_count.py`` checks the
    count against the saved tensors of the real modules):

    - each RMSNorm: compiled, its input; eager, its float32 upcast and its normalised output (HF's
      ``weight * hidden.to(dtype)``), its input not kept; and its output, which the next projections keep;
    - the attention: the contiguous [tokens, heads, head_dim] queries, keys and values the kernel keeps,
      its output (o_proj's input) and its float32 log-sum-exp a head; the rotary product keeps only the
      shared cos / sin; Qwen3's per-head norms keep their inputs as a norm does;
    - the MLP: compiled (Inductor's partition), gate, up and their product; eager, gate, silu's output,
      up and the product (down_proj's input).

    ``padded_width`` (rows that run padded to that width through transformers' ``sdpa`` with their padding
    mask, as rows with images do): the attention keeps the keys and values repeated to the query heads
    (transformers hands sdpa grouped keys only without a mask) and the mask as a bias in the passes'
    dtype, one value per key of the row."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.attention or h, shape.kv or h
    if padded_width:
        kv = q

    def norm(width: int) -> float:  # what a norm keeps besides its output
        return element * width if compiled else (FP32 + element) * width

    out = 2 * (norm(h) + element * h)  # the two norms and their outputs
    out += element * (2 * q + 2 * kv + padded_width) + FP32 * (shape.heads or 1)
    if shape.qk_norm:
        out += norm(q) + norm(kv)
    out += element * i * (3 if compiled else 4)
    return float(out)


def activation_bytes(shape: Shape, element: int, compiled: bool, checkpointed: bool,
                     padded_width: int = 0) -> float:
    """Activation bytes per token of a training pass's micro-batch at its peak, early in its backward:
    every layer's saved tensors (``layer_bytes``, of rows padded to ``padded_width`` where given; LoRA's
    ``adapter_per_token`` on top; checkpointed, each
    layer's input, ``element`` bytes, plus one layer's recomputed ones), the final norm's and the head's
    input, the rotary cos / sin, and the gradients the backward holds beside them (``logprob_pass_bytes``:
    the residual stream's and one MLP's intermediates)."""
    h = shape.hidden
    head_dim = (shape.attention or h) // max(shape.heads, 1)
    adapters = adapter_per_token(shape.adapted, element == 2) / max(shape.layers, 1)
    layer = layer_bytes(shape, element, compiled, padded_width) + adapters
    kept = element * shape.layers * h + layer if checkpointed else shape.layers * layer
    final = (1 if compiled else 1 + FP32 / element) * element * h + element * h + 2 * element * head_dim
    return kept + final + logprob_pass_bytes(shape, element)


def logprob_pass_bytes(shape: Shape, element: int) -> float:
    """Per-token bytes of a layer's transient tensors: a log-prob pass without a graph (old log-probs, the
    reference's) holds at its peak the residual stream and a norm's output, and the MLP's gate, up and
    product inside one layer; a backward, the gradients of the same tensors."""
    return float(element * (2 * shape.hidden + 3 * shape.intermediate))


def adapter_per_token(adapted: int, half: bool) -> float:
    """Activation bytes per token that LoRA adapters on linear layers of ``adapted`` summed (in + out)
    width add (``ADAPTER_ACTIVATION_BYTES``; twice as much without bf16 / fp16 autocast)."""
    return ADAPTER_ACTIVATION_BYTES * adapted * (1.0 if half else 2.0)


def adapted_width(model: torch.nn.Module) -> int:
    """The summed (in + out) widths of ``model``'s linear layers that carry peft LoRA adapters."""
    return sum(int(m.in_features) + int(m.out_features) for m in model.modules()
               if hasattr(m, "lora_A") and hasattr(m, "in_features") and hasattr(m, "out_features"))


def family_of(model: torch.nn.Module) -> Optional[str]:
    """The ``model_type`` of a built model's config (under an FSDP1 / DDP wrapper too)."""
    return getattr(getattr(getattr(model, "module", model), "config", None), "model_type", None)


def shape_of(model: torch.nn.Module) -> Shape:
    """The ``Shape`` of a built model (on any device, ``meta`` included)."""
    cfg = getattr(getattr(model, "module", model), "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    params = list(model.parameters())
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p in params]
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // heads if heads else 0))
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    return Shape(sum(t.numel() for t in local), sum(t.numel() for p, t in zip(params, local) if p.requires_grad),
                 int(getattr(cfg, "num_hidden_layers", 0) or 0),
                 hidden + int(getattr(cfg, "intermediate_size", 0) or 0), hidden, adapted_width(model),
                 int(getattr(cfg, "vocab_size", 0) or 0), heads * head_dim, kv_heads * head_dim, heads,
                 getattr(cfg, "model_type", None) in QK_NORM_FAMILIES)


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
    element: int = 2  # bytes of an activation: 2 in bf16 passes, 4 in float32

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


def blocks_compiled(cfg: Config, device: torch.device, sharded: bool, peft: bool,
                    model_type: Optional[str] = None, counted: bool = False) -> bool:
    """``actor.compile_blocks`` resolved (its null: auto, on a GPU for an unsharded actor without adapters);
    off, whatever the key, for a model whose ``model_type`` is not one whose norms and MLPs
    ``compiled_blocks`` compiles. ``counted``: as the token budget counts them, where a vision-language
    model's (``compiled_blocks.VISION_FAMILIES``, its language model's) count as eager ones (what they keep,
    at most)."""
    if model_type in compiled_blocks.VISION_FAMILIES and counted:
        return False
    if model_type is not None and model_type not in compiled_blocks.FAMILIES | compiled_blocks.VISION_FAMILIES:
        return False
    if cfg.actor.compile_blocks is not None:
        return cfg.actor.compile_blocks
    return device.type == "cuda" and not sharded and not peft


def plan(cfg: Config, shape: Shape, free_bytes: float, needs_reference: bool, peft: bool,
         compiled: Optional[bool] = None) -> Plan:
    """The memory of a run of ``cfg`` on a GPU with ``free_bytes`` free (module docstring); ``compiled``:
    the norms and MLPs compiled (None: ``blocks_compiled`` for an unsharded actor)."""
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
    element = 2 if bf16_autocast or weight == 2 else 4
    if compiled is None:
        compiled = blocks_compiled(cfg, torch.device("cuda"), False, peft)
    per_token = activation_bytes(shape, element, compiled, checkpointed=False)
    checkpointed = activation_bytes(shape, element, compiled, checkpointed=True)
    sequence = cfg.trainer.max_prompt_length + r.max_new_tokens
    worthwhile = MICRO_BATCH_S * UPDATE_FLOPS_PER_S / (2.0 * shape.parameters) if shape.parameters else float("inf")
    return Plan(static, free_bytes, per_token, checkpointed, r.n * sequence, sequence, worthwhile, element)


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


def logprob_head_bytes(tokens: int, shape: Shape, element: int, fused: bool) -> float:
    """What the head of a log-prob pass without a graph holds: fused, one chunk of logits at a time (and
    the hidden states it reads); plain, the [tokens, vocab] logits."""
    if fused:
        from verl_fast.kernels.linear_logprobs import LinearConfig

        return tokens * shape.hidden * element + LinearConfig.chunk_bytes
    return tokens * shape.vocab * element


@dataclass(frozen=True)
class Estimate:
    """A run's peak device bytes by phase: what stays (``static``), then either the update's micro-batch
    (its saved activations as ``mode`` keeps them, and the log-prob head), a log-prob pass without a graph
    (old log-probs, the reference's: ``logprob_pass``) or the rollout's decode (its KV cache and sampling
    rows), which never hold memory at the same time."""

    static: float
    mode: str  # "plain" | "checkpointed": how the update keeps its activations
    micro_tokens: int  # the update's micro-batch, in tokens
    activations: float
    head: float  # what the log-prob head adds to the update's peak (checkpointed: beyond a recomputed layer's)
    rollout: float
    rollout_prompts: int  # the prompts one decode call takes
    logprob_pass: float = 0.0  # a log-prob pass's peak over the same micro-batch, its head included

    @property
    def update_peak(self) -> float:
        return self.static + self.activations + self.head

    @property
    def rollout_peak(self) -> float:
        return self.static + self.rollout

    @property
    def logprob_peak(self) -> float:
        return self.static + self.logprob_pass

    @property
    def peak(self) -> float:
        return max(self.update_peak, self.rollout_peak, self.logprob_peak)

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {**out, "update_peak": self.update_peak, "rollout_peak": self.rollout_peak,
                "logprob_peak": self.logprob_peak, "peak": self.peak}


def estimate(cfg: Config, shape: Shape, hf_config: Any, free_bytes: float, needs_reference: bool = False,
             peft: bool = False, compiled: bool = True, fused_head: bool = True,
             micro_tokens: Optional[int] = None) -> Estimate:
    """The peak of a run of ``cfg`` on a GPU with ``free_bytes`` free, phase by phase (``Estimate``).

    The update: the micro-batch is ``micro_tokens`` when given (the one a caller cut), else
    ``actor.max_token_len_per_gpu`` when set, else what the trainer's auto budget takes
    (``trainer/batching.token_budget``: the room over the per-token activations, at most the step's
    tokens), never less than one sequence; its activations are kept whole where the room holds them
    (``plan``'s ``checkpointing``, or ``actor.gradient_checkpointing`` when set), else checkpointed
    (``activation_bytes``). ``compiled``: the norms and MLPs compiled (``actor.compile_blocks``);
    ``fused_head``: the fused log-prob head (``head_bytes``). The rollout: the compiled HF decode's
    prompts per call in the room (``decode_prompts_per_call``) at their cache."""
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    p = plan(cfg, shape, free_bytes, needs_reference, peft, compiled)
    checkpointing = p.checkpointing if a.gradient_checkpointing is None else a.gradient_checkpointing
    per_token = p.per_token_checkpointed if checkpointing else p.per_token
    step_tokens = t.train_batch_size * r.n * p.sequence_tokens
    budget = micro_tokens or a.max_token_len_per_gpu or min(step_tokens, int(max(p.room, 0.0) // per_token))
    tokens = budget if micro_tokens else max(p.sequence_tokens, budget)
    step = hf_decode.CompiledForward.WIDTH
    width = -(-t.max_prompt_length // step) * step
    element = 2 if a.autocast in (None, "auto", "bfloat16", "float16") else DTYPE_BYTES[a.dtype]
    prompts = decode_prompts_per_call(p, cfg, hf_config)
    rollout = prompts * decode_memory.bytes_per_prompt(hf_config, width, r.max_new_tokens, r.n, element)
    passes = tokens * logprob_pass_bytes(shape, p.element) + logprob_head_bytes(tokens, shape, p.element, fused_head)
    head = head_bytes(tokens, shape.hidden, shape.vocab, fused_head)
    if checkpointing:  # the head's backward runs before any layer is recomputed: only its excess over one counts
        head = max(0.0, head - tokens * (p.per_token_checkpointed - p.element * shape.layers * shape.hidden))
    return Estimate(p.static_bytes, "checkpointed" if checkpointing else "plain", tokens, tokens * per_token,
                    head, rollout, prompts, passes)


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
    return decode_memory.prompts_per_call(hf_config, width, r.max_new_tokens, r.n, t.train_batch_size, max(p.room, 0.0),
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
    from verl_fast.distributed import world_size
    from verl_fast.strategies.sharding import Sharding

    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.actor.trust_remote_code)
    sharded = Sharding.from_config(cfg.actor, "actor", world_size()).strategy != "none"
    compiled = blocks_compiled(cfg, device, sharded, peft, getattr(model_config, "model_type", None), counted=True)
    p = plan(cfg, shape, free, needs_reference and not peft, peft, compiled)
    if not p.fits():
        raise DoesNotFit(refusal(p, cfg))
    per_call = decode_prompts_per_call(p, cfg, model_config)
    if per_call < cfg.trainer.train_batch_size:
        logger.info("memory plan: the HF decode takes %d of a step's %d prompts per call (KV cache at %d new tokens "
                    "in %.1f GiB of room)", per_call, cfg.trainer.train_batch_size, cfg.rollout.max_new_tokens,
                    p.room / GIB)
    return p


def wants_checkpointing(cfg: Config, model: torch.nn.Module, device: torch.device, needs_reference: bool,
                        sharded: bool) -> bool:
    """``actor.gradient_checkpointing``'s auto for ``model`` (on ``device``, not yet holding its
    gradients or optimizer states; ``sharded``: it will be): off on the CPU, where memory is not the limit."""
    if device.type != "cuda":
        return False
    free = allocatable_bytes(device)
    shape = shape_of(model)
    here = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    peft = is_peft(model)
    compiled = blocks_compiled(cfg, device, sharded, peft, family_of(model), counted=True)
    return plan(cfg, shape, free + here, needs_reference, peft, compiled).checkpointing
