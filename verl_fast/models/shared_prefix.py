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

Small batches go further (``packed_prompt_logprobs``): every group's prompt and its responses, padding
removed, in ONE sequence, with a 4-D mask that lets a prompt token see its own prompt (causally) and a
response token its group's prompt and its own response (causally); the vocabulary projection runs
only where a response token is predicted. With 16-token responses averaging 8 tokens, 4 groups of 8
and 28-token prompts that is 384 tokens instead of 624 and 272 projected positions instead of 512.
The mask is dense (T x T), so this is used up to ``PACKED_MAX_TOKENS``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from verl_fast.ops.logprobs import logprobs_from_logits

# The packed path's T x T mask and attention scores stay small (4096^2 booleans = 16 MiB) up to here.
PACKED_MAX_TOKENS = 4096
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


def packed_layout(attention_mask: torch.Tensor, response_length: int, groups: Tuple[torch.Tensor, torch.Tensor]):
    """Where each token of the packed sequence comes from, or None when the batch does not fit
    ``PACKED_MAX_TOKENS`` or a response's tokens are not a prefix of its columns. Returns
    ``(source [T] flat index into input_ids, position [T], mask [T, T] bool, predictor [M], target [M],
    slot [M] flat index into [N, L])``."""
    first, row_group = groups
    N, width = attention_mask.shape
    L = int(response_length)
    P = width - L
    keep = attention_mask.bool()
    resp = keep[:, P:]
    r_len = resp.sum(1)
    if not torch.equal(resp, torch.arange(L, device=resp.device) < r_len[:, None]):
        return None  # a response with a hole: its positions would not be consecutive
    p_keep = keep[first, :P]
    total = int(p_keep.sum()) + int(r_len.sum())
    if total > PACKED_MAX_TOKENS:
        return None
    cols = torch.arange(width, device=keep.device)
    source, position, owner, group_of, predictor, target, slot = [], [], [], [], [], [], []

    def segment(src: torch.Tensor, first_position: int, row: int, g: int) -> None:
        source.append(src)
        position.append(first_position + torch.arange(src.numel(), device=keep.device))
        owner.append(torch.full((src.numel(),), row, device=keep.device))
        group_of.append(torch.full((src.numel(),), g, device=keep.device))

    start = 0
    for g in range(first.numel()):
        pcols = cols[:P][p_keep[g]]
        p = pcols.numel()
        segment(first[g] * width + pcols, 0, -1, g)  # the group's prompt: owner -1, every row sees it
        last_prompt = start + p - 1
        start += p
        for row in (row_group == g).nonzero()[:, 0].tolist():
            r = int(r_len[row])
            tokens = row * width + P + cols[:r]
            segment(tokens, p, row, g)
            # token j of the response is predicted at the token before it (the prompt's last for j = 0)
            pred = start - 1 + torch.arange(r, device=keep.device)
            pred[:1] = last_prompt
            predictor.append(pred)
            target.append(tokens)
            slot.append(row * L + cols[:r])
            start += r
    position, owner, group_of = torch.cat(position), torch.cat(owner), torch.cat(group_of)
    mask = (group_of[:, None] == group_of[None, :]) & (position[None, :] <= position[:, None]) \
        & ((owner[None, :] == -1) | (owner[None, :] == owner[:, None]))
    return torch.cat(source), position, mask, torch.cat(predictor), torch.cat(target), torch.cat(slot)


def _attention(model: torch.nn.Module) -> Optional[str]:
    from verl_fast.models.wrapping import hf_module

    return getattr(getattr(hf_module(model), "config", None), "_attn_implementation", None)


def packed_prompt_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [N, P + L]: left-padded prompt, then right-padded response
    layout,  # from packed_layout
    response_length: int,  # L
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logprobs [N, L] float32, entropy [N, L] or None)`` from one packed forward (zeros past each
    response's end), differentiable."""
    source, position, mask, predictor, target, slot = layout
    N, L = input_ids.shape[0], int(response_length)
    flat = input_ids.reshape(-1)
    if _attention(model) == "eager":
        dtype = next(model.parameters()).dtype
        mask4 = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    else:
        mask4 = mask
    out = model(input_ids=flat[source][None], attention_mask=mask4[None, None], position_ids=position[None],
                logits_to_keep=predictor)
    result = logprobs_from_logits(out.logits[0], flat[target], temperature, with_entropy)
    logp, entropy = result if with_entropy else (result, None)

    def spread(values: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(N * L, dtype=torch.float32, device=values.device)
        return full.index_put((slot,), values.float()).view(N, L)

    return spread(logp), (spread(entropy) if entropy is not None else None)


def experience_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        response_length: int, group: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False, fused: Optional[bool] = None,
                        share: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``response_logprobs`` of rows grouped by prompt (``group [N]``): the prompt runs once per group
    when ``share`` and the model allows it (an HF causal LM with a KV cache, no fused head, no
    gradient checkpointing, not sharded); otherwise the plain forward. A sharded (FSDP) model takes
    the plain path: its ranks must run the same number of forward passes, and whether a micro-batch
    can share depends on the rows each rank holds."""
    from verl_fast.models.response_logprobs import _accepts, _fused_default, response_logprobs
    from verl_fast.models.wrapping import hf_module, is_sharded

    use_fused = _fused_default(model) if fused is None else fused
    if share and not use_fused and not is_sharded(model) and _accepts(model, "logits_to_keep") \
            and _accepts(model, "past_key_values") and not getattr(hf_module(model), "is_gradient_checkpointing", False):
        groups = prompt_groups(input_ids, attention_mask, group, response_length)
        layout = None
        if groups is not None and _attention(model) in _MASKABLE:
            layout = packed_layout(attention_mask, response_length, groups)
        if layout is not None:
            return packed_prompt_logprobs(model, input_ids, layout, response_length, temperature, with_entropy)
        if groups is not None:
            return shared_prompt_logprobs(model, input_ids, attention_mask, response_length, groups,
                                          temperature, with_entropy)
    return response_logprobs(model, input_ids, attention_mask, response_length, temperature, with_entropy,
                             fused=fused)
