"""The preference algorithms' rows as one ``Experience`` trained through the strategy's
``forward_backward`` / ``optimizer_step`` (the entry the RL update and SFT use, so every backend that
trains the actor runs DPO, KTO, ORPO, SimPO and CPO): chosen and rejected responses interleaved
(row ``2i`` chosen, ``2i + 1`` rejected, both of prompt ``i``: the prompt's forward can be shared),
micro-batches of whole pairs, and each row's summed response log-prob.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from verl_fast.records.experience import Experience


def sequence_tensors(prompts: Sequence[List[int]], responses: Sequence[List[int]], pad_id: int,
                     device: torch.device) -> Tuple[torch.Tensor, ...]:
    """``[N, P + L]`` ids and attention mask and the ``[N, L]`` response mask of prompt / response
    rows: left-padded prompts, right-padded responses."""
    P = max(len(p) for p in prompts)
    L = max(1, max(len(r) for r in responses))
    ids = torch.full((len(responses), P + L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, resp) in enumerate(zip(prompts, responses)):
        if prompt:
            ids[row, P - len(prompt) : P] = torch.as_tensor(prompt)
            mask[row, P - len(prompt) : P] = 1
        if resp:
            ids[row, P : P + len(resp)] = torch.as_tensor(resp)
            mask[row, P : P + len(resp)] = 1
    return ids.to(device), mask.to(device), mask[:, P:].to(device)


def rows_experience(prompts: Sequence[List[int]], responses: Sequence[List[int]], prompt_index: Sequence[int],
                    pad_id: int, device: torch.device) -> Experience:
    ids, mask, rmask = sequence_tensors(prompts, responses, pad_id, device)
    return Experience(input_ids=ids, attention_mask=mask, response_mask=rmask,
                      prompt_index=torch.as_tensor(list(prompt_index), dtype=torch.long, device=device))


def pair_experience(pairs: Sequence[Any], pad_id: int, device: torch.device) -> Experience:
    """``pairs`` (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``) as ``2B`` interleaved rows."""
    prompts = [p.prompt_ids for p in pairs for _ in range(2)]
    responses = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    exp = rows_experience(prompts, responses, [i for i in range(len(pairs)) for _ in range(2)], pad_id, device)
    if any(p.vision is not None for p in pairs):  # both rows of a pair carry its images
        exp.vision = [p.vision for p in pairs for _ in range(2)]
    return exp


def micro_batches(num_items: int, per_micro: int, rows_per_item: int, device: torch.device) -> List[torch.Tensor]:
    """Row indices of ``per_micro`` whole items (a pair is 2 rows, a KTO example 1) per micro-batch."""
    return list(torch.arange(num_items * rows_per_item, device=device).split(per_micro * rows_per_item))


def summed(logp: torch.Tensor, sub: Experience) -> torch.Tensor:
    """``[n]`` float32: each row's log-probs summed over its response tokens."""
    return (logp.float() * sub.response_mask).sum(-1)


def lengths(sub: Experience) -> torch.Tensor:
    """``[n]`` float32: each row's response tokens (at least 1)."""
    return sub.response_mask.sum(-1).clamp(min=1).float()


@torch.no_grad()
def reference_logprobs(strategy: Any, exp: Experience, micro: List[torch.Tensor]) -> None:
    """``exp.ref_logprobs`` from the strategy's reference (none: reference-free, left None)."""
    if strategy.has_reference:
        exp.ref_logprobs = strategy.ref_logprobs(exp, micro)


def step(updates: Any, exp: Experience, micro: List[torch.Tensor],
         loss_fn: Callable[[torch.Tensor, Experience], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]
         ) -> Tuple[Dict[str, float], float]:
    """One optimiser step (``trainer/updates.Updates.step``) with ``loss_fn(logp, sub)``, whose
    statistics are each micro-batch's share of the step's: summed here, read back once."""
    stats, norm = updates.step(exp, micro, lambda logp, entropy, sub: loss_fn(logp, sub), entropy=False)
    totals: Dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            totals[k] = totals.get(k, 0.0) + v
    return {k: float(v) for k, v in totals.items()}, norm
