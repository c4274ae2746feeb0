"""Per-token log-probs (and entropy) of a causal LM's response tokens.

``response_logprobs`` is the one entry the trainer uses for the actor and the reference model.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P + L]: left-padded prompt, then right-padded response
    attention_mask: torch.Tensor,  # [B, P + L]
    response_length: int,  # L: log-probs of the last L tokens given everything before them
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: Optional[bool] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns ``(logprobs [B, L] float32, entropy [B, L] float32 or None)``, differentiable."""
    L = response_length
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logits = out.logits[:, -L - 1 : -1, :].float() / temperature  # predicts tokens -L..-1
    labels = input_ids[:, -L:]
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy
