"""Ulysses sequence parallelism for the attention of Hugging Face causal LMs (DeepSpeed-Ulysses' scheme):
the ranks of a group split each row's tokens into contiguous shards, and every layer but the attention
runs on its own shard only; around the attention, one all-to-all turns [tokens / P, all heads] into
[all tokens, heads / P] (each rank attends over whole rows for its heads) and another turns the output
back. A layer's activations, the MLP's included, are then 1 / P of a whole row's on each rank, at two
all-to-alls of q, k, v and the output per layer.

Layout (P ranks, row length T padded to a multiple of P, rank r holding columns [r T/P, (r+1) T/P)):
- positions are the whole row's (from its attention mask), so rotary embeddings are those of the
  unsharded forward;
- query [B, H, T/P, D] -> [B, H/P, T, D]; keys and values likewise with their KV heads (repeated to the
  query heads first where the KV heads do not split P ways), the rank's heads being the r-th P-th;
- the attention is causal with the rows' padding masked (a query that sees no valid key attends to
  itself, as a padded position must produce a number), then [B, H/P, T, D] -> [B, H, T/P, D];
- the log-prob of the token at column c + 1 is computed on the rank holding column c (its label read
  from the whole row), and the ranks' shards are gathered into every rank's [B, L].

Gradients: every rank computes the same loss on the gathered log-probs; the gather's backward hands each
rank its shard's part, the all-to-alls' backwards are the inverse all-to-alls, so the parameter gradients
of the P ranks sum to the unsharded forward's (the caller reduces them over the group, as data parallelism
reduces over its own).

    with sequence_parallel(model):
        logp = ulysses_logprobs(model, input_ids, attention_mask, response_length, group)
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_fast.ops.logprobs import logprobs_from_logits

ATTENTION = "verl_fast_ulysses"  # the name the sharded forward's attention is registered under


def refusal(config, size: int) -> Optional[str]:
    """Why ``size``-way sequence parallelism cannot run the model of HF ``config`` (None when it can)."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads or heads % size:
        return f"the model's {heads} attention heads do not split {size} ways"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    return None


class _AllToAll(torch.autograd.Function):
    """x split P ways along ``scatter`` and sent one piece to each rank; the pieces received laid side by
    side along ``gather``. Its backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _exchange(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter)).contiguous()  # [P, ...]: piece p goes to rank p
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather)


class _GatherColumns(torch.autograd.Function):
    """Every rank's [B, t] laid side by side into [B, P t]; the backward keeps this rank's columns (each
    rank's loss is the same function of the whole, so its gradient is already whole on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


class Rows:
    """What the sharded forward's attention needs of the whole rows: the group and the padding mask."""

    def __init__(self, group, attention_mask: torch.Tensor):
        self.group = group
        self.mask = attention_mask.bool()  # [B, T]

    def attention_mask(self, device: torch.device) -> torch.Tensor:
        """[B, 1, T, T] boolean: causal, valid keys only, and each query its own key at least."""
        T = self.mask.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        allowed = causal[None] & self.mask.to(device)[:, None, :]
        return (allowed | torch.eye(T, dtype=torch.bool, device=device)[None])[:, None]


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (registered as ``ATTENTION``): a sharded forward's layers
    (``ulysses=<Rows>``) attend over whole rows for their share of the heads; any other call while the
    name is set goes to the model's own implementation. query [B, H, T/P, D], key / value [B, Hkv, T/P, D];
    returns [B, T/P, H, D]."""
    rows = kwargs.pop("ulysses", None)
    if rows is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[module.config._verl_fast_ulysses](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    world = dist.get_world_size(rows.group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % world:  # the KV heads do not split P ways: each query head's own copy
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        kv_heads = heads
    q, k, v = (_AllToAll.apply(t, rows.group, 1, 2) for t in (query, key, value))  # [B, heads / P, T, D]
    device = q.device.type
    # under autocast, queries and keys leave the float32 rotary product: attend in the autocast dtype,
    # as sdpa (on autocast's lower-precision list) would
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else v.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if kv_heads != heads:  # this rank's query heads use its KV heads in order (heads / kv_heads each)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.attention_mask(q.device), scale=scaling)
    return _AllToAll.apply(out, rows.group, 2, 1).transpose(1, 2), None  # [B, T / P, H, D]


def _mask_of_original(config, **kwargs):
    """Masks for the model's unsharded calls while ``ATTENTION`` is set: its own implementation's (a sharded
    call's attention ignores the one made for its shard and builds the whole rows', ``Rows``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[config._verl_fast_ulysses](config=config, **kwargs)


@contextlib.contextmanager
def sequence_parallel(model: torch.nn.Module) -> Iterator[None]:
    """While active, ``model`` (an HF model, unwrapped) attends through ``ulysses_attention``. Hold it over
    the backward too: a recomputed (gradient-checkpointed) layer looks the attention up again."""
    cfg = model.config
    before = cfg._attn_implementation
    if before == ATTENTION:  # already switched by an outer caller
        yield
        return
    cfg._verl_fast_ulysses = before
    cfg._attn_implementation = ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = before
        del cfg._verl_fast_ulysses


def ulysses_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     response_length: int, group=None, temperature: float = 1.0) -> torch.Tensor:
    """[B, L] float32 log-probs of the last L tokens of each row, as ``response_logprobs`` computes them,
    from a forward sharded over ``group``'s ranks (module docstring); every rank passes the same rows and
    gets the same result. Call it inside ``sequence_parallel(model)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    B, T = input_ids.shape
    L = int(response_length)
    if not 1 <= L < T:
        raise ValueError(f"response_length must be in [1, T) for input_ids [B, T] = {[B, T]}, got {response_length}")
    pad = -T % world
    ids = F.pad(input_ids, (0, pad))
    mask = F.pad(attention_mask, (0, pad))
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    labels = torch.roll(ids, -1, dims=1)  # column c predicts column c + 1 (the last column's label unused)
    width = (T + pad) // world
    cols = slice(rank * width, (rank + 1) * width)
    logits = model(input_ids=ids[:, cols], position_ids=positions[:, cols], attention_mask=None, use_cache=False,
                   ulysses=Rows(group, mask)).logits
    local = logprobs_from_logits(logits, labels[:, cols], temperature, check=False)  # [B, width]
    whole = _GatherColumns.apply(local.float(), group)  # [B, T + pad]
    return whole[:, T - L - 1 : T - 1]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _mask_of_original)


_register()
