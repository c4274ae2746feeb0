"""Partial rollouts in synchronous training (``rollout.partial_step_tokens``): a step's rollout stops at a
token budget, and the responses still running are carried into the next step with their tokens and the
behaviour log-probs the engine returned for them, then continued under the new weights.

A step's pool holds the groups carried from earlier steps (a group: one prompt's ``n`` samples) and the
step's fresh prompts. The pool decodes in rounds of ``partial_round_tokens`` new tokens a sample, each
round one ``engine.generate`` call through the engine's ordinary API: a fresh prompt asks for its ``n``
samples, an unfinished sample is re-submitted as prompt + its tokens so far, one sample, and its new
tokens and log-probs are appended (a round's tokens past the sample's cap are cut, which leaves the
distribution of those kept as a call with the smaller limit samples it). After each round the step stops
once as many groups are complete (every sample ended by EOS or the cap) as the step has prompts, or once
its samples have had ``partial_step_tokens`` tokens; a group carried ``partial_max_carry`` steps is
finished in the step whatever the budget, and so is every group while none is complete. The step trains
on complete groups only, at most its batch size, the oldest first; the rest is carried. The carry is the
over-sampling: in a steady state a step has its fresh prompts and the carried ones in flight and trains
as many as it was given.

Every token keeps the log-prob of the weights that sampled it, so ``algorithm.rollout_correction``
weights each token by ``exp(old_logprob - behaviour_logprob)``, truncated (which the start-up checks ask
for). A checkpoint holds the carry (prompts, tokens, log-probs, sampling); a resumed run continues it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from verl_fast.records.prompts import PromptRow
from verl_fast.records.generation import GenerationOutput, SamplingSpec, pad_completions, texts_of
from verl_fast.rollout.base import RolloutEngine


@dataclass
class Sample:
    """One response in flight: its tokens and their behaviour log-probs, and why it ended (None: running)."""

    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finished: Optional[str] = None  # "stop" (EOS / a stop token) or "length" (the cap)


@dataclass
class Group:
    """One prompt's samples; ``born``: the step it entered the pool; ``spec``: its sampling (``max_tokens``
    the cap, ``n`` the samples)."""

    row: PromptRow
    spec: SamplingSpec
    born: int
    samples: List[Sample] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return bool(self.samples) and all(s.finished for s in self.samples)


class PartialRollout:
    """The pool of a synchronous run with partial rollouts (module docstring)."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, step_tokens: int, round_tokens: Optional[int],
                 max_carry: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.step_tokens, self.round_tokens = step_tokens, round_tokens or step_tokens
        self.max_carry = max_carry
        self.carry: List[Group] = []

    def rollout(self, batch: Sequence[PromptRow], specs: Sequence[SamplingSpec], step: int, seed: int,
                metrics: Dict[str, Any]) -> Tuple[List[PromptRow], GenerationOutput]:
        """The step's rollout: (the prompts of the groups it trains on, their samples)."""
        for spec in specs:
            if spec.stop:
                raise ValueError("rollout.partial_step_tokens is not supported with stop strings (a string "
                                 "across two rounds would be missed); use stop_token_ids, or "
                                 "rollout.partial_step_tokens=0")
        pool = self.carry + [Group(row, spec, step) for row, spec in zip(batch, specs)]
        used, rounds, overdue_rounds = 0, 0, 0
        while True:
            done = sum(g.complete for g in pool)
            running = [g for g in pool if not g.complete]
            stopped = rounds and (done >= len(batch) or used >= self.step_tokens) and done
            if stopped:  # the overdue groups only
                running = [g for g in running if step - g.born >= self.max_carry]
            if not running:
                break
            tokens = min(self.round_tokens, self.step_tokens - used) if used < self.step_tokens else self.round_tokens
            self._round(running, tokens, seed + 100_003 * rounds)
            used, rounds, overdue_rounds = used + tokens, rounds + 1, overdue_rounds + bool(stopped)
        ready = sorted((g for g in pool if g.complete), key=lambda g: g.born)[: len(batch)]
        chosen = {id(g) for g in ready}
        self.carry = [g for g in pool if id(g) not in chosen]
        metrics.update({"partial/rounds": float(rounds), "partial/overdue_rounds": float(overdue_rounds),
                        "partial/trained_groups": float(len(ready)),
                        "partial/carried_groups": float(len(self.carry)),
                        "partial/trained_from_carry": float(sum(g.born < step for g in ready)),
                        "partial/max_age": float(max((step - g.born for g in ready), default=0)),
                        "partial/carried_tokens": float(sum(len(s.tokens) for g in self.carry for s in g.samples))})
        return [g.row for g in ready], self._output(ready)

    def _round(self, groups: Sequence[Group], tokens: int, seed: int) -> None:
        """One ``engine.generate`` call: up to ``tokens`` more tokens for every running sample of ``groups``
        (their texts not asked for: the trained samples' are decoded once, whole, in ``_output``)."""
        prompts, specs, targets = [], [], []  # targets: per prompt, the samples its output rows extend
        for g in groups:
            cap = g.spec.max_tokens
            if not g.samples:  # fresh: its n samples from the prompt
                g.samples = [Sample() for _ in range(g.spec.n)]
                prompts.append(list(g.row.prompt_ids))
                specs.append(replace(g.spec, max_tokens=min(tokens, cap), seed=seed + len(specs), detokenize=False))
                targets.append((cap, g.samples))
                continue
            for s in g.samples:
                if s.finished is None:  # prompt + its tokens so far, one sample
                    prompts.append(list(g.row.prompt_ids) + s.tokens)
                    specs.append(replace(g.spec, n=1, max_tokens=min(tokens, cap - len(s.tokens)),
                                         seed=seed + len(specs), detokenize=False))
                    targets.append((cap, [s]))
        out = self.engine.generate(prompts, specs)
        if out.logprobs is None:
            raise ValueError("rollout.partial_step_tokens needs the engine's log-probs of its samples (SamplingSpec."
                             "logprobs): a RolloutOperator's generation kwargs may have turned them off")
        seen = [0] * len(prompts)
        for r, p in enumerate(out.prompt_index.tolist()):
            cap, samples = targets[p]
            sample = samples[seen[p]]
            seen[p] += 1
            width = int(out.response_mask[r].sum())
            sample.tokens += out.response_ids[r, :width].tolist()
            sample.logprobs += out.logprobs[r, :width].tolist()
            if out.finish_reasons and out.finish_reasons[r] == "stop":
                sample.finished = "stop"
            elif len(sample.tokens) >= cap:
                sample.finished = "length"

    def _output(self, groups: Sequence[Group]) -> GenerationOutput:
        completions, logprobs, index, reasons = [], [], [], []
        for i, g in enumerate(groups):
            for s in g.samples:
                completions.append(s.tokens)
                logprobs.append(s.logprobs)
                index.append(i)
                reasons.append(s.finished)
        texts = texts_of(self.tokenizer, completions)
        return pad_completions(completions, logprobs, index, self.tokenizer.pad_token_id, texts, reasons)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """The carry as plain data (lists, numbers, strings: what a checkpoint's state holds)."""
        return {"carry": [{"row": dataclasses.asdict(g.row), "born": g.born,
                           "spec": {k: list(v) if isinstance(v, tuple) else v
                                    for k, v in dataclasses.asdict(g.spec).items()},
                           "samples": [dataclasses.asdict(s) for s in g.samples]} for g in self.carry]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.carry = [Group(PromptRow(**c["row"]),
                            SamplingSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in c["spec"].items()}),
                            int(c["born"]), [Sample(**s) for s in c["samples"]]) for c in state.get("carry", [])]
