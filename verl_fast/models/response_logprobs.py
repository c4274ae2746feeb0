"""Per-token log-probs (and entropy) of a causal LM's response tokens.

``response_logprobs`` is the one entry the trainer uses for the actor and the reference model.

Fused path (the default where Triton and a CUDA model are present): the model runs its own
forward -- under whatever FSDP wrapping it has -- with its output head swapped, for the duration of
the call, for one that turns the final (normed) hidden states of the positions predicting the last
L tokens into ``linear_logprobs(hidden, lm_head.weight, labels)``: the [B, L, V] logits never
exist. Working inside the head's call, rather than running ``model.model`` and reading
``lm_head.weight`` afterwards, keeps FSDP's unsharded weight, its hooks on the module's outputs,
and autocast in play. Families: those whose head is a plain ``nn.Linear`` on the final hidden
states with no logit post-processing (``FUSED_FAMILIES``).

Plain path: the logits of the last L + 1 positions only (``logits_to_keep``), then
``logprobs_from_logits`` on the slice (one pass, no full log_softmax, no fp32 copy).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from typing import Dict, Optional, Tuple

import torch

from verl_fast.models.wrapping import hf_module, peft_base
from verl_fast.ops.logprobs import linear_logprobs, logprobs_from_logits

FUSED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl"})


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    config = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if getattr(config, "model_type", None) in FUSED_FAMILIES and isinstance(head, torch.nn.Linear):
        return head
    return None


def fused_default(model: torch.nn.Module) -> bool:
    if importlib.util.find_spec("triton") is None or output_head(model) is None:
        return False
    return next(model.parameters()).device.type == "cuda"


def _cast_like_linear(hidden, weight, bias):
    """The dtypes F.linear would compute in: the autocast dtype when autocast is on, else the weight's."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


@contextlib.contextmanager
def head_returns_logprobs(head: torch.nn.Linear, labels, temperature: float, with_entropy: bool,
                           shifted: bool = True):
    """While active, ``head(hidden [B, k, H])`` returns [B, L, 1 or 2] = (logp, entropy) for the labels
    [B, L], from the k positions the model passes: ``shifted``, the L before the last (the last L + 1
    or all were kept); else exactly the L predicting positions."""
    L = labels.shape[1]

    def forward(hidden):
        h, weight, bias = _cast_like_linear(hidden[:, -L - 1 : -1] if shifted else hidden, head.weight, head.bias)
        # check=False: the labels are input tokens the model's embedding has already looked up, and the
        # range check would read back to the host mid-forward (the GPU then idles while the backward queues)
        out = linear_logprobs(h, weight, labels, temperature, with_entropy, bias=bias, check=False)
        return torch.stack(out, dim=-1) if with_entropy else out.unsqueeze(-1)

    previous = head.__dict__.get("forward")  # an instance-level forward someone else installed, if any
    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward  # back to the class's forward
        else:
            head.forward = previous


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model``'s forward takes the keyword ``name``. Wrappers that pass the keywords they do
    not name through to the model they wrap (FSDP1 / DDP's ``module``, peft's base model, whose
    forward names none of ``logits_to_keep``, ``past_key_values``) are looked through: without this,
    LoRA actors ran every pass padded, with the head over every position."""
    try:
        return name in inspect.signature(peft_base(hf_module(model)).forward).parameters
    except (TypeError, ValueError):
        return False


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P + L]: left-padded prompt, then right-padded response
    attention_mask: torch.Tensor,  # [B, P + L]
    response_length: int,  # L: log-probs of the last L tokens given everything before them
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: Optional[bool] = None,
    model_inputs: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns ``(logprobs [B, L] float32, entropy [B, L] float32 or None)``, differentiable.

    ``fused``: None = fused where Triton and a CUDA model are present (and the family is in
    ``FUSED_FAMILIES``); True forces it (on CPU it runs the chunked torch implementation); False
    takes the plain logits path. ``model_inputs``: more keywords of the forward, which replace the
    plain ones (a vision-language model's images and 3-D positions: ``models/vision.model_inputs``).
    """
    L = int(response_length)
    if input_ids.dim() != 2 or not 1 <= L < input_ids.shape[1]:
        raise ValueError(f"response_length must be in [1, P + L) for input_ids [B, P + L] = "
                         f"{list(input_ids.shape)}, got {response_length}")
    labels = input_ids[:, -L:]
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    kwargs.update(model_inputs or {})
    if accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = L + 1
    if fused is None:
        fused = fused_default(model)
    if fused:
        head = output_head(model)
        if head is None:
            raise ValueError(f"fused log-probs support the families {sorted(FUSED_FAMILIES)} with an nn.Linear "
                             f"head; got model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r}: "
                             "use fused=False")
        with head_returns_logprobs(head, labels, temperature, with_entropy):
            out = model(**kwargs).logits  # [B, L, 1 or 2]
        return out[..., 0], (out[..., 1] if with_entropy else None)
    logits = model(**kwargs).logits[:, -L - 1 : -1, :]  # predicts tokens -L..-1; a view, no copy
    result = logprobs_from_logits(logits, labels, temperature, with_entropy, check=False)  # as the fused head
    return result if with_entropy else (result, None)
