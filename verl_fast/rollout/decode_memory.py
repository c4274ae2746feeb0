"""What the HF decode holds on the device, counted before it runs: the KV cache's bytes a token, a prompt's
bytes in the loop at its peak (its samples' caches and sampling rows, its prefill's activations) and how many
prompts one call of the loop takes within the memory at hand (``rollout/hf_engine.py``, ``rollout/kv_turns.py``,
``strategies/memory_plan.py``)."""

from __future__ import annotations

from typing import Optional


def kv_bytes_per_token(config, element_bytes: int, shards: int = 1) -> Optional[int]:
    """Every layer's key and value of one token at ``element_bytes`` an element, the KV heads split over
    ``shards`` (tensor parallelism); None where the config does not say."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * max(1, kv_heads // shards) * head_dim * element_bytes


# The most prompt columns one prefill forward takes: longer prompts run in chunks of it
PREFILL_CHUNK = 2048

# Device bytes the prefill holds per prompt token and unit of the layers' (hidden + intermediate) width:
# one layer's temporaries at a time (the MLP's gate, up and product, the attention's q, k, v and output,
# in bf16) beside the float32 residual stream; a round upper count, not measured
PREFILL_BYTES = 8


def bytes_per_prompt(config, width: int, max_new_tokens: int, samples: int, kv_element_bytes: int = 4) -> int:
    """Device bytes one prompt decoded ``samples`` times takes in the loop at its peak (the first step:
    compaction only shrinks it): each sample's KV cache (every layer's keys and values for ``width +
    max_new_tokens`` columns at ``kv_element_bytes`` an element: the autocast dtype's under autocast,
    ``static_kv.StaticKV``, else the model's) and float32 sampling rows over the vocabulary (the logits and a few
    temporaries of their size), and once for the prompt the prefill's activations over its ``width``
    columns, or one chunk's (``PREFILL_CHUNK``), and its boolean attention mask (the prefill runs each
    prompt once, ``hf_decode.decode``'s ``rows``)."""
    cfg = getattr(config, "text_config", None) or config
    length = width + max_new_tokens
    kv = kv_bytes_per_token(cfg, kv_element_bytes) * length
    inner = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    chunk = min(width, PREFILL_CHUNK)  # a chunk after the first attends to the whole cache's columns
    prefill = PREFILL_BYTES * chunk * (cfg.hidden_size + inner) + chunk * (width if width <= PREFILL_CHUNK else length)
    return samples * (kv + 6 * 4 * cfg.vocab_size) + prefill


def prompts_per_call(config, width: int, max_new_tokens: int, samples: int, prompts: int,
                     room: Optional[float], kv_element_bytes: int) -> int:
    """How many of ``prompts`` prompts (each decoded ``samples`` times) one call of the loop takes:
    all of them, or as many as ``room`` bytes hold at ``bytes_per_prompt`` (at least one; None: no
    limit). The rest decode in further calls: the cache is never planned at the whole batch x cap when
    that does not fit."""
    if room is None:
        return prompts
    per_prompt = bytes_per_prompt(config, width, max_new_tokens, samples, kv_element_bytes)
    return max(1, min(prompts, int(room // per_prompt)))
