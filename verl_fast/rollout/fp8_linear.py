"""FP8 linear layers for the HF decode (``rollout.quantization: fp8`` with ``rollout.type: hf``): while the
engine generates, each plain ``nn.Linear`` of the decoder layers runs on an FP8 e4m3 copy of its weight
with one scale per output channel (``ops.reshard.fp8``), and its input quantised per token the same way
(w8a8, as vLLM's FP8 layers). The embeddings, the LM head and the norms stay in the actor's dtype.

- The copies are the engine's weights: written from the actor's parameters by the resharding engine's
  FP8 quantisation (the CUDA kernel on a GPU; every changed layer in one call) at the first rollout and
  again at each rollout after an optimiser step changed a weight (its version counter moved), into
  buffers kept from one rollout to the next.
- The product: ``torch._scaled_mm`` (FP8 tensor cores, float32 accumulation) on a GPU that has it
  (compute capability 8.9+: Ada, Hopper); elsewhere the same numbers emulated in float32 from the
  dequantised operands (the CPU: tests and the CPU demo), announced once in one line.
- The input's scales (``ACTIVATIONS``): ``"token"``, one per token (the product scales rows and columns:
  ``_scaled_mm``'s row-wise mode); ``"tensor"``, one for the whole input (the product is tensor-wise scaled,
  cuBLASLt's FP8 GEMM, and the weight's per-channel scales multiply its output). Per-token scales follow
  each token's magnitude; one scale costs the small tokens of a batch precision where one token is large.
- LoRA layers (PEFT) keep their own forward: only plain linear layers are quantised.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from verl_fast.ops.reshard import fp8
from verl_fast.rollout import merged_projections, sync_check

logger = logging.getLogger(__name__)

SKIPPED = ("lm_head", "embed_tokens", "score")  # layers kept in the actor's dtype (vLLM's FP8 models too)
ACTIVATIONS = ("token", "tensor")  # the input's scales: one per token, one per input (module docstring)


def scaled_mm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs FP8 products here: a CUDA GPU of compute capability 8.9 or more."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_rows(x: torch.Tensor, per_token: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` as FP8 with one scale per row (``per_token``) or one for all (amax / 448; 1 for
    zeros), in torch ops (traceable by torch.compile and CUDA graphs): ``(q [M, K], scale [M, 1] or [1, 1]
    float32)``."""
    a = x.detach().abs()
    amax = (a.amax(dim=-1, keepdim=True) if per_token else a.amax().reshape(1, 1)).float()
    scale = torch.where(amax > 0, amax / fp8.FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return q, scale


def product(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
            dequantized: Optional[torch.Tensor], bias: Optional[torch.Tensor], per_token: bool = True) -> torch.Tensor:
    """``(q_x * s_x) @ (q_w * s_w)^T + b``: ``torch._scaled_mm`` where ``dequantized`` is None, else the same
    operands in float32 (what the FP8 tensor cores compute, up to the order of the sums). ``per_token``: the
    input's scales (``ACTIVATIONS``)."""
    shape = x.shape
    q, s = quantize_rows(x.reshape(-1, shape[-1]), per_token)
    # the dtype the layer's own product returns: autocast's where it is on (float32 weights and activations under
    # bf16 autocast give bf16, as the bf16 rollout's products do: its values cached and attended in bf16), else x's
    device = x.device.type
    out_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32)
    if dequantized is not None:
        y = (q.float() * s) @ dequantized.t()
    elif per_token:
        y = torch._scaled_mm(q, weight_fp8.t(), scale_a=s, scale_b=weight_scale.view(1, -1),
                             out_dtype=out_dtype if out_dtype != torch.float32 else torch.bfloat16)
    else:
        # tensor-wise: the input's one scale in the GEMM, the weight's per-channel scales on its output (one
        # pointwise multiply, which the compiled decode fuses with the bias and the cast). The GEMM's output
        # is the product over the weight's scales, up to 1 / min(scale) times the true one: kept in float32
        # until they multiply it, so that a float16 output does not overflow and a bf16 one is rounded once
        y = torch._scaled_mm(q, weight_fp8.t(), scale_a=s, scale_b=s.new_ones((1, 1)), out_dtype=torch.float32)
        y = y * weight_scale.view(1, -1)
    y = y.to(out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.reshape(*shape[:-1], y.shape[-1])


class FP8Linear(torch.nn.Module):
    """Stands in for ``linear`` during a rollout (``product`` of its FP8 copy). ``storage``: the rows of a
    stack's buffers (``FP8Stack``) to keep the copy in, else buffers of its own."""

    def __init__(self, linear: torch.nn.Linear, fast: bool,
                 storage: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, per_token: bool = True):
        super().__init__()
        self.linear, self.fast, self.per_token = linear, fast, per_token
        self.in_features, self.out_features = linear.in_features, linear.out_features  # as nn.Linear reads
        w = linear.weight
        self.weight_fp8, self.weight_scale = storage if storage is not None else (
            torch.empty(w.shape, dtype=fp8.FP8, device=w.device),
            torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device))
        self.dequantized: Optional[torch.Tensor] = None  # the emulation's float32 weight

    def written(self) -> None:
        """Notes that ``weight_fp8`` / ``weight_scale`` now hold the weight quantised (``refresh``)."""
        self.dequantized = None if self.fast else fp8.dequantize(self.weight_fp8, self.weight_scale, "channel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight_fp8, self.weight_scale, self.dequantized, self.linear.bias, self.per_token)


class FP8Stack(torch.nn.Module):
    """The FP8 copies of layers that read one input (q/k/v, gate/up) stacked along their output rows, as one
    product: the compiled decode's merged product (``merged_projections``' ``merged_product``), one GEMM and
    one quantisation of the input where the layers' own would run three or two. Per-channel scales make
    each layer's rows its own quantisation: the layers' ``FP8Linear`` copies are views into these buffers."""

    def __init__(self, linears: List[torch.nn.Linear], fast: bool, per_token: bool = True):
        super().__init__()
        w = linears[0].weight
        rows = sum(lin.weight.shape[0] for lin in linears)
        self.weight_fp8 = torch.empty(rows, w.shape[1], dtype=fp8.FP8, device=w.device)
        self.weight_scale = torch.empty(rows, 1, dtype=torch.float32, device=w.device)
        self.parts: List[FP8Linear] = []
        at = 0
        for lin in linears:
            n = lin.weight.shape[0]
            self.parts.append(FP8Linear(lin, fast, (self.weight_fp8[at:at + n], self.weight_scale[at:at + n]),
                                        per_token))
            at += n
        biased = all(lin.bias is not None for lin in linears)
        self.bias = torch.empty(rows, dtype=linears[0].bias.dtype, device=w.device) if biased else None
        self.fast, self.per_token = fast, per_token
        self.dequantized: Optional[torch.Tensor] = None

    def written(self) -> None:
        """After a rollout's refresh: the stacked bias copied again, the emulation's weight made again."""
        if self.bias is not None:
            torch.cat([part.linear.bias.detach() for part in self.parts], out=self.bias)
        self.dequantized = None if self.fast else fp8.dequantize(self.weight_fp8, self.weight_scale, "channel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight_fp8, self.weight_scale, self.dequantized, self.bias, self.per_token)


def refresh(layers: List[FP8Linear]) -> int:
    """The layers' weights quantised into their FP8 copies in one call (``fp8.quantize_many``: one kernel
    launch per 32 layers on a GPU, no host synchronisation); how many were. Every layer, every call: an
    update does not always tell (the fused AdamW writes the weights without moving their version counter),
    and a copy left stale would sample from an older policy."""
    fp8.quantize_many([layer.linear.weight.detach() for layer in layers], [layer.weight_fp8 for layer in layers],
                      [layer.weight_scale for layer in layers], "channel")
    for layer in layers:
        layer.written()
    return len(layers)


class FP8Decode:
    """The FP8 copies of one model's linear layers (module docstring); ``swapped(model)`` puts them in place
    for the length of a rollout, and gives each mergeable attention / MLP its stacked copy. ``activations``:
    the input's scales, one of ``ACTIVATIONS``."""

    def __init__(self, activations: str = ACTIVATIONS[0]) -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.per_token = activations == "token"
        self.layers: Dict[str, FP8Linear] = {}
        self.stacks: Dict[str, FP8Stack] = {}
        self._noted = False
        self.refreshed = 0  # layers quantised at the last rollout (the FP8 sync's work)

    def _targets(self, model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
        out = []
        for name, parent in model.named_modules():
            for attr, child in parent.named_children():
                full = f"{name}.{attr}" if name else attr
                if type(child) is torch.nn.Linear and attr not in SKIPPED and child.weight.is_floating_point():
                    out.append((full, parent, attr, child))
        return out

    def _stacks(self, model: torch.nn.Module, fast: bool) -> List[Tuple[str, torch.nn.Module]]:
        """The mergeable modules (``merged_projections.kind``), each with its stack (kept while its layers
        are the same objects), the stacked layers' copies registered as the stack's parts."""
        out = []
        for name, sub in model.named_modules():
            found = merged_projections.kind(sub)
            if found is None:
                continue
            linears = [getattr(sub, part) for part in merged_projections.PARTS[found]]
            stack = self.stacks.get(name)
            if stack is None or stack.fast != fast or [p.linear for p in stack.parts] != linears:
                stack = self.stacks[name] = FP8Stack(linears, fast, self.per_token)
            for part, lin in zip(merged_projections.PARTS[found], stack.parts):
                self.layers[f"{name}.{part}" if name else part] = lin
            out.append((name, sub))
        return out

    @contextlib.contextmanager
    def swapped(self, model: torch.nn.Module) -> Iterator[None]:
        targets = self._targets(model)
        device = next(model.parameters()).device
        fast = scaled_mm_available(device)
        if not fast and not self._noted:
            logger.warning("rollout.quantization=fp8: no FP8 matrix products on %s (torch._scaled_mm needs a GPU "
                           "of compute capability 8.9+); the FP8 layers are emulated from dequantised weights "
                           "(the same numbers, no speed-up)", device)
            self._noted = True
        with torch.no_grad():
            stacked = self._stacks(model, fast)
            for full, _, _, child in targets:
                layer = self.layers.get(full)
                if layer is None or layer.linear is not child or layer.fast != fast:
                    self.layers[full] = FP8Linear(child, fast, per_token=self.per_token)
            self.refreshed = refresh([self.layers[full] for full, *_ in targets])
            for name, _ in stacked:
                self.stacks[name].written()
        for full, parent, attr, _ in targets:
            setattr(parent, attr, self.layers[full])
        for name, sub in stacked:
            sub._modules["merged_product"] = self.stacks[name]
        try:
            yield
        finally:
            for _, sub in stacked:
                del sub._modules["merged_product"]
            for _, parent, attr, child in targets:
                setattr(parent, attr, child)

    def weight_differences(self, model: torch.nn.Module) -> List[str]:
        """The layers whose FP8 copy is not ``model``'s weight quantised (beyond FP8's rounding)."""
        theirs = dict(model.named_parameters())
        engine = {f"{k}.weight": fp8.dequantize(v.weight_fp8, v.weight_scale, "channel")
                  for k, v in self.layers.items()}
        actor = {k: theirs[k] for k in engine if k in theirs}
        return sync_check.differing_groups(engine, actor, {k: fp8.FP8 for k in engine})
