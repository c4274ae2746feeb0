"""One step's rollout as training tensors (``Experience``), shared by the trainer, the algorithms and the
training strategies: built from the engine's output, cut into micro-batches by ``Experience.select``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, List, Optional, Sequence

import torch

from verl_fast.records.prompts import PromptRow
from verl_fast.records.generation import GenerationOutput


@dataclass
class Experience:
    """N sequences (prompts x samples); P = longest prompt, L = longest response."""

    input_ids: torch.Tensor  # [N, P + L]: left-padded prompt, right-padded response
    attention_mask: torch.Tensor  # [N, P + L]
    response_mask: torch.Tensor  # [N, L] 1 on generated tokens (EOS included)
    prompt_index: torch.Tensor  # [N] which prompt of the step's batch
    scores: Optional[torch.Tensor] = None  # [N] sequence rewards
    token_level_rewards: Optional[torch.Tensor] = None  # [N, L]
    old_logprobs: Optional[torch.Tensor] = None  # [N, L] actor before the update
    ref_logprobs: Optional[torch.Tensor] = None  # [N, L]
    values: Optional[torch.Tensor] = None  # [N, L] critic
    advantages: Optional[torch.Tensor] = None  # [N, L]
    returns: Optional[torch.Tensor] = None  # [N, L]
    rollout_logprobs: Optional[torch.Tensor] = None  # [N, L] the rollout engine's, when it returned them
    rollout_is_weights: Optional[torch.Tensor] = None  # [N, L] algorithm.rollout_correction's weights
    routed_experts: Optional[torch.Tensor] = None  # [N, P + L, layers, k] int16 rollout experts (-1: none)
    # [N] each row's prompt's images (data/images.VisionInputs, None for a text prompt); None: no images
    vision: Optional[List[Any]] = None

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_length(self) -> int:
        return int(self.response_mask.shape[1])

    def to(self, device: torch.device) -> "Experience":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def select(self, index: torch.Tensor) -> "Experience":
        """Rows ``index``, with the padding columns no selected row needs cut away."""
        sub = {f.name: getattr(self, f.name)[index] for f in fields(self)
               if getattr(self, f.name) is not None and f.name != "vision"}
        if self.vision is not None:  # a sample's images go with its tokens
            sub["vision"] = [self.vision[i] for i in index.tolist()]
        L = self.response_length
        P = self.input_ids.shape[1] - L
        prompt_mask = sub["attention_mask"][:, :P]
        used = prompt_mask.any(0).nonzero()
        start = int(used[0]) if used.numel() else P
        # the longest response's extent (multi-turn responses have holes in response_mask)
        resp_len = _extent(sub["attention_mask"][:, P:]) if index.numel() else 0
        resp_len = max(resp_len, 1)
        keep = torch.cat([torch.arange(start, P), torch.arange(P, P + resp_len)]).to(self.input_ids.device)
        for name in ("input_ids", "attention_mask", "routed_experts"):  # the token columns
            if name in sub:
                sub[name] = sub[name][:, keep]
        for name, value in list(sub.items()):
            if name != "vision" and value.dim() == 2 and name not in ("input_ids", "attention_mask"):
                sub[name] = value[:, :resp_len]
        return Experience(**sub)


def concat(parts: Sequence[Experience]) -> Experience:
    """Row-wise concatenation; prompts stay left-aligned to the response boundary (padding on the
    left), responses right-padded to the longest."""
    P = max(e.input_ids.shape[1] - e.response_length for e in parts)
    L = max(e.response_length for e in parts)
    out = {}
    for f in fields(Experience):
        values = [getattr(e, f.name) for e in parts]
        if f.name == "vision" and not all(v is None for v in values):  # rows of text prompts: None each
            out[f.name] = [x for v, e in zip(values, parts) for x in (v or [None] * e.num_sequences)]
            continue
        if any(v is None for v in values):
            out[f.name] = None
            continue
        if f.name in ("input_ids", "attention_mask"):
            values = [torch.nn.functional.pad(v, (P - (v.shape[1] - e.response_length), L - e.response_length))
                      for v, e in zip(values, parts)]
        elif f.name == "routed_experts":  # token columns, the layers and k kept
            values = [torch.nn.functional.pad(v, (0, 0, 0, 0, P - (v.shape[1] - e.response_length),
                                                  L - e.response_length), value=-1) for v, e in zip(values, parts)]
        elif values[0].dim() == 2:
            values = [torch.nn.functional.pad(v, (0, L - v.shape[1])) for v in values]
        out[f.name] = torch.cat(values)
    return Experience(**out)


def build_experience(prompts: Sequence[PromptRow], gen: GenerationOutput, pad_id: int) -> Experience:
    """Prompt tokens (left-padded, repeated per sample) joined to the generated responses."""
    N = gen.num_sequences
    # a multi-turn rollout gives each sequence its own first prompt, and attends to its observations too
    firsts = gen.prompt_ids or [prompts[i].prompt_ids for i in gen.prompt_index.tolist()]
    P = max((len(ids) for ids in firsts), default=1)
    prompt_ids = torch.full((N, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((N, P), dtype=torch.long)
    for row, ids in enumerate(firsts):
        if ids:
            prompt_ids[row, P - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            prompt_mask[row, P - len(ids):] = 1
    response_mask = gen.response_mask.long()
    attended = response_mask if gen.attention_mask is None else gen.attention_mask.long()
    return Experience(
        input_ids=torch.cat([prompt_ids, gen.response_ids.long()], dim=1),
        attention_mask=torch.cat([prompt_mask, attended], dim=1),
        response_mask=response_mask,
        prompt_index=gen.prompt_index.long(),
        rollout_logprobs=None if gen.logprobs is None else gen.logprobs.float(),
        routed_experts=None if gen.routed_experts is None else _routed_columns(firsts, gen, P),
        vision=([prompts[i].vision for i in gen.prompt_index.tolist()]
                if any(p.vision is not None for p in prompts) else None),
    )


def _routed_columns(firsts: Sequence[Sequence[int]], gen: GenerationOutput, P: int) -> torch.Tensor:
    """The engine's per-sequence experts laid out as ``input_ids`` is: [N, P + L, layers, k], -1 on padding."""
    first = gen.routed_experts[0]
    out = torch.full((gen.num_sequences, P + gen.response_ids.shape[1]) + tuple(first.shape[1:]), -1,
                     dtype=torch.int16)
    for row, ids in enumerate(firsts):
        seq = gen.routed_experts[row]
        start = P - len(ids)
        out[row, start : start + seq.shape[0]] = seq.to(torch.int16)
    return out


def last_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome rewards placed on each response's last token: ``[N] -> [N, L]``."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = (_extent_per_row(response_mask) - 1).clamp(min=0)  # the last trained token (masks may have holes)
    rewards[torch.arange(len(scores), device=rewards.device), last] = scores.float().to(rewards.device)
    return rewards


def _extent_per_row(mask: torch.Tensor) -> torch.Tensor:
    """[N] one past each row's last nonzero column of ``mask`` [N, L] (0 for an empty row)."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (cols * (mask != 0)).max(-1).values if mask.shape[1] else torch.zeros(mask.shape[0], dtype=torch.long)


def _extent(mask: torch.Tensor) -> int:
    """One past the last nonzero column of ``mask`` [N, L] over all rows."""
    return int(_extent_per_row(mask).max().item()) if mask.shape[0] else 0
