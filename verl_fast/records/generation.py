"""What a generation asks and returns, engine-neutral: ``SamplingSpec`` (one per prompt, or one for all)
and ``GenerationOutput`` (``n`` completions per prompt, right-padded, with a response mask and, when the
engine provides them, the sampled tokens' log-probs). Every engine returns this type and the trainer
and the algorithms only ever see it; an algorithm that generates on its own (ReMax's greedy rollout,
online DPO's pairs) gets a ``Generate`` callable, not the rollout operator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch

from verl_fast.records.prompts import PromptRow


@dataclass(frozen=True)
class SamplingSpec:
    """Per-request sampling, engine-neutral (mapped to vLLM SamplingParams or HF generate kwargs)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 64
    stop: Tuple[str, ...] = ()
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None
    logprobs: bool = True  # return the sampled tokens' log-probs
    detokenize: bool = True  # return the samples' texts (off: empty strings, for a caller that reads the tokens only)

    @staticmethod
    def from_kwargs(base: "SamplingSpec", kwargs: dict) -> "SamplingSpec":
        """``base`` with the keys of a generation-kwargs dict applied (HF names accepted too)."""
        aliases = {"max_new_tokens": "max_tokens", "num_return_sequences": "n", "stop_strings": "stop"}
        known = set(SamplingSpec.__dataclass_fields__)
        changes = {}
        for key, value in kwargs.items():
            key = aliases.get(key, key)
            if key == "do_sample":
                if not value:
                    changes["temperature"] = 0.0
                continue
            if key not in known:
                raise ValueError(f"unknown generation argument {key!r}; allowed: {sorted(known | set(aliases))}")
            if key in ("stop", "stop_token_ids"):
                value = (value,) if isinstance(value, (str, int)) else tuple(value)
            changes[key] = value
        spec = replace(base, **changes)
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    """``N = sum of n over prompts`` completions, grouped by prompt in prompt order."""

    prompt_index: torch.Tensor  # [N] int64: which input prompt each row answers
    response_ids: torch.Tensor  # [N, L] int64, right-padded with pad_token_id
    response_mask: torch.Tensor  # [N, L] int64: 1 on generated tokens, EOS included
    logprobs: Optional[torch.Tensor]  # [N, L] float32 sampled-token log-probs (0 past the end)
    texts: List[str] = field(default_factory=list)
    finish_reasons: List[str] = field(default_factory=list)  # "stop" (EOS / stop string) or "length"
    # MoE engines recording routing: per sequence [prompt + response tokens, layers, k] int16 experts
    # (-1 where the engine computed none: the last sampled token is never fed back)
    routed_experts: Optional[List[torch.Tensor]] = None
    # multi-turn trajectories (verl_fast/agents/rollout.py): the response holds observation tokens too
    attention_mask: Optional[torch.Tensor] = None  # [N, L] 1 on every response token (None: response_mask)
    prompt_ids: Optional[List[List[int]]] = None  # per sequence: its first prompt (None: the batch row's)
    turn_ends: Optional[List[List[int]]] = None  # per sequence: each model turn's last response position
    token_rewards: Optional[torch.Tensor] = None  # [N, L] the environments' per-turn rewards

    @property
    def num_sequences(self) -> int:
        return int(self.response_ids.shape[0])


def _flat(rows: Sequence[Sequence[Any]]) -> List[Any]:
    """The rows' values in one list, row after row (a tensor row as its values)."""
    return [v for row in rows for v in (row.tolist() if isinstance(row, torch.Tensor) else row)]


