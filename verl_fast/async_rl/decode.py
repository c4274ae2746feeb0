"""The rollout workers' decoding loop (``trainer.async_mode: full``): token by token over a
left-padded batch with a KV cache, calling ``between_tokens()`` before every forward pass. That
call may load newer weights into the model (a partial rollout: the sequences in flight continue
under them, their cache kept) and returns the version the model then holds; each sampled token is
tagged with it, and its behaviour log-prob is that forward's.

Log-probs are those of the raw logits divided by the temperature (what the trainer's log-prob pass
computes), not of the top-k / top-p filtered distribution that is sampled; temperature 0 is
greedy. Sampling draws from ``generator`` only, so a batch's samples depend on its seed and on the
weights each token saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch

from verl_fast.records.generation import SamplingSpec


@dataclass
class Decoded:
    tokens: List[int]
    logprobs: List[float]
    versions: List[int]
    finish_reason: str  # "stop" (an EOS / stop token) or "length"


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits [B, V]`` with the tokens outside the top-k and outside the smallest set whose
    probability reaches top_p set to -inf (the top token always kept)."""
    out = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ordered, index = torch.sort(out, dim=-1, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
        drop = before >= top_p  # the mass before a token already reaches top_p
        out = out.masked_fill(drop.scatter(-1, index, drop), float("-inf"))
    return out


@torch.no_grad()
def decode(model: torch.nn.Module, prompts: Sequence[Sequence[int]], spec: SamplingSpec, generator: torch.Generator,
           stop_ids: Sequence[int], pad_id: int, between_tokens: Callable[[], int]) -> List[List[Decoded]]:
    """``spec.n`` samples of each prompt, grouped by prompt."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    rows = [list(p) for p in prompts for _ in range(spec.n)]
    B, W = len(rows), max(len(p) for p in rows)
    ids = torch.full((B, W), pad_id, dtype=torch.int64)
    mask = torch.zeros((B, W), dtype=torch.int64)
    for i, p in enumerate(rows):
        ids[i, W - len(p):] = torch.as_tensor(p)
        mask[i, W - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stops = torch.as_tensor(sorted(set(stop_ids) | set(spec.stop_token_ids)), dtype=torch.int64, device=device)
    cache = DynamicCache()
    done = torch.zeros(B, dtype=torch.bool, device=device)
    steps = []  # per token: (sampled [B], its log-prob [B], live before it [B], version)
    feed, feed_pos = ids, positions
    for _ in range(spec.max_tokens):
        version = between_tokens()
        logits = model(input_ids=feed, attention_mask=mask, position_ids=feed_pos, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
        if spec.temperature > 0:
            logits = logits / spec.temperature
            probs = torch.softmax(filter_logits(logits, spec.top_k, spec.top_p), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).flatten()
        else:
            token = logits.argmax(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).flatten()
        steps.append((token, chosen, ~done, version))
        done = done | torch.isin(token, stops)
        if bool(done.all()):
            break
        feed, feed_pos = token[:, None], feed_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=-1)
    tokens = torch.stack([t for t, _, _, _ in steps], 1).tolist()
    logps = torch.stack([c for _, c, _, _ in steps], 1).tolist()
    live = torch.stack([a for _, _, a, _ in steps], 1).tolist()
    versions = [v for _, _, _, v in steps]
    stop_set = set(stops.tolist())
    out = []
    for i in range(B):
        k = sum(live[i])
        reason = "stop" if k and tokens[i][k - 1] in stop_set else "length"
        out.append(Decoded(tokens[i][:k], logps[i][:k], versions[:k], reason))
    return [out[i * spec.n:(i + 1) * spec.n] for i in range(len(prompts))]
