"""Response log-probs with the prompt run once per group: the samples of one prompt share its keys
and values.

GRPO-style batches hold ``n`` responses to each prompt. A plain forward runs the prompt's tokens
``n`` times; here the prompt runs once per group (with the model's KV cache kept, gradients
included), the cache rows are repeated for the group's responses, and the responses run on top.
The log-probs and their gradients are the plain forward's (the same attention over the same keys
and values; the prompt's gradient arrives summed over its responses, as it does when the prompt is
run ``n`` times). Work saved: (n - 1) x prompt tokens per group, e.g. 36-token prompts and 16-token
responses at n = 8: 164 tokens instead of 416 per group.

Used for Hugging Face causal LMs whose forward takes ``past_key_values`` (Llama, Qwen2, Qwen3, ...);
``prompt_groups`` returns None when rows of a group do not hold the same prompt tokens, and the
caller then takes the plain path.

Packed (``models/packed``): the group's prompt once and its responses in one sequence without
padding, the vocabulary projection only where a response token is predicted; on a GPU with
``actor.use_remove_padding`` through torch's varlen flash attention (any batch size), on the CPU
through a dense [T, T] mask for small batches (up to ``packed.DENSE_MAX_TOKENS``). With 16-token
responses averaging 8 tokens, 4 groups of 8 and 28-token prompts that is 384 tokens instead of 624
and 272 projected positions instead of 512.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_fast.ops.logprobs import logprobs_from_logits

# attention implementations that take a custom 4-D mask as it is
_MASKABLE = ("sdpa", "eager")


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, group: torch.Tensor,
                  response_length: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(first_row [G], row_group [N])`` when rows of equal ``group`` hold identical prompt columns
    and sharing saves work (some group has 2+ rows), else None."""
    P = input_ids.shape[1] - int(response_length)
    _, row_group, counts = torch.unique(group, return_inverse=True, return_counts=True)
    if P < 1 or int(counts.max()) < 2:
        return None
    first = torch.full((counts.numel(),), input_ids.shape[0], dtype=torch.long, device=group.device)
    first = first.scatter_reduce(0, row_group, torch.arange(group.numel(), device=group.device), "amin")
    same = (input_ids[:, :P] == input_ids[first][row_group, :P]).all() and \
        (attention_mask[:, :P] == attention_mask[first][row_group, :P]).all()
    return (first, row_group) if bool(same) else None


def shared_prompt_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [N, P + L]: left-padded prompt, then right-padded response
    attention_mask: torch.Tensor,  # [N, P + L]
    response_length: int,  # L
    groups: Tuple[torch.Tensor, torch.Tensor],  # from prompt_groups
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logprobs [N, L] float32, entropy [N, L] or None)`` of the last L tokens, differentiable."""
    first, row_group = groups
    L = int(response_length)
    P = input_ids.shape[1] - L
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    # the prompt, once per group; its last position predicts the first response token
    head = model(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                 position_ids=position_ids[first, :P], use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    cache.batch_select_indices(row_group)  # [G, ...] -> [N, ...], differentiable
    body = model(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=position_ids[:, P:],
                 past_key_values=cache, use_cache=True, logits_to_keep=L)
    logits = torch.cat([head.logits[row_group], body.logits[:, :-1]], dim=1)  # [N, L, V]
    result = logprobs_from_logits(logits, input_ids[:, P:], temperature, with_entropy)
    return result if with_entropy else (result, None)


def _attention(model: torch.nn.Module) -> Optional[str]:
    from verl_fast.models.wrapping import hf_module

    return getattr(getattr(hf_module(model), "config", None), "_attn_implementation", None)


def packed_layout(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_length: int, group: torch.Tensor, share: bool):
    """The varlen layout ``experience_logprobs(packed=True)`` runs these rows with (each group's prompt
    once when ``share``), or None where it takes the plain forward."""
    from verl_fast.models import packed as packing
    from verl_fast.models.response_logprobs import accepts

    if not accepts(model, "logits_to_keep"):  # the head runs on the predicting positions only
        return None
    groups = prompt_groups(input_ids, attention_mask, group, response_length) if share else None
    return packing.layout(attention_mask, response_length, groups, bucketed=input_ids.is_cuda)


def experience_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        response_length: int, group: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False, fused: Optional[bool] = None,
                        share: bool = True, packed: bool = False,
                        layout=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``response_logprobs`` of rows grouped by prompt (``group [N]``).

    ``packed`` (``actor.use_remove_padding``; the caller holds ``packed.attention_switched``): the
    rows without padding through the varlen attention, each group's prompt once when ``share``;
    the plain forward where the batch cannot be packed. ``layout``: that packing, made by the caller
    (``packed_layout``; implies ``packed``). Otherwise, when ``share`` and the model
    allows it (an HF causal LM with a KV cache, no fused head, no gradient checkpointing, not
    sharded), the prompt runs once per group: packed under a dense mask for small batches, else
    through the KV cache; otherwise the plain forward. A sharded (FSDP) model takes the plain path
    there: its ranks must run the same number of forward passes, and whether a micro-batch can share
    depends on the rows each rank holds (the packed path is always one pass)."""
    from verl_fast.models import packed as packing
    from verl_fast.models.response_logprobs import accepts, fused_default, response_logprobs
    from verl_fast.models.wrapping import hf_module, is_sharded

    use_fused = fused_default(model) if fused is None else fused
    if packed or layout is not None:
        lay = layout if layout is not None else packed_layout(model, input_ids, attention_mask, response_length,
                                                                group, share)
        if lay is not None:
            return packing.packed_logprobs(model, input_ids, lay, response_length, temperature, with_entropy,
                                           fused=use_fused)
    elif share and not use_fused and not is_sharded(model) and accepts(model, "logits_to_keep") \
            and accepts(model, "past_key_values") and not getattr(hf_module(model), "is_gradient_checkpointing", False):
        groups = prompt_groups(input_ids, attention_mask, group, response_length)
        lay = None
        if groups is not None and _attention(model) in _MASKABLE:
            lay = packing.layout(attention_mask, response_length, groups, max_tokens=packing.DENSE_MAX_TOKENS)
        if lay is not None:
            return packing.packed_logprobs(model, input_ids, lay, response_length, temperature, with_entropy,
                                           attention="dense")
        if groups is not None:
            return shared_prompt_logprobs(model, input_ids, attention_mask, response_length, groups,
                                          temperature, with_entropy)
    return response_logprobs(model, input_ids, attention_mask, response_length, temperature, with_entropy,
                             fused=fused)