def texts_of(tokenizer: Any, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> List[str]:
    """Each token list's text, as ``tokenizer.decode(ids, skip_special_tokens=...)`` gives it. A transformers
    tokenizer's ``decode`` first converts its argument to plain Python, checking every element (on a fast
    tokenizer, about twice the time of the decoding itself); token lists are plain already, so its
    one-sequence ``_decode``, which ``decode`` calls after that, is called directly where it has one."""
    one = getattr(tokenizer, "_decode", None) or tokenizer.decode
    return [one(list(ids), skip_special_tokens=skip_special_tokens) for ids in sequences]


def pad_completions(
    completions: Sequence[Sequence[int]],
    logprobs: Optional[Sequence[Sequence[float]]],
    prompt_index: Sequence[int],
    pad_token_id: int,
    texts: Sequence[str] = (),
    finish_reasons: Sequence[str] = (),
    routed_experts: Optional[Sequence[torch.Tensor]] = None,
) -> GenerationOutput:
    """Right-pads token lists (and their log-probs) into a ``GenerationOutput``: each list's values in one
    flat tensor, scattered to the mask's positions in row order (one conversion, not one a row)."""
    N = len(completions)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.int64)
    L = max(int(lengths.max()) if N else 0, 1)
    kept = torch.arange(L)[None, :] < lengths[:, None]
    mask = kept.to(torch.int64)
    ids = torch.full((N, L), pad_token_id, dtype=torch.int64)
    ids[kept] = torch.tensor(_flat(completions), dtype=torch.int64)
    lp = None
    if logprobs is not None:
        if [len(x) for x in logprobs] != lengths.tolist():
            raise ValueError("pad_completions: every completion needs one log-prob per token")
        lp = torch.zeros((N, L), dtype=torch.float32)
        lp[kept] = torch.tensor(_flat(logprobs), dtype=torch.float32)
    return GenerationOutput(
        prompt_index=torch.as_tensor(list(prompt_index), dtype=torch.int64),
        response_ids=ids,
        response_mask=mask,
        logprobs=lp,
        texts=list(texts),
        finish_reasons=list(finish_reasons),
        routed_experts=None if routed_experts is None else list(routed_experts),
    )


def merge_outputs(parts: Sequence[Tuple[GenerationOutput, Sequence[int]]], pad_token_id: int) -> GenerationOutput:
    """Outputs of several generate calls as one, in prompt order: ``parts`` pairs each output with
    the original prompt index of each of its prompts."""
    rows = []  # (original prompt, part, row)
    for p, (out, prompts) in enumerate(parts):
        for r, i in enumerate(out.prompt_index.tolist()):
            rows.append((prompts[i], p, r))
    rows.sort(key=lambda x: x[0])  # stable: samples of a prompt keep their order
    L = max(out.response_ids.shape[1] for out, _ in parts)
    ids = torch.full((len(rows), L), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), L), dtype=torch.int64)
    with_lp = all(out.logprobs is not None for out, _ in parts)
    lp = torch.zeros((len(rows), L), dtype=torch.float32) if with_lp else None
    texts, reasons = [], []
    for k, (_, p, r) in enumerate(rows):
        out = parts[p][0]
        width = out.response_ids.shape[1]
        ids[k, :width] = out.response_ids[r]
        mask[k, :width] = out.response_mask[r]
        if lp is not None:
            lp[k, :width] = out.logprobs[r]
        texts.append(out.texts[r] if out.texts else "")
        reasons.append(out.finish_reasons[r] if out.finish_reasons else "")
    index = torch.tensor([x[0] for x in rows], dtype=torch.int64)
    routed = None
    if all(out.routed_experts is not None for out, _ in parts):
        routed = [parts[p][0].routed_experts[r] for _, p, r in rows]
    return GenerationOutput(prompt_index=index, response_ids=ids, response_mask=mask, logprobs=lp, texts=texts,
                            finish_reasons=reasons, routed_experts=routed)


class Generate(Protocol):
    """How an algorithm generates (``RolloutOperator.generate``): the completions of ``batch``, each prompt
    sampled as the run samples it, changed by ``change`` when given (ReMax: greedy, one sample)."""

    def __call__(self, batch: Sequence[PromptRow],
                 change: Optional[Callable[[SamplingSpec], SamplingSpec]] = None) -> GenerationOutput:
        ...
