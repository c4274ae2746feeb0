"""The HF decode's static KV cache and its decode-step attention: ``StaticKV`` keeps every layer's keys and
values in tensors of fixed shape (what a CUDA graph needs), made from the prompts' prefill or continued from a
conversation's earlier columns (``Past``); ``grouped_attention`` reads each cached KV head once for all the
query heads that share it, on a GPU through the Triton kernel ``kernels.decode_attention`` (``KERNEL``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

try:
    from verl_fast.kernels import rope_cache
    from verl_fast.kernels.decode_attention import decode_attention
except ImportError:  # no Triton: the matmul form and the torch rotary everywhere
    decode_attention = rope_cache = None
# The GPU decode step's attention through the Triton kernel (True) or the matmul form (False):
# bench_decode's kernel_attention variant measures the two inside the compiled, graph-captured decode.
KERNEL = True


@dataclass
class Past:
    """Earlier columns a decode continues from (a conversation's next turn, ``rollout/kv_turns.py``):
    each row's cached keys and values, its valid columns and the position its next token takes."""

    keys: List[torch.Tensor]  # per layer [B, kv_heads, C, head_dim]
    values: List[torch.Tensor]  # per layer [B, kv_heads, C, head_dim]
    valid: torch.Tensor  # [B, C] bool: columns holding a token of the row
    position: torch.Tensor  # [B] long: the position of each row's first new token

    @property
    def columns(self) -> int:
        return self.valid.shape[1]


class StaticKV(Cache):
    """Keys and values of every layer in tensors of fixed shape [B, kv_heads, length, head_dim],
    written at the columns ``cols`` (a device tensor the caller advances). The model calls only
    ``update``; masks come in as ready 4-D tensors, so nothing asks the cache for lengths.
    (transformers' StaticCache gives keys and values the dtype of the first keys; under autocast
    values leave a bf16 projection while keys leave the float32 rotary product.) The first forward
    (the prefill) may come with fewer sequences than the cache holds: row b of the cache then holds
    sequence ``rows[b]`` of it (the samples of one prompt share its prefill). With ``fused`` set, a
    decode step's attention may hand its merged q/k/v product to ``write_rotated`` instead (the rotary
    embedding and the write in one kernel). With a ``past``, each layer's cache is made at its first
    update from the past's columns (then freed), and every forward writes its columns and attends to
    the whole cache."""

    is_compileable = False

    def __init__(self, num_layers: int, length: int, rows: Optional[torch.Tensor] = None,
                 fused: bool = False, past: Optional[Past] = None):  # no Cache.__init__
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers
        self.length = length
        self.rows = rows  # None: the prefill's sequences are the cache's rows
        self.past = past
        self.cols: Optional[torch.Tensor] = None
        # a prefill in width buckets (``hf_decode``'s ``width_buckets``): the cache's rows, and the rows the
        # current forward writes (``dest``) from which of its sequences (``src``)
        self.batch = 0
        self.writes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.seen = 0  # host-side count, for transformers versions that derive positions from it
        self.fused = fused and rope_cache is not None

    def write_rotated(self, layer_idx: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int) -> Optional[torch.Tensor]:
        """A decode step's queries rotated [B, heads, 1, D], its keys rotated and its values written at
        ``cols`` (``kernels.rope_cache``), from the merged product ``qkv`` [B, 1, (heads + 2 kv_heads) * D];
        None where the fused kernel does not apply (not ``fused``, the prefill, another table shape):
        the caller then rotates and calls ``update``."""
        keys = self.keys[layer_idx]
        if not self.fused or keys is None or qkv.shape[1] != 1 or cos.shape[-1] != keys.shape[-1]:
            return None
        return rope_cache.rope_cache_write(qkv, cos, sin, keys, self.values[layer_idx], self.cols, heads)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, *args, **kwargs):
        if self.keys[layer_idx] is None and self.past is not None:  # the layer's cache: the past, then room
            for store, old in ((self.keys, self.past.keys), (self.values, self.past.values)):
                shape = old[layer_idx].shape
                store[layer_idx] = old[layer_idx].new_zeros(shape[:2] + (self.length, shape[3]))
                store[layer_idx][:, :, : shape[2]] = old[layer_idx]
                old[layer_idx] = None
        if self.writes is not None:  # one width bucket of the prefill: its sequences' own keys attended
            dest, src = self.writes
            for store, new, dtype in zip((self.keys, self.values), (key_states, value_states),
                                         self._dtypes(key_states, value_states)):
                if store[layer_idx] is None:  # every row's columns before its bucket's stay empty (never attended)
                    store[layer_idx] = new.new_zeros((self.batch, new.shape[1], self.length, new.shape[3]), dtype=dtype)
                # rows dest at columns cols: [rows, cols, kv_heads, head_dim] as advanced indexing orders them
                store[layer_idx][dest[:, None], :, self.cols[None, :]] = new.index_select(0, src).to(dtype).transpose(1, 2)
            return key_states, value_states
        if self.keys[layer_idx] is not None:  # a decode step: its column written, the whole cache attended
            self.keys[layer_idx].index_copy_(2, self.cols, key_states.to(self.keys[layer_idx].dtype))
            self.values[layer_idx].index_copy_(2, self.cols, value_states.to(self.values[layer_idx].dtype))
            return self.keys[layer_idx], self.values[layer_idx]
        # the prefill: the cache allocated, each sequence's keys and values written into the rows that
        # decode it; its attention reads the sequences' own (the cache's later columns are empty). Under
        # autocast, sdpa casts its inputs to the autocast dtype: keys stored in it attend exactly as the
        # fp32 keys would, with half the bytes read per token
        for store, new, dtype in zip((self.keys, self.values), (key_states, value_states),
                                     self._dtypes(key_states, value_states)):
            per_row = new if self.rows is None else new.index_select(0, self.rows)
            store[layer_idx] = per_row.new_zeros((per_row.shape[0], per_row.shape[1], self.length, per_row.shape[3]),
                                                 dtype=dtype)
            store[layer_idx].index_copy_(2, self.cols, per_row.to(dtype))
        return key_states, value_states

    @staticmethod
    def _dtypes(key_states: torch.Tensor, value_states: torch.Tensor) -> Tuple[torch.dtype, torch.dtype]:
        """The cache's key and value dtypes: the keys' the autocast dtype where autocast is on (above)."""
        device = key_states.device.type
        return (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else key_states.dtype,
                value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return len(self.keys)


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Decode-step attention that reads each cached key and value once: the query heads sharing a KV
    head are stacked into one matrix ([B, kv, group * q, D] against [B, kv, L, D]). With a mask,
    sdpa needs the KV heads repeated to every query head first (a copy of the whole cache per layer
    and token, 7x its size for 14 heads over 2). ``attention_mask``: [B, 1, q, L] boolean, True =
    attend. Returns [B, q, heads, D] as transformers' attention functions do. With ``KERNEL`` set, a
    decode step (one query column) on a GPU runs the Triton kernel ``kernels.decode_attention``, which
    also leaves the cache's empty columns unread; this matmul form is its reference."""
    for name in ("softcap", "s_aux", "sinks", "sliding_window"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"grouped_attention does not implement {name}")
    b, heads, q_len, d = query.shape
    scaling = scaling if scaling is not None else d ** -0.5
    if KERNEL and decode_attention is not None and query.is_cuda and q_len == 1:
        return decode_attention(query, key, value, attention_mask[:, 0, 0], scaling), None
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = query.reshape(b, kv_heads, group * q_len, d)  # head h uses KV head h // group, as repeat_kv does
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling
    mask = attention_mask[:, :, None].expand(b, 1, group, q_len, length).reshape(b, 1, group * q_len, length)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(value.dtype)
    out = torch.matmul(probs, value).reshape(b, heads, q_len, d).transpose(1, 2)
    return out, None


ATTENTION = "verl_fast_grouped"
AttentionInterface.register(ATTENTION, grouped_attention)


@contextlib.contextmanager
def attention_set(module, name: str) -> Iterator[None]:
    """The model's attention implementation set to ``name`` for the decode steps only."""
    cfg = module.config.get_text_config()  # a vision-language model's vision tower keeps its own
    before = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = before
